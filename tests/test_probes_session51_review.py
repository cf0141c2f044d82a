"""Probes of the fifty-first session's review: defects in the session's new code (AsyncLLM's output kinds and
n > 1 samples, ...), each fixed at its cause."""

from __future__ import annotations

import asyncio

import pytest

from infer.models.tiny import ensure_builtin


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


def test_delta_outputs_carry_the_prompts_logprobs_once(path):
    """vLLM's DELTA outputs carry prompt_logprobs with the first output only (its logprobs processor pops them), as
    every other field of a DELTA output is what is new. Every output carried the whole prompt's again, so a program
    joining the parts got them once per step (AsyncLLM.generate and LLM.stream, each sample of n > 1 on its own)."""
    from infer import LLM, AsyncLLM, RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA)

    async def run(llm, p, rid):
        return [out async for out in llm.generate("Hello there", p, rid)]

    llm = AsyncLLM(path, max_model_len=64, block_size=4)
    try:
        one = asyncio.run(run(llm, params, "a"))
        two = asyncio.run(run(llm, SamplingParams(max_tokens=3, ignore_eos=True, n=2, seed=1, temperature=1.0,
                                                  prompt_logprobs=1, output_kind=RequestOutputKind.DELTA), "b"))
    finally:
        llm.shutdown()
    assert len(one) == 4 and one[0].prompt_logprobs  # (None, then a record per prompt token from the second)
    assert [o.prompt_logprobs for o in one[1:]] == [None] * 3
    firsts = {}
    for o in two:
        firsts.setdefault(o.outputs[0].index, []).append(o.prompt_logprobs is not None)
    assert firsts == {0: [True, False, False], 1: [True, False, False]}
    with LLM(path, max_model_len=64, block_size=4) as llm:
        events = [out for _, _, out in llm.stream(["Hello there"], params)]
    assert len(events) == 4 and events[0].prompt_logprobs
    assert [o.prompt_logprobs for o in events[1:]] == [None] * 3


def test_aborting_a_samples_own_id_ends_its_parents_generate(path):
    """AsyncLLM runs n > 1 as child requests "{j}_{id}" (the docstring names them). abort("0_c") stopped that sample
    in the engine without a last output and without waking the parent's generate, which then waited for ever for the
    sample's end; now it ends the parent's generate, as abort("c") does, and frees every sample."""
    from infer import AsyncLLM, SamplingParams

    llm = AsyncLLM(path, max_model_len=256, block_size=4)

    async def main():
        params = SamplingParams(max_tokens=200, ignore_eos=True, n=2, seed=1, temperature=1.0)
        seen = []

        async def consume():
            async for out in llm.generate("Hello there", params, "c"):
                seen.append(out)
                if len(seen) == 2:
                    await llm.abort("0_c")
        await asyncio.wait_for(consume(), 30)
        return seen

    try:
        seen = asyncio.run(main())
        assert 2 <= len(seen) < 400 and not seen[-1].finished
        assert llm._loop.num_in_flight() == 0 and not llm._streams
    finally:
        llm.shutdown()


def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_staging_folder_of_another_pid_namespace_on_this_host_is_kept(tmp_path, monkeypatch):
    """Containers sharing the machine's hostname (docker --network host) and a disk each have pids of their own: a
    run writing in one looked killed from another (its pid not found there), which removed its staging folder while
    it wrote. The staging name now carries the pid namespace too, so only this namespace's dead runs are removed."""
    import os

    from infer.quant import convert
    out, dead = tmp_path / "out", _dead_pid()
    with monkeypatch.context() as m:
        m.setattr(convert, "_pid_namespace", lambda: "4026599999")  # another container's
        theirs = tmp_path / f".out.tmp-{convert._host()}-{dead}-abc"
    theirs.mkdir()
    ours = tmp_path / f".out.tmp-{convert._host()}-{dead}-abc"
    ours.mkdir()
    assert ours != theirs
    with convert.staged_output(out, overwrite=False) as tmp:
        assert tmp.name.startswith(f".out.tmp-{convert._host()}-{os.getpid()}-")
        (tmp / "config.json").write_text("{}")
    assert theirs.exists() and not ours.exists()


def test_a_finished_requests_id_is_free_while_its_generator_is_still_held(path):
    """A program that keeps its generate() object and breaks out of the loop at the finished output, then reuses the
    id (a fixed id per worker, say), got RequestIdInUseError: the id was taken until the generator was closed, since
    AsyncLLM checks its own streams (for n > 1's parent ids) and dropped one only then. The engine frees an id when
    the request finishes, and so does AsyncLLM now."""
    from infer import AsyncLLM, SamplingParams

    llm = AsyncLLM(path, max_model_len=64, block_size=4)

    async def main():
        outs, held = [], []
        for n in (1, 2, 1):
            params = SamplingParams(max_tokens=3, ignore_eos=True, n=n, seed=1, temperature=1.0)
            held.append(llm.generate("Hello there", params, "r"))  # (still referenced: not closed)
            async for out in held[-1]:
                if out.finished:
                    outs.append(out)
                    break
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        llm.shutdown()
    assert len(outs) == 3 and all(o.finished for o in outs)
