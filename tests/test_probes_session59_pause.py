"""Probes of the fifty-ninth session (pause): the gaps pause/resume left. Another thread's
llm.llm_engine.pause_generation() while an LLM.generate steps (one lock: the pause waits for the step running);
the requests held while paused counted in /metrics' num_requests_waiting; a "wait" pause left queued (its timeout ran
out) that must not clear the prefix cache of a later clear_cache=False pause; a served beam search (use_beam_search)
under POST /pause's modes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from helpers import StepGate, hf_greedy, metric_families, run_async_llm, wait_until
from infer import LLM, SamplingParams
from infer.engine.sleep import PAUSED
from infer.errors import PauseError, PauseTimeoutError
from test_probes_session58_pause import LONG, PROMPTS, _in_thread, _run, served  # noqa: F401


@pytest.fixture(scope="module")
def path():
    from infer.models.tiny import ensure_builtin
    return str(ensure_builtin("tiny-llama"))


class _Watched:
    """An engine's lock that tells (`waiting`, an Event) when a thread had to wait for it."""

    def __init__(self, lock):
        self.lock, self.waiting = lock, threading.Event()

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.waiting.set()
            self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()

    def _is_owned(self) -> bool:
        return self.lock._is_owned()


def _pausing_mid_step(engine, mode: str, at_step: int = 3) -> dict:
    """engine's `at_step`-th step (its body, under the lock) starts another thread's pause_generation(mode) and
    goes on once that thread waits for the lock (_calling_mid_step's dict)."""
    return _calling_mid_step(engine, lambda: engine.pause_generation(mode=mode), at_step)


def _calling_mid_step(engine, target, at_step: int = 3) -> dict:
    """engine's `at_step`-th step (its body, under the lock) starts `target()` in another thread and goes on once
    that thread waits for the engine's lock: {"steps": [the steps begun so far], "waited": whether it waited,
    "ran_mid_step": whether the thread had ended meanwhile, "thread": the thread}."""
    engine.lock = _Watched(engine.lock)
    advance, calls, seen = engine._advance, [0], {}
    seen["steps"] = calls

    def step_body(outputs):
        calls[0] += 1
        if calls[0] == at_step:
            calling = threading.Thread(target=target)
            calling.start()
            seen["thread"] = calling  # (started: the test joins it)
            seen["waited"] = engine.lock.waiting.wait(10)
            seen["ran_mid_step"] = not calling.is_alive()
        return advance(outputs)
    engine._advance = step_body
    return seen


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_a_pause_from_another_thread_waits_for_the_step_and_the_generate_follows_its_mode(path, mode):
    """llm.llm_engine.pause_generation() from a second thread while LLM.generate steps in a first: it waits for
    the step running (it never changes the queues under it) and then: "keep" freezes the generate, which waits
    (a generate started meanwhile is refused: PauseError) and finishes after resume_generation() with Hugging
    Face's greedy tokens; "abort" ends it (finish_reason "abort", PAUSED); "wait" lets it finish first."""
    want = [hf_greedy(path, prompt, 20) for prompt in PROMPTS]
    with LLM(path, block_size=4, max_model_len=64) as llm:
        engine = llm.llm_engine
        seen = _pausing_mid_step(engine, mode)
        gen, got = _in_thread(lambda: llm.generate(PROMPTS, LONG))
        assert wait_until(lambda: "thread" in seen)
        seen["thread"].join(60)
        assert seen["waited"] and not seen["ran_mid_step"] and engine.is_paused()
        if mode == "keep":
            assert gen.is_alive()  # (frozen: it waits for the resume)
            with pytest.raises(PauseError, match="generation is paused"):
                llm.generate(PROMPTS[0], LONG)
            engine.resume_generation()
        gen.join(60)
        assert not gen.is_alive()
        outs = got[0]
        if mode == "abort":
            assert [(o.finish_reason, o.error) for o in outs] == [("abort", PAUSED)] * 2
            assert all(1 <= len(o.token_ids) < 20 and o.token_ids == w[:len(o.token_ids)] for o, w in zip(outs, want))
            engine.resume_generation()
        else:
            assert [(o.finish_reason, list(o.token_ids)) for o in outs] == [("length", w) for w in want]
        if mode == "wait":
            engine.resume_generation()
        assert not engine.is_paused()
        assert [list(o.token_ids) for o in llm.generate(PROMPTS, LONG)] == want


