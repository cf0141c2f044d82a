"""Review probes of session 58's pause/resume (vLLM's pause_generation / resume_generation / is_paused): what a probe
found wrong, each with its regression test."""

from __future__ import annotations

import shutil
import threading

import pytest

from helpers import StepGate, hf_greedy, wait_until
from infer import LLM, SamplingParams
from infer.errors import PauseError, RequestError
from infer.models.tiny import ensure_builtin

PROMPT = [5, 9, 13, 21]
LONG = SamplingParams(max_tokens=16, ignore_eos=True)


def _new_weights(src, out) -> None:
    """`src`'s model with other weights (its MLPs scaled): another greedy continuation of the same prompt."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    state = load_file(str(out / "model.safetensors"))
    for key in [k for k in state if ".mlp." in k]:
        state[key] = state[key] * 3
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _raised(call, into: list) -> None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 (the test says which)
        into.append(e)
    else:
        into.append(None)


def _served(max_queue: int | None = None, graceful_timeout: float = 5.0):
    """(its AsyncEngine, the context manager that serves it: the base URL) of tiny-llama, 2 sequences at most."""
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(str(ensure_builtin("tiny-llama")), block_size=4, max_model_len=64,
                                    max_num_seqs=2))
    aengine = AsyncEngine(engine, max_queue)
    return aengine, serve_in_thread(Server(aengine, "tiny"), graceful_timeout=graceful_timeout)


def _step(engine, n: int) -> list:
    return [out for _ in range(n) for out in engine.step()]


@pytest.mark.parametrize("mode, overlap", [("keep", False), ("keep", True), ("abort", False), ("abort", True)])
def test_reload_weights_right_after_pause_and_keep_goes_on_with_the_new_weights(tmp_path, mode, overlap):
    """vLLM's RL loop on the engine: pause_generation(), reload_weights(), resume_generation(). The reload was refused
    ("reload_weights() while requests run") while the pause's outputs were not handed out yet: those of the requests
    "abort" ended, and with overlap the step "keep" completed. A frozen request goes on with the new weights: its
    tokens are those it had, then Hugging Face's greedy tokens of the new model given the prompt and those. Not paused,
    the reload is refused, naming pause_generation()."""
    src = ensure_builtin("tiny-llama")
    shutil.copytree(src, tmp_path / "engine")
    _new_weights(src, tmp_path / "new")
    with LLM(str(tmp_path / "engine"), block_size=4, max_model_len=64, overlap=overlap) as llm:
        engine = llm.llm_engine
        engine.add_request("r", PROMPT, LONG)
        outs = _step(engine, 4)
        with pytest.raises(RequestError, match=r"reload_weights\(\) while requests run") as e:
            llm.collective_rpc("reload_weights")  # (not paused: refused, naming the pause)
        assert "pause_generation()" in e.value.hint
        engine.pause_generation(mode=mode)
        kept = list(engine.requests["r"].output_token_ids)  # (with overlap: the step the pause completed, too)
        assert 1 <= len(kept) < 16 and kept == hf_greedy(str(src), PROMPT, len(kept))
        shutil.copy(tmp_path / "new" / "model.safetensors", tmp_path / "engine" / "model.safetensors")
        llm.collective_rpc("reload_weights")
        engine.resume_generation()
        outs += _step(engine, 40)
        assert not engine.has_unfinished_requests()
        (last,) = [o for o in outs if o.finished]
        new = hf_greedy(str(tmp_path / "new"), PROMPT, 16)
        assert new != hf_greedy(str(src), PROMPT, 16)  # (the new weights answer otherwise)
        if mode == "abort":
            assert (last.finish_reason, list(last.token_ids)) == ("abort", kept)
            assert [list(o.outputs[0].token_ids) for o in llm.generate([PROMPT], LONG)] == [new]
        else:  # the tokens it had, then the new model's greedy ones given the prompt and those
            want = kept + hf_greedy(str(tmp_path / "new"), PROMPT + kept, 16 - len(kept))
            assert (last.finish_reason, list(last.token_ids)) == ("length", want) and want[len(kept):] != \
                hf_greedy(str(src), PROMPT, 16)[len(kept):]


def test_server_stop_while_paused_ends_the_paused_requests_at_once(tmp_path):
    """Stopping a server while generation was paused waited the whole --shutdown-timeout for requests that cannot
    finish (no POST /resume comes once it stops), then answered "--shutdown-timeout passed": now a request frozen
    by POST /pause?mode=keep and one that arrived while paused end at once, each a 503 saying generation was
    paused. /health (200) and /metrics answer while paused."""
    httpx = pytest.importorskip("httpx")
    aengine, serving = _served(graceful_timeout=60)
    engine = aengine.engine
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    got = []
    threads = [threading.Thread(target=lambda: got.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                     timeout=120))) for _ in range(2)]
    with serving as url:
        with StepGate(engine, closed=True) as gate:
            threads[0].start()
            assert wait_until(lambda: engine.scheduler.has_unfinished())
            pausing = threading.Thread(target=lambda: httpx.post(f"{url}/pause?mode=keep", timeout=60))
            pausing.start()
            assert wait_until(aengine.is_paused)
            gate.open.set()
            pausing.join(60)
        threads[1].start()
        assert wait_until(lambda: len(aengine._held) == 1) and len(engine.scheduler.waiting) == 1
        health = httpx.get(f"{url}/health", timeout=60)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert httpx.get(f"{url}/metrics", timeout=60).status_code == 200
    for t in threads:
        t.join(60)
    assert [r.status_code for r in got] == [503, 503]
    for r in got:
        assert "while generation was paused" in r.json()["error"]["message"], r.text
    assert not engine.requests


def test_an_llm_call_while_paused_is_refused_not_a_hang():
    """LLM.generate (and chat, stream, beam_search: every LLM call that adds requests) on an engine paused through
    llm.llm_engine.pause_generation() queued its requests and waited for ever for a resume_generation() that a
    single-threaded program never makes: refused now (PauseError naming resume_generation), as a sleeping engine's
    generate is; a generate started before the pause on another thread goes on after the resume."""
    from infer.engine.beam import BeamSearchParams
    with LLM(str(ensure_builtin("tiny-llama")), block_size=4, max_model_len=64) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate([PROMPT], LONG)]
        engine = llm.llm_engine
        engine.pause_generation()
        for call in (lambda: llm.generate([PROMPT], LONG), lambda: list(llm.stream([PROMPT], LONG)),
                     lambda: llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2,
                                                                                             max_tokens=4))):
            raised = []
            t = threading.Thread(target=_raised, args=(call, raised))
            t.start()
            t.join(30)
            hung = t.is_alive()
            if hung:  # (the hang: the resume lets the call end)
                engine.resume_generation()
                t.join(60)
            assert not hung and isinstance(raised[0], PauseError), raised
            assert "generation is paused (llm.llm_engine.pause_generation())" in raised[0].message
            assert "resume_generation()" in raised[0].hint and not engine.has_unfinished_requests()
        engine.resume_generation()
        got = []
        with StepGate(engine, closed=True) as gate:
            t = threading.Thread(target=lambda: got.append(llm.generate([PROMPT], LONG)))
            t.start()
            assert wait_until(lambda: engine.scheduler.has_unfinished())
            # a pause runs between two steps: from another thread, as the step the gate holds has the engine's lock
            pausing = threading.Thread(target=engine.pause_generation, kwargs={"mode": "keep"})
            pausing.start()
            assert wait_until(lambda: engine._controls_waiting == 1)
            gate.open.set()
            pausing.join(60)
            assert not pausing.is_alive() and engine.is_paused()
            t.join(0.3)
            assert t.is_alive()
            engine.resume_generation()
            t.join(60)
        assert [list(o.outputs[0].token_ids) for o in got[0]] == want


def test_max_queue_reached_while_paused_says_generation_is_paused():
    """--max-queue counts the requests that wait for POST /resume; the 503 queue_full of one more said only "N
    requests are already waiting": it says generation is paused now (the queue empties at POST /resume, not by
    waiting). After the resume every accepted request runs."""
    httpx = pytest.importorskip("httpx")
    aengine, serving = _served(max_queue=1)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with serving as url:
        assert httpx.post(f"{url}/pause", timeout=60).status_code == 200
        got = []
        threads = [threading.Thread(target=lambda: got.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                         timeout=120))) for _ in range(3)]
        for i, t in enumerate(threads):  # (max_num_seqs 2 free slots, then 1 waiting: 3 accepted)
            t.start()
            assert wait_until(lambda: len(aengine._held) == i + 1)
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        assert "generation is paused: they run after POST /resume" in r.json()["error"]["message"], r.text
        assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
        for t in threads:
            t.join(60)
    assert [r.json()["choices"][0]["finish_reason"] for r in got] == ["length"] * 3


def test_a_resume_while_asleep_leaves_the_requests_that_waited_for_it_waiting_for_wake_up():
    """pause_generation, a generate that then waits, sleep(), resume_generation(), wake_up(): the resume admitted the
    waiting generate to the sleeping engine, which refused it: it ended with finish_reason "error" ("the engine is
    asleep"; a 500 from the server, which had accepted it). It waits for wake_up now, and then finishes with an
    uninterrupted run's tokens, as the generate the pause froze does."""
    import asyncio

    from infer.serve.async_llm import AsyncLLM

    async def generate(llm, rid):
        async for out in llm.generate(PROMPT, LONG, rid):
            last = out
        return last.outputs[0]

    async def main(llm):
        want = list((await generate(llm, "w")).token_ids)
        with StepGate(llm.engine, delay=0.01):
            steps = llm.engine.num_steps
            frozen = asyncio.ensure_future(generate(llm, "frozen"))
            assert await asyncio.to_thread(wait_until, lambda: llm.engine.num_steps >= steps + 3)
            await llm.pause_generation(mode="keep")
        held = asyncio.ensure_future(generate(llm, "held"))
        assert await asyncio.to_thread(wait_until, lambda: len(llm._loop._held) == 1)
        assert "frozen" in llm.engine.requests and llm._loop._held[0].request_id == "held"
        await llm.sleep(level=1, mode="keep")
        await llm.resume_generation()
        await asyncio.sleep(0.3)
        assert not held.done() and not frozen.done() and not await llm.is_paused()
        await llm.wake_up()
        got = await asyncio.wait_for(asyncio.gather(frozen, held), 60)
        assert [(o.finish_reason, list(o.token_ids)) for o in got] == [("length", want)] * 2

    llm = AsyncLLM(str(ensure_builtin("tiny-llama")), block_size=4, max_model_len=64, enable_sleep_mode=True)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()
