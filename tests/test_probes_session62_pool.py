"""Per-token pooling (vLLM's token_classify and token_embed tasks): a *ForTokenClassification model (a score head with
a bias over every token's final hidden state) equals transformers' AutoModelForTokenClassification through
LLM.encode(..., pooling_task="token_classify"), POST /pooling and infer run lines of url /pooling, whole or in chunks
and with an adapter; an embedding model's token_embed is every token's normalized hidden state, never read from the
prefix cache; tasks a model lacks and fields a task does not take are refused."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from infer import LLM, PoolingParams
from infer.engine.pooling import PoolingRequestOutput
from infer.errors import ConfigError, RequestError
from infer.models.tiny import ensure_builtin

from helpers import build_score_head_model, random_prompts
from lora_helpers import THREE, hf_float, save_adapter
from test_probes_session60_classify import _post, _serve, build_classifier

LENGTHS = (11, 3, 17, 1, 8)
LABELS = {0: "O", 1: "B-PER", 2: "I-PER"}


def build_token_classifier(src_name: str, folder, seed: int, num_labels: int = 3):
    """A *ForTokenClassification folder from a built-in tiny model: its decoder and a random score head and bias;
    returns (folder, transformers' model in float32)."""
    return build_score_head_model(src_name, folder, "AutoModelForTokenClassification", num_labels, seed, LABELS,
                                  bias=True)


@pytest.fixture(scope="module")
def tok_llama(tmp_path_factory):
    return build_token_classifier("tiny-llama", tmp_path_factory.mktemp("tok") / "llama", seed=1)


def hf_token_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_hidden(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0].float()


def check_rows(outs, want: list[torch.Tensor]) -> None:
    assert len(outs) == len(want)
    for o, w in zip(outs, want):
        assert o.outputs.data.shape == w.shape
        torch.testing.assert_close(o.outputs.data, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tokens", [4, 64])
def test_token_classify_equals_transformers(tok_llama, tokens):
    """Every token's softmax of transformers' logits (bias included), whole prompts or in chunks of 4 tokens (a
    prompt's rows gathered in order across steps); use_activation false gives the logits; runner auto pools it."""
    path, hf = tok_llama
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=3)
    logits = [hf_token_logits(hf, p) for p in prompts]
    with LLM(str(path), block_size=4, max_num_batched_tokens=tokens, max_num_seqs=4) as llm:
        pooler = llm.engine.pooler
        assert (pooler.task, pooler.tasks, pooler.labels) == ("token_classify", ("token_classify",),
                                                             tuple(LABELS.values()))
        outs = llm.encode(prompts, pooling_task="token_classify")
        check_rows(outs, [torch.softmax(x, -1) for x in logits])
        assert [o.prompt_token_ids for o in outs] == prompts
        assert all(type(o) is PoolingRequestOutput for o in outs)  # (vLLM's LLM.encode's)
        check_rows(llm.encode(prompts[:2]), [torch.softmax(x, -1) for x in logits[:2]])  # (the model's own task)
        check_rows(llm.encode(prompts[:3], PoolingParams(use_activation=False), pooling_task="token_classify"),
                   logits[:3])
        cut = llm.encode(prompts[2:3], pooling_task="token_classify", truncate_prompt_tokens=5)  # (the last 5 kept)
        check_rows(cut, [torch.softmax(hf_token_logits(hf, prompts[2][-5:]), -1)])
        assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_other_families_token_classify_as_transformers(tmp_path, name):
    path, hf = build_token_classifier(name, tmp_path / name, seed=5, num_labels=1)
    prompts = random_prompts(hf.config.vocab_size, LENGTHS[:3], seed=6)
    with LLM(str(path), block_size=4, max_num_batched_tokens=4, max_num_seqs=2) as llm:  # one label: a sigmoid
        check_rows(llm.encode(prompts, pooling_task="token_classify"),
                   [torch.sigmoid(hf_token_logits(hf, p)) for p in prompts])


def test_token_classify_with_an_adapter_equals_peft(tok_llama, tmp_path):
    """A LoRA adapter of the decoder (peft's, on transformers' token classifier) in one batch with base requests."""
    from peft import PeftModel
    path, hf = tok_llama
    adapter = save_adapter(hf, tmp_path / "a", seed=3, lora_dropout=0.0, **THREE["a"])
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=8)
    base = [torch.softmax(hf_token_logits(hf, p), -1) for p in prompts]
    peft = PeftModel.from_pretrained(hf, str(adapter)).eval()
    tuned = [torch.softmax(hf_token_logits(peft, p), -1) for p in prompts]
    peft.unload()
    assert not torch.allclose(tuned[0], base[0], atol=1e-3)
    with LLM(str(path), enable_lora=True, max_lora_rank=8, loras={"a": str(adapter)}, block_size=4,
             max_num_batched_tokens=8, max_num_seqs=4) as llm:
        mixed = llm.encode(prompts, pooling_task="token_classify", lora=["a", None, "a", None, "a"])
    check_rows(mixed, [tuned[i] if i % 2 == 0 else base[i] for i in range(len(prompts))])


