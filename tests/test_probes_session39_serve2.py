"""Probes of session 39 (serve, second part): vLLM's CORS options (--allowed-origins, --allowed-methods,
--allowed-headers as JSON lists, --allow-credentials) were missing, so a browser's preflight OPTIONS got a 405; and
vLLM V1's request metrics (inter-token latency, queue / prefill / decode / inference times, prompt and generation
token histograms, preemptions, prefix cache queries and hits) were not in /metrics."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.cli.main import app  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.errors import ConfigError  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.cors import CorsOptions, cors_options  # noqa: E402

runner = CliRunner()
KEY = "sekrit"
PAGE = "http://page.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4))


def _server(engine, **kw):
    return serve_in_thread(Server(AsyncEngine(engine), "tiny", **kw))


# ----------------------------------------------------------------------------------------------------- CORS
def test_a_preflight_is_answered_before_the_api_key_as_vllm_does(engine):
    with _server(engine, api_key=KEY) as base:
        r = httpx.options(f"{base}/v1/chat/completions", headers={**PREFLIGHT, "X-Request-Id": "pre-1"})
        assert r.status_code == 200, r.text  # was a 405
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["x-request-id"] == "pre-1"  # the echo middleware still wraps it
        # the real request still needs the key; its 401 carries the CORS header, so the page can read it
        r = httpx.post(f"{base}/v1/chat/completions", headers={"Origin": PAGE},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.post(f"{base}/v1/completions", headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"},
                       json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        assert 'infer:http_requests_total{route="/v1/chat/completions",status="401"} 1.0' in text
        assert 'infer:http_requests_total{route="/v1/completions",status="200"} 1.0' in text


def test_allowed_origins_limit_who_may_call(engine):
    cors = CorsOptions(allowed_origins=(PAGE,), allowed_methods=("POST",), allowed_headers=("content-type",),
                       allow_credentials=True)
    with _server(engine, cors=cors) as base:
        r = httpx.options(f"{base}/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers":
                                                             "content-type"})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == PAGE
        assert r.headers["access-control-allow-credentials"] == "true"
        other = httpx.options(f"{base}/v1/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = httpx.get(f"{base}/health", headers={"Origin": "http://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_serve_reads_the_cors_options(monkeypatch):
    seen = {}
    monkeypatch.setattr("infer.cli.serve._serve", lambda engine, *a, **kw: seen.update(**kw))
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0", "--allowed-origins", f'["{PAGE}"]',
                              "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["x-a"]',
                              "--allow-credentials"])
    assert res.exit_code == 0, res.output
    assert seen["cors"] == CorsOptions((PAGE,), ("GET", "POST"), ("x-a",), True)
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0"])
    assert res.exit_code == 0, res.output
    assert seen["cors"] == CorsOptions()  # vLLM's defaults: every origin, method and header, no credentials


@pytest.mark.parametrize("option", ["--allowed-origins", "--allowed-methods", "--allowed-headers"])
@pytest.mark.parametrize("value", ["http://a.example", '"*"', '["a", 1]', '{"a": 1}'])
def test_a_cors_value_not_a_json_list_of_strings_is_refused_naming_the_option(option, value, monkeypatch):
    monkeypatch.setattr("infer.cli.serve._serve", lambda *a, **kw: pytest.fail("served"))
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0", option, value])
    assert res.exit_code != 0 and option in res.output and "JSON list of strings" in res.output, res.output
    with pytest.raises(ConfigError, match=option):
        cors_options(*[value if o == option else '["*"]' for o in
                       ("--allowed-origins", "--allowed-methods", "--allowed-headers")], False)


def test_data_parallel_serving_gets_the_cors_options_too(monkeypatch):
    import types

    import infer.parallel.serve as ps
    seen = {}
    monkeypatch.setattr("infer.cli.serve_parallel.serve_data_parallel", lambda *a, **kw: seen.update(cli=kw["cors"]))
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0", "--data-parallel", "2", "--allowed-origins",
                              f'["{PAGE}"]'])
    assert res.exit_code == 0, res.output
    assert seen["cli"] == CorsOptions((PAGE,))

    class FakeServer:
        def __init__(self, aengine, model_id, **kw):
            seen.update(server=kw.get("cors"))
            self.metrics = types.SimpleNamespace(registry=types.SimpleNamespace(register=lambda c: None))
    monkeypatch.setattr("infer.serve.app.Server", FakeServer)
    monkeypatch.setattr("infer.models.resolve.resolve_model", lambda m: m)
    monkeypatch.setattr("infer.engine.setup.load_tokenizer", lambda *a: None)
    monkeypatch.setattr(ps, "start_replicas", lambda *a, **kw: ([], [{}]))
    monkeypatch.setattr("infer.parallel.serve_engine.RayAsyncEngine", lambda *a, **kw: None)
    monkeypatch.setattr("infer.parallel.serve_engine.ReplicaView", lambda *a: None)
    ps.build_server(types.SimpleNamespace(get=lambda refs: refs), EngineConfig("tiny-llama"), 2, "m", None, 8, 1.0,
                    cors=CorsOptions((PAGE,)))
    assert seen["server"] == CorsOptions((PAGE,))


# -------------------------------------------------------------------------------------------------- metrics
def _samples(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{base}/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):  # model_name and engine (vLLM's labels) left out
        for s in family.samples:
            labels = sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            key = s.name + (str(labels) if labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def _complete(base: str, prompt, n: int, stream: bool = False) -> int:
    body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True}} if stream else {"prompt": prompt, "max_tokens": n,
                                                                         "ignore_eos": True}
    if not stream:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    import json
    return json.loads(lines[-1][6:])["usage"]["prompt_tokens"]


def test_vllm_request_metrics_count_what_the_requests_did():
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4))
    prompt = list(range(5, 15))  # 10 tokens: a second run finds its first 8 (two whole blocks) cached
    made = [6, 1, 3, 4]
    with _server(engine) as base:
        before = _samples(base)
        assert before["infer:inter_token_latency_seconds_count"] == 0
        assert before["infer:prefix_cache_queries_total"] == 0 and before["infer:num_preemptions_total"] == 0
        prompts = [_complete(base, prompt, made[0]), _complete(base, prompt, made[1]),
                   _complete(base, "hello there", made[2], stream=True), _complete(base, [7, 8, 9], made[3])]
        m = _samples(base)
    assert prompts[:2] == [10, 10]
    n = len(made)
    assert m["infer:request_prompt_tokens_count"] == n and m["infer:request_prompt_tokens_sum"] == sum(prompts)
    assert m["infer:request_generation_tokens_count"] == n and m["infer:request_generation_tokens_sum"] == sum(made)
    assert m["infer:inter_token_latency_seconds_count"] == sum(k - 1 for k in made)
    assert m["infer:request_time_per_output_token_seconds_count"] == sum(k > 1 for k in made)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert m[f"infer:request_{phase}_time_seconds_count"] == n
    # each is a difference of the engine's timestamps: they add up
    assert m["infer:inter_token_latency_seconds_sum"] == pytest.approx(m["infer:request_decode_time_seconds_sum"])
    assert m["infer:request_inference_time_seconds_sum"] == pytest.approx(
        m["infer:request_prefill_time_seconds_sum"] + m["infer:request_decode_time_seconds_sum"])
    assert m["infer:request_inference_time_seconds_sum"] > 0
    # every prompt looked up once (nothing was preempted); the repeated prompt found two blocks
    assert m["infer:num_preemptions_total"] == 0
    assert m["infer:prefix_cache_queries_total"] == sum(prompts)
    assert m["infer:prefix_cache_hits_total"] == 8
    assert m["infer:generation_tokens_total"] == sum(made)


def test_preemptions_show_in_metrics():
    import concurrent.futures
    import time
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, num_kv_blocks=10, max_model_len=40))
    real, deadline, started = engine.step, time.monotonic() + 60, []

    def step():  # no step before the four requests are in: their growth together is what preempts (sent over HTTP
        # from four threads, on a loaded machine one could finish before the last arrived, and none was preempted)
        if not started and engine.get_num_unfinished_requests() < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
            return []
        started.append(True)
        return real()
    engine.step = step
    with _server(engine) as base:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: _complete(base, [10 + i] * 6, 14), range(4)))
        m = _samples(base)
    assert engine.stats()["num_preemptions"] > 0
    assert 0 < m["infer:num_preemptions_total"] <= engine.stats()["num_preemptions"]  # a scrape sees the last snapshot
    assert m["infer:prefix_cache_queries_total"] == engine.block_manager.prefix_queries == 4 * 6  # first admissions
    assert m["infer:inter_token_latency_seconds_count"] == 4 * 13


def test_inter_token_latency_from_outputs_read_step_by_step_or_shipped_whole():
    """A replica's outputs come pickled (their lists read): the same latencies as the engine's lazy ones."""
    from prometheus_client.parser import text_string_to_metric_families

    from infer.engine.outputs import RequestOutput
    from infer.serve.metrics import ServerMetrics
    metrics, counted = ServerMetrics(lambda: {}, max_model_len=64), {}
    times = [10.0, 10.5, 11.5, 13.5]
    for k in (1, 3, 4):  # the second output brings two tokens at once
        out = RequestOutput("r", [1, 2], token_ids=list(range(k)), token_times=times[:k], arrival_time=9.0,
                            first_token_time=10.0, first_scheduled_time=9.5, finished=k == 4,
                            finish_reason="length" if k == 4 else None, finished_time=13.5)
        metrics.observe_output(out, 9.0, counted)
    metrics.observe_finished(out, 9.0, 14.0)
    m = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert m["infer:inter_token_latency_seconds_count"] == 3 and m["infer:inter_token_latency_seconds_sum"] == 3.5
    assert m["infer:request_queue_time_seconds_sum"] == 0.5 and m["infer:request_prefill_time_seconds_sum"] == 0.5
    assert m["infer:request_decode_time_seconds_sum"] == 3.5 and m["infer:request_inference_time_seconds_sum"] == 4.0
    assert m["infer:request_time_per_output_token_seconds_sum"] == pytest.approx(3.5 / 3)
