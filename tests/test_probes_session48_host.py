"""Session 48, host work per step: the step_overhead bench's --adapters."""

from __future__ import annotations

import pytest


def test_step_overhead_runs_requests_with_mixed_adapters(tmp_path):
    from infer.bench import step_overhead
    loras = step_overhead.write_adapters("tiny-llama", 2, tmp_path)
    engine = step_overhead.build_engine("tiny-llama", 3, "cpu", None, 256, loras)
    step_overhead.start_requests(engine, 3, 8, adapters=list(loras))
    assert [s.lora_name for s in engine.scheduler.running] == ["lora0", "lora1", "lora0"]
    assert engine.lora_manager.max_loras == 2


def test_step_overhead_adapters_option_reaches_the_run(monkeypatch):
    from infer.bench import step_overhead
    seen = []
    monkeypatch.setattr(step_overhead, "run_one", lambda *a: seen.append(a) or {})
    step_overhead.main(["--concurrency", "4", "--adapters", "3"])
    assert seen and seen[0][-1] == 3
    with pytest.raises(SystemExit):
        step_overhead.main(["--adapters", "-1"])
