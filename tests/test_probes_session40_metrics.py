"""Probes of /metrics and the model ids against vLLM's (session 40): vLLM labels every engine metric with model_name
(the served model's first id) and engine, so a dashboard built for vLLM filters on them, and shows its finished
reasons from the start; vLLM's iteration_tokens_total histogram (tokens per engine step) was missing; with
--served-model-name, MODEL itself was still accepted as a request's `model`, where vLLM answers 404."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, max_num_batched_tokens=64))


def _families(base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}


def _value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    family = families[name]
    return sum(s.value for s in family.samples if s.name == (sample or name)
               and all(s.labels.get(k) == v for k, v in labels.items()))


ENGINE_METRICS = ("infer:num_requests_running", "infer:num_requests_waiting", "infer:kv_cache_usage_perc",
                  "infer:num_preemptions", "infer:prefix_cache_queries", "infer:prefix_cache_hits",
                  "infer:prompt_tokens", "infer:generation_tokens", "infer:request_finished",
                  "infer:time_to_first_token_seconds", "infer:e2e_request_latency_seconds",
                  "infer:inter_token_latency_seconds", "infer:request_time_per_output_token_seconds",
                  "infer:request_queue_time_seconds", "infer:request_prefill_time_seconds",
                  "infer:request_decode_time_seconds", "infer:request_inference_time_seconds",
                  "infer:request_prompt_tokens", "infer:request_generation_tokens", "infer:iteration_tokens_total")


def test_engine_metrics_carry_vllms_model_name_and_engine_labels(engine):
    with serve_in_thread(Server(AsyncEngine(engine), ["llama", "llama-int4"])) as base:
        r = httpx.post(f"{base}/v1/completions", json={"model": "llama-int4", "prompt": "hi", "max_tokens": 3,
                                                          "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        families = _families(base)
    for name in ENGINE_METRICS:
        samples = families[name].samples
        assert samples, name
        for s in samples:  # the first served id, as vLLM's served_model_name; one engine
            assert s.labels.get("model_name") == "llama" and s.labels.get("engine") == "0", (name, s)
    # vLLM's finished reasons are there from the start (a rate() works before the first abort)
    reasons = {s.labels["finished_reason"] for s in families["infer:request_finished"].samples}
    assert {"stop", "length", "abort"} <= reasons
    assert _value(families, "infer:request_finished", "infer:request_finished_total", finished_reason="length") == 1


def test_iteration_tokens_histogram_counts_the_tokens_of_every_step(engine):
    prompts = [list(range(5, 15)), list(range(20, 26))]  # 10 and 6 prompt tokens, no shared prefix
    made = 4
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as base:
        before = _families(base)
        steps_before = engine.stats()["num_steps"]
        r = httpx.post(f"{base}/v1/completions", json={"prompt": prompts, "max_tokens": made, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        after = _families(base)
    name = "infer:iteration_tokens_total"
    assert after[name].type == "histogram"
    buckets = sorted(float(s.labels["le"]) for s in after[name].samples if s.name == name + "_bucket")
    assert buckets[:4] == [1.0, 8.0, 16.0, 32.0] and buckets[-2] == 16384.0  # vLLM's buckets
    total = _value(after, name, name + "_sum") - _value(before, name, name + "_sum")
    # every token computed once: each prompt (no cache hit, no preemption) and every generated token but the last
    # (the last one is sampled, never fed back)
    assert total == sum(map(len, prompts)) + len(prompts) * (made - 1)
    steps = _value(after, name, name + "_count") - _value(before, name, name + "_count")
    assert made <= steps == engine.stats()["num_steps"] - steps_before  # one observation a step


def test_iteration_tokens_counts_a_step_per_observation():
    from infer.serve.metrics import ServerMetrics
    metrics = ServerMetrics(lambda: {}, max_model_len=64, model_name="m")
    for tokens in (3, 40, 1):
        metrics.iteration_tokens.observe(tokens)
    text = metrics.render().decode()
    assert 'infer:iteration_tokens_total_count{engine="0",model_name="m"} 3.0' in text
    assert 'infer:iteration_tokens_total_sum{engine="0",model_name="m"} 44.0' in text


def test_served_model_names_replace_model_itself_as_vllm_does(engine):
    body = {"prompt": "hi", "max_tokens": 1}
    with serve_in_thread(Server(AsyncEngine(engine), ["a", "b"])) as base:
        r = httpx.post(f"{base}/v1/completions", json={**body, "model": "tiny-llama"}, timeout=60)
        assert r.status_code == 404, r.text  # was 200: MODEL was accepted beside the served names
        assert r.json()["error"]["code"] == "model_not_found" and "a, b" in r.json()["error"]["message"]
        for name in ("a", "b"):
            assert httpx.post(f"{base}/v1/completions", json={**body, "model": name}, timeout=60).status_code == 200


def test_model_as_given_is_still_an_id_when_served_under_its_folder_name(engine, monkeypatch):
    import types

    from infer.serve import protocol as p
    default, named = Server(AsyncEngine(engine), "tiny-llama"), Server(AsyncEngine(engine), ["a", "b"])
    monkeypatch.setattr(engine, "config", types.SimpleNamespace(model="/models/tiny-llama/"))
    assert default.lora_for("/models/tiny-llama/") is None  # vLLM's id without --served-model-name: the base
    assert default.lora_for("tiny-llama") is None
    with pytest.raises(p.ApiError) as e:
        named.lora_for("/models/tiny-llama/")
    assert e.value.status == 404


def _bounds(text: str, name: str) -> list[float]:
    from prometheus_client.parser import text_string_to_metric_families
    return sorted(float(s.labels["le"]) for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == name + "_bucket" and s.labels["le"] != "+Inf")


def test_latency_histograms_reach_as_high_as_vllms():
    """TTFT stopped at 10 s and the request latency at 60 s: a p99 of a loaded server read 10 s (60 s) however long
    requests waited, where vLLM's buckets reach 2560 s (7680 s)."""
    from infer.serve.metrics import ServerMetrics
    metrics = ServerMetrics(lambda: {}, max_model_len=64, model_name="m")
    metrics.ttft.observe(30.0)
    metrics.e2e.observe(300.0)
    text = metrics.render().decode()
    ttft, e2e = _bounds(text, "infer:time_to_first_token_seconds"), _bounds(text, "infer:e2e_request_latency_seconds")
    vllm_ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0, 160.0, 640.0, 2560.0]
    vllm_e2e = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0]
    assert set(vllm_ttft) <= set(ttft) and set(vllm_e2e) <= set(e2e)
    assert 'infer:time_to_first_token_seconds_bucket{engine="0",le="40.0",model_name="m"} 1.0' in text
    assert 'infer:e2e_request_latency_seconds_bucket{engine="0",le="480.0",model_name="m"} 1.0' in text