def test_requests_held_while_paused_count_as_waiting_in_metrics(served):
    """The requests that arrive while paused wait for POST /resume outside the engine: /metrics'
    infer:num_requests_waiting counts them (and /health's num_waiting), and 0 once they ran."""
    httpx = pytest.importorskip("httpx")
    url, aengine, body = served

    def waiting() -> float:
        samples = metric_families(httpx.get(f"{url}/metrics", timeout=60).text)
        return samples[("infer:num_requests_waiting", (("engine", "0"), ("model_name", "tiny")))]

    assert httpx.post(f"{url}/pause?mode=keep", timeout=60).status_code == 200
    body = {**body, "max_tokens": 4}
    calls = [_in_thread(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120)) for _ in range(3)]
    assert wait_until(lambda: aengine.num_held() == 3)
    assert waiting() == 3
    assert httpx.get(f"{url}/health", timeout=60).json()["engine"]["num_waiting"] == 3
    assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
    for t, got in calls:
        t.join(60)
        assert got[0].status_code == 200 and got[0].json()["choices"][0]["finish_reason"] == "length"
    assert waiting() == 0


@pytest.mark.parametrize("resumed", [False, True])
def test_a_timed_out_wait_pause_leaves_a_later_pause_its_own_clear_cache(path, resumed):
    """pause_generation(mode="wait", timeout=) whose timeout runs out stays queued until the requests end; a later
    pause (after a resume, or not) with clear_cache=False supersedes it: the prefix cache a prompt left is still
    there afterwards (it was forgotten by the leftover wait, clear_cache=True)."""
    prompt = list(range(3, 20))

    async def main(llm):
        engine = llm.engine
        await _run(llm, "warm", prompt)
        with StepGate(engine, closed=True) as gate:
            running = asyncio.ensure_future(_run(llm, "r"))
            assert await asyncio.to_thread(wait_until, lambda: engine.scheduler.has_unfinished())
            with pytest.raises(PauseTimeoutError):
                await llm.pause_generation(mode="wait", timeout=0.2)
            # controls run between two steps, in the order they came: queued behind the step the gate holds
            resuming = asyncio.ensure_future(llm.resume_generation()) if resumed else None
            pausing = asyncio.ensure_future(llm.pause_generation(mode="abort", clear_cache=False))
            gate.open.set()
            await asyncio.wait_for(pausing, 60)
            assert resuming is None or resuming.done()
        assert (await running).finish_reason == "abort"
        await llm.pause_generation(mode="wait", clear_cache=False)  # (queued after the leftover: it ran)
        await llm.resume_generation()
        outs = [out async for out in llm.generate(prompt, SamplingParams(max_tokens=2), "again")]
        assert outs[-1].num_cached_tokens > 0

    run_async_llm(path, main, enable_prefix_caching=True)


class _Steps:
    """engine.step held before each step until `allow(k)` lets k more run; `started` counts the steps begun."""

    def __init__(self, engine):
        self.engine, self.gate, self.started = engine, threading.Semaphore(0), 0
        self.inner = engine.step

    def __enter__(self):
        def step():
            self.started += 1
            self.gate.acquire(timeout=30)
            return self.inner()
        self.engine.step = step
        return self

    def allow(self, k: int) -> None:
        for _ in range(k):
            self.gate.release()

    def __exit__(self, *exc):
        self.allow(1000)
        del self.engine.step


