"""Gaps of the pooling runner closed: a /v1/embeddings body with more inputs than the server holds at once runs in
waves; vLLM's chat form (messages); AsyncLLM.encode(truncate_prompt_tokens=...); embed_dtype and endianness of a
base64 vector (encoding_format "bytes" refused); infer bench --url refuses a pooling server before it runs."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from infer.errors import ConfigError
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import hf_float
from test_probes_session59_embed import _post, check_close, hf_hidden, pooled, qwen3, served_pooling  # noqa: F401


@pytest.fixture(scope="module")
def served_small():
    """tiny-llama as a pooling server (MEAN) holding 3 requests at once (2 running, --max-queue 1): (URL, hf,
    engine)."""
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    path = ensure_builtin("tiny-llama")
    engine = LLMEngine(EngineConfig("tiny-llama", runner="pooling", pooler_config={"pooling_type": "MEAN"},
                                    max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8, block_size=4))
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=1), "tiny-llama")) as base:
        yield base, hf_float(path), engine


def test_a_body_larger_than_the_server_holds_runs_in_waves(served_small):
    """9 inputs at a server that holds 3 at once: was a 400 ("this request has 9 prompts"); now every vector, in
    order, equals transformers', the tokens are all counted, and nothing is left in the engine."""
    base, hf, engine = served_small
    prompts = random_prompts(hf.config.vocab_size, (5, 9, 3, 12, 7, 4, 6, 10, 2), seed=21)
    status, body = _post(base, "/v1/embeddings", {"input": prompts})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == list(range(9))
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    check_close([torch.tensor(d["embedding"]) for d in body["data"]],
                [pooled(hf_hidden(hf, p), "MEAN") for p in prompts])
    assert engine.block_manager.num_used_blocks == 0


def test_a_later_waves_refused_input_names_it(served_small):
    """An input the engine refuses (a token outside the vocabulary) in a later wave: a 400 naming input."""
    base, hf, _ = served_small
    prompts = random_prompts(hf.config.vocab_size, (3,) * 5, seed=22) + [[3, 10 ** 6]]
    status, body = _post(base, "/v1/embeddings", {"input": prompts})
    assert status == 400, body
    assert body["error"]["param"] == "input" and "outside the vocabulary" in body["error"]["message"], body


def _chat_ids(messages: list[dict], **options) -> list[int]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **options)["input_ids"])


CHAT = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]


@pytest.mark.parametrize("fields, options", [
    ({}, {"add_generation_prompt": False}),  # (vLLM's EmbeddingChatRequest: no generation prompt by default)
    ({"add_generation_prompt": True}, {"add_generation_prompt": True}),
    ({"add_generation_prompt": False, "continue_final_message": True},
     {"add_generation_prompt": False, "continue_final_message": True}),
])
def test_chat_form_embeds_the_rendered_chat(served_pooling, fields, options):  # noqa: F811
    """`messages` instead of `input`: the vector of the chat template's rendering (transformers' over the ids
    apply_chat_template gives), the same as that rendering sent as `input`."""
    base, hf, _ = served_pooling
    ids = _chat_ids(CHAT, **options)
    status, body = _post(base, "/v1/embeddings", {"messages": CHAT, **fields})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(ids)
    check_close([torch.tensor(body["data"][0]["embedding"])], [pooled(hf_hidden(hf, ids), "MEAN")])
    assert _post(base, "/v1/embeddings", {"input": ids})[1]["data"] == body["data"]


@pytest.mark.parametrize("extra, param, says", [
    ({"input": "hi"}, "input", "either input or messages"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "add_generation_prompt=false"),
    ({"add_special_tokens": True}, "add_special_tokens", "chat messages"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "--trust-request-chat-template"),
])
def test_chat_form_refusals(served_pooling, extra, param, says):  # noqa: F811
    base, _, _ = served_pooling
    status, body = _post(base, "/v1/embeddings", {"messages": CHAT, **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and says in body["error"]["message"], body


def test_async_llm_encode_takes_truncate_prompt_tokens(qwen3):  # noqa: F811
    """vLLM's encode(..., truncate_prompt_tokens=N) (was a TypeError): the prompt's last N tokens are embedded;
    the caller's PoolingParams are left as they were."""
    import asyncio

    from infer import AsyncLLM, PoolingParams
    path, hf = qwen3
    prompt = random_prompts(hf.config.vocab_size, (9,), seed=23)[0]
    params = PoolingParams()

    async def run(llm):
        return [out async for out in llm.encode(prompt, params, "cut", truncate_prompt_tokens=4)]
    with AsyncLLM(str(path), runner="pooling", block_size=4) as llm:
        outs = asyncio.run(run(llm))
    assert outs[0].prompt_token_ids == prompt[-4:]
    check_close([torch.tensor(outs[0].outputs.embedding)], [pooled(hf_hidden(hf, prompt[-4:]), "LAST")])
    assert params.truncate_prompt_tokens is None


@pytest.mark.parametrize("dtype, endian, numpy_dtype", [
    ("float32", "little", "<f4"), ("float16", "native", "<f2"), ("float16", "big", ">f2"), ("float32", "big", ">f4"),
])
def test_base64_embed_dtype_and_endianness(served_pooling, dtype, endian, numpy_dtype):  # noqa: F811
    """vLLM's embed_dtype and endianness: the base64 bytes are the vector as that dtype, in that byte order (they
    were dropped: float32 bytes that a float16 reader decodes as noise)."""
    base, hf, _ = served_pooling
    ids = random_prompts(hf.config.vocab_size, (6,), seed=24)[0]
    status, body = _post(base, "/v1/embeddings", {"input": ids, "encoding_format": "base64", "embed_dtype": dtype,
                                                  "endianness": endian})
    assert status == 200, body
    got = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), numpy_dtype).astype("<f4")
    want = pooled(hf_hidden(hf, ids), "MEAN").to(getattr(torch, dtype)).float()
    check_close([torch.from_numpy(got.copy())], [want], atol=1e-3)


