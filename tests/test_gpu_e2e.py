"""The parts of the GPU end-to-end benchmark that run on a CPU: shapes, model building, adapters, the engine
over an in-memory model, and the roofline arithmetic (tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from infer.bench import e2e_models, e2e_report, roofline
from infer.bench import gpu_e2e as e2e

TINY = dict(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=300, max_position_embeddings=512)


def test_exits_2_without_cuda(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert e2e.main(["--out", str(tmp_path)]) == 2
    assert "CUDA" in capsys.readouterr().err


@pytest.mark.parametrize("name,params", [("llama-2-7b", 6_738_415_616), ("qwen1.5-14b", 14_167_290_880),
                                                ("llama-3-8b", 8_030_261_248)])
def test_real_shapes_have_the_published_parameter_counts(name, params):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(e2e_models.hf_config(name))
    assert sum(p.numel() for p in model.parameters()) == params


def gptq_bytes(k, n, group=128):
    return k * n // 2 + (k // group) * n // 2 + (k // group) * n * 2  # qweight, qzeros, fp16 scales


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_random_gptq_model_runs_and_weight_bytes_match_the_shapes(model_type):
    cfg = e2e_models.hf_config("llama-2-7b" if model_type == "llama" else "qwen1.5-14b", **TINY)
    model, label = e2e_models.build_model(cfg, torch.float32, "cpu", quantized=True)
    assert label == "gptq-int4-g128"
    h, i, v, layers = 256, 384, 300, 2
    per_layer = gptq_bytes(h, 3 * h) + gptq_bytes(h, h) + gptq_bytes(h, 2 * i) + gptq_bytes(i, h)
    per_layer += 4 * (3 * h + i)  # g_idx (int32) is read on the CPU path, which has no plain-group flag
    per_layer += 2 * h * 4  # two norms
    bias = 3 * h * 4 if model_type == "qwen2" else 0
    want = layers * (per_layer + bias) + h * 4 + v * h * 4 + 16 * h * 4  # final norm, head, 16 embedding rows
    assert roofline.weight_bytes_per_step(model, 16) == want
    from infer.models.context import ForwardContext
    runner_cache = torch.zeros(2, 4, 4, 4, 64)  # k|v, blocks, block size, heads, head dim
    for layer in model.layers:
        layer.self_attn.k_cache, layer.self_attn.v_cache = runner_cache[0], runner_cache[1]
    ctx = ForwardContext(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                         torch.tensor([[0]], dtype=torch.int32), torch.tensor([0, 1, 2]), 3)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor([5, 6, 7]), torch.arange(3), ctx))
    assert logits.shape == (3, v) and torch.isfinite(logits).all() and logits.std() > 0


def test_fp16_fallback_label(monkeypatch):
    monkeypatch.setattr(e2e_models, "gptq_method_factory", lambda: None)
    cfg = e2e_models.hf_config("llama-2-7b", **TINY)
    model, label = e2e_models.build_model(cfg, torch.float32, "cpu", quantized=True)
    assert label == "float32 (GPTQ linear method missing)"
    assert model.layers[0].mlp.down_proj.weight.shape == (256, 384)


def test_engine_runs_the_workload_with_mixed_adapters(tmp_path):
    cfg = e2e_models.hf_config("llama-2-7b", **TINY)
    model, _ = e2e_models.build_model(cfg, torch.float32, "cpu")
    adapters = e2e_models.write_random_adapters(cfg, tmp_path, num=3, rank=4)
    tokenizer = e2e_models.make_tokenizer(cfg.vocab_size)
    engine = e2e.build_engine(model, cfg, tokenizer, "cpu", adapters, 4, concurrency=3, max_len=32)
    reqs = e2e.make_requests(cfg.vocab_size, 3, prompt_len=5, output_len=4, adapters=list(adapters))
    assert [r.lora for r in reqs] == ["lora0", "lora1", "lora2"]
    metrics = e2e.run_engine(engine, reqs, 3)
    assert metrics["completed"] == 3 and metrics["total_output_tokens"] == 12
    per_adapter = roofline.lora_bytes_per_adapter(model)
    h, i = 256, 384  # A [rank, in] per shard: qkv 3h, o h, gate_up 2h, down i; B [out, rank]: 3h, h, 2i, h
    assert per_adapter == 2 * 4 * 4 * ((3 * h + h + 2 * h + i) + (3 * h + h + 2 * i + h))  # 2 layers, fp32


def test_roofline_arithmetic_and_tables(tmp_path):
    roof = roofline.decode_roofline(weight_bytes=4_000_000_000, kv_bytes_per_token=500_000, batch=16,
                                    mean_context=172, adapter_bytes=10_000_000, num_adapters=16, bandwidth=2e12)
    assert roof["step_bytes"] == 4_000_000_000 + 500_000 * 16 * 172 + 160_000_000
    assert roof["step_s"] == pytest.approx(roof["step_bytes"] / 2e12)
    assert roof["tok_s"] == pytest.approx(16 / roof["step_s"])
    metrics = {"output_throughput": 500.0, "mean_tpot_ms": 2 * roof["step_s"] * 1000, "mean_ttft_ms": 40.0}
    row = e2e_report.result_row("m", "gptq-int4-g128", "none", "infer", metrics, roof, 2e12)
    assert row["fraction_of_roofline"] == 0.5
    md = e2e_report.write_tables([row], tmp_path, ["a note"])
    assert (tmp_path / "results.csv").read_text().splitlines()[0] == ",".join(e2e_report.COLUMNS)
    assert "| m | gptq-int4-g128 |" in md and "- a note" in md


def test_bench_model_rows_on_cpu_with_tiny_shapes():
    """The whole per-model flow (infer without/with adapters, then transformers) on tiny shapes."""
    args = e2e.parse_args(["--out", "unused", "--num-prompts", "2", "--concurrency", "2", "--input-len", "5",
                           "--output-len", "3", "--num-adapters", "2", "--rank", "4", "--compare-eager"])
    rows = e2e.bench_model("qwen1.5-14b", args, bandwidth=1e10, device="cpu", dtype=torch.float32, **TINY)
    assert [(r["weights"], r["lora"], r["engine"]) for r in rows] == [
        ("gptq-int4-g128", "none", "infer"), ("gptq-int4-g128", "none", "infer --eager"),
        ("gptq-int4-g128", "2 mixed r4", "infer"), ("gptq-int4-g128", "2 mixed r4", "infer --eager"),
        ("float32", "none", "hf generate")]
    assert all(r["output_tok_s"] > 0 and r["fraction_of_roofline"] > 0 for r in rows)
    assert rows[2]["step_MB"] > rows[0]["step_MB"] and rows[4]["step_MB"] > rows[0]["step_MB"]  # adapters; fp32
    # each adapter row's cost is taken against the same engine without adapters (graphs with graphs, eager with eager)
    assert [n.split(":")[0] for n in e2e_report.adapter_costs(rows)] == [
        "qwen1.5-14b infer, 2 mixed r4", "qwen1.5-14b infer --eager, 2 mixed r4"]


def record_engines(monkeypatch, what) -> list:
    """What `what(engine)` says of every engine gpu_e2e builds from here on, in order."""
    built = []
    real = e2e.build_engine

    def recorded(*args, **kwargs):
        engine = real(*args, **kwargs)
        built.append(what(engine))
        return engine
    monkeypatch.setattr(e2e, "build_engine", recorded)
    return built


def test_adapters_through_fewer_slots_swap_and_costs_are_reported(monkeypatch):
    """--max-loras below the number of adapters adds a row whose engine swaps adapters (counted);
    --compare-lora-epilogue a row whose engine adds every expand in the int4 epilogue; --compare-lora-fused a row
    whose qkv and gate_up expands are added by their consumers and one whose every expand is launched alone; the notes give each adapter row's
    cost next to the cost its bytes explain."""
    def modes(engine):
        layers = engine.lora_manager.layers if engine.lora_manager else []
        return (engine.config.lora_epilogue, engine.config.lora_streams,
                {(layer.streams, layer.expand_beside, layer.fused, layer.fused_norm) for layer in layers} or None)
    built = record_engines(monkeypatch, modes)
    args = e2e.parse_args(["--out", "unused", "--num-prompts", "4", "--concurrency", "2", "--input-len", "5",
                           "--output-len", "3", "--num-adapters", "3", "--rank", "4", "--max-loras", "1",
                           "--skip-hf", "--compare-lora-epilogue", "--compare-lora-streams", "--compare-lora-fused"])
    rows = e2e.bench_model("llama-2-7b", args, bandwidth=1e10, device="cpu", dtype=torch.float32, **TINY)
    assert [r["lora"] for r in rows] == ["none", "3 mixed r4", "3 mixed r4 via 1 slots",
                                         "3 mixed r4, expand in epilogue", "3 mixed r4, shrink on the main stream",
                                         "3 mixed r4, expand beside too",
                                         "3 mixed r4, qkv/gate_up expands in their consumers",
                                         "3 mixed r4, every expand launched alone"]
    on = (None, False, False, True)
    assert built == [(None, None, None), (None, None, {on}), (None, None, {on}), (True, None, {on}),
                     (None, False, {(False, False, False, True)}), (None, None, {(None, True, False, True)}),
                     (None, None, {(None, False, True, True)}), (None, None, {(None, False, False, False)})]
    assert rows[0]["lora_swaps"] == 0 and rows[2]["lora_swaps"] > 0
    notes = e2e_report.adapter_costs(rows)
    assert len(notes) == 7 and all("the adapters' bytes alone explain" in n for n in notes)


def test_staggered_requests_and_the_piecewise_comparison(monkeypatch):
    """--stagger spreads the output lengths over output-len / 2 .. output-len (seeded); --compare-piecewise adds a
    row per plain mode whose engine runs prefills and mixed steps eagerly (cuda_graph_max_tokens 0), each paired
    with its own kind in the adapter costs and compared with the default in a note of its own."""
    reqs = e2e.make_requests(100, 64, prompt_len=3, output_len=20, adapters=[], stagger=True)
    lens = [r.output_len for r in reqs]
    assert min(lens) >= 10 and max(lens) <= 20 and len(set(lens)) > 5
    assert lens == [r.output_len for r in e2e.make_requests(100, 64, 3, 20, [], stagger=True)]
    assert {r.output_len for r in e2e.make_requests(100, 8, 3, 20, [])} == {20}
    built = record_engines(monkeypatch, lambda engine: engine.config.cuda_graph_max_tokens)
    args = e2e.parse_args(["--out", "unused", "--num-prompts", "4", "--concurrency", "2", "--input-len", "5",
                           "--output-len", "4", "--num-adapters", "2", "--rank", "4", "--skip-hf", "--stagger",
                           "--compare-piecewise"])
    rows = e2e.bench_model("llama-2-7b", args, bandwidth=1e10, device="cpu", dtype=torch.float32, **TINY)
    assert [r["lora"] for r in rows] == ["none", "none, mixed steps eager", "2 mixed r4",
                                         "2 mixed r4, mixed steps eager"]
    assert built == [512, 0, 512, 0]
    assert all(r["piecewise_steps"] == 0 and r["steps"] > 0 for r in rows)  # CPU: no graphs of any kind
    costs = e2e_report.adapter_costs(rows)
    assert [c.split(":")[0] for c in costs] == ["llama-2-7b infer, 2 mixed r4",
                                                "llama-2-7b infer, 2 mixed r4, mixed steps eager"]
    gains = e2e_report.piecewise_gains(rows)
    assert [g.split(":")[0] for g in gains] == ["llama-2-7b infer, none", "llama-2-7b infer, 2 mixed r4"]
    ratio = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    assert f"give {ratio:.2f}x the throughput" in gains[0] and "0 of " in gains[0]
    notes = e2e_report.run_notes("cpu", args, rows)
    assert "2-4 output tokens" in notes[0] and gains[1] in notes


def test_compare_silu_runs_an_engine_with_silu_and_mul_apart(monkeypatch):
    """--compare-silu: a row whose engine launches silu_and_mul after the int4 gate_up matmul
    (EngineConfig.silu_in_gate_up False) beside the default one, and a note setting the two side by side."""
    built = record_engines(monkeypatch, lambda engine: engine.config.silu_in_gate_up)
    args = e2e.parse_args(["--out", "unused", "--num-prompts", "2", "--concurrency", "2", "--input-len", "5",
                           "--output-len", "3", "--num-adapters", "0", "--skip-hf", "--compare-silu"])
    rows = e2e.bench_model("llama-2-7b", args, bandwidth=1e10, device="cpu", dtype=torch.float32, **TINY)
    assert [r["lora"] for r in rows] == ["none", f"none, {e2e_report.SILU_APART}"]
    assert built == [True, False]
    [note] = e2e_report.silu_gains(rows)
    assert note.startswith("llama-2-7b infer, none: silu_and_mul in the int4 gate_up kernel's epilogue gives ")
    assert note in e2e_report.run_notes("cpu", args, rows)


def test_compare_loads_runs_an_engine_with_the_loads_late(monkeypatch):
    """--compare-loads: a row whose engine is built and run with the int4 kernels issuing each K step's loads in
    that step (gptq_gemm.int4_loads "late") beside the default one, the setting given back after it, and a note
    setting the two side by side."""
    from infer.kernels import gptq_gemm
    monkeypatch.setattr(gptq_gemm, "int4_loads", None)
    built = record_engines(monkeypatch, lambda engine: gptq_gemm.int4_loads)
    args = e2e.parse_args(["--out", "unused", "--num-prompts", "2", "--concurrency", "2", "--input-len", "5",
                           "--output-len", "3", "--num-adapters", "0", "--skip-hf", "--compare-loads"])
    rows = e2e.bench_model("llama-2-7b", args, bandwidth=1e10, device="cpu", dtype=torch.float32, **TINY)
    assert [r["lora"] for r in rows] == ["none", f"none, {e2e_report.LOADS_LATE}"]
    assert built == [None, "late"] and gptq_gemm.int4_loads is None
    [note] = e2e_report.loads_gains(rows)
    assert note.startswith("llama-2-7b infer, none: the int4 kernels' loads one K step ahead give ")
    assert note in e2e_report.run_notes("cpu", args, rows)


def test_compare_expand_runs_engines_with_the_expands_gathered_and_by_segments(monkeypatch):
    """--compare-expand: rows with the mixed adapters whose engines are built and run with their decode steps' LoRA
    expands all gathers (lora_ops.expand_by "gather") and all by segments ("segments"), the setting given back after
    each, their adapter cost against the row without adapters, and notes setting each beside the default engine
    (gathers up to GATHER_AUTO_TOKENS tokens)."""
    from infer.kernels import lora_ops
    monkeypatch.setattr(lora_ops, "expand_by", None)
    built = record_engines(monkeypatch, lambda engine: lora_ops.expand_by)
    args = e2e.parse_args(["--out", "unused", "--num-prompts", "2", "--concurrency", "2", "--input-len", "5",
                           "--output-len", "3", "--num-adapters", "2", "--rank", "4", "--skip-hf",
                           "--compare-expand"])
    rows = e2e.bench_model("llama-2-7b", args, bandwidth=1e10, device="cpu", dtype=torch.float32, **TINY)
    gathered, segments = e2e_report.GATHERED, e2e_report.SEGMENTS
    assert [r["lora"] for r in rows] == ["none", "2 mixed r4", f"2 mixed r4, {gathered}", f"2 mixed r4, {segments}"]
    assert built == [None, None, "gather", "segments"] and lora_ops.expand_by is None
    notes = e2e_report.gather_gains(rows)
    assert [n.split(": ")[1][:40] for n in notes] == ["the LoRA expands all as gathers (lora_op",
                                                      "the LoRA expands all by segments (tiles "]
    assert all(n.startswith("llama-2-7b infer, 2 mixed r4: ") for n in notes)
    costs = e2e_report.adapter_costs(rows)
    assert [c.split(":")[0] for c in costs] == ["llama-2-7b infer, 2 mixed r4", f"llama-2-7b infer, 2 mixed r4, "
                                                f"{gathered}", f"llama-2-7b infer, 2 mixed r4, {segments}"]
    assert all(n in e2e_report.run_notes("cpu", args, rows) for n in notes + costs)


def test_compare_priority_runs_engines_with_their_graphs_at_high_priority(monkeypatch):
    """--compare-priority: the plain modes again, each with EngineConfig.graph_priority True (all its CUDA graphs
    recorded on a high-priority stream) and False (all at the default priority; the default engine's is None, by
    the graph's tokens), rows labelled as such, their adapter cost against the like row, and a note setting each
    beside the default engine."""
    built = record_engines(monkeypatch, lambda engine: engine.config.graph_priority)
    args = e2e.parse_args(["--out", "unused", "--num-prompts", "2", "--concurrency", "2", "--input-len", "5",
                           "--output-len", "3", "--num-adapters", "2", "--rank", "4", "--skip-hf",
                           "--compare-priority"])
    rows = e2e.bench_model("llama-2-7b", args, bandwidth=1e10, device="cpu", dtype=torch.float32, **TINY)
    high, low = e2e_report.HIGH_PRIORITY, e2e_report.LOW_PRIORITY
    assert [r["lora"] for r in rows] == ["none", f"none, {high}", f"none, {low}", "2 mixed r4", f"2 mixed r4, {high}",
                                         f"2 mixed r4, {low}"]
    assert built == [None, True, False, None, True, False]
    notes = e2e_report.priority_gains(rows)
    assert [n.split(":")[0] for n in notes] == ["llama-2-7b infer, none", "llama-2-7b infer, 2 mixed r4"] * 2
    assert all("CUDA graphs all recorded at high priority" in n for n in notes[:2])
    assert all("CUDA graphs all recorded at the default priority" in n for n in notes[2:])
    costs = e2e_report.adapter_costs(rows)
    assert [c.split(":")[0] for c in costs] == ["llama-2-7b infer, 2 mixed r4", f"llama-2-7b infer, 2 mixed r4, {high}",
                                                f"llama-2-7b infer, 2 mixed r4, {low}"]
    assert all(n in e2e_report.run_notes("cpu", args, rows) for n in notes + costs)
    eager = e2e.parse_args(["--out", "unused", "--eager", "--num-adapters", "0", "--compare-priority"])
    run = e2e.ShapeRun("llama-2-7b", None, None, eager, 1e10, "cpu", torch.float32)
    assert [m[0] for m in e2e.engine_modes(run, None)] == ["none"]  # without graphs there is nothing to record

