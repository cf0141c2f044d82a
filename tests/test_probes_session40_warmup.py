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


def test_estimate_counts_one_g_idx_per_merged_gptq_layer_as_the_engine_holds(tmp_path):
    """`--estimate` counted a g_idx per checkpoint shard (q, k, v, gate, up: five) where the engine's merged layers
    hold one each (two), and none for a checkpoint that has no g_idx, whose layers the engine gives one; estimate
    and measured weights now agree to the byte. On CUDA an act-order layer also holds the int64 permutation of its
    inputs."""
    import sys
    from pathlib import Path

    import pytest
    import torch
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    sys.path.insert(0, str(Path(__file__).parent))
    from quant_helpers import has_gptqmodel

    from infer.cli.main import app
    from infer.cli.warmup_plan import estimate_plan
    from infer.memory.checkpoint import checkpoint_weights_bytes
    from infer.models.loader import load_config, weight_files
    if not has_gptqmodel():
        pytest.skip("needs the quantize extra (gptqmodel)")
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "-o", str(out), "--group-size", "32",
                                   "--num-samples", "4", "--seq-len", "32"])
    assert res.exit_code == 0, res.output

    def weights(mode):
        cfg = EngineConfig(model=str(out), device="cpu", max_num_seqs=1, max_model_len=64, memory_limit="64MB")
        return (estimate_plan if mode == "estimate" else measured_plan)(cfg, 64, 1)[0].weights_bytes
    assert weights("estimate") == weights("measured")
    files = weight_files(out)
    cfg = load_config(out)
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    q = cfg.num_attention_heads * cfg.head_dim
    inputs = layers * (h + q + h + inter)  # qkv, o_proj, gate_up, down_proj
    cuda = torch.device("cuda")
    assert checkpoint_weights_bytes(files, cfg, torch.float16, cuda, 4, act_order=True) \
        - checkpoint_weights_bytes(files, cfg, torch.float16, cuda, 4) == 8 * inputs
    for f in files:  # an export without g_idx: the engine's layers make their own
        save_file({k: v for k, v in load_file(f).items() if not k.endswith(".g_idx")}, f, metadata={"format": "pt"})
    assert weights("estimate") == weights("measured")


def test_vllms_kv_cache_sizing_options_say_what_sizes_infers_cache():
    """vLLM's --num-gpu-blocks-override, --kv-cache-memory-bytes and --cpu-offload-gb, typed at `infer warmup` (or
    serve), were "No such option" with only "see --help"; they now say what sizes infer's KV cache instead."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    for option, word in (("--num-gpu-blocks-override", "num_kv_blocks"), ("--kv-cache-memory-bytes", "budget"),
                         ("--cpu-offload-gb", "int4")):
        res = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", option, "100"])
        assert res.exit_code == 2 and f"{option} is vLLM's option" in res.output and word in res.output, res.output


def test_adapter_slots_past_the_budget_are_a_plan_that_does_not_fit_not_an_allocation(monkeypatch):
    """An engine start refuses --max-loras x --max-lora-rank slots that pass the budget before it allocates them;
    warmup (measured) allocated them first, which on a GPU they exceed is the allocator's OutOfMemoryError (a
    traceback), on a CPU the machine's memory filling. It now answers "does not fit" naming the slots, as
    --estimate does, without allocating them."""
    import torch

    from infer.lora import manager

    def no_room(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB")
    monkeypatch.setattr(manager.LoRAManager, "__init__", no_room)
    kw = dict(model="tiny-llama", max_num_seqs=2, max_model_len=256, memory_limit="20MB", enable_lora=True,
              max_loras=64, max_lora_rank=256)
    plan, extra = measured_plan(EngineConfig(**kw), 256, 2)
    from infer.cli.warmup import advice
    from infer.cli.warmup_plan import estimate_plan
    est, _ = estimate_plan(EngineConfig(**kw), 256, 2)
    assert not plan.fits and plan.kv_blocks == 0 and plan.lora_bytes == est.lora_bytes > plan.budget_bytes
    assert "--max-loras" in advice(plan) and extra["worst_case_run"] is False


def test_the_reserve_row_says_its_floor():
    """Under a 20 MB budget the table's "runtime reserve (1% of budget)" read 4.0 MiB, a fifth of it: the reserve
    is 1% of the budget but at least 4 MiB (memory.plan.runtime_reserve), and the row now says so."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-length", "256", "--concurrency", "2",
                                   "--memory-limit", "20MB"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if "runtime reserve" in line)
    assert "at least 4 MiB" in row and "4.0 MiB" in row
