"""Probes of the fifty-first session: the Python API as a vLLM program calls it (LLM, AsyncLLM, SamplingParams,
RequestOutput), each field it relies on honoured or refused by name."""

from __future__ import annotations

import asyncio

import pytest

from infer.models.tiny import ensure_builtin


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


def test_async_llm_honours_vllms_output_kind(path):
    """vLLM's streaming example sets SamplingParams(output_kind=RequestOutputKind.DELTA) and prints each output's
    outputs[0].text as the new text; FINAL_ONLY yields the finished output alone. The field was refused ("no field
    'output_kind'", with no way to say it), so such a program could not run; now DELTA's outputs[0] holds what is
    new (text, token ids, logprobs), FINAL_ONLY yields once, and the default (CUMULATIVE) is as before."""
    from infer import AsyncLLM, RequestOutputKind, SamplingParams
    from infer.errors import RequestError

    async def run(llm, kind, rid):
        params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1, output_kind=kind)
        return [out async for out in llm.generate("Hello there", params, rid)]

    llm = AsyncLLM(path, max_model_len=64, block_size=4)
    try:
        whole = asyncio.run(run(llm, RequestOutputKind.CUMULATIVE, "c"))
        delta = asyncio.run(run(llm, RequestOutputKind.DELTA, "d"))
        final = asyncio.run(run(llm, "final_only", "f"))
    finally:
        llm.shutdown()
    last = whole[-1].outputs[0]
    assert len(last.token_ids) == 5 and len(whole) > 1
    assert [o.outputs[0].text for o in whole] == [o.text for o in whole]  # cumulative, as before
    parts = [o.outputs[0] for o in delta]
    assert "".join(p.text for p in parts) == last.text
    assert [t for p in parts for t in p.token_ids] == last.token_ids
    assert [r for p in parts for r in p.logprobs] == delta[-1].logprobs  # (the request's own: all of them)
    assert len(delta[-1].logprobs) == 5
    assert [p.cumulative_logprob for p in parts] == pytest.approx([sum(r["logprob"] for r in o.logprobs)
                                                                    for o in delta])  # the running total
    assert all(len(p.token_ids) >= 1 for p in parts) and len(parts) > 1 and delta[-1].finished
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == last.token_ids
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(RequestError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="partial")


def test_vllms_llm_keywords_at_their_no_op_values_are_taken(path):
    """vLLM programs spell out LLM(model, disable_log_stats=True, tokenizer_mode="auto", task="generate", ...): each
    was refused as an unknown option (with infer's 30 options to guess from). At the values that change nothing here
    they are taken (LLM and AsyncLLM); another value is refused naming the keyword, the values taken and what to do."""
    from infer import LLM, SamplingParams
    from infer.engine.llm import _check_options
    from infer.errors import UnknownOptionError
    vllm = dict(disable_log_stats=True, tokenizer_mode="auto", skip_tokenizer_init=False, task="generate",
                cpu_offload_gb=0, hf_overrides=None,
                distributed_executor_backend=None, compilation_config=None)
    assert _check_options({**vllm, "max_model_len": 64}) == {"max_model_len": 64}
    with LLM(path, max_model_len=64, block_size=4, **vllm) as llm:
        out = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(UnknownOptionError) as e:
        _check_options({"disable_log_stats": False})
    assert "disable_log_stats only as True" in e.value.message and "no periodic stats" in e.value.hint
    assert _check_options({"max_logprobs": 5}) == {"max_logprobs": 5}  # (an option of its own since session 53)
    with pytest.raises(UnknownOptionError, match="has no option 'no_such_option'"):
        _check_options({"task": "auto", "no_such_option": 1})