def test_server_beam_search_under_pause_keep_goes_on_and_abort_answers_its_beams_so_far(served):
    """use_beam_search: POST /pause?mode=keep three steps into a search freezes it (its next steps wait for
    /resume) and it answers, after POST /resume, the beams of an uninterrupted search; POST /pause (mode abort)
    three steps in answers at once, 200, each choice finish_reason "abort" with the beams the search had: those of a
    search of 3 tokens. A plain request runs after."""
    httpx = pytest.importorskip("httpx")
    url, aengine, body = served
    engine = aengine.engine
    beam = {**body, "max_tokens": 8, "use_beam_search": True, "n": 2}

    def texts(r, reason):
        assert r.status_code == 200, r.text
        assert [c["finish_reason"] for c in r.json()["choices"]] == [reason, reason]
        return [c["text"] for c in r.json()["choices"]]

    want = texts(httpx.post(f"{url}/v1/completions", json=beam, timeout=60), "length")
    three = texts(httpx.post(f"{url}/v1/completions", json={**beam, "max_tokens": 3}, timeout=60), "length")
    for mode in ("keep", "abort"):
        with _Steps(engine) as steps:
            started = steps.started
            t, got = _in_thread(lambda: httpx.post(f"{url}/v1/completions", json=beam, timeout=120))
            steps.allow(3)
            assert wait_until(lambda: steps.started == started + 4)  # (the 4th step's requests are in the engine)
            pausing, answer = _in_thread(lambda: httpx.post(f"{url}/pause?mode={mode}", timeout=60))
            if mode == "keep":
                assert wait_until(aengine.is_paused)  # (from now on the search's next steps wait for /resume)
            else:  # (answered at once, while the engine still runs its 4th step)
                t.join(60)
                assert texts(got[0], "abort") == three
                assert got[0].json()["usage"]["prompt_tokens"] == len(PROMPTS[1])
            steps.allow(1000)
            pausing.join(60)
            assert answer[0].status_code == 200
            if mode == "keep":
                assert wait_until(lambda: aengine.num_held() == 2) and t.is_alive()
                assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
                t.join(60)
                assert texts(got[0], "length") == want
        if mode == "abort":
            assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
            assert wait_until(lambda: not engine.has_unfinished_requests())
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_async_llm_beam_search_under_pause_abort_and_keep(path):
    """AsyncLLM.beam_search (vLLM's EngineClient.beam_search): pause_generation() (mode abort) two steps in ends
    it at once with every beam it had (those of a search of 2 tokens), finish_reason "abort"; mode "keep" two
    steps in: it goes on after resume_generation() with the beams of an uninterrupted search."""
    from infer.engine.beam import BeamSearchParams

    async def search(llm, rid, tokens):
        outs = [o async for o in llm.beam_search(PROMPTS[0], rid, BeamSearchParams(beam_width=2, max_tokens=tokens))]
        return outs[-1].finish_reason, [o.text for o in outs[-1].outputs]

    async def main(llm):
        want, two = await search(llm, "w", 6), await search(llm, "t", 2)
        for mode in ("abort", "keep"):
            with _Steps(llm.engine) as steps:
                started = steps.started
                task = asyncio.ensure_future(search(llm, mode, 6))
                steps.allow(2)
                assert await asyncio.to_thread(wait_until, lambda: steps.started == started + 3)
                pausing = asyncio.ensure_future(llm.pause_generation(mode=mode))
                if mode == "abort":
                    assert await asyncio.wait_for(task, 60) == ("abort", two[1])
                else:
                    assert await asyncio.to_thread(wait_until, llm._loop.is_paused)
                steps.allow(1000)
                await asyncio.wait_for(pausing, 60)
                if mode == "keep":
                    assert await asyncio.to_thread(wait_until, lambda: llm._loop.num_held() == 2)
                    assert not task.done()
                await llm.resume_generation()
                if mode == "keep":
                    assert await asyncio.wait_for(task, 60) == want

    run_async_llm(path, main)


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_offline_beam_search_under_another_threads_pause(path, mode):
    """LLM.beam_search in one thread, llm.llm_engine.pause_generation() in another (mid-step): "keep" holds its
    next steps (not refused as a new call would be) and it answers, after resume_generation(), the beams of an
    uninterrupted search; "abort" ends it with PauseError naming the abort. A search begun while paused is
    refused (PauseError) as a generate is."""
    from infer.engine.beam import BeamSearchParams
    params = BeamSearchParams(beam_width=2, max_tokens=6)

    def texts(outs):
        return [[s.text for s in o.sequences] for o in outs]

    with LLM(path, block_size=4, max_model_len=64) as llm:
        engine = llm.llm_engine
        want = texts(llm.beam_search([PROMPTS[0]], params))
        seen = _pausing_mid_step(engine, mode)
        errors: list = []

        def search():
            try:
                return llm.beam_search([PROMPTS[0]], params)
            except PauseError as e:
                errors.append(e)
        t, got = _in_thread(search)
        assert wait_until(lambda: "thread" in seen)
        seen["thread"].join(60)
        assert engine.is_paused()
        with pytest.raises(PauseError, match="generation is paused"):
            llm.beam_search([PROMPTS[0]], params)
        if mode == "keep":
            assert wait_until(lambda: engine.has_unfinished_requests()) and t.is_alive()
        engine.resume_generation()
        t.join(60)
        if mode == "keep":
            assert texts(got[0]) == want and not errors
        else:
            assert got == [None] and "ended the beam search" in str(errors[0])
