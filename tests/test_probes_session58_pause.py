"""Probes of the fifty-eighth session (pause): vLLM's pause_generation(mode="abort"|"wait"|"keep", clear_cache) /
resume_generation / is_paused (an RL trainer's, around a weight update) on LLMEngine and AsyncLLM, and the server's
POST /pause, POST /resume, GET /is_paused. While paused, new requests wait (not refused) and run after resume."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from helpers import StepGate, hf_greedy, wait_until
from infer import LLM, SamplingParams
from infer.engine.sleep import PAUSED
from infer.errors import PauseError, PauseTimeoutError, RequestError
from infer.models.tiny import ensure_builtin

PROMPTS = [[5, 9, 13, 21], [7, 3, 2, 8, 11, 40]]
LONG = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


def _llm(path, **kw):
    return LLM(path, block_size=4, max_model_len=64, **kw)


def _finish(engine, outs=None) -> dict:
    """Step until nothing is left (bounded): {request id: (finish_reason, token ids)} of the requests that ended."""
    outs = list(outs or [])
    for _ in range(300):
        if not engine.has_unfinished_requests():
            break
        outs += engine.step()
    return {o.request_id: (o.finish_reason, list(o.token_ids)) for o in outs if o.finished}


def _started(engine, steps: int = 3) -> list:
    """Requests "a" and "b" added and stepped `steps` times: their outputs so far."""
    engine.add_request("a", PROMPTS[0], LONG)
    engine.add_request("b", PROMPTS[1], LONG)
    outs = []
    for _ in range(steps):
        outs += engine.step()
    return outs


# ------------------------------------------------------------------ 1. the engine
@pytest.mark.parametrize("overlap", [False, True])
def test_keep_freezes_the_requests_and_they_finish_after_resume_as_hf_greedy(path, overlap):
    """pause_generation(mode="keep"): steps run nothing and end nothing, the frozen requests hold no KV block, no
    preemption is counted; a request added while paused is queued, not refused; after resume_generation() every
    one finishes with Hugging Face's greedy tokens (an uninterrupted run's)."""
    want = {rid: hf_greedy(path, prompt, 20) for rid, prompt in zip("ab", PROMPTS)}
    with _llm(path, overlap=overlap) as llm:
        engine = llm.llm_engine
        outs = _started(engine)
        engine.pause_generation(mode="keep")
        assert engine.is_paused()
        engine.add_request("c", PROMPTS[1], LONG)
        for _ in range(5):
            outs += engine.step()
        assert not [o for o in outs if o.finished] and engine.stalled()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert len(engine.scheduler.waiting) == 3 and not engine.scheduler.running
        assert engine.stats()["num_preemptions"] == 0
        engine.resume_generation()
        assert not engine.is_paused()
        got = _finish(engine, outs)
    assert got == {"a": ("length", want["a"]), "b": ("length", want["b"]), "c": ("length", want["b"])}


def test_abort_ends_the_requests_with_abort_and_new_ones_wait_for_resume(path):
    """pause_generation() (mode "abort", vLLM's default): the requests end with finish_reason "abort" and the
    tokens they had (handed out by the next step, their error PAUSED); one added while paused runs after resume."""
    with _llm(path) as llm:
        engine = llm.llm_engine
        _started(engine)
        engine.pause_generation()
        assert engine.is_paused()
        ends = [o for o in engine.step() if o.finished]
        assert sorted((o.request_id, o.finish_reason, o.error) for o in ends) == [("a", "abort", PAUSED),
                                                                                  ("b", "abort", PAUSED)]
        assert all(1 <= len(o.token_ids) < 20 for o in ends)
        engine.add_request("c", PROMPTS[0], LONG)
        assert not engine.step() and engine.is_paused() and engine.stalled()
        engine.resume_generation()
        assert _finish(engine) == {"c": ("length", hf_greedy(path, PROMPTS[0], 20))}


def test_wait_runs_the_requests_to_their_end_before_it_returns(path):
    """pause_generation(mode="wait"): the requests run to their end inside the call (their outputs handed out by
    the next step, finish_reason "length", the tokens of an uninterrupted run); paused afterwards."""
    with _llm(path) as llm:
        engine = llm.llm_engine
        want = _finish(engine, _started(engine, 0))
        _started(engine)
        engine.pause_generation(mode="wait")
        assert engine.is_paused() and not engine.scheduler.has_unfinished()
        assert _finish(engine) == want
        engine.resume_generation()


@pytest.mark.parametrize("clear", [True, False])
def test_clear_cache_forgets_the_prefix_cache(path, clear):
    """clear_cache (vLLM's, default True) forgets the prefix cache: a prompt run before the pause hits no cached
    block after it; with clear_cache=False it still does."""
    with _llm(path, enable_prefix_caching=True) as llm:
        prompt = list(range(3, 20))
        llm.generate([prompt], SamplingParams(max_tokens=2))
        llm.llm_engine.pause_generation(mode="abort", clear_cache=clear)
        llm.llm_engine.resume_generation()
        cached = llm.generate([prompt], SamplingParams(max_tokens=2))[0].num_cached_tokens
    assert (cached == 0) if clear else (cached > 0)


def test_refusals_name_the_problem_and_what_to_do(path):
    """A bad mode or clear_cache: RequestError naming them. mode "wait" while requests are frozen: PauseError
    naming resume_generation and mode "abort", nothing changed; a later "keep" leaves them frozen, a later
    "abort" ends them."""
    with _llm(path) as llm:
        engine = llm.llm_engine
        with pytest.raises(RequestError, match="pause mode must be one of 'abort', 'wait', 'keep', got 'later'"):
            engine.pause_generation(mode="later")
        with pytest.raises(RequestError, match="clear_cache must be True or False"):
            engine.pause_generation(clear_cache="yes")
        assert not engine.is_paused()
        _started(engine)
        engine.pause_generation(mode="keep")
        with pytest.raises(PauseError, match="cannot run to their end") as e:
            engine.pause_generation(mode="wait")
        assert "resume_generation()" in e.value.hint and "mode=\"abort\"" in e.value.hint
        assert "POST /resume" in e.value.route
        engine.pause_generation(mode="keep")
        assert engine.scheduler.has_unfinished() and not [o for o in engine.step() if o.finished]
        engine.pause_generation(mode="abort")
        assert {rid: r for rid, (r, _) in _finish(engine).items()} == {"a": "abort", "b": "abort"}


def test_pause_and_sleep_are_independent(path):
    """Sleeping while paused: a sleep(mode="wait") with requests frozen is refused (PauseError naming
    resume_generation); sleep(mode="keep") keeps them. After wake_up the engine is still paused (nothing runs)
    until resume_generation(); then they finish with an uninterrupted run's tokens. Pausing while asleep works."""
    with _llm(path, enable_sleep_mode=True) as llm:
        engine = llm.llm_engine
        want = _finish(engine, _started(engine, 0))
        outs = _started(engine)
        engine.pause_generation(mode="keep")
        with pytest.raises(PauseError, match="generation is paused") as e:
            engine.sleep(1, mode="wait")
        assert "resume_generation()" in e.value.hint and not engine.is_sleeping()
        engine.sleep(1, mode="keep")
        engine.wake_up()
        assert engine.is_paused() and not engine.is_sleeping()
        for _ in range(3):
            outs += engine.step()
        assert not [o for o in outs if o.finished]
        engine.resume_generation()
        assert _finish(engine, outs) == want
        engine.sleep(1)
        engine.pause_generation(mode="keep")  # (asleep: nothing to freeze)
        engine.wake_up()
        assert engine.is_paused()
        engine.resume_generation()
        assert _finish(engine, _started(engine, 0)) == want


# ------------------------------------------------------------------ 2. AsyncLLM
def _async_llm(path):
    from infer import AsyncLLM
    return AsyncLLM(path, block_size=4, max_model_len=64)


async def _run(llm, rid, prompt=PROMPTS[1], on_first=None):
    outs = []
    async for out in llm.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True), rid):
        outs.append(out)
        if len(outs) == 1 and on_first is not None:
            await on_first()
    return outs[-1].outputs[0]


