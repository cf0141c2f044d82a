"""Embeddings (vLLM's pooling runner): LLM(..., runner="pooling").embed, POST /v1/embeddings and `infer run` lines
with url /v1/embeddings equal transformers' last_hidden_state (after the final norm) pooled and normalized, and
peft's with an adapter, through chunked prefill and prefix-cache hits; bad inputs get clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer import LLM, PoolingParams
from infer.errors import ConfigError, RequestError
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import THREE, hf_float, save_adapter

LENGTHS = (11, 3, 17, 1, 8)


def hf_hidden(model, prompt: list[int]) -> torch.Tensor:
    """The last_hidden_state [T, hidden] of transformers' decoder (`model`: a CausalLM, its .model is AutoModel's),
    float32."""
    with torch.no_grad():
        return model.model(torch.tensor([prompt])).last_hidden_state[0].float()


def pooled(hidden: torch.Tensor, kind: str, normalize: bool = True) -> torch.Tensor:
    vec = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]
    return torch.nn.functional.normalize(vec, dim=-1) if normalize else vec


def vectors(outs) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outs]


def check_close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=atol, rtol=1e-4)


@pytest.fixture(scope="module")
def qwen3():
    path = ensure_builtin("tiny-qwen3")
    return path, hf_float(path)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooled_hidden_states_equal_transformers_in_chunks_and_whole(qwen3, kind, normalize):
    """Each pooling type, normalized or not, equals transformers' last_hidden_state pooled, whether the prompts run
    whole or in chunks of 4 tokens (max_num_batched_tokens 4: a MEAN pool sums every chunk)."""
    path, hf = qwen3
    cfg = {"pooling_type": kind, "normalize": normalize}
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=4)
    want = [pooled(hf_hidden(hf, p), kind, normalize) for p in prompts]
    for tokens in (4, 64):
        with LLM(str(path), runner="pooling", pooler_config=cfg, block_size=4, max_num_batched_tokens=tokens,
                 max_num_seqs=4) as llm:
            check_close(vectors(llm.embed(prompts)), want)
            assert llm.engine.block_manager.num_used_blocks == 0


def test_llama_last_token_default_is_normalized():
    """Without --pooler-config or sentence-transformers files: LAST, normalized (vLLM's default for a decoder)."""
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=5)
    with LLM(str(path), runner="pooling", block_size=4) as llm:
        outs = llm.embed(prompts)
    check_close(vectors(outs), [pooled(hf_hidden(hf, p), "LAST") for p in prompts])
    assert all(abs(torch.tensor(o.outputs.embedding).norm().item() - 1) < 1e-5 for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts and all(o.finished for o in outs)


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_prefix_cache_hit_gives_the_same_vector(qwen3, kind):
    """A prompt whose blocks are cached: LAST uses the hit (its last token is computed again), MEAN turns the cache
    off (the hit's tokens would be missing from the sum); both give transformers' vector."""
    path, hf = qwen3
    prompt = random_prompts(hf.config.vocab_size, (14,), seed=6)[0]
    want = pooled(hf_hidden(hf, prompt), kind)
    with LLM(str(path), runner="pooling", pooler_config={"pooling_type": kind}, block_size=4) as llm:
        first, second = llm.embed([prompt])[0], llm.embed([prompt])[0]
    check_close(vectors([first, second]), [want, want])
    assert second.num_cached_tokens == (12 if kind == "LAST" else 0)


def test_sentence_transformers_files_choose_the_pooling(tmp_path):
    """modules.json with a Pooling module (1_Pooling/config.json: mean tokens) and no Normalize module: MEAN, not
    normalized; --pooler-config overrides a key of it."""
    src = ensure_builtin("tiny-qwen3")
    folder = tmp_path / "st"
    shutil.copytree(src, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_lasttoken": False}))
    hf = hf_float(src)
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=7)
    with LLM(str(folder), runner="pooling", block_size=4) as llm:
        assert (llm.engine.pooler.pooling_type, llm.engine.pooler.normalize) == ("MEAN", False)
        check_close(vectors(llm.embed(prompts)), [pooled(hf_hidden(hf, p), "MEAN", False) for p in prompts])
    with LLM(str(folder), runner="pooling", block_size=4, pooler_config='{"normalize": true}') as llm:
        check_close(vectors(llm.embed(prompts[:2])), [pooled(hf_hidden(hf, p), "MEAN") for p in prompts[:2]])
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens"):
        LLM(str(folder), runner="pooling")


def test_adapter_embeddings_equal_peft(tmp_path):
    """A request with an adapter (by lora_request or by name) equals peft's model's last_hidden_state; in one batch
    with base-model requests, each gets its own."""
    from peft import PeftModel

    from infer import LoRARequest
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    adapter = save_adapter(hf, tmp_path / "a", seed=3, lora_dropout=0.0, **THREE["a"])
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=8)
    base = [pooled(hf_hidden(hf, p), "MEAN") for p in prompts]
    peft = PeftModel.from_pretrained(hf, str(adapter)).eval()
    with torch.no_grad():
        tuned = [pooled(peft.base_model.model.model(torch.tensor([p])).last_hidden_state[0], "MEAN") for p in prompts]
    assert not torch.allclose(tuned[0], base[0], atol=1e-3)  # the adapter changes the vectors
    with LLM(str(path), runner="pooling", pooler_config={"pooling_type": "MEAN"}, enable_lora=True,
             max_lora_rank=8, block_size=4, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        check_close(vectors(llm.embed(prompts, lora_request=LoRARequest("a", 1, str(adapter)))), tuned)
        mixed = llm.embed(prompts, lora=["a", None, "a", None, "a"])
    check_close(vectors(mixed), [tuned[i] if i % 2 == 0 else base[i] for i in range(len(prompts))])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_follows_float32(qwen3, dtype):
    """float16 and bfloat16 engines give transformers' float32 vector up to their rounding (cosine > 0.999)."""
    path, hf = qwen3
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=9)
    with LLM(str(path), runner="pooling", dtype=dtype, block_size=4) as llm:
        got = vectors(llm.embed(prompts))
    for g, p in zip(got, prompts):
        assert torch.nn.functional.cosine_similarity(g, pooled(hf_hidden(hf, p), "LAST"), dim=0) > 0.999


