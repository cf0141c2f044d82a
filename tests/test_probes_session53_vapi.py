"""Probes of the fifty-third session: infer's Python API where vLLM code would break or read a different value
(RequestOutput.lora_request, EngineArgs, max_logprobs, beam records' rank)."""

from __future__ import annotations

import pytest

from helpers import tiny_llama_str as path  # noqa: F401 (a fixture)
from test_lora_request import adapters  # noqa: F401 (a fixture)

P_LEN = [5, 9, 13, 21]


def test_request_output_carries_the_lora_request(path, adapters):
    """vLLM's RequestOutput.lora_request (and CompletionOutput.lora_request) is the LoRARequest the request ran with,
    None without an adapter: `out.lora_request.lora_name` was an AttributeError. The object given as lora_request= is
    handed back; an adapter named by lora= (registered by add_lora) reads as a LoRARequest of its name and folder,
    with an id of its own."""
    from infer import LLM, LoRARequest, SamplingParams
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with LLM(path, block_size=4, max_model_len=64, enable_lora=True, max_lora_rank=8) as llm:
        a = LoRARequest("a", 1, str(adapters["a"]))
        base, with_a = llm.generate([P_LEN, P_LEN], params, lora_request=[None, a])
        assert base.lora_request is None and base.outputs[0].lora_request is None
        assert with_a.lora_request is a and with_a.outputs[0].lora_request is a
        llm.add_lora("b", str(adapters["b"]))
        out = llm.generate(P_LEN, SamplingParams(max_tokens=2, ignore_eos=True, n=2), lora="b")[0]
        got = out.lora_request
        assert (got.lora_name, got.lora_path, got.lora_int_id) == ("b", str(adapters["b"]), 2)
        assert [o.lora_request for o in out.outputs] == [got, got]
        streamed = [o for _, _, o in llm.stream(P_LEN, params, lora="a")]
        assert all(o.lora_request is a for o in streamed)
        engine = llm.llm_engine
        engine.add_request("r", P_LEN, params, lora_request=a)
        while engine.has_unfinished_requests():
            for o in engine.step():
                assert o.lora_request is a


def test_beam_search_logprobs_carry_vllms_rank(path):
    """vLLM's BeamSearchSequence.logprobs are {token id: Logprob(logprob, rank, decoded_token)} per token: a vLLM
    program reading `beam.logprobs[k][token].logprob` or `.rank` failed on infer's bare floats, and the served beam
    search's logprob records lacked the `rank` that sampled tokens' records carry. Each candidate is now a float
    with vLLM's fields (the values compare and add as before), and the served records carry the token's rank."""
    import pickle

    from infer import LLM, BeamSearchParams
    from infer.engine.beam import Logprob
    from infer.serve.beams import beam_output
    with LLM(path, block_size=4, max_model_len=64) as llm:
        best = llm.beam_search([P_LEN], BeamSearchParams(beam_width=2, max_tokens=3))[0].sequences[0]
        tokenizer = llm.get_tokenizer()
    assert len(best.logprobs) == 3
    for token, options in zip(best.output_token_ids, best.logprobs):
        chosen = options[token]
        assert isinstance(chosen.rank, int) and chosen.rank >= 1 and chosen.logprob == float(chosen)
        assert chosen.rank == 1 + sum(v > chosen for v in options.values())  # (ties: as vLLM's, itself included)
        assert all(isinstance(v, Logprob) and v.decoded_token is None for v in options.values())
    assert best.cum_logprob == pytest.approx(sum(o[t] for t, o in zip(best.output_token_ids, best.logprobs)))
    assert pickle.loads(pickle.dumps(best.logprobs[0])) == best.logprobs[0]
    assert pickle.loads(pickle.dumps(chosen)).rank == chosen.rank
    out = beam_output("c", best, tokenizer, False, 2)
    assert [r["rank"] for r in out.logprobs] == [o[t].rank for t, o in zip(best.output_token_ids, best.logprobs)]
    assert all(type(r["logprob"]) is float for r in out.logprobs)