def test_async_llm_keep_abort_wait_and_queued_generates(path):
    """AsyncLLM (vLLM's API): "keep" freezes a running generate, which finishes after resume_generation() with an
    uninterrupted one's tokens; a generate started while paused waits (not refused) and then runs; "abort" ends a
    running one with finish_reason "abort"; "wait" (and vLLM's older wait_for_inflight_requests=True) returns
    once the running one finished. is_paused() says so from the call until resume_generation()."""
    async def main(llm):
        want = list((await _run(llm, "w")).token_ids)
        assert want == hf_greedy(path, PROMPTS[1], 30)
        queued = []

        async def keep():
            await llm.pause_generation(mode="keep")
            assert await llm.is_paused()
            queued.append(asyncio.ensure_future(_run(llm, "q")))
            await asyncio.sleep(0.2)
            assert not queued[0].done() and llm._loop._held
            await llm.resume_generation()
            assert not await llm.is_paused()

        got = await _run(llm, "k", on_first=keep)
        assert (list(got.token_ids), got.finish_reason) == (want, "length")
        assert list((await queued[0]).token_ids) == want
        got = await _run(llm, "a", on_first=llm.pause_generation)
        assert got.finish_reason == "abort" and 1 <= len(got.token_ids) < 30
        await llm.resume_generation()
        for kw in ({"mode": "wait"}, {"wait_for_inflight_requests": True}):
            pausing = []

            async def wait():
                pausing.append(asyncio.ensure_future(llm.pause_generation(**kw)))

            got = await _run(llm, "t", on_first=wait)
            await pausing[0]
            assert (list(got.token_ids), got.finish_reason) == (want, "length") and await llm.is_paused()
            await llm.resume_generation()
        with pytest.raises(RequestError, match="wait_for_inflight_requests=True and mode='keep'"):
            await llm.pause_generation(mode="keep", wait_for_inflight_requests=True)
        with pytest.raises(RequestError, match="pause mode must be one of"):
            await llm.pause_generation(mode="later")
        assert not await llm.is_paused()

    llm = _async_llm(path)
    try:
        with StepGate(llm.engine, delay=0.01):  # (slowed: a pause lands a few tokens in, however loaded the machine)
            asyncio.run(main(llm))
    finally:
        llm.shutdown()


