"""Hostile inputs to what session 60 built (classify / score / rerank, gpt-oss, the new families, tuned tables):
each a crash, a 500 or a wrong result found by a probe, now a clear error or the right answer."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from infer import LLM, PoolingParams

from test_probes_session60_classify import _post, hf_logits
from test_probes_session60_classify import qwen_ce, served_cross_encoder  # noqa: F401 (fixtures)
from test_probes_session59_moetune import moe_cache  # noqa: F401 (fixture)


def _post_raw(base: str, route: str, raw: bytes) -> tuple[int, dict]:
    r = httpx.post(base + route, content=raw, headers={"content-type": "application/json"}, timeout=60)
    return r.status_code, r.json()


@pytest.mark.parametrize("route, raw, param, message", [
    ("/score", b'{"text_1": "a", "text_2": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, "levels deep; the limit"),
    ("/rerank", b'{"query": "a", "documents": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, "levels deep; the limit"),
    ("/classify", b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, "levels deep; the limit"),
    ("/v1/score", b'{"text_1": "\\ud800", "text_2": "b"}', "text_1", "text_1 contains an unpaired surrogate"),
    ("/v2/rerank", b'{"query": "q", "documents": ["\\udfff"]}', "documents", "documents contains an unpaired"),
    ("/classify", b'{"input": "\\ud800"}', "input", "input contains an unpaired surrogate"),
    ("/rerank", b'{"query": "q", "documents": ["d"], "top_n": NaN}', "top_n", "top_n must be a finite number"),
    ("/score", b"", None, "the request body is empty"),
])
def test_scoring_routes_read_bodies_as_the_other_routes(served_cross_encoder, route, raw, param,  # noqa: F811
                                                        message):
    """A body nested past Python's recursion limit and an unpaired surrogate (the pair's tokenizer's TypeError) were
    500s on /classify, /score and /rerank: now 400s naming the depth limit or the field, as /v1/embeddings'."""
    status, reply = _post_raw(served_cross_encoder, route, raw)
    assert status == 400 and message in reply["error"]["message"], reply
    assert reply["error"]["param"] == param, reply
    status, reply = _post(served_cross_encoder, "/score", {"text_1": "a", "text_2": "b"})  # (the server still serves)
    assert status == 200, reply


def test_score_cuts_the_pair_by_pooling_params_truncation(qwen_ce):  # noqa: F811 (fixture)
    """LLM.score(..., pooling_params=PoolingParams(truncate_prompt_tokens=N)) on a cross-encoder refused the long
    pair ("give truncate_prompt_tokens", which it had): the pair is now cut as with the keyword, as the tokenizer's
    pair truncation cuts it (transformers' logit of that encoding)."""
    from transformers import AutoTokenizer
    path, hf = qwen_ce
    tok = AutoTokenizer.from_pretrained(path)
    query, doc = "where is the cat " * 5, "the cat sat on the mat " * 6
    want = tok(query, doc, truncation=True, max_length=12)["input_ids"]
    with LLM(str(path), block_size=4, max_model_len=64) as llm:
        got = llm.score(query, doc, pooling_params=PoolingParams(truncate_prompt_tokens=12))
        by_keyword = llm.score(query, doc, truncate_prompt_tokens=12)
    assert got[0].prompt_token_ids == by_keyword[0].prompt_token_ids == want
    torch.testing.assert_close(torch.tensor(got[0].outputs.score), torch.sigmoid(hf_logits(hf, want))[0],
                               atol=1e-5, rtol=1e-4)


def test_a_tuned_folder_of_an_unknown_user_is_a_config_error(moe_cache, monkeypatch):  # noqa: F811 (fixture)
    """$INFER_TUNED_CONFIG_FOLDER=~nosuchuser/tables: Path.expanduser's RuntimeError ended the engine start with a
    traceback; now a ConfigError naming the variable and what to give."""
    from infer.errors import ConfigError
    from infer.kernels import gptq_configs
    monkeypatch.setenv("INFER_TUNED_CONFIG_FOLDER", "~no-such-user-p61/tables")
    with pytest.raises(ConfigError, match="INFER_TUNED_CONFIG_FOLDER='~no-such-user-p61/tables' starts with a ~user"):
        gptq_configs.load("GPU_X")