def test_async_llm_runs_n_samples_as_vllms_does(path):
    """vLLM's AsyncLLM.generate runs SamplingParams(n=3): its outputs carry the sample that changed (outputs[0].index),
    the last one finished once all are, and FINAL_ONLY yields one output of all n. It was refused ("an engine request
    is one sample ... with LLMEngine, add one request per sample"), so a vLLM program sampling several replies
    through AsyncLLM could not run. The samples are those of LLM.generate (sample j draws with seed + j); abort() of
    the request id, and leaving the loop early, stop every sample."""
    from infer import LLM, AsyncLLM, RequestOutputKind, SamplingParams

    def params(kind=RequestOutputKind.CUMULATIVE):
        return SamplingParams(n=3, max_tokens=4, ignore_eos=True, temperature=1.0, seed=7, output_kind=kind)

    async def run(llm, kind, rid):
        return [out async for out in llm.generate("Hello there", params(kind), rid)]

    async def left_early(llm):
        async for out in llm.generate("Hello there", params(), "early"):
            break
        gen = llm.generate("Hello there", params(), "aborted")
        first = await gen.__anext__()
        await llm.abort("aborted")
        rest = [out async for out in gen]
        for _ in range(500):
            if not llm.engine.has_unfinished_requests() and not llm._loop._sinks:
                return first, rest
            await asyncio.sleep(0.01)
        raise AssertionError("samples still running")

    with LLM(path, max_model_len=64, block_size=4) as llm:
        want = [c.token_ids for c in llm.generate("Hello there", params())[0].outputs]
    assert len({tuple(t) for t in want}) > 1
    llm = AsyncLLM(path, max_model_len=64, block_size=4)
    try:
        whole = asyncio.run(run(llm, RequestOutputKind.CUMULATIVE, "c"))
        delta = asyncio.run(run(llm, RequestOutputKind.DELTA, "d"))
        final = asyncio.run(run(llm, RequestOutputKind.FINAL_ONLY, "f"))
        first, rest = asyncio.run(left_early(llm))
    finally:
        llm.shutdown()
    assert {o.request_id for o in whole + delta + final} == {"c", "d", "f"}
    last = {}
    for out in whole:
        assert len(out.outputs) == 1
        last[out.outputs[0].index] = out.outputs[0].token_ids
    assert [last[j] for j in range(3)] == want
    assert [o.finished for o in whole] == [False] * (len(whole) - 1) + [True]
    joined = {j: [] for j in range(3)}
    for out in delta:
        joined[out.outputs[0].index] += out.outputs[0].token_ids
    assert [joined[j] for j in range(3)] == want and delta[-1].finished
    assert len(final) == 1 and [c.token_ids for c in final[0].outputs] == want
    assert [c.index for c in final[0].outputs] == [0, 1, 2]
    assert first.request_id == "aborted" and all(o.request_id == "aborted" for o in rest)  # (then it ends)


def test_a_prompt_dicts_empty_multi_modal_keys_are_taken(path):
    """vLLM code builds one prompt dict for every model: {"prompt": text, "multi_modal_data": None} (or {}) for a
    text prompt. LLM.generate and AsyncLLM.generate refused it ("has 'multi_modal_data', which infer does not take")
    though it asks for nothing; the empty values are taken now, and data (an image) is still refused, saying infer
    runs text models."""
    from infer import LLM, AsyncLLM, SamplingParams
    from infer.errors import RequestError
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    prompts = [{"prompt": "Hello", "multi_modal_data": None}, {"prompt": "Hello", "multi_modal_data": {},
                                                               "mm_processor_kwargs": None}]
    with LLM(path, max_model_len=64, block_size=4) as llm:
        want = llm.generate("Hello", p)[0].token_ids
        ids = llm.get_tokenizer()("Hello")["input_ids"]
        got = llm.generate([*prompts, {"prompt_token_ids": ids, "multi_modal_uuids": None}], p)
        assert [o.token_ids for o in got] == [want] * 3
        with pytest.raises(RequestError, match="'multi_modal_data', which infer does not take: it runs text models"):
            llm.generate([{"prompt": "Hello", "multi_modal_data": {"image": object()}}], p)

    async def run(llm):
        return [out async for out in llm.generate(prompts[0], p, "mm")]
    llm = AsyncLLM(path, max_model_len=64, block_size=4)
    try:
        assert asyncio.run(run(llm))[-1].token_ids == want
    finally:
        llm.shutdown()