def test_base64_bfloat16(served_pooling):  # noqa: F811
    base, hf, _ = served_pooling
    ids = random_prompts(hf.config.vocab_size, (6,), seed=24)[0]
    status, body = _post(base, "/v1/embeddings", {"input": ids, "encoding_format": "base64",
                                                  "embed_dtype": "bfloat16"})
    assert status == 200, body
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<u2").astype("<u4") << 16
    want = pooled(hf_hidden(hf, ids), "MEAN").to(torch.bfloat16).float()
    check_close([torch.from_numpy(raw.view("<f4").copy())], [want], atol=1e-2)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_base64_fp8(served_pooling, dtype):  # noqa: F811
    """vLLM's fp8 embed_dtypes: one byte a value, the float8 encoding of the vector."""
    base, hf, _ = served_pooling
    ids = random_prompts(hf.config.vocab_size, (6,), seed=24)[0]
    status, body = _post(base, "/v1/embeddings", {"input": ids, "encoding_format": "base64", "embed_dtype": dtype})
    assert status == 200, body
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[dtype]
    raw = bytearray(base64.b64decode(body["data"][0]["embedding"]))
    got = torch.frombuffer(raw, dtype=torch.uint8).view(fp8).float()
    want = pooled(hf_hidden(hf, ids), "MEAN")
    assert got.shape == want.shape
    # (within float8's rounding: 3 mantissa bits (e4m3) or 2 (e5m2), whichever way a value near a midpoint rounds)
    torch.testing.assert_close(got, want, rtol={"fp8_e4m3": 2 ** -3, "fp8_e5m2": 2 ** -2}[dtype], atol=1e-2)


@pytest.mark.parametrize("extra, param, says", [
    ({"encoding_format": "bytes"}, "encoding_format", "send encoding_format base64"),
    ({"encoding_format": "base64", "embed_dtype": "float64"}, "embed_dtype", "float32, float16, bfloat16"),
    ({"encoding_format": "base64", "endianness": "middle"}, "endianness", "native, little, big"),
])
def test_encodings_infer_does_not_write_are_refused(served_pooling, extra, param, says):  # noqa: F811
    base, _, _ = served_pooling
    status, body = _post(base, "/v1/embeddings", {"input": "hi", **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and says in body["error"]["message"], body


def test_bench_url_refuses_a_pooling_server_before_it_runs(served_pooling, tmp_path, monkeypatch):  # noqa: F811
    """`infer bench --url` at a pooling server ran and failed every request: refused at once, nothing written."""
    from typer.testing import CliRunner

    from infer.cli.bench import check_url
    from infer.cli.main import app
    base, _, _ = served_pooling
    with pytest.raises(ConfigError, match="as a pooling model"):
        check_url(base, "tiny-llama", [], None)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--url", base, "-c", "1", "--num-prompts", "1"])
    assert res.exit_code == 2, res.output
    assert "pooling model" in res.output
    assert not (tmp_path / "bench-results").exists()


def test_infer_run_embedding_lines_take_embed_dtype_and_refuse_the_chat_form(tmp_path):
    """An `infer run` line of url /v1/embeddings: embed_dtype float16 writes the vector's float16 bytes; messages
    (the server's chat form) get a clear error record (was "body.input must be text or token ids")."""
    from helpers import infer_run_records
    from test_probes_session59_embed import _line
    hf = hf_float(ensure_builtin("tiny-llama"))
    ids = random_prompts(hf.config.vocab_size, (6,), seed=25)[0]
    lines = [_line("a", {"input": ids, "encoding_format": "base64", "embed_dtype": "float16"}),
             _line("b", {"messages": CHAT})]
    recs, _ = infer_run_records(tmp_path, lines, "--runner", "pooling", "--block-size", "4",
                                "--output-format", "openai", key="custom_id")
    got = np.frombuffer(base64.b64decode(recs["a"]["response"]["body"]["data"][0]["embedding"]), "<f2")
    want = pooled(hf_hidden(hf, ids), "LAST").half().float()
    check_close([torch.from_numpy(got.astype("<f4"))], [want], atol=1e-3)
    assert "takes input, not the chat form" in recs["b"]["error"]["message"]


def test_a_later_wave_waits_for_room_in_the_queue():
    """A later wave that finds --max-queue full (other clients' requests queued meanwhile) waits and is submitted
    when there is room: the body's first waves are done and its client is waiting; the first wave's 503 is the
    client's to retry."""
    import asyncio

    from infer.serve import embeddings, protocol as p

    class Busy:
        def __init__(self):
            self.tries = 0

        def submit(self, part, lora, base_id):
            self.tries += 1
            if self.tries < 3:
                raise p.ApiError(503, "the queue is full", code="queue_full")
            return "queue", [base_id]
    later = Busy()
    assert asyncio.run(embeddings._submit(later, None, None, "embd-x-4", None, first=False)) == ("queue", ["embd-x-4"])
    assert later.tries == 3
    with pytest.raises(p.ApiError, match="the queue is full"):
        asyncio.run(embeddings._submit(Busy(), None, None, "embd-x-0", None, first=True))
