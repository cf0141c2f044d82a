"""Review of classification, scoring and reranking (session 60): a classifier pools where transformers does (the
last token that is not the pad token), keeps no vocabulary-sized head, converts with its score head, and the
commands that cannot do a classifier (bench, lora-validate's numeric check) say so."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app

from helpers import random_prompts
from test_probes_session60_classify import DOCS, _post, build_classifier, check_close, hf_logits, probs
from test_probes_session60_classify import qwen_ce, served_cross_encoder  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A tiny Llama classifier of three labels whose config.json keeps pad_token_id 0 (the built-in tokenizer's)."""
    path, hf = build_classifier("tiny-llama", tmp_path_factory.mktemp("rcls") / "padded", 3, seed=7)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "pad_token_id": 0}))
    hf.config.pad_token_id = 0
    return path, hf


def test_classify_pools_the_last_token_that_is_not_the_pad_token(padded):
    """transformers scores the last non-pad token of a prompt (its first token when all are pad): prompts that end
    in pad tokens, whole and in chunks of 4; each output keeps the prompt as given."""
    path, hf = padded
    body = random_prompts(hf.config.vocab_size, (9, 5, 3), seed=8)
    body = [[t or 1 for t in p] for p in body]  # (no pad token inside the text)
    prompts = [body[0] + [0, 0, 0], body[1] + [0], body[2], [0, 0, 0, 0, 0, 0], body[1][:2] + [0] + body[2] + [0]]
    want = [torch.softmax(hf_logits(hf, p), -1) for p in prompts]
    assert not torch.allclose(want[0], torch.softmax(hf.score(hf.model(torch.tensor([prompts[0]]))
                                                              .last_hidden_state[0, -1]), -1).detach(), atol=1e-3)
    for tokens in (4, 64):
        with LLM(str(path), block_size=4, max_num_batched_tokens=tokens, max_num_seqs=4) as llm:
            outs = llm.classify(prompts)
            check_close(probs(outs), want)
            assert [o.prompt_token_ids for o in outs] == prompts