def test_dimensions_need_a_matryoshka_model(tmp_path):
    """vLLM's rule: dimensions is refused for a model that is not matryoshka; with config.json's
    matryoshka_dimensions, a listed one cuts the vector and then normalizes it, another is refused."""
    src = ensure_builtin("tiny-qwen3")
    hf = hf_float(src)
    prompt = random_prompts(hf.config.vocab_size, (9,), seed=10)[0]
    with LLM(str(src), runner="pooling", block_size=4) as llm:
        with pytest.raises(RequestError, match="does not support matryoshka"):
            llm.embed([prompt], PoolingParams(dimensions=16))
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    with LLM(str(folder), runner="pooling", block_size=4) as llm:
        [out] = llm.embed([prompt], PoolingParams(dimensions=16))
        with pytest.raises(RequestError, match=r"only supports \[16, 32, 64\]"):
            llm.embed([prompt], PoolingParams(dimensions=20))
    want = torch.nn.functional.normalize(hf_hidden(hf, prompt)[-1][:16], dim=-1)
    check_close(vectors([out]), [want])


def test_runner_refusals_and_bad_prompts(qwen3):
    """generate on a pooling engine and embed on a generating one are refused (vLLM's runners); an empty prompt, a
    prompt past the context, a bad token id, bad PoolingParams get clear errors. A prompt of the whole context is an
    embedding (nothing is generated after it)."""
    path, hf = qwen3
    with LLM(str(path), block_size=4) as llm:
        with pytest.raises(RequestError, match="runner pooling"):
            llm.embed(["hello"])
    with LLM(str(path), runner="pooling", block_size=4, max_model_len=16) as llm:
        with pytest.raises(RequestError, match="only supported for generative models"):
            llm.generate(["hello"])
        with pytest.raises(RequestError, match="empty"):
            llm.embed([[]])
        with pytest.raises(RequestError, match="17 tokens"):
            llm.embed([[5] * 17])
        with pytest.raises(RequestError, match="outside the vocabulary"):
            llm.embed([[5, hf.config.vocab_size]])
        with pytest.raises(RequestError, match="normalize must be"):
            llm.embed(["hi"], PoolingParams(normalize="yes"))
        whole = random_prompts(hf.config.vocab_size, (16,), seed=11)[0]
        check_close(vectors(llm.embed([whole])), [pooled(hf_hidden(hf, whole), "LAST")])
        [cut] = llm.embed([[7] * 5 + whole[-6:]], truncate_prompt_tokens=6)
        assert cut.prompt_token_ids == whole[-6:]


