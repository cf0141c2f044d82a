"""vLLM benchmark_serving metrics on synthetic timestamps, checked against hand-computed answers."""

import math

import pytest

from infer.bench.metrics import RequestRecord, RunResult, compute_metrics


def _records():
    return [
        # ttft 0.1, e2el 0.6, tpot (0.6 - 0.1) / 2 = 0.25, itl [0.2, 0.3]
        RequestRecord(0, prompt_tokens=10, send_time=0.0, chunk_times=[0.1, 0.3, 0.6], output_tokens=3,
                      text="abcd", success=True),
        # one token: ttft 0.5, e2el 0.5, no tpot, no itl
        RequestRecord(1, prompt_tokens=5, send_time=1.0, chunk_times=[1.5], output_tokens=1, text="xy",
                      success=True),
        # failed: counts nowhere but in "failed"
        RequestRecord(2, prompt_tokens=7, send_time=0.0, chunk_times=[9.0], output_tokens=1, text="zzzz",
                      success=False, error="boom"),
    ]


def test_counts_and_throughput():
    m = compute_metrics(_records(), duration_s=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 15 and m["total_output_tokens"] == 4
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.0)
    assert m["total_token_throughput"] == pytest.approx(9.5)
    assert m["chars_per_s"] == pytest.approx(3.0)
    assert m["mean_reply_chars"] == pytest.approx(3.0)


def test_latency_percentiles():
    m = compute_metrics(_records(), duration_s=2.0)
    expected = {
        "ttft": dict(mean=300, median=300, std=200, p90=460, p99=496),
        "tpot": dict(mean=250, median=250, std=0, p90=250, p99=250),
        "itl": dict(mean=250, median=250, std=50, p90=290, p99=299),
        "e2el": dict(mean=550, median=550, std=50, p90=590, p99=599),
    }
    for name, stats in expected.items():
        for stat, value in stats.items():
            assert m[f"{stat}_{name}_ms"] == pytest.approx(value), f"{stat}_{name}_ms"


def test_tpot_uses_token_count_not_chunk_count():
    # an HTTP stream may carry several tokens per chunk: TPOT divides by output tokens - 1
    r = RequestRecord(0, prompt_tokens=3, send_time=0.0, chunk_times=[0.1, 0.2], output_tokens=5, success=True)
    m = compute_metrics([r], duration_s=1.0)
    assert m["mean_tpot_ms"] == pytest.approx(25.0)
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(200.0)


def test_custom_percentiles_and_empty():
    m = compute_metrics([], duration_s=1.0, percentiles=(50, 99.9))
    assert m["completed"] == 0 and m["failed"] == 0
    assert m["p50_ttft_ms"] == 0 and m["p99.9_itl_ms"] == 0 and m["mean_e2el_ms"] == 0


def test_run_result_memory_and_dict():
    run = RunResult("infer", 4, _records(), duration_s=2.0, num_requests=3, peak_rss_bytes=100)
    assert run.peak_memory_bytes == 100
    run.peak_gpu_bytes = 7
    assert run.peak_memory_bytes == 7
    d = run.to_dict()
    assert d["request_rate"] is None and len(d["records"]) == 3
    assert run.metrics()["completed"] == 2
    assert math.isinf(run.request_rate)