def test_async_wait_timeout_stays_paused_and_a_cancelled_waiter_is_freed(path):
    """mode "wait" with a timeout that runs out: PauseTimeoutError naming the requests left, generation stays
    paused and the running generate finishes; a generate waiting for resume that is cancelled leaves nothing
    behind. A bad timeout is a RequestError."""
    async def main(llm):
        engine = llm.engine
        with StepGate(engine, closed=True) as gate:
            task = asyncio.ensure_future(_run(llm, "r"))
            assert await asyncio.to_thread(wait_until, lambda: engine.scheduler.has_unfinished())
            with pytest.raises(PauseTimeoutError, match=r"timed out after 0.2 s with 1 request\(s\) still running"):
                await llm.pause_generation(mode="wait", timeout=0.2)
            assert await llm.is_paused()
            waiter = asyncio.ensure_future(_run(llm, "x"))
            await asyncio.sleep(0.05)
            assert len(llm._loop._held) == 1
            waiter.cancel()
            await asyncio.sleep(0.05)
            assert not llm._loop._held and llm._loop.num_in_flight() == 1
            gate.open.set()
            assert (await task).finish_reason == "length"
        assert await llm.is_paused()
        with pytest.raises(RequestError, match="timeout must be a number of seconds above 0"):
            await llm.pause_generation(mode="wait", timeout=0)
        with pytest.raises(RequestError, match="a timeout is for mode \"wait\""):
            await llm.pause_generation(mode="keep", timeout=1)
        await llm.resume_generation()

    llm = _async_llm(path)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()


def test_async_a_generate_during_a_wait_pause_waits_and_a_resume_meanwhile_stands(path):
    """While pause_generation(mode="wait") lets the running generate finish, a generate started meanwhile does not
    run (it would hold the pause up): it has no token when the pause returns and finishes after resume. A
    resume_generation() while such a pause still waits stands: once the running generate ended nothing is paused
    and a new generate runs."""
    async def main(llm):
        engine = llm.engine
        with StepGate(engine, closed=True) as gate:
            running = asyncio.ensure_future(_run(llm, "r"))
            assert await asyncio.to_thread(wait_until, lambda: engine.scheduler.has_unfinished())
            pausing = asyncio.ensure_future(llm.pause_generation(mode="wait"))
            await asyncio.sleep(0.05)
            late = asyncio.ensure_future(_run(llm, "late"))
            await asyncio.sleep(0.05)
            gate.open.set()
            await asyncio.wait_for(pausing, 60)
            assert (await running).finish_reason == "length"
            assert not late.done() and "late" not in engine.requests
            await llm.resume_generation()
            assert (await asyncio.wait_for(late, 60)).finish_reason == "length"
        with StepGate(engine, closed=True) as gate:
            running = asyncio.ensure_future(_run(llm, "r2"))
            assert await asyncio.to_thread(wait_until, lambda: engine.scheduler.has_unfinished())
            pausing = asyncio.ensure_future(llm.pause_generation(mode="wait"))
            await asyncio.sleep(0.05)
            resuming = asyncio.ensure_future(llm.resume_generation())
            await asyncio.sleep(0.05)
            assert not await llm.is_paused()  # (at once: new generates run again)
            gate.open.set()
            await asyncio.wait_for(asyncio.gather(pausing, resuming, running), 60)
        assert not await llm.is_paused() and not engine.is_paused()
        assert (await asyncio.wait_for(_run(llm, "after"), 60)).finish_reason == "length"

    llm = _async_llm(path)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()