def test_config_refusals():
    with pytest.raises(ConfigError, match="--runner 'embed' is not one of auto, generate, pooling"):
        LLM("tiny-qwen3", runner="embed")
    with pytest.raises(ConfigError, match="pooling_type 'max' is not one of LAST, MEAN, CLS"):
        LLM("tiny-qwen3", runner="pooling", pooler_config={"pooling_type": "max"})
    with pytest.raises(ConfigError, match="--pooler-config is for --runner pooling"):
        LLM("tiny-qwen3", pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ConfigError, match="--pooler-config is not JSON"):
        LLM("tiny-qwen3", runner="pooling", pooler_config="{mean}")


def test_vllm_task_embed_keyword_is_the_pooling_runner():
    with LLM("tiny-qwen3", task="embed", block_size=4) as llm:
        assert llm.engine.pooler is not None and len(llm.embed("hello")[0].outputs.embedding) == 64


def test_gptq_int4_model_equals_transformers_on_its_dequantized_weights(tmp_path):
    """A GPTQ int4 checkpoint (infer quantize) pools transformers' last_hidden_state of its dequantized weights."""
    from quant_helpers import dequantized_float_model, has_gptqmodel, infer_quantize
    if not has_gptqmodel():
        pytest.skip("needs the quantize extra (gptqmodel)")
    out = infer_quantize("tiny-llama", tmp_path / "tiny-llama-gptq")
    hf = dequantized_float_model(ensure_builtin("tiny-llama"), out)
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=12)
    with LLM(str(out), runner="pooling", pooler_config={"pooling_type": "MEAN"}, block_size=4,
             max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.qweight is not None
        check_close(vectors(llm.embed(prompts)), [pooled(hf_hidden(hf, p), "MEAN") for p in prompts], atol=5e-4)


@pytest.fixture(scope="module")
def served_pooling(tmp_path_factory):
    """tiny-llama as a pooling server (MEAN, normalized) with adapter "a" registered: (base URL, hf, adapter)."""
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    adapter = save_adapter(hf, tmp_path_factory.mktemp("ad") / "a", seed=3, lora_dropout=0.0, **THREE["a"])
    engine = LLMEngine(EngineConfig("tiny-llama", runner="pooling", pooler_config={"pooling_type": "MEAN"},
                                    max_model_len=32, max_num_seqs=4, max_num_batched_tokens=8, block_size=4,
                                    loras={"a": str(adapter)}, max_lora_rank=8))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        yield base, hf, adapter


def _post(base: str, route: str, body) -> tuple[int, dict]:
    import httpx
    r = httpx.post(base + route, json=body, timeout=60)
    return r.status_code, r.json()


def test_embeddings_route_equals_transformers(served_pooling):
    """The four input forms, float and base64, usage counts, and `model` naming the adapter (peft's vector)."""
    import base64

    import numpy as np
    from peft import PeftModel
    base, hf, adapter = served_pooling
    tok_ids = random_prompts(hf.config.vocab_size, (5, 9), seed=13)
    status, body = _post(base, "/v1/embeddings", {"model": "tiny-llama", "input": tok_ids})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "tiny-llama"
    assert [d["index"] for d in body["data"]] == [0, 1] and body["usage"] == {"prompt_tokens": 14, "total_tokens": 14}
    want = [pooled(hf_hidden(hf, p), "MEAN") for p in tok_ids]
    check_close([torch.tensor(d["embedding"]) for d in body["data"]], want)
    status, one = _post(base, "/v1/embeddings", {"input": tok_ids[1], "encoding_format": "base64"})
    assert status == 200, one
    check_close([torch.from_numpy(np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), "<f4").copy())],
                want[1:])
    from transformers import AutoTokenizer
    texts = ["hello world", "a b c"]
    ids = [AutoTokenizer.from_pretrained(ensure_builtin("tiny-llama"))(t)["input_ids"] for t in texts]
    status, body = _post(base, "/v1/embeddings", {"input": texts})
    assert status == 200 and body["usage"]["prompt_tokens"] == sum(map(len, ids))
    check_close([torch.tensor(d["embedding"]) for d in body["data"]], [pooled(hf_hidden(hf, i), "MEAN") for i in ids])
    status, body = _post(base, "/v1/embeddings", {"model": "a", "input": "hello world"})
    assert status == 200, body
    peft = PeftModel.from_pretrained(hf, str(adapter)).eval()
    try:
        with torch.no_grad():
            tuned = peft.base_model.model.model(torch.tensor([ids[0]])).last_hidden_state[0]
    finally:
        peft.unload()
    check_close([torch.tensor(body["data"][0]["embedding"])], [pooled(tuned, "MEAN")])


