"""Probes of session 42: `infer serve` as an operator deploys it (keys from the environment, signals, proxies).

An --api-key read with a trailing newline (a key file, a Kubernetes secret made with `echo`) could never match: the
client's token is stripped (and a header value cannot hold a newline), the server's key was not, so every request
was a 401; a key with a character outside ASCII was taken, though no client can send it in a header."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.cli.main import app  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=256, block_size=4, max_num_seqs=4))


def _server(engine, **kw):
    return serve_in_thread(Server(AsyncEngine(engine, max_queue=64), "tiny", **kw))


# ------------------------------------------------------------------------------------------------ the API key
@pytest.mark.parametrize("key", ["secret\n", " secret", "secret\r\n"])
def test_a_key_read_with_surrounding_whitespace_still_authenticates(engine, key):
    with _server(engine, api_key=key) as base:
        ok = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200, ok.text  # was a 401 for every request
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer other"}).status_code == 401
        assert httpx.get(f"{base}/v1/models").status_code == 401


@pytest.mark.parametrize("key", ["sécret", "sec\x07ret", "clé-🔑"])
def test_a_key_no_header_can_carry_is_refused_at_start(monkeypatch, key):
    monkeypatch.setattr("infer.cli.serve._serve", lambda *a, **kw: pytest.fail("the server started"))
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0"], env={"INFER_API_KEY": key})
    assert res.exit_code == 2, res.output
    assert "--api-key" in res.output and "header" in res.output


# ------------------------------------------------------------------------------------ vLLM's server options
@pytest.mark.parametrize("argv, words", [
    (["--enable-request-id-headers"], "always sends a request's X-Request-Id header back"),  # was: --allowed-headers?
    (["--uds", "/tmp/infer.sock"], "listens on TCP"),
    (["--disable-fastapi-docs"], "no /docs"),
    (["--api-server-count", "2"], "--data-parallel"),
    (["--ssl-cert-reqs", "2"], "TLS"),
    (["--max-log-len", "100"], "logs no request contents"),
    (["--h11-max-header-count", "64"], "--max-body-size"),
    (["--middleware", "my.mod.Middleware"], "proxy"),
])
def test_vllms_server_options_say_what_to_do_instead(argv, words):
    result = runner.invoke(app, ["serve", "tiny-llama", *argv])
    assert result.exit_code == 2, result.output
    assert f"{argv[0]} is vLLM's option" in result.output and words in result.output, result.output


# ------------------------------------------------------------------------------------ several keys, as vLLM's
def _served_keys(monkeypatch, *argv, env=None):
    seen = {}
    monkeypatch.setattr("infer.cli.serve._serve", lambda engine, sock, host, ids, api_key, *a, **kw:
                        seen.update(api_key=api_key))
    for name in ("INFER_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0", *argv], env=env)
    assert res.exit_code == 0, res.output
    return seen["api_key"]


def test_api_key_takes_several_keys_as_vllms(monkeypatch):
    assert _served_keys(monkeypatch, "--api-key", "old", "new") == ["old", "new"]  # was: an unexpected argument
    assert _served_keys(monkeypatch, "--api-key", "old", "--api-key", "new") == ["old", "new"]
    assert _served_keys(monkeypatch, "--api-key", "k") == "k"
    # a variable holds one key, whole: not one key per word
    assert _served_keys(monkeypatch, env={"INFER_API_KEY": "pass phrase"}) == "pass phrase"
    assert _served_keys(monkeypatch, env={"VLLM_API_KEY": "v"}) == "v"


def test_every_key_of_several_is_accepted(engine):
    with _server(engine, api_key=["old", "new\n"]) as base:
        for key, status in (("old", 200), ("new", 200), ("other", 401), ("oldnew", 401)):
            r = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == status, (key, r.text)
        assert httpx.get(f"{base}/v1/models").status_code == 401


# ------------------------------------------------------------------------------------------------ --host
def test_an_ipv6_host_in_brackets_is_bound_and_named_as_a_url_writes_it():
    import socket

    from infer.cli.serve import _bind
    from infer.errors import ConfigError
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        busy = _bind("[::1]", 0)  # was: "cannot listen on [::1]:0: Name or service not known"
    except ConfigError as e:
        if "Name or service" in str(e) or "Cannot assign" in str(e):
            raise
        pytest.skip(f"no IPv6 loopback here: {e}")
    with busy:
        assert busy.family == socket.AF_INET6
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError) as e:
            _bind("::1", port)
        assert f"cannot listen on [::1]:{port}:" in str(e.value)  # was: ::1:PORT


# ------------------------------------------------------------------------------------------------ logs
def test_vllms_uvicorn_log_level_trace_is_taken(monkeypatch):
    seen = {}
    monkeypatch.setattr("infer.cli.serve._serve", lambda engine, sock, host, ids, key, queue, timeout, log_level, *a,
                        **kw: seen.update(log_level=log_level))
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0", "--uvicorn-log-level", "trace"])
    assert res.exit_code == 0, res.output  # was: "--log-level 'trace' is not one of ..."
    assert seen["log_level"] == "trace"


def test_a_500_is_logged_with_the_clients_request_id(engine, monkeypatch, caplog):
    server = Server(AsyncEngine(engine, max_queue=64), "tiny")

    def broken(model):
        raise KeyError("simulated bug")
    monkeypatch.setattr(server, "lora_for", broken)
    with serve_in_thread(server) as base, caplog.at_level("ERROR", logger="infer.serve"):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"X-Request-Id": "req-42"}, timeout=60)
    assert r.status_code == 500 and r.headers["x-request-id"] == "req-42"
    logged = [rec.getMessage() for rec in caplog.records if "unhandled error" in rec.getMessage()]
    assert logged and "req-42" in logged[0], logged  # was: only the method and path, nothing to match the client's


def test_a_blank_key_given_to_the_server_lets_no_one_in(engine):
    with _server(engine, api_key=["  ", "k"]) as base:
        for header in ({"Authorization": "Bearer"}, {"Authorization": "bearer"}, {}):
            assert httpx.get(f"{base}/v1/models", headers=header).status_code == 401, header
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


# ------------------------------------------------------------------------------------------------ /health
def test_health_is_503_while_every_engine_step_fails_and_ok_again_after(engine, monkeypatch):
    """A device that fails every step (a CUDA error poisons its context) made every request a 500 while /health said
    ok, so no orchestrator restarted the server (vLLM's /health is a 503 once its engine is dead)."""
    def broken(batch):
        raise RuntimeError("simulated lost device")
    with _server(engine) as base:
        monkeypatch.setattr(engine.runner, "run", broken)
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
        assert r.status_code == 500
        assert httpx.get(f"{base}/health").status_code == 200  # one failed step: not yet a dead engine
        for prompt in ("b", "c"):
            assert httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                              timeout=60).status_code == 500
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503, r.text
        assert "simulated lost device" in r.json()["error"] and "restart" in r.json()["error"]
        monkeypatch.undo()  # the device is back: a step that runs makes the engine healthy again
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "d", "max_tokens": 2},
                          timeout=60).status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200
