"""Probes of the fifty-fourth session's fourth review of sleep mode: what a request in flight sees when the engine is
put to sleep, and other cases the first probes left out."""

from __future__ import annotations

import json
import threading
import time

import pytest

from infer.models.tiny import ensure_builtin


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


def _server(path, **kw):
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(path, block_size=4, max_model_len=512, max_num_seqs=2, enable_sleep_mode=True,
                                    **kw))
    return engine, Server(AsyncEngine(engine), "tiny")


def _until(cond, timeout=60.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_stream_open_at_post_sleep_ends_with_finish_reason_abort(path):
    """POST /sleep while an SSE stream runs: the stream ends with a chunk of finish_reason "abort", then [DONE], as
    vLLM's; it said "the server shut down before the request finished" (503 server_shutting_down), which it did
    not. A whole (not streamed) completion in flight gets a 503 engine_sleeping naming the sleep, not a shutdown."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.serve.app import serve_in_thread
    engine, server = _server(path)
    body = {"model": "tiny", "prompt": [5, 9, 13], "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with serve_in_thread(server) as url:
        lines = []

        def read():
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        t = threading.Thread(target=read)
        t.start()
        _until(lambda: len(lines) >= 2 or not t.is_alive())
        assert httpx.post(f"{url}/sleep?level=1", timeout=60).status_code == 200
        t.join(60)
        assert not t.is_alive() and lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: "):])
        assert "error" not in last, last
        assert last["choices"][0]["finish_reason"] == "abort"
        assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200

        whole = {}
        t = threading.Thread(target=lambda: whole.update(r=httpx.post(f"{url}/v1/completions", json=body, timeout=60)))
        t.start()
        _until(lambda: engine.num_steps > 0 and engine.has_unfinished_requests() or not t.is_alive())
        assert httpx.post(f"{url}/sleep?level=1", timeout=60).status_code == 200
        t.join(60)
        r = whole["r"]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_sleeping" and "sleep" in r.json()["error"]["message"]


def test_a_served_beam_search_refused_a_step_by_sleep_ends_as_aborted(path, monkeypatch):
    """A served beam search whose next step is refused because POST /sleep ran between two steps (SleepModeError
    from the engine's add) ends as the steps sleep aborted do (503 engine_sleeping), not as a 500 "beam search
    failed"."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.errors import SleepModeError
    from infer.serve.app import serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    _, server = _server(path)
    real, calls = AsyncEngine.add, []

    def add(self, *a, **kw):
        calls.append(1)
        if len(calls) > 1:  # the search's first step runs; the next is refused, as after a sleep
            raise SleepModeError("the engine is asleep", "wake it first: wake_up()")
        return real(self, *a, **kw)

    monkeypatch.setattr(AsyncEngine, "add", add)
    body = {"model": "tiny", "prompt": [5, 9, 13], "n": 2, "max_tokens": 4, "use_beam_search": True,
            "temperature": 0, "ignore_eos": True}
    with serve_in_thread(server) as url:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert len(calls) > 1
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_sleeping"


def test_collective_rpc_needs_sleep_mode(path):
    """POST /collective_rpc on a server started without --enable-sleep-mode is refused naming the flag (as /sleep
    is): any client could make it read its weights again (reload_weights) or hand out the model (get_model)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(path, block_size=4, max_model_len=64, max_num_seqs=2))
    reloads = []
    engine.reload_weights = lambda: reloads.append(1)
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as url:
        for method in ("reload_weights", "get_model"):
            r = httpx.post(f"{url}/collective_rpc", json={"method": method}, timeout=60)
            assert r.status_code == 400, r.text
            assert "--enable-sleep-mode" in r.json()["error"]["message"]
    assert not reloads


def test_wake_up_of_both_tags_after_one_wakes_the_other(path):
    """wake_up(["weights", "kv_cache"]) after wake_up(["weights"]) (and reload_weights) wakes the KV cache: it did
    nothing (a warning that the weights were awake) and the engine stayed asleep, refusing every request."""
    from infer import LLM, SamplingParams
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(path, block_size=4, max_model_len=64, enable_sleep_mode=True) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate([[5, 9, 13]], params)]
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(["weights", "kv_cache"])
        assert not llm.is_sleeping()
        assert [o.outputs[0].token_ids for o in llm.generate([[5, 9, 13]], params)] == want


@pytest.mark.parametrize("argv", [["--data-parallel", "2"], ["--ray-address", "auto"]])
def test_serve_refuses_sleep_mode_with_data_parallel_at_start(monkeypatch, argv):
    """`infer serve --enable-sleep-mode --data-parallel 2` (or --ray-address) is refused at start naming both: it
    started a server whose sleep routes all answer 400 (sleep mode runs one engine)."""
    pytest.importorskip("fastapi")
    from typer.testing import CliRunner
    from infer.cli.main import app
    monkeypatch.setattr("infer.cli.serve._serve", lambda *a, **kw: pytest.fail("the server started"))
    monkeypatch.setattr("infer.cli.serve_parallel.serve_data_parallel",
                        lambda *a, **kw: pytest.fail("the data-parallel server started"))
    monkeypatch.setattr("infer.parallel.runtime.check_local_replicas", lambda *a, **kw: None)
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--enable-sleep-mode", *argv])
    assert res.exit_code == 2, res.output
    assert "--enable-sleep-mode" in res.output and "--data-parallel" in res.output, res.output


def test_collective_rpc_refuses_arguments_a_worker_method_does_not_take(path):
    """collective_rpc("sleep", kwargs={"lvl": 1}) is a RequestError naming the method and what it takes (POST
    /collective_rpc: a 400); it raised the TypeError of the call (the server's 500 "internal server error")."""
    from infer import LLM
    from infer.errors import RequestError
    with LLM(path, block_size=4, max_model_len=64, enable_sleep_mode=True) as llm:
        with pytest.raises(RequestError, match="'sleep'.*lvl") as e:
            llm.collective_rpc("sleep", kwargs={"lvl": 1})
        assert "level" in e.value.hint
        with pytest.raises(RequestError, match="'is_sleeping'"):
            llm.collective_rpc("is_sleeping", args=(1, 2))
        assert not llm.is_sleeping()
        assert llm.collective_rpc("sleep", args=(1,)) == [None] and llm.is_sleeping()