@pytest.mark.parametrize("body, status, message", [
    ({}, 400, "input is required"),
    ({"input": ""}, 400, "input[0] is an empty string"),
    ({"input": []}, 400, "input is an empty list"),
    ({"input": [[]]}, 400, "input[0] is an empty list of token ids"),
    ({"input": 5}, 400, "input must be text or token ids, got int"),
    ({"input": ["a", 5]}, 400, "input[1] is neither text nor a list of token ids"),
    ({"input": [1.5, 2]}, 400, "input[0] is neither text nor a list of token ids"),
    ({"input": [True]}, 400, "input[0] is neither text nor a list of token ids"),
    ({"input": [5] * 40}, 400, "the prompt has 40 tokens"),
    ({"input": "hi", "encoding_format": "hex"}, 400, "encoding_format 'hex' is not one of float, base64"),
    ({"input": "hi", "dimensions": 8}, 400, "does not support matryoshka"),
    ({"input": "hi", "dimensions": "8"}, 400, "dimensions must be an integer"),
    ({"input": "hi", "model": "nope"}, 404, "the model 'nope' does not exist"),
])
def test_embeddings_route_refuses_bad_bodies(served_pooling, body, status, message):
    got, reply = _post(served_pooling[0], "/v1/embeddings", body)
    assert got == status and message in reply["error"]["message"], reply


@pytest.mark.parametrize("route, api", [("/v1/completions", "Completions"), ("/v1/chat/completions",
                                                                            "Chat Completions"),
                                        ("/v1/responses", "Responses")])
def test_pooling_server_refuses_generation(served_pooling, route, api):
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    status, reply = _post(served_pooling[0], route, body)
    assert status == 400 and reply["error"]["message"].startswith(f"The model does not support {api} API"), reply


def test_generation_server_refuses_embeddings():
    from helpers import served_tiny_llama
    gen = served_tiny_llama()
    base = next(gen)
    try:
        status, reply = _post(base, "/v1/embeddings", {"input": "hi"})
    finally:
        gen.close()
    assert status == 400 and "--runner pooling" in reply["error"]["message"], reply


def test_speculative_decoding_is_refused_on_a_pooling_engine():
    with pytest.raises(ConfigError, match="--runner pooling never makes"):
        LLM("tiny-qwen3", runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                 "prompt_lookup_max": 3})


