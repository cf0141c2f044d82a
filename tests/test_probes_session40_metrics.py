"""Probes of /metrics and the model ids against vLLM's (session 40): vLLM labels every engine metric with model_name
(the served model's first id) and engine, so a dashboard built for vLLM filters on them, and shows its finished
reasons from the start."""

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
                  "infer:request_prompt_tokens", "infer:request_generation_tokens")


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