def test_finished_requests_are_counted_under_vllms_request_success_name_too(engine):
    """vLLM's dashboards and alerts read vllm:request_success_total{finished_reason}; infer only had
    request_finished_total."""
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as base:
        body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True, "n": 2}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        families = _families(base)
    assert families["infer:request_success"].type == "counter"
    for reason, count in (("length", 2), ("stop", 0), ("abort", 0)):
        for name in ("infer:request_success", "infer:request_finished"):
            assert _value(families, name, name + "_total", finished_reason=reason, model_name="tiny") == count


def test_data_parallel_metrics_carry_the_labels_and_every_replicas_steps():
    """--data-parallel 2: the driver observes each replica's step tokens, each replica has its own series (label
    engine, as vLLM's data-parallel engines), and they add up to the requests' tokens."""
    ray = pytest.importorskip("ray")
    from infer.parallel.serve import build_server
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2 ** 20, logging_level="ERROR")
    try:
        srv, _ = build_server(ray, EngineConfig("tiny-llama", max_model_len=128, max_num_seqs=4), 2, ["llama"],
                              api_key=None, max_queue=64, shutdown_timeout=5)
        prompts = [[5, 17, 99, 230, 41, 7], [8, 9, 10], [300, 301, 302, 303], [42] * 5]
        with serve_in_thread(srv) as base:
            r = httpx.post(f"{base}/v1/completions", json={"prompt": prompts, "max_tokens": 3, "ignore_eos": True},
                           timeout=120)
            assert r.status_code == 200, r.text
            families = _families(base)
    finally:
        ray.shutdown()
    name = "infer:iteration_tokens_total"
    assert _value(families, name, name + "_sum", model_name="llama") == sum(map(len, prompts)) + 4 * 2
    for engine in ("0", "1"):  # two requests each (the driver sends a request to the replica with fewest in flight)
        assert _value(families, name, name + "_sum", model_name="llama", engine=engine) > 0
        assert _value(families, "infer:request_success", "infer:request_success_total", finished_reason="length",
                      engine=engine) == 2
    assert _value(families, "infer:prompt_tokens", "infer:prompt_tokens_total", model_name="llama") == 18
    assert _value(families, "infer:request_success", "infer:request_success_total", finished_reason="length") == 4


def test_an_iteration_without_a_step_observes_no_step_tokens(engine):
    """The engine thread also wakes for an abort or an adapter change when nothing runs: no step, so no
    observation (it observed the previous step's tokens again)."""
    from infer.engine.sampling_params import SamplingParams
    aengine, seen = AsyncEngine(engine), []
    aengine.on_step = seen.append
    engine.add_request("probe-steps", [5, 6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        aengine._iteration([], [])
    assert sum(seen) == 3 + 1  # the prompt, then the first token fed back
    aengine._iteration([], ["gone"])  # an abort of a request that already ended, nothing running
    aengine._iteration([], [])
    assert sum(seen) == 3 + 1