def _line(custom_id: str, body: dict, url: str = "/v1/embeddings") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_infer_run_embedding_lines(tmp_path):
    """`infer run --runner pooling` answers vLLM run-batch lines of url /v1/embeddings: OpenAI batch output lines
    whose body is the server's embeddings response (float or base64), or infer's own records; a bad line gets its
    error record and the others run."""
    import base64

    import numpy as np

    from helpers import infer_run_records
    hf = hf_float(ensure_builtin("tiny-llama"))
    ids = random_prompts(hf.config.vocab_size, (6, 13), seed=14)
    lines = [_line("a", {"model": "tiny-llama", "input": ids[0]}),
             _line("b", {"input": [ids[1]], "encoding_format": "base64"}),
             _line("c", {"input": ["x", "y"]}), _line("d", {"input": ""}),
             _line("e", {"prompt": "hi"}, url="/v1/completions")]
    recs, printed = infer_run_records(tmp_path, lines, "--runner", "pooling", "--block-size", "4",
                                      "--output-format", "openai", key="custom_id")
    want = [pooled(hf_hidden(hf, p), "LAST") for p in ids]
    a, b = recs["a"]["response"], recs["b"]["response"]
    assert a["status_code"] == 200 and a["body"]["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    assert a["body"]["model"] == "tiny-llama" and a["body"]["data"][0]["object"] == "embedding"
    got_b = torch.from_numpy(np.frombuffer(base64.b64decode(b["body"]["data"][0]["embedding"]), "<f4").copy())
    check_close([torch.tensor(a["body"]["data"][0]["embedding"]), got_b], want)
    assert len(recs["c"]["response"]["body"]["data"]) == 2  # (a list of inputs: test_probes_session60_gaps.py)
    assert "body.input[0] is an empty string" in recs["d"]["error"]["message"]
    assert "only supported for generative models" in recs["e"]["error"]["message"]
    own, _ = infer_run_records(tmp_path, lines[:1], "--runner", "pooling", "--block-size", "4")
    check_close([torch.tensor(own["a"]["embedding"])], want[:1])
    assert own["a"]["usage"] == {"prompt_tokens": 6, "completion_tokens": 0}
    gen, _ = infer_run_records(tmp_path, lines[:1], "--block-size", "4")
    assert "--runner pooling" in gen["a"]["error"]


def test_warmup_estimate_of_a_pooling_runner_holds_no_logits():
    """`infer warmup --estimate --runner pooling`: a pooling step computes no logits and samples nothing, so its
    activations are the generating engine's less the logits' rows and the penalty table (activation_bytes's)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.engine.config import EngineConfig
    from infer.memory.sizes import activation_bytes, penalty_table_bytes, step_tokens
    from infer.models.loader import load_config

    def estimate(*args: str) -> dict:
        res = CliRunner().invoke(app, ["warmup", "tiny-qwen3", "--estimate", "--json", "--max-length", "64",
                                       "--concurrency", "4", "--device", "cpu", *args])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout.strip().splitlines()[-1])
    gen, pool = estimate(), estimate("--runner", "pooling")
    cfg = load_config(ensure_builtin("tiny-qwen3"))
    step = step_tokens(EngineConfig("tiny-qwen3").max_num_batched_tokens, 4, 64)
    saved = activation_bytes(cfg, torch.float32, step, 4, 64) - activation_bytes(cfg, torch.float32, step, 4, 64,
                                                                                 logits=False)
    assert saved >= penalty_table_bytes(cfg, 4) + 4 * cfg.vocab_size * 4  # the table, and 4 rows of logits at least
    assert gen["activation_peak_bytes"] - pool["activation_peak_bytes"] == saved


def test_infer_serve_runner_pooling_starts_and_answers():
    """`infer serve MODEL --runner pooling` warms its kernels with pooling requests (a generating warm-up request
    was refused at start) and answers /v1/embeddings with transformers' vector; /metrics counts the prompt tokens."""
    import httpx

    from helpers import serve_process
    hf = hf_float(ensure_builtin("tiny-llama"))
    prompt = random_prompts(hf.config.vocab_size, (7,), seed=15)[0]
    with serve_process("--runner", "pooling", "--block-size", "4") as (_, base, _adapters):
        status, body = _post(base, "/v1/embeddings", {"input": prompt})
        metrics = httpx.get(base + "/metrics", timeout=60).text
    assert status == 200, body
    check_close([torch.tensor(body["data"][0]["embedding"])], [pooled(hf_hidden(hf, prompt), "LAST")])
    assert 'infer:prompt_tokens_total{engine="0",model_name="tiny-llama"} 7.0' in metrics


def test_async_llm_encode(qwen3):
    """vLLM's AsyncLLM.encode on a pooling engine yields one finished output, transformers' vector, under the
    request id given; PoolingParams' truncation keeps the prompt's end."""
    import asyncio

    from infer import AsyncLLM
    path, hf = qwen3
    prompts = random_prompts(hf.config.vocab_size, (9, 4), seed=16)

    async def run(llm):
        got = []
        for i, p in enumerate(prompts):
            got.append([out async for out in llm.encode(p, request_id=f"r{i}")])
        cut = [out async for out in llm.encode(prompts[0], PoolingParams(truncate_prompt_tokens=4), "cut")]
        return got, cut
    with AsyncLLM(str(path), runner="pooling", block_size=4) as llm:
        got, cut = asyncio.run(run(llm))
    assert [len(outs) for outs in got] == [1, 1] and all(outs[0].finished for outs in got)
    check_close(vectors([outs[0] for outs in got]), [pooled(hf_hidden(hf, p), "LAST") for p in prompts])
    assert cut[0].prompt_token_ids == prompts[0][-4:] and cut[0].request_id == "cut"