def test_token_embed_rows_are_normalized_hidden_states_never_from_the_prefix_cache():
    """An embedding model's token_embed: every token's final hidden state, L2-normalized each (normalize false: as
    they are), in chunks of 4 tokens; a prompt whose prefix is cached (by a LAST embed) computes its every token."""
    path = ensure_builtin("tiny-qwen3")
    hf = hf_float(path)
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=4)
    prompts[2][:8] = prompts[0][:8]
    hidden = [hf_hidden(hf, p) for p in prompts]
    with LLM(str(path), runner="pooling", enable_prefix_caching=True, block_size=4, max_num_batched_tokens=4,
             max_num_seqs=4) as llm:
        assert llm.engine.block_manager.enable_prefix_caching
        llm.embed(prompts[:1])
        again = llm.embed(prompts[2:3])
        assert again[0].num_cached_tokens == 8  # (the cache does hold the shared prefix)
        outs = llm.encode(prompts, pooling_task="token_embed")
        check_rows(outs, [torch.nn.functional.normalize(h, dim=-1) for h in hidden])
        assert all(o.num_cached_tokens == 0 for o in outs)
        check_rows(llm.encode(prompts[:2], PoolingParams(normalize=False), pooling_task="token_embed"), hidden[:2])
        vec = llm.encode(prompts[:1], pooling_task="embed")[0].outputs.data  # (LLM.embed's)
        torch.testing.assert_close(vec, torch.nn.functional.normalize(hidden[0][-1], dim=-1), atol=1e-5, rtol=1e-4)


def test_token_classify_on_a_sequence_classifier(tmp_path):
    """A *ForSequenceClassification model's token_classify (vLLM's): its score head over every token's state."""
    path, hf = build_classifier("tiny-llama", tmp_path / "seq", 3, seed=7)
    prompts = random_prompts(hf.config.vocab_size, LENGTHS[:3], seed=9)
    with LLM(str(path), block_size=4, max_num_batched_tokens=4, max_num_seqs=2) as llm:
        assert llm.engine.pooler.tasks == ("classify", "token_classify")
        outs = llm.encode(prompts, pooling_task="token_classify")
        with torch.no_grad():
            want = [torch.softmax(hf_hidden(hf, p) @ hf.score.weight.T, -1) for p in prompts]
        check_rows(outs, want)
        torch.testing.assert_close(torch.tensor(llm.classify(prompts[:1])[0].outputs.probs), want[0][-1],
                                   atol=1e-5, rtol=1e-4)


def test_refusals(tok_llama):
    path, hf = tok_llama
    with LLM(str(path), block_size=4) as llm:
        with pytest.raises(RequestError, match="pooling_task 'token' is not one of embed, classify, token_embed"):
            llm.encode(["hi"], pooling_task="token")
        for task in ("classify", "embed", "token_embed"):
            with pytest.raises(RequestError, match=f"pooling task '{task}' is not supported by this model: it does "
                                                   "token_classify"):
                llm.encode(["hi"], pooling_task=task)
        with pytest.raises(RequestError, match="not supported by this model"):
            llm.classify(["hi"])
        with pytest.raises(RequestError, match="does token_classify only .* scores no pairs"):
            llm.score("a", "b")
        with pytest.raises(RequestError, match="only supported for generative models"):
            llm.generate(["hi"])
        with pytest.raises(RequestError, match="matryoshka"):
            llm.encode(["hi"], PoolingParams(dimensions=2))
    with pytest.raises(ConfigError, match="pooling_type is not for a token classifier"):
        LLM(str(path), pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ConfigError, match="is a classifier"):
        LLM(str(path), runner="generate")
    with LLM("tiny-qwen3", runner="pooling", block_size=4) as llm:
        with pytest.raises(RequestError, match="'token_classify' is not supported by this model: it does embed, "
                                               "token_embed"):
            llm.encode(["hi"], pooling_task="token_classify")
    with LLM("tiny-llama", block_size=4) as llm:
        with pytest.raises(RequestError, match="LLM.encode needs the LLM started with --runner pooling"):
            llm.encode(["hi"], pooling_task="token_embed")