@pytest.mark.parametrize("tied", [False, True])
def test_a_classifier_holds_and_is_estimated_without_a_vocabulary_head(padded, tmp_path, tied):
    """A classifier has its score head, no output head over the vocabulary: the CPU engine prepacks no copy of the
    embeddings as one (tied or not in config.json), and `infer warmup --estimate` counts the weights as loaded."""
    from infer.memory.sizes import weights_bytes
    path, _ = padded
    if tied:
        import shutil
        path = shutil.copytree(path, tmp_path / "tied")
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    res = CliRunner().invoke(app, ["warmup", str(path), "--estimate", "--json", "--max-length", "64"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    with LLM(str(path), max_model_len=64) as llm:
        model = llm.engine.runner.model
        assert model.packed_head is None and not hasattr(model, "lm_head")
        assert plan["weights_bytes"] == weights_bytes(model)


def test_convert_keeps_a_classifiers_score_head(padded, tmp_path):
    """`infer convert` of a classifier writes it as one (transformers' *ForSequenceClassification, its score head):
    the copy classifies as transformers does on the source."""
    path, hf = padded
    res = CliRunner().invoke(app, ["convert", str(path), "-o", str(tmp_path / "copy")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "copy" / "config.json").read_text())["architectures"] == \
        ["LlamaForSequenceClassification"]
    prompts = random_prompts(hf.config.vocab_size, (7, 2), seed=9)
    with LLM(str(tmp_path / "copy")) as llm:
        check_close(probs(llm.classify(prompts)), [torch.softmax(hf_logits(hf, p), -1) for p in prompts])


def test_bench_refuses_a_classifier_in_process_and_at_a_url(padded):
    """infer bench's pooling runner times embeddings: a classifier folder (runner auto or pooling) is refused before
    loading, and so is a classifier server at --url (it was an AttributeError after the run, and a server taken
    for a generation one)."""
    from contextlib import contextmanager

    from infer.cli.bench import check_embeds
    from infer.errors import ConfigError
    from test_probes_session60_classify import _serve
    path, _ = padded
    for runner in ([], ["--runner", "pooling"]):
        res = CliRunner().invoke(app, ["bench", str(path), "--num-prompts", "2", "--input-len", "4", *runner])
        assert res.exit_code == 2 and "is a classifier" in res.output and "benches embeddings" in res.output, \
            res.output
    with contextmanager(_serve)(path) as base:
        with pytest.raises(ConfigError, match="'cls' at .* is a classifier .* benches embeddings"):
            check_embeds(base, "cls", {})


def test_lora_validate_on_a_classifier_base_refuses_the_numeric_check(padded, tmp_path):
    """lora-validate's numeric check compares generated tokens' logits: on a classifier base it is refused by name
    (it was the engine's "LLM.generate() is only supported for generative models"), --steps 0 checks statically."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from infer.models.tiny import ensure_builtin
    path, _ = padded
    base = AutoModelForCausalLM.from_pretrained(ensure_builtin("tiny-llama"))
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "ad")
    res = CliRunner().invoke(app, ["lora-validate", str(path), str(tmp_path / "ad")])
    assert res.exit_code == 2 and "is a classifier" in res.output and "--steps 0" in res.output, res.output
    res = CliRunner().invoke(app, ["lora-validate", str(path), str(tmp_path / "ad"), "--steps", "0", "--json"])
    assert res.exit_code == 0, res.output


def test_rerank_usage_counts_the_prompt_tokens(served_cross_encoder, qwen_ce):  # noqa: F811 (fixtures)
    """POST /rerank's usage is vLLM's RerankUsage: prompt_tokens and total_tokens, the pairs' tokens (it had
    total_tokens alone)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen_ce[0])
    status, body = _post(served_cross_encoder, "/v1/rerank", {"query": "where is the cat", "documents": DOCS})
    assert status == 200, body
    tokens = sum(len(tok("where is the cat", d)["input_ids"]) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_truncated_pairs_keep_the_query_as_transformers_truncates_them(served_cross_encoder, qwen_ce):  # noqa: F811
    """truncate_prompt_tokens on a cross-encoder's pair cuts it as vLLM's tokenizer call (transformers' truncation,
    longest first: the longer text's end), through LLM.score and POST /score, not the joined prompt's last tokens
    (which dropped the query); token-id pairs are cut alike; fewer tokens than the special ones is refused."""
    from transformers import AutoTokenizer

    from infer.errors import RequestError
    path, hf = qwen_ce
    tok = AutoTokenizer.from_pretrained(path)
    query, docs = "where is the cat now", ["the cat sat on the mat " * 4, "a dog", "hello world, again and again"]
    cut = [tok(query, d, truncation=True, max_length=9)["input_ids"] for d in docs]
    assert all(c[:3] == tok(query)["input_ids"][:3] for c in cut)  # (the query's start kept)
    want = [torch.sigmoid(hf_logits(hf, c))[0].item() for c in cut]
    status, body = _post(served_cross_encoder, "/score", {"text_1": query, "text_2": docs,
                                                          "truncate_prompt_tokens": 9})
    assert status == 200, body
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), torch.tensor(want),
                               atol=1e-5, rtol=1e-4)
    assert body["usage"]["prompt_tokens"] == sum(map(len, cut))
    ids = [tok(query, add_special_tokens=False)["input_ids"], tok(docs[0], add_special_tokens=False)["input_ids"]]
    with LLM(str(path), block_size=4) as llm:
        outs = llm.score(query, docs, truncate_prompt_tokens=9)
        assert [o.prompt_token_ids for o in outs] == cut
        assert llm.score([ids[0]], [ids[1]], truncate_prompt_tokens=9)[0].prompt_token_ids == cut[0]
        with pytest.raises(RequestError, match="truncate_prompt_tokens 1 leaves no room"):
            llm.score(query, docs, truncate_prompt_tokens=1)


def test_classify_route_names_its_own_task_for_an_empty_text(served_cross_encoder):  # noqa: F811 (fixtures)
    status, body = _post(served_cross_encoder, "/classify", {"input": ["a", ""]})
    assert status == 400 and "input[1] is an empty string: there is nothing to classify" in \
        body["error"]["message"], body


def test_request_id_names_the_classify_score_and_rerank_responses(served_cross_encoder):  # noqa: F811
    """vLLM's request_id field (and the X-Request-Id header, first): the response's id is classify-, score- or
    rerank- and it; a request_id that is not a string is refused by name."""
    import httpx
    for route, body, prefix in (("/classify", {"input": "hi"}, "classify-"),
                                ("/score", {"text_1": "a", "text_2": "b"}, "score-"),
                                ("/rerank", {"query": "a", "documents": ["b"]}, "rerank-")):
        status, reply = _post(served_cross_encoder, route, {**body, "request_id": "job-7"})
        assert status == 200 and reply["id"] == prefix + "job-7", reply
        r = httpx.post(served_cross_encoder + route, json={**body, "request_id": "job-7"},
                       headers={"X-Request-Id": "hdr-1"}, timeout=60)
        assert r.json()["id"] == prefix + "hdr-1", r.text
        status, reply = _post(served_cross_encoder, route, {**body, "request_id": 7})
        assert status == 400 and reply["error"]["param"] == "request_id" and \
            f"{prefix}job-7" in reply["error"]["message"], reply