def test_a_cohere_logit_scale_of_null_is_refused_naming_it(tmp_path):
    """config.json's "logit_scale": null (a Cohere config type transformers accepts) ended `infer run` with a
    TypeError traceback from the model's build: now the model's refusal, naming the field and what to give."""
    from typer.testing import CliRunner
    from infer.cli.main import app
    from infer.models.tiny import ensure_builtin
    folder = tmp_path / "cohere"
    shutil.copytree(ensure_builtin("tiny-cohere"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "logit_scale": None}))
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    got = CliRunner().invoke(app, ["run", str(folder), str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert got.exit_code == 2 and "logit_scale None is not a number" in got.output, got.output
    assert "0.0625" in got.output and got.exc_info[0] is SystemExit


@pytest.fixture(scope="module")
def served_embedder():
    from helpers import served_tiny_llama
    yield from served_tiny_llama(runner="pooling", max_num_seqs=2)


LONG = "w " * 100  # (more tokens than either server's context)


@pytest.mark.parametrize("route, body, message, param", [
    ("/rerank", {"query": "q", "documents": ["a", "b", LONG, "c"]}, "documents[2]: the prompt has 101", "documents"),
    ("/rerank", {"query": LONG, "documents": ["a", "b"]}, "query: the prompt has 101 tokens", "query"),
    ("/rerank", {"query": "q", "documents": ["a", [99999], "c"]}, "documents[1]: token id 99999 is", "documents"),
    ("/score", {"text_1": ["a", "b", "c"], "text_2": ["a", "b", LONG]}, "text_2[2]: the prompt has 101", "text_2"),
    ("/score", {"text_1": [99999], "text_2": ["a", "b"]}, "text_1: token id 99999 is outside the", "text_1"),
    ("/score", {"text_1": "q", "text_2": LONG}, "text_2: the prompt has 101 tokens", "text_2"),  # (one wave)
    ("/score", {"text_1": "a", "text_2": ["b", "c"], "priority": 1}, "priority=1, but this engine", "priority"),
    ("/v1/embeddings", {"input": ["b", "c", "d"], "priority": 1}, "priority=1, but this engine", "priority"),
])
def test_an_embedding_models_scores_name_the_text_refused(served_embedder, route, body, message, param):
    """An embedding model scores each text embedded apart: a text too long (or of a token outside the vocabulary)
    was refused as input[5] (its place among the texts the pairs run as, a field the body has not) or, in a body
    within the running slots, as "the prompt"; now as the body's field and index. A refusal of a body field
    (priority) was named as the first input's (input[0]: priority=1 ...): now as the field's."""
    status, reply = _post(served_embedder, route, body)
    assert status == 400 and reply["error"]["message"].startswith(message), reply
    assert reply["error"]["param"] == param, reply


@pytest.mark.parametrize("route, body, message", [
    ("/rerank", {"query": "q", "documents": ["a", "b", LONG, "c"]}, "documents[2]: the pair has 10"),
    ("/score", {"text_1": "q", "text_2": ["x", [99999]]}, "text_2[1]: token id 99999 is outside the vocabulary"),
])
def test_a_cross_encoders_scores_name_the_pair_refused(served_cross_encoder, route, body, message):  # noqa: F811
    """A cross-encoder's pair too long among several was refused without saying which."""
    status, reply = _post(served_cross_encoder, route, body)
    assert status == 400 and reply["error"]["message"].startswith(message), reply
    assert reply["error"]["param"] == message.split("[")[0], reply


def test_an_embedding_models_score_takes_a_list_of_one_per_pair(tmp_path):
    """LLM.score on an embedding model runs each pair's two texts as two prompts: a list of one lora, priority or
    PoolingParams per pair (as a cross-encoder takes) was refused as "4 prompts but 2 lora"; now each pair's texts
    run with the pair's (the adapter's pair scored as alone with it), and a list of another length is refused
    naming the pairs."""
    from infer.errors import RequestError
    from lora_helpers import hf_float, save_adapter
    from infer.models.tiny import ensure_builtin
    adapter = save_adapter(hf_float(ensure_builtin("tiny-qwen3")), tmp_path / "a", seed=4, scale=0.5, r=4,
                           target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with LLM("tiny-qwen3", runner="pooling", block_size=4, enable_lora=True, max_lora_rank=8,
             loras={"a": str(adapter)}, scheduling_policy="priority") as llm:
        mixed = [o.outputs.score for o in llm.score("a cat", ["the mat", "a dog"], lora=["a", None],
                                                     priority=[1, 0], pooling_params=[PoolingParams()] * 2)]
        alone = [llm.score("a cat", "the mat", lora="a")[0].outputs.score, llm.score("a cat", "a dog")[0].outputs.score]
        base = llm.score("a cat", "the mat")[0].outputs.score
        with pytest.raises(RequestError, match=r"2 pair\(s\) but 3 lora \(give one lora per pair"):
            llm.score("a cat", ["the mat", "a dog"], lora=["a", None, None])
    assert mixed == pytest.approx(alone, abs=1e-6) and abs(alone[0] - base) > 1e-4


def test_a_document_object_is_refused_naming_the_text_to_give(served_cross_encoder):  # noqa: F811 (fixture)
    """Cohere's and Jina's clients may send documents as {"text": ...} objects, which vLLM's rerank does not read:
    the refusal said only that the item is no text; it now says to send the text itself."""
    status, reply = _post(served_cross_encoder, "/v1/rerank", {"query": "q", "documents": ["a", {"text": "d"}]})
    assert status == 400 and reply["error"]["param"] == "documents", reply
    assert reply["error"]["message"].startswith("documents[1] is neither a text nor a list of token ids"), reply
    assert 'not an object such as {"text": ...}' in reply["error"]["message"], reply