def test_engine_args_build_engines_as_vllms_do(path):
    """vLLM builds engines from EngineArgs / AsyncEngineArgs: `LLMEngine.from_engine_args(EngineArgs(model=...,
    max_model_len=...))`, `AsyncLLM.from_engine_args(AsyncEngineArgs(...))` (AsyncLLMEngine's too), and
    `LLM(**dataclasses.asdict(args))`. infer had none of them (ImportError, AttributeError). Now its EngineArgs take
    vLLM's names of the options infer has, and refuse the others as LLM(...) does, naming them."""
    import asyncio
    from dataclasses import asdict, fields

    from infer import LLM, AsyncEngineArgs, AsyncLLMEngine, EngineArgs, EngineConfig, LLMEngine, SamplingParams
    from infer.errors import ConfigError, UnknownOptionError
    from infer.serve.async_llm import AsyncLLM
    args = EngineArgs(model=path, max_model_len=64, block_size=4, max_num_seqs=8, seed=3, enforce_eager=True,
                      disable_log_stats=True)  # (vLLM's keyword at a value that changes nothing: dropped)
    assert [f.name for f in fields(args)] == [f.name for f in fields(EngineConfig)]
    assert (args.max_model_len, args.max_num_seqs, args.gpu_memory_utilization) == (64, 8, 0.9)
    config = args.create_engine_config()
    assert isinstance(config, EngineConfig) and (config.model, config.block_size, config.seed) == (path, 4, 3)
    assert EngineArgs(path, max_cpu_loras=2).max_loras == 2  # (as LLM(max_cpu_loras=2) reads it)
    with pytest.raises(UnknownOptionError, match=r"EngineArgs\(\) has no option 'trust_remote_code'"):
        EngineArgs(model=path, trust_remote_code=True)
    with pytest.raises(UnknownOptionError, match=r"EngineArgs\(\) takes vLLM's tensor_parallel_size only as 1"):
        EngineArgs(model=path, tensor_parallel_size=2)
    with pytest.raises(UnknownOptionError, match=r"AsyncEngineArgs\(\) has no option 'max_modle_len'") as e:
        AsyncEngineArgs(model=path, max_modle_len=64)
    assert "max_model_len" in e.value.hint
    with pytest.raises(ConfigError, match="takes an EngineArgs"):
        LLMEngine.from_engine_args({"model": path})
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine = LLMEngine.from_engine_args(args)
    try:
        assert engine.max_model_len == 64 and engine.config.block_size == 4
        engine.add_request("r", P_LEN, params)
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.finished]
        want = done[0].token_ids
    finally:
        engine.close()
    with LLM(**asdict(args)) as llm:
        assert llm.generate(P_LEN, params)[0].token_ids == want

    async def run(llm):
        return [o async for o in llm.generate(P_LEN, params, "a")][-1].token_ids
    assert AsyncLLMEngine is AsyncLLM
    llm = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(path, max_model_len=64, block_size=4))
    try:
        assert isinstance(llm, AsyncLLM) and llm.engine.max_model_len == 64
        assert asyncio.run(run(llm)) == want
    finally:
        llm.shutdown()


def test_llm_get_default_sampling_params(path, tmp_path):
    """vLLM's examples start from `llm.get_default_sampling_params()` (the model's generation_config.json sampling,
    vLLM's defaults for the rest) and set fields on it: an AttributeError here. Now it returns a SamplingParams of the
    file's temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens), temperature 1
    where the file has none, as the server's requests get them."""
    import json
    import shutil

    from infer import LLM, SamplingParams
    model = tmp_path / "m"
    shutil.copytree(path, model)
    (model / "generation_config.json").write_text(json.dumps({"top_k": 5, "top_p": 0.8, "max_new_tokens": 7}))
    with LLM(str(model), block_size=4, max_model_len=64) as llm:
        params = llm.get_default_sampling_params()
        assert isinstance(params, SamplingParams)
        assert (params.temperature, params.top_k, params.top_p, params.max_new_tokens) == (1.0, 5, 0.8, 7)
        params.seed = 1
        assert len(llm.generate(P_LEN, params)[0].token_ids) <= 7