# ------------------------------------------------------------------ 3. the server
@pytest.fixture
def served(path):
    """(base URL, its AsyncEngine, completion body) of tiny-llama served in a thread."""
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(path, block_size=4, max_model_len=64, max_num_seqs=2, enable_sleep_mode=True))
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    aengine = AsyncEngine(engine)
    with serve_in_thread(Server(aengine, "tiny")) as url:
        yield url, aengine, body


def _in_thread(fn) -> tuple[threading.Thread, list]:
    got: list = []
    t = threading.Thread(target=lambda: got.append(fn()))
    t.start()
    return t, got


def _streamed(httpx, url, body) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_server_keep_and_requests_that_arrive_while_paused(served):
    """POST /pause?mode=keep: a completion in flight is frozen; a completion and a streamed one sent while paused
    wait; after POST /resume all three answer the text of an uninterrupted one. GET /is_paused says so."""
    httpx = pytest.importorskip("httpx")
    url, aengine, body = served
    engine = aengine.engine
    want = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert httpx.get(f"{url}/is_paused", timeout=60).json() == {"is_paused": False}
    with StepGate(engine, delay=0.02):  # (slowed: paused a few tokens in)
        steps = engine.num_steps
        first, got = _in_thread(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120))
        assert wait_until(lambda: engine.num_steps >= steps + 3)
        r = httpx.post(f"{url}/pause?mode=keep", timeout=60)
    assert (r.status_code, r.json()) == (200, {"status": "paused"})
    assert httpx.get(f"{url}/is_paused", timeout=60).json() == {"is_paused": True}
    second, got2 = _in_thread(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120))
    third, got3 = _in_thread(lambda: _streamed(httpx, url, body))
    assert wait_until(lambda: len(aengine._held) == 2)
    first.join(0.3)
    assert first.is_alive() and second.is_alive() and third.is_alive()
    r = httpx.post(f"{url}/resume", timeout=60)
    assert (r.status_code, r.json()) == (200, {"status": "resumed"})
    for t in (first, second, third):
        t.join(60)
    assert [g[0].json()["choices"][0]["text"] for g in (got, got2)] == [want, want]
    chunks = got3[0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{url}/is_paused", timeout=60).json() == {"is_paused": False}


@pytest.mark.parametrize("stream", [False, True])
def test_server_abort_answers_finish_reason_abort(served, stream):
    """POST /pause (mode abort, vLLM's default): a completion in flight answers 200 with finish_reason "abort" and
    the text it had (streamed: its last chunk says "abort"), as vLLM's; after /resume requests run again."""
    httpx = pytest.importorskip("httpx")
    url, aengine, body = served
    engine = aengine.engine
    with StepGate(engine, closed=True) as gate:
        call = (lambda: _streamed(httpx, url, body)) if stream else \
            (lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120))
        t, got = _in_thread(call)
        assert wait_until(lambda: engine.scheduler.has_unfinished())
        pausing, answer = _in_thread(lambda: httpx.post(f"{url}/pause", timeout=60))
        assert wait_until(aengine.is_paused)  # (its abort queued: it runs before the next step)
        gate.open.set()
        pausing.join(60)
    t.join(60)
    assert answer[0].status_code == 200
    if stream:
        assert got[0][-1]["choices"][0]["finish_reason"] == "abort"
    else:
        assert got[0].status_code == 200, got[0].text
        assert got[0].json()["choices"][0]["finish_reason"] == "abort"
    assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_server_wait_timeout_and_bad_parameters(served):
    """POST /pause?mode=wait&timeout=: 504 pause_timeout naming the requests left when it runs out, the server
    stays paused and the request in flight finishes; a bad mode, clear_cache or timeout is a 400 naming it;
    wait_for_inflight_requests=true is mode=wait."""
    httpx = pytest.importorskip("httpx")
    url, aengine, body = served
    engine = aengine.engine
    for query, param in (("mode=later", "mode"), ("clear_cache=maybe", "clear_cache"),
                         ("mode=wait&timeout=-1", "timeout"), ("mode=keep&timeout=5", "timeout"),
                         ("mode=keep&wait_for_inflight_requests=true", "wait_for_inflight_requests")):
        r = httpx.post(f"{url}/pause?{query}", timeout=60)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
    assert httpx.get(f"{url}/is_paused", timeout=60).json() == {"is_paused": False}
    with StepGate(engine, closed=True) as gate:
        t, got = _in_thread(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120))
        assert wait_until(lambda: engine.scheduler.has_unfinished())
        r = httpx.post(f"{url}/pause?mode=wait&timeout=0.2", timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "pause_timeout"
        assert "1 request(s) still running" in r.json()["error"]["message"]
        assert "POST /resume" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/is_paused", timeout=60).json() == {"is_paused": True}
        gate.open.set()
        t.join(60)
    assert got[0].json()["choices"][0]["finish_reason"] == "length"
    assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
    t, got = _in_thread(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120))
    assert wait_until(lambda: engine.scheduler.has_unfinished())
    r = httpx.post(f"{url}/pause?wait_for_inflight_requests=true", timeout=120)
    assert r.status_code == 200 and not t.join(60) and got[0].json()["choices"][0]["finish_reason"] == "length"
    assert httpx.post(f"{url}/resume", timeout=60).status_code == 200


