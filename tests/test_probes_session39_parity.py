"""Probes of vLLM parity, session 39: a tool whose function.parameters is null (a function without parameters,
which vLLM and OpenAI's SDK accept) was a 400; a forced tool call or response_format combined with min_tokens (or
another field a constraint cannot run with) was refused in the words of structured_outputs, a field the client never
sent."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

from test_probes_session38_serve import base, engine  # noqa: E402,F401 (the tiny server, per module)

MESSAGES = [{"role": "user", "content": "hi"}]
NAMED = {"type": "function", "function": {"name": "ping"}}


@pytest.mark.parametrize("tool_choice", ["none", "required", NAMED])
def test_a_tool_whose_parameters_are_null_is_a_function_without_parameters(base, tool_choice):
    tools = [{"type": "function", "function": {"name": "ping", "description": "no arguments", "parameters": None}}]
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 24, "tools": tools,
                                                         "tool_choice": tool_choice}, timeout=60)
    assert r.status_code == 200, r.text
    if tool_choice == NAMED:
        call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "ping" and call["arguments"].startswith("{")


@pytest.mark.parametrize("tool_choice, words", [(NAMED, "tool_choice (function 'ping')"),
                                                 ("required", "tool_choice 'required'")])
@pytest.mark.parametrize("field, value", [("min_tokens", 4), ("ignore_eos", True)])
def test_a_forced_tool_call_that_conflicts_names_tool_choice(base, tool_choice, words, field, value):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, "tools": tools,
                                                         "tool_choice": tool_choice, field: value}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice"
    assert "structured_outputs" not in error["message"]
    assert error["message"].startswith(f"{words} cannot be combined with {field}")


def test_response_format_that_conflicts_names_response_format(base):
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, "min_tokens": 2,
                                                         "response_format": {"type": "json_object"}}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert error["message"].startswith("response_format cannot be combined with min_tokens"), error["message"]


# ----------------------------------------------------------------------------- --served-model-name A B (vLLM nargs +)
@pytest.mark.parametrize("args, names", [
    (["tiny-llama", "--served-model-name", "a", "b"], ["a", "b"]),
    (["tiny-llama", "--served-model-name", "a", "b", "--port", "0"], ["a", "b"]),
    (["--served-model-name", "a", "b", "tiny-llama", "--port", "0"], ["a", "b"]),
    (["--served-model-name", "a", "tiny-llama"], ["a"]),
    (["tiny-llama", "--served-model-name", "a", "--served-model-name", "b", "--served-model-name", "a"], ["a", "b"]),
    (["tiny-llama"], ["tiny-llama"]),
])
def test_serve_takes_several_served_model_names(monkeypatch, args, names):
    from typer.testing import CliRunner

    from infer.cli.main import app
    seen = {}
    monkeypatch.setattr("infer.cli.serve._serve", lambda cfg, sock, host, ids, *a, **k: seen.update(ids=ids,
                                                                                                   model=cfg.model))
    if "--port" not in args:
        args = [*args, "--port", "0"]
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 0, result.output
    assert seen == {"ids": names, "model": "tiny-llama"}


def test_a_server_with_several_ids_answers_to_each_and_lists_them(engine):
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=8), ["first", "second"])) as url:
        cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [c["id"] for c in cards] == ["first", "second"]
        for model, reported in (("second", "second"), ("first", "first"), (None, "first")):
            body = {"prompt": "hi", "max_tokens": 2, **({"model": model} if model else {})}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == reported
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "third"}, timeout=60)
        assert r.status_code == 404 and "first, second" in r.json()["error"]["message"], r.text


# ----------------------------------------------------------------------------- load_inplace (vLLM's LoRA reload)
LORA_N = 8
LONG_PROMPT = [(7 * i + 3) % 200 + 5 for i in range(40)]  # more than two full KV blocks: the prefix cache keys them


@pytest.fixture(scope="module")
def lora_paths(tmp_path_factory):
    from lora_helpers import PeftOracle, three_adapters
    hf, paths = three_adapters(tmp_path_factory.mktemp("inplace"), 20, "ab")
    return paths, PeftOracle(hf, paths)


def test_a_replaced_adapter_serves_new_requests_and_finishes_old_ones_with_the_old_weights(lora_paths):
    from infer import LLM, SamplingParams
    paths, oracle = lora_paths
    params = SamplingParams(max_new_tokens=LORA_N, ignore_eos=True)
    short = [9, 10, 11]
    with LLM("tiny-llama", enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256,
             max_num_seqs=1) as llm:
        llm.add_lora("x", str(paths["a"]))
        assert llm.generate([LONG_PROMPT], params, lora="x")[0].token_ids == oracle.greedy("a", LONG_PROMPT, LORA_N)
        stream = llm.stream([LONG_PROMPT, short], params, lora=["x", "x"])
        next(stream)  # the first runs, the second waits (max_num_seqs=1): both were added before the replacement
        with pytest.raises(Exception, match="already loaded"):
            llm.add_lora("x", str(paths["b"]))
        llm.add_lora("x", str(paths["b"]), replace=True)
        assert llm.list_loras() == ["x"]
        new = llm.generate([LONG_PROMPT], params, lora="x")[0]  # its prompt's blocks are cached with a's K/V
        assert new.token_ids == oracle.greedy("b", LONG_PROMPT, LORA_N)
        old = {i: out for i, _, out in stream if out.finished}
        assert old[0].token_ids == oracle.greedy("a", LONG_PROMPT, LORA_N)
        assert old[1].token_ids == oracle.greedy("a", short, LORA_N)
        assert old[0].lora == old[1].lora == new.lora == "x"
        assert llm.generate([short], params, lora="x")[0].token_ids == oracle.greedy("b", short, LORA_N)
        manager = llm.engine.lora_manager
        assert not manager.retired() and list(manager.cpu_resident()) == ["x"]  # the old weights are freed


def test_load_inplace_on_the_server(lora_paths):
    paths, _ = lora_paths
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=2, enable_lora=True, max_lora_rank=8))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", runtime_lora=True)) as url:
        def load(name, path, **kw):
            return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **kw},
                              timeout=60)

        def reply(model):
            body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        assert load("x", paths["a"]).status_code == 200
        assert load("y", paths["b"]).status_code == 200
        first, other = reply("x"), reply("y")
        assert first != other
        r = load("x", paths["b"])
        assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"], r.text
        r = load("x", paths["b"], load_inplace="yes")
        assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace", r.text
        assert load("x", paths["b"], load_inplace=True).status_code == 200
        assert reply("x") == other
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=60).json()["data"]] == ["tiny", "x", "y"]


def _fake_data_parallel(answers, loaded):
    """A RayAsyncEngine's adapter calls over fake replicas (no Ray, no driver thread): replica i answers add_lora
    with answers[i] (None: loaded, a dict: its error); `loaded`: the names every replica has already."""
    ray = pytest.importorskip("ray")
    from types import SimpleNamespace

    from infer.parallel.serve_engine import RayAsyncEngine, _Adapters, _Replica
    calls = []

    def replica(i, answer):
        add = SimpleNamespace(remote=lambda *args: calls.append(("add", i, *args)) or answer)
        remove = SimpleNamespace(remote=lambda name: calls.append(("remove", i, name)) or 0)
        return _Replica(i, SimpleNamespace(add_lora=add, remove_lora=remove), {"host": f"host{i}"})

    async def on_driver(fn):
        return fn(eng)
    eng, adapters = RayAsyncEngine.__new__(RayAsyncEngine), _Adapters(list(loaded))
    eng.ray = SimpleNamespace(get=lambda value: value, exceptions=ray.exceptions)
    eng._lora_changes, eng._call, eng._send = None, on_driver, lambda flush: calls.append(("sent",))
    eng.replicas = [replica(i, a) for i, a in enumerate(answers)]
    eng.engine = SimpleNamespace(lora_slots=lambda: adapters)
    return eng, adapters, calls


def test_load_inplace_with_data_parallel_replaces_on_every_replica_after_the_requests_sent():
    import asyncio

    from infer.errors import LoRAError, LoRANameError
    eng, adapters, calls = _fake_data_parallel([None, None], ["sql"])
    with pytest.raises(LoRANameError, match="already loaded"):
        asyncio.run(eng.add_lora("sql", "/srv/sql2"))
    asyncio.run(eng.add_lora("sql", "/srv/sql2", replace=True))
    assert adapters.has("sql")
    assert calls == [("sent",), ("add", 0, "sql", "/srv/sql2", True), ("add", 1, "sql", "/srv/sql2", True)]
    # one replica cannot read the new folder: the other has no old weights left, so no replica serves the name
    eng, adapters, calls = _fake_data_parallel([None, {"message": "no adapter_config.json in /srv/sql3"}], ["sql"])
    with pytest.raises(LoRAError, match="replica 1 .*no adapter_config.json.*'sql' is no longer served"):
        asyncio.run(eng.add_lora("sql", "/srv/sql3", replace=True))
    assert not adapters.has("sql")
    assert [c for c in calls if c[0] == "remove"] == [("remove", 0, "sql"), ("remove", 1, "sql")]
