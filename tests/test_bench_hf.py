"""HF generate baseline: static left-padded batches give each request the greedy tokens of an unpadded run."""

import pytest

from infer.bench.datasets import BenchRequest
from infer.bench.hf_baseline import StepClock, load_hf, run_hf_generate
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


def test_static_batches_match_unpadded_greedy(path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [[5, 9, 11, 40, 41], [7, 8], [100, 3, 200, 17], [300, 301, 302]]
    lens = [3, 6, 4, 2]
    reqs = [BenchRequest(None, p, n, ignore_eos=True) for p, n in zip(prompts, lens)]
    res = run_hf_generate(path, reqs, batch_size=3, progress=False)
    assert res.backend == "hf" and res.concurrency == 3 and not res.partial
    assert [r.index for r in res.records] == [0, 1, 2, 3]
    first_batch_start = res.records[0].send_time
    for r, p, n in zip(res.records, prompts, lens):
        assert r.success and r.output_tokens == n and len(r.chunk_times) == n and r.prompt_tokens == len(p)
        assert r.text == tok.decode(hf_greedy(path, p, n), skip_special_tokens=True)
    # batch 1 = requests 0..2 sent together; request 3 is sent when batch 1 is done
    assert res.records[1].send_time == first_batch_start == res.records[2].send_time
    assert res.records[3].send_time >= max(r.chunk_times[-1] for r in res.records[:3])
    m = res.metrics()
    assert m["completed"] == 4 and m["total_output_tokens"] == sum(lens) and m["mean_ttft_ms"] > 0
    assert res.peak_rss_bytes > 0 and res.timeline


def test_eos_respected_when_not_ignored(path):
    hf = load_hf(path, dtype="float32", device="cpu")
    res = run_hf_generate(hf, [BenchRequest(None, [5, 9, 11], 30, ignore_eos=False)], batch_size=1,
                          progress=False)
    r = res.records[0]
    assert r.success and 1 <= r.output_tokens <= 30 and len(r.chunk_times) == r.output_tokens
    assert r.finish_reason in ("stop", "length")


def test_step_clock_skips_prompt():
    c = StepClock()
    c.put("prompt")
    c.put("t1")
    c.put("t2")
    c.end()
    assert len(c.times) == 2 and c.times[0] <= c.times[1]