def test_max_logprobs_is_vllms_engine_option(path):
    """vLLM's max_logprobs (20 by default; -1: no cap, and then a request's logprobs=-1 returns every token's) was
    refused at any value but 20, and SamplingParams refused logprobs over 20 or -1 whatever the engine: a vLLM program
    asking for 50 top logprobs, or for the whole distribution, could not run. Now it is an engine option (LLM,
    EngineArgs, --max-logprobs) the engine checks requests against, as vLLM's processor does; the server's bound is
    the engine's."""
    from infer import LLM, SamplingParams
    from infer.errors import ConfigError, RequestError
    from infer.engine.inputs import MAX_LOGPROBS
    from infer.serve.protocol import ApiError, parse_completion
    assert SamplingParams(logprobs=-1).logprobs == -1 and SamplingParams(logprobs=50).logprobs == 50
    with pytest.raises(RequestError, match="logprobs must be at least 0, or -1"):
        SamplingParams(logprobs=-2)
    with pytest.raises(ConfigError, match="max-logprobs must be at least -1"):
        LLM(path, max_model_len=64, max_logprobs=-2)
    with LLM(path, block_size=4, max_model_len=64) as llm:
        with pytest.raises(RequestError, match=r"logprobs must be in 0..20, got 21") as e:
            llm.generate(P_LEN, SamplingParams(max_tokens=1, logprobs=21))
        assert "max_logprobs" in e.value.hint
        with pytest.raises(RequestError, match=r"logprobs must be in 0..20, got -1"):
            llm.generate(P_LEN, SamplingParams(max_tokens=1, logprobs=-1))
        assert len(llm.generate(P_LEN, SamplingParams(max_tokens=1, logprobs=20))[0].logprobs[0]["top_logprobs"]) == 20
    with LLM(path, block_size=4, max_model_len=64, max_logprobs=30) as llm:
        out = llm.generate(P_LEN, SamplingParams(max_tokens=2, logprobs=25, prompt_logprobs=30))[0]
        assert [len(r["top_logprobs"]) for r in out.logprobs] == [25, 25]
        assert len(out.prompt_logprobs[1]["top_logprobs"]) == 30
        with pytest.raises(RequestError, match=r"prompt_logprobs must be in 0..30, got 31"):
            llm.generate(P_LEN, SamplingParams(max_tokens=1, prompt_logprobs=31))
    with LLM(path, block_size=4, max_model_len=64, max_logprobs=-1) as llm:
        vocab = llm.llm_engine.model_config.vocab_size
        out = llm.generate(P_LEN, SamplingParams(max_tokens=1, logprobs=-1, prompt_logprobs=-1))[0]
        record = out.logprobs[0]
        assert len(record["top_logprobs"]) == vocab and record["rank"] == 1
        assert sum(torch_exp(x["logprob"]) for x in record["top_logprobs"]) == pytest.approx(1.0, abs=1e-3)
        assert len(out.prompt_logprobs[1]["top_logprobs"]) == vocab
        with pytest.raises(RequestError, match=f"logprobs must be in 0..{vocab} or -1, got {vocab + 1}"):
            llm.generate(P_LEN, SamplingParams(max_tokens=1, logprobs=vocab + 1))
    tok = llm.tokenizer
    from infer import EngineConfig
    from infer.parallel.serve_engine import ReplicaView  # (the data-parallel driver's and --strict's checks)
    view = ReplicaView(EngineConfig(path, block_size=4, max_logprobs=30), path, tok, {
        "max_model_len": 64, "vocab_size": vocab, "num_blocks": 100, "adapters": []})
    view.validate(P_LEN, SamplingParams(max_tokens=1, logprobs=30))
    with pytest.raises(RequestError, match="logprobs must be in 0..30, got 31"):
        view.validate(P_LEN, SamplingParams(max_tokens=1, logprobs=31))
    for most, asked, ok in ((20, 21, False), (30, 30, True), (30, 31, False), (-1, -1, True), (-1, 500, True)):
        body = {"model": "m", "prompt": "hi", "logprobs": asked}
        if ok:
            assert parse_completion(body, tok, defaults={MAX_LOGPROBS: most}).params.logprobs == asked
        else:
            with pytest.raises(ApiError, match=f"logprobs must be in 0..{most}, got {asked}"):
                parse_completion(body, tok, defaults={MAX_LOGPROBS: most})


def torch_exp(x: float) -> float:
    import math
    return math.exp(x)