@pytest.fixture(scope="module")
def served_tokens(tok_llama):
    yield from _serve(tok_llama[0])


def test_pooling_route_equals_transformers(served_tokens, tok_llama):
    """POST /pooling (vLLM's PoolingResponse): a row per token of each input, float or base64 (little-endian
    float32, row after row), the token classifier's task by default; the usage counts the prompts' tokens."""
    from transformers import AutoTokenizer
    path, hf = tok_llama
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["the cat sat on the mat", "a dog"]
    ids = [tok(t)["input_ids"] for t in texts]
    want = [torch.softmax(hf_token_logits(hf, i), -1) for i in ids]
    status, body = _post(served_tokens, "/pooling", {"model": "cls", "input": texts})
    assert status == 200, body
    assert body["id"].startswith("pool-") and body["object"] == "list"
    assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {"pooling"}
    for d, w in zip(body["data"], want):
        torch.testing.assert_close(torch.tensor(d["data"]), w, atol=1e-5, rtol=1e-4)
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    status, body = _post(served_tokens, "/pooling", {"input": ids[1], "task": "token_classify",
                                                     "encoding_format": "base64", "endianness": "little",
                                                     "use_activation": False})
    assert status == 200, body
    rows = np.frombuffer(base64.b64decode(body["data"][0]["data"]), dtype="<f4").reshape(len(ids[1]), 3)
    torch.testing.assert_close(torch.from_numpy(rows.copy()), hf_token_logits(hf, ids[1]), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("body, message", [
    ({"input": "hi", "task": "classify"}, "task: pooling task 'classify' is not supported by this model"),
    ({"input": "hi", "task": "nope"}, "task 'nope' is not one of"),
    ({"input": "hi", "normalize": True}, "normalize is an embedding's field"),
    ({"input": "hi", "dimensions": 2}, "dimensions is an embedding's field: task token_classify"),
    ({"input": ""}, "input[0] is an empty string"),
])
def test_pooling_route_refuses_bad_bodies(served_tokens, body, message):
    status, reply = _post(served_tokens, "/pooling", body)
    assert status == 400 and message in reply["error"]["message"], reply


@pytest.mark.parametrize("route", ["/classify", "/score", "/rerank", "/v1/embeddings"])
def test_token_classifier_server_refuses_the_sequence_routes(served_tokens, route):
    status, reply = _post(served_tokens, route, {"input": "a", "text_1": "a", "text_2": "b", "query": "a",
                                                 "documents": ["b"]})
    assert status == 400 and "is a token classifier" in reply["error"]["message"], reply


def test_pooling_route_of_an_embedding_server_and_a_generating_one():
    """An embedding server's /pooling: token_embed's normalized rows when asked, embed's one vector by default
    (vLLM's get_pooling_task: the model's own task); use_activation refused; a generation server refuses the
    route."""
    from helpers import served_tiny_llama
    path = ensure_builtin("tiny-qwen3")
    hf = hf_float(path)
    ids = random_prompts(hf.config.vocab_size, (6,), seed=2)[0]
    hidden = torch.nn.functional.normalize(hf_hidden(hf, ids), dim=-1)
    for base in _serve("tiny-qwen3", runner="pooling"):
        status, body = _post(base, "/pooling", {"input": ids, "task": "token_embed"})
        assert status == 200, body
        torch.testing.assert_close(torch.tensor(body["data"][0]["data"]), hidden, atol=1e-5, rtol=1e-4)
        status, body = _post(base, "/pooling", {"input": ids})
        torch.testing.assert_close(torch.tensor(body["data"][0]["data"]), hidden[-1], atol=1e-5, rtol=1e-4)
        status, reply = _post(base, "/pooling", {"input": ids, "use_activation": True})
        assert status == 400 and "use_activation is a classifier's field" in reply["error"]["message"], reply
    gen = served_tiny_llama()
    try:
        status, reply = _post(next(gen), "/pooling", {"input": "hi"})
        assert status == 400 and "/pooling needs the server started with --runner pooling" in \
            reply["error"]["message"], reply
    finally:
        gen.close()


def test_infer_run_pooling_lines(tmp_path, tok_llama):
    """infer run lines of url /pooling answer as the server: the model's per-token task, every input's rows."""
    from helpers import infer_run_records
    path, hf = tok_llama
    ids = random_prompts(hf.config.vocab_size, (5, 2), seed=11)
    lines = [{"custom_id": "p", "url": "/pooling", "body": {"input": ids}},
             {"custom_id": "one", "url": "/pooling", "body": {"input": ids[1], "use_activation": False}},
             {"custom_id": "bad", "url": "/pooling", "body": {"input": ids[0], "task": "embed"}}]
    recs, _ = infer_run_records(tmp_path, lines, "--block-size", "4", "--output-format", "openai", key="custom_id",
                                model=str(path))
    body = recs["p"]["response"]["body"]
    assert body["id"].startswith("pool-") and [d["index"] for d in body["data"]] == [0, 1], body
    for d, p in zip(body["data"], ids):
        torch.testing.assert_close(torch.tensor(d["data"]), torch.softmax(hf_token_logits(hf, p), -1), atol=1e-5,
                                   rtol=1e-4)
    torch.testing.assert_close(torch.tensor(recs["one"]["response"]["body"]["data"][0]["data"]),
                               hf_token_logits(hf, ids[1]), atol=1e-5, rtol=1e-4)
    assert "pooling task 'embed' is not supported by this model" in recs["bad"]["error"]["message"], recs["bad"]
    recs, printed = infer_run_records(tmp_path, [{"id": "t", "prompt": ids[0]}], "--block-size", "4",
                                      model=str(path))  # (infer's own format: every token classified)
    want = torch.softmax(hf_token_logits(hf, ids[0]), -1)
    torch.testing.assert_close(torch.tensor(recs["t"]["probs"]), want, atol=1e-5, rtol=1e-4)
    assert recs["t"]["labels"] == [LABELS[int(k)] for k in want.argmax(-1)] and recs["t"]["num_classes"] == 3


def test_classify_route_runs_an_empty_text_as_its_bos(tmp_path):
    """vLLM's /classify of an empty text: the tokenizer's special tokens alone (the BOS) are classified, as
    transformers classifies them; a tokenizer that adds none has nothing to classify (test_probes_session60_rcls)."""
    from tokenizers import processors
    from transformers import AutoTokenizer
    path, hf = build_classifier("tiny-llama", tmp_path / "bos", 3, seed=2)
    tok = AutoTokenizer.from_pretrained(path)
    bos_id = tok.eos_token_id if tok.bos_token_id is None else tok.bos_token_id  # (a special token as the BOS)
    bos = tok.convert_ids_to_tokens(bos_id)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    tok.save_pretrained(path)
    assert AutoTokenizer.from_pretrained(path)("")["input_ids"] == [bos_id]
    with torch.no_grad():
        want = [torch.softmax(hf(torch.tensor([AutoTokenizer.from_pretrained(path)(t)["input_ids"]])).logits[0], -1)
                for t in ("", "a dog")]
    for base in _serve(path):
        status, body = _post(base, "/classify", {"input": ["", "a dog"]})
        assert status == 200, body
        torch.testing.assert_close(torch.tensor([d["probs"] for d in body["data"]]), torch.stack(want), atol=1e-5,
                                   rtol=1e-4)
        assert body["usage"]["prompt_tokens"] == 1 + len(tok("a dog")["input_ids"])


def test_score_takes_vllms_prompt_dicts():
    """LLM.score's data given as vLLM's prompt dicts ({"prompt": text}, {"prompt_token_ids": ids}), alone or in a
    list, scores as the texts and token ids themselves (they were refused); a bad dict is named by its place."""
    with LLM("tiny-qwen3", runner="pooling", block_size=4) as llm:
        ids = llm.tokenizer("a dog")["input_ids"]
        want = [o.outputs.score for o in llm.score("the cat", [ids, "a cat"])]
        got = [o.outputs.score for o in llm.score({"prompt": "the cat"},
                                                  [{"prompt_token_ids": ids}, {"prompt": "a cat"}])]
        assert got == pytest.approx(want, abs=1e-6) and want[0] != pytest.approx(want[1], abs=1e-4)
        assert llm.score("the cat", {"prompt_token_ids": ids})[0].outputs.score == pytest.approx(want[0], abs=1e-6)
        with pytest.raises(RequestError, match=r"data_2\[1\] has both prompt and prompt_token_ids"):
            llm.score("a", ["b", {"prompt": "c", "prompt_token_ids": [1]}])