def test_async_llm_generate_takes_vllms_other_keywords_at_their_defaults(path):
    """vLLM's AsyncLLM.generate(prompt, params, request_id, trace_headers=None, data_parallel_rank=None, ...) was a
    bare TypeError ("unexpected keyword argument"); the values that change nothing are taken, others are refused
    naming the keyword and what to do, and an unknown keyword is a RequestError naming it."""
    from infer import AsyncLLM, SamplingParams
    from infer.errors import RequestError
    p = SamplingParams(max_tokens=2, ignore_eos=True)

    async def run(llm, rid, **kw):
        return [out async for out in llm.generate("Hello", p, rid, **kw)]
    llm = AsyncLLM(path, max_model_len=64, block_size=4)
    try:
        outs = asyncio.run(run(llm, "a", trace_headers=None, data_parallel_rank=0, tokenization_kwargs=None,
                               prompt_text=None))
        assert outs[-1].finished and len(outs[-1].token_ids) == 2
        with pytest.raises(RequestError, match="data_parallel_rank only as None or 0") as e:
            asyncio.run(run(llm, "b", data_parallel_rank=1))
        assert "one engine" in e.value.hint
        with pytest.raises(RequestError, match="has no keyword 'max_tokens'"):
            asyncio.run(run(llm, "c", max_tokens=3))
        assert not llm.engine.requests
    finally:
        llm.shutdown()


def test_llm_stream_honours_output_kind(path):
    """LLM.stream took SamplingParams(output_kind=DELTA) and still gave each output's outputs[0] the whole reply so
    far (FINAL_ONLY: every step's event): the field was silently ignored. DELTA now gives what is new (as
    AsyncLLM's), FINAL_ONLY each sample's finished output alone, its whole text as the event's text."""
    from infer import LLM, RequestOutputKind, SamplingParams

    def params(kind, n=1):
        return SamplingParams(max_tokens=4, ignore_eos=True, n=n, temperature=1.0, seed=3, output_kind=kind)

    with LLM(path, max_model_len=64, block_size=4) as llm:
        want = [c.token_ids for c in llm.generate("Hello", params(RequestOutputKind.CUMULATIVE, 2))[0].outputs]
        delta = list(llm.stream("Hello", params(RequestOutputKind.DELTA, 2)))
        final = list(llm.stream(["Hello", "Hello"], [params(RequestOutputKind.FINAL_ONLY),
                                                     params(RequestOutputKind.CUMULATIVE)]))
    joined = {0: [], 1: []}
    for _, text, out in delta:
        assert out.outputs[0].text == text
        joined[out.outputs[0].index] += out.outputs[0].token_ids
    assert [joined[0], joined[1]] == want
    firsts = [(text, out) for i, text, out in final if i == 0]
    assert len(firsts) == 1 and firsts[0][1].finished and firsts[0][1].outputs[0].token_ids == want[0]
    assert firsts[0][0] == firsts[0][1].text
    assert len([1 for i, _, _ in final if i == 1]) == 4  # CUMULATIVE: an event per token, as before


def test_async_llm_refuses_an_id_in_flight_whatever_n_either_runs(path):
    """With n > 1 the samples run under child ids ("{j}_{id}"), which the engine sees instead of the id itself: a
    request of n = 1 with the same id as a running n = 3 one (or the other way round) was taken, and one of them lost
    its place in abort() and in the streams' table. The id in flight is refused whichever request runs it."""
    from infer import AsyncLLM, SamplingParams
    from infer.serve.async_engine import RequestIdInUseError

    def params(n):
        return SamplingParams(n=n, max_tokens=40, ignore_eos=True, temperature=1.0, seed=1)

    async def clash(first_n, second_n):
        gen = llm.generate("Hello there", params(first_n), "x")
        await gen.__anext__()  # running
        try:
            with pytest.raises(RequestIdInUseError, match="already in use"):
                async for _ in llm.generate("Hello there", params(second_n), "x"):
                    pass
        finally:
            await gen.aclose()

    llm = AsyncLLM(path, max_model_len=64, block_size=4)
    try:
        asyncio.run(clash(3, 1))
        asyncio.run(clash(1, 3))
    finally:
        llm.shutdown()