def test_the_server_takes_the_engines_max_logprobs(path):
    """`infer serve --max-logprobs 30`: the server's bound on logprobs / top_logprobs is the engine's (it was 20
    whatever the engine)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(path, block_size=4, max_model_len=64, max_num_seqs=2, max_logprobs=30))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as url:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "logprobs": 25}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) > 20  # (tokens of one text share a key)
        r = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 31}, timeout=60)
        assert r.status_code == 400 and "logprobs must be in 0..30, got 31" in r.json()["error"]["message"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True,
                "top_logprobs": 30}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 30
        r = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 1,
                                                     "top_logprobs": 25}, timeout=60)
        assert r.status_code == 200, r.text


def test_async_llm_state_calls_are_vllms(path):
    """vLLM's AsyncLLM.get_tokenizer is a coroutine (`tokenizer = await engine.get_tokenizer()`): infer's returned the
    tokenizer, which cannot be awaited (TypeError). vLLM's `errored` / `dead` / `is_stopped` and `do_log_stats()`,
    read by vLLM's API servers and health loops, were AttributeErrors."""
    import asyncio

    from infer import AsyncLLM

    async def run(llm):
        tok = await llm.get_tokenizer()
        await llm.do_log_stats()
        return tok, llm.errored, llm.dead, llm.is_stopped
    llm = AsyncLLM(path, max_model_len=64, block_size=4)
    try:
        tok, errored, dead, stopped = asyncio.run(run(llm))
        assert tok is llm.tokenizer and not errored and not dead and not stopped
    finally:
        llm.shutdown()
    assert llm.errored and llm.dead and llm.is_stopped


def test_request_output_has_vllms_other_fields(path):
    """vLLM's RequestOutput has encoder_prompt, encoder_prompt_token_ids, multi_modal_placeholders and
    kv_transfer_params (None, or {} for the placeholders, for a text decoder): code that prints or checks them was an
    AttributeError on infer's outputs."""
    from infer import LLM, SamplingParams
    with LLM(path, block_size=4, max_model_len=64) as llm:
        out = llm.generate("Hello", SamplingParams(max_tokens=2))[0]
    assert (out.encoder_prompt, out.encoder_prompt_token_ids, out.kv_transfer_params) == (None, None, None)
    assert out.multi_modal_placeholders == {}


def test_llm_apply_model(path):
    """vLLM's `llm.apply_model(lambda model: ...)` (a list of func(model), one per worker) was an AttributeError."""
    import torch

    from infer import LLM
    from infer.errors import RequestError
    with LLM(path, block_size=4, max_model_len=64) as llm:
        got = llm.apply_model(lambda model: (isinstance(model, torch.nn.Module), sum(p.numel() for p in
                                                                                    model.parameters()) > 0))
        assert got == [(True, True)]
        with pytest.raises(RequestError, match="apply_model takes a function"):
            llm.apply_model("model")


def test_batch_lines_take_the_engines_max_logprobs(path):
    """`infer run --max-logprobs 30` with OpenAI batch lines: a chat line's top_logprobs was refused above 20 whatever
    the engine's max_logprobs; its bound is the engine's now (model_names passes it on)."""
    from infer.cli.batch_io import model_names
    from infer.engine.config import EngineConfig
    from infer.engine.inputs import ModelNames, parse_request
    from infer.errors import RequestError
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    assert model_names(EngineConfig(path, max_logprobs=30)).max_logprobs == 30

    def line(top):
        return {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                         "top_logprobs": top}}
    assert parse_request(line(25), tok, "1", names=ModelNames(max_logprobs=30)).params.logprobs == 25
    with pytest.raises(RequestError, match=r"body.top_logprobs must be an integer in 0..30, got 31"):
        parse_request(line(31), tok, "1", names=ModelNames(max_logprobs=30))
    with pytest.raises(RequestError, match=r"body.top_logprobs must be an integer in 0..20, got 21"):
        parse_request(line(21), tok, "1")
    assert parse_request(line(-1), tok, "1", names=ModelNames(max_logprobs=-1)).params.logprobs == -1


def test_responses_top_logprobs_take_the_engines_max_logprobs():
    """/v1/responses checks top_logprobs (without the logprobs include) against 0..20 whatever the engine's
    max_logprobs; its bound is the engine's now, as the chat route's."""
    from infer.serve.protocol import ApiError
    from infer.serve.responses import to_chat
    body = {"model": "m", "input": "hi", "top_logprobs": 25}
    to_chat(body, 30)
    with pytest.raises(ApiError, match="top_logprobs must be an integer in 0..20, got 25"):
        to_chat(body)
    with pytest.raises(ApiError, match="top_logprobs must be an integer in 0..30, got 31"):
        to_chat({**body, "top_logprobs": 31}, 30)
