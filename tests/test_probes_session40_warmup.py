"""Probes of the fortieth session: `infer warmup`'s figures against what an engine start with the same options
allocates (its budget, the weights an estimate counts), its defaults and the vLLM spellings of its memory options."""

from __future__ import annotations

from infer.cli.warmup_plan import measured_plan
from infer.engine.config import EngineConfig
from infer.engine.setup import load_engine_parts


def test_the_default_cpu_budget_is_the_one_an_engine_start_reads(monkeypatch):
    """Without --memory-limit a CPU's budget is half the free RAM plus the weights. An engine start adds the
    weights it holds; warmup added the growth of the resident memory over the load, which also held the ~100 MB of
    torch modules a first model build imports: it planned with a budget the engine never had (more KV blocks)."""
    from infer.memory import meter, plan as memory_plan
    monkeypatch.setattr(memory_plan, "available_cpu_memory", lambda: 64 << 20)
    grown = iter(range(0, 1 << 40, 100 << 20))  # each reading 100 MB above the one before
    monkeypatch.setattr(meter, "resident_bytes", lambda device: next(grown))
    kw = dict(model="tiny-llama", max_num_seqs=2, max_model_len=256)
    plan, extra = measured_plan(EngineConfig(**kw), 256, 2)
    engine = load_engine_parts(EngineConfig(**kw)).memory_plan
    assert extra["weights_resident_bytes"] == 100 << 20
    assert plan.budget_bytes == engine.budget_bytes == (32 << 20) + engine.weights_bytes


def test_the_resident_weights_figure_holds_no_library_code():
    """`weights_resident_bytes` (--json) was ~100 MB for a 1 MB model in a fresh process: building a model on the
    meta device imports torch._dynamo at its first init, after warmup had warmed the math libraries."""
    import json
    import os
    import subprocess
    import sys
    code = ("import json\nfrom infer.cli.warmup_plan import measured_plan\n"
            "from infer.engine.config import EngineConfig\n"
            "cfg = EngineConfig(model='tiny-llama', max_num_seqs=1, max_model_len=64, memory_limit='64MB')\n"
            "p, x = measured_plan(cfg, 64, 1)\nprint(json.dumps([x['weights_resident_bytes'], p.weights_bytes]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=120)
    resident, weights = json.loads(out.stdout.strip().splitlines()[-1])
    assert resident < weights + (30 << 20)


def test_without_max_length_a_model_of_a_shorter_context_is_warmed_up_at_its_context(tmp_path):
    """`infer warmup MODEL` of a model of 2,048 positions died with "--max-length 4096 is above the model's context
    of 2048", an option the user had not given (its default); the engine's own default is the model's context. The
    default is now 4,096 or the model's context where that is shorter; a --max-length given is still checked."""
    import json
    import shutil

    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.models.resolve import resolve_model
    model = tmp_path / "short"
    shutil.copytree(resolve_model("tiny-llama"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    args = ["warmup", str(model), "--estimate", "--concurrency", "2", "--memory-limit", "30MB", "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["max_length"] == 2048
    res = CliRunner().invoke(app, ["warmup", "tiny-llama", *args[2:]])
    assert res.exit_code == 0 and json.loads(res.stdout)["max_length"] == 4096
    res = CliRunner().invoke(app, [*args, "--max-length", "2049"])
    assert res.exit_code != 0 and "--max-length 2049 is above the model's context of 2048" in res.output