def test_server_sleep_wait_timeout_answers_504_and_sleeps_once_they_end(served):
    """POST /sleep?mode=wait&timeout= (the existing wait-sleep, given a timeout as /pause's): 504 sleep_timeout
    naming the requests left and POST /sleep?mode=abort; new requests stay refused (503 engine_sleeping) and the
    engine goes to sleep once the request in flight ended (200, finish_reason "length"). A timeout with another
    mode is a 400 naming it."""
    httpx = pytest.importorskip("httpx")
    url, aengine, body = served
    engine = aengine.engine
    r = httpx.post(f"{url}/sleep?level=1&mode=abort&timeout=1", timeout=60)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "timeout")
    with StepGate(engine, closed=True) as gate:
        t, got = _in_thread(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120))
        assert wait_until(lambda: engine.scheduler.has_unfinished())
        r = httpx.post(f"{url}/sleep?level=1&mode=wait&timeout=0.2", timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "sleep_timeout", r.text
        assert "1 request(s) still running" in r.json()["error"]["message"]
        assert "POST /sleep?mode=abort" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
        assert not engine.is_sleeping()
        gate.open.set()
        t.join(60)
    assert got[0].json()["choices"][0]["finish_reason"] == "length"
    assert wait_until(engine.is_sleeping) and not aengine._draining
    assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["finish_reason"] == "length"


def test_server_client_gone_while_paused_frees_its_place(served):
    """A streamed request that waits for /resume and whose client goes away leaves nothing waiting."""
    httpx = pytest.importorskip("httpx")
    url, aengine, body = served
    engine = aengine.engine
    assert httpx.post(f"{url}/pause", timeout=60).status_code == 200
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=5) as r:
        assert r.status_code == 200
        assert wait_until(lambda: len(aengine._held) == 1)
    assert wait_until(lambda: not aengine._held and not aengine.num_in_flight())
    assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
    assert not engine.has_unfinished_requests()


def test_server_routes_are_guarded_and_refused_with_data_parallel(path):
    """--api-key guards the routes (401 without it); a data-parallel server answers 400 naming the flag."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(path, block_size=4, max_model_len=64, max_num_seqs=2))
    server = Server(AsyncEngine(engine), "tiny", api_key="k")
    with TestClient(create_app(server)) as client:
        for method, route in (("post", "/pause"), ("post", "/resume"), ("get", "/is_paused")):
            assert getattr(client, method)(route).status_code == 401
        key = {"Authorization": "Bearer k"}
        assert client.post("/pause?mode=keep", headers=key).json() == {"status": "paused"}
        assert client.get("/is_paused", headers=key).json() == {"is_paused": True}
        assert client.post("/resume", headers=key).json() == {"status": "resumed"}
        server.aengine.replicas = []  # (what parallel.serve_engine's data-parallel driver has)
        r = client.post("/pause", headers=key)
        assert r.status_code == 400 and "pause runs on a server of one engine" in r.json()["error"]["message"]


def test_serve_banner_lists_the_pause_routes(monkeypatch):
    """`infer serve`'s banner lists the pause routes (sleep mode's are listed when it is on)."""
    from typer.testing import CliRunner

    import infer.serve.app  # noqa: F401  (imported first: its own uvicorn_server stays the real one)
    from infer.cli.main import app
    from infer.serve import lifecycle
    from test_probes_session55_newcomer2 import _NoUvicorn
    monkeypatch.setattr(lifecycle, "uvicorn_server", lambda *a, **k: _NoUvicorn())
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--device", "cpu", "--max-model-len", "64",
                                   "--max-num-seqs", "2"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("infer: serving"))
    assert "pause: POST /pause?mode=abort, wait or keep, POST /resume, GET /is_paused" in line, line
