"""Session 61: fewer launches per decode step through Triton epilogues. The int4 gate|up kernel applies Gemma's GeGLU
(gelu_tanh_and_mul) in its epilogue as it applies silu_and_mul (the kernels' GATED constexpr: 1 silu, 2 gelu_tanh);
the fused MoE adds gpt-oss's expert biases in its matmuls' epilogue (float and int4 experts) and computes its clamped
SwiGLU in the gate_up matmul's epilogue (gate and up interleaved: a tile holds both halves of its units). Kernels under
TRITON_INTERPRET=1 against the torch reference (outputs NaN-filled first), the engines' greedy tokens against the CPU
path, the benches' side-by-side timings on a GPU."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import gptq_configs
from infer.kernels import reference as ref
from infer.quant import packing

from helpers import fused, gemm, interpreted_module, nan_filled_empty, recorded_launch_arg  # noqa: F401 (fixtures)
from test_gptq_kernel import DECODE, GEMV, MMAT_SCALED, ROWS, make_weights

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
interpreted = pytest.mark.skipif(CUDA, reason="a GPU runs the real kernels (pytest -m gpu)")


def _gated_launches(gemm, monkeypatch) -> list:
    """The `gated` constexpr of every fused int4 launch (gptq_gemm._launch) from now on."""
    return recorded_launch_arg(gemm, monkeypatch, 16, "gated")


# ------------------------------------------------------------------------------------- GeGLU in the int4 gate_up
@pytest.mark.parametrize("cfg", [DECODE, GEMV, ROWS, MMAT_SCALED], ids=["mma-split3", "gemv", "gemv-rows", "mmat"])
def test_gelu_tanh_epilogue_equals_the_gelu_launch_after_the_matmul(gemm, fused, monkeypatch, cfg):
    """gated="gelu_tanh": the kernel's epilogue applies gelu_tanh(gate) * up (GATED 2) to the rounded tile (after
    the bias, after split-K's partials are summed), bit for bit what fused.gelu_tanh_and_mul computes from the
    plain matmul's output (and not silu's), close to the torch reference; no activation launch after it."""
    g = torch.Generator().manual_seed(61)
    half = 64
    qw, qz, s, gi = make_weights(g, 4, 32, 128, 2 * half, True, False)
    wp = gptq_configs.interleave_for(32, 128, 8)
    qi = packing.interleave_rows(qw, 4, wp)
    launches = _gated_launches(gemm, monkeypatch)
    after = []
    real_act = fused.silu_and_mul
    monkeypatch.setattr(fused, "silu_and_mul", lambda *a, **kw: (after.append(kw.get("gelu")), real_act(*a, **kw))[1])
    for dtype in (torch.float32, torch.float16):
        m = 3 if cfg["kernel"] == "gemv" and "BLOCK_M" not in cfg else 19
        x = (torch.randn(m, 128, generator=g) * 0.3).to(dtype).to(DEV)
        bias = (torch.randn(2 * half, generator=g) * 0.5).to(dtype).to(DEV)
        plain = gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 32, wp, config=cfg, bias=bias)
        launches.clear()
        with nan_filled_empty(gemm):
            y = gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 32, wp, config=cfg, bias=bias, gated="gelu_tanh")
        assert launches == [2] and after == [], (launches, after)
        assert y.shape == (m, half) and y.dtype == dtype
        act_after = fused.gelu_tanh_and_mul(plain)
        if dtype == torch.float16:  # (the tile rounded to float16 first: the same bits)
            assert torch.equal(y, act_after)
        else:  # (float32 tiles: the interpreter's dots of other column sets round their last bit apart)
            torch.testing.assert_close(y, act_after, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(y, fused.silu_and_mul(plain), atol=1e-3)  # (the activation matters here)
        after.clear()
        want = ref.gelu_tanh_and_mul(ref.gptq_matmul(x.cpu().float(), qw, qz, s, gi, 4, True, 32,
                                                     bias=bias.cpu().float()))
        tol = (2e-3 if dtype == torch.float16 else 1e-5) * want.abs().max().item()  # (max error / max |reference|)
        torch.testing.assert_close(y.cpu().float(), want, atol=tol, rtol=0)


def test_gelu_tanh_where_the_tiles_cannot_hold_the_halves_is_launched_after(gemm, fused, monkeypatch):
    """Halves of 40 columns (no whole 16-column tiles): the plain kernel, then gelu_tanh_and_mul's launch (not
    silu_and_mul's): the reference's values."""
    g = torch.Generator().manual_seed(62)
    qw, qz, s, gi = make_weights(g, 4, 32, 128, 80, True, False)
    launches = _gated_launches(gemm, monkeypatch)
    x = torch.randn(5, 128, generator=g)
    y = gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 32, config=DECODE, gated="gelu_tanh")
    assert launches == [0]
    want = ref.gptq_matmul(x, qw, qz, s, gi, 4, True, 32, gated="gelu_tanh")
    torch.testing.assert_close(want, ref.gelu_tanh_and_mul(ref.gptq_matmul(x, qw, qz, s, gi, 4, True, 32)))
    torch.testing.assert_close(y, want, atol=1e-5 * want.abs().max().item(), rtol=0)


def test_an_unknown_gate_activation_is_refused(gemm):
    g = torch.Generator().manual_seed(63)
    qw, qz, s, gi = make_weights(g, 4, 32, 128, 64, True, False)
    with pytest.raises(ValueError, match=r"gated='relu' is no activation of a gate\|up layer: use True, 'silu' or "):
        gemm.gptq_matmul(torch.randn(2, 128), qw, qz, s, gi, 4, True, 32, gated="relu")


# ----------------------------------------------------------------------- gpt-oss's biases and SwiGLU in the MoE
@pytest.fixture(scope="module")
def moe():
    yield from interpreted_module("infer.kernels.moe")


def oai_case(int4: bool, dtype, t: int, seed: int, inter: int = 24):
    """(x, w13, w2, weights, ids, oai) of 4 experts, top-2: float [E, N, K] experts or int4 ones, gate and up
    interleaved (2I = 48: a ragged last column tile), biases of N(0, 1), limit 1.5 (the clamp reached on both
    sides), alpha 1.702; routing weights in float32."""
    from test_probes_session56_moeq import int4_experts
    from test_probes_session60_gptoss import oai_experts
    w13, w2, oai = oai_experts(e=4, h=32, inter=inter, seed=seed)
    if int4:
        w13, w2 = int4_experts(4, 32, 2 * inter, 16, False, False, True, seed), int4_experts(4, inter, 32, 8, False,
                                                                                              True, False, seed + 1)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    oai = oai._replace(b13=oai.b13.to(dtype), b2=oai.b2.to(dtype))
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(t, 32, generator=g).to(dtype)
    top, ids = torch.topk(torch.randn(t, 4, generator=g), 2, dim=-1)
    return x, w13, w2, torch.softmax(top, dim=-1), ids, oai


def on(device, obj):
    """`obj`'s tensors on `device`, through tuples and NamedTuples (OaiExperts, Int4Experts)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        items = [on(device, o) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def check_oai_epilogue(moe, monkeypatch, int4: bool, dtype) -> None:
    """gpt-oss's experts through the fused MoE: two matmul launches, the gate_up's adding its expert's bias and
    computing the clamped SwiGLU (its output [pairs, I]), the down's adding its bias before the routing weight; no
    torch op on the pairs in between. The same bits as the ops apart (`apart=True`: plain matmuls, index_select adds,
    reference.oai_swiglu's torch ops; half precision: every op's rounding restated), the reference's values (at
    decode's few tokens and a prefill's)."""
    from infer.kernels import reference
    name = "_gemm_int4" if int4 else "_gemm"
    real = getattr(moe, name)
    run = moe.fused_moe_int4 if int4 else moe.fused_moe
    launched = []
    monkeypatch.setattr(moe, name, lambda *a, **kw: (launched.append(
        (kw.get("bias") is not None, kw.get("act") is not None, a[7])), real(*a, **kw))[1])
    for t in (3, 37):
        case = oai_case(int4, dtype, t, seed=t)
        x, w13, w2, weights, ids, oai = on(DEV, case)
        launched.clear()
        with monkeypatch.context() as mp:
            mp.setattr(reference, "oai_swiglu", lambda *a: pytest.fail("oai_swiglu ran apart"))
            with nan_filled_empty(moe):
                got = run(x, w13, w2, weights, ids, oai=oai)
        assert launched == [(True, True, False), (True, False, True)]  # (bias, activation, weighted): gate_up, down
        launched.clear()
        want_apart = run(x, w13, w2, weights, ids, oai=oai, apart=True)  # (session 60's way: the bench's baseline)
        assert launched == [(False, False, False), (False, False, False)]
        if dtype == torch.float32:  # (the interpreter's float32 dots of other shapes: last bits apart)
            torch.testing.assert_close(got, want_apart, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(got, want_apart), (got - want_apart).abs().max()
        want = (reference.fused_moe_int4 if int4 else reference.fused_moe)(*case[:5], oai=case[5])  # (on the CPU)
        tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype] * want.abs().max().item()
        torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=0)


@interpreted
@pytest.mark.parametrize("int4", [False, True], ids=["float", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_oai_biases_and_swiglu_in_the_epilogue_equal_the_ops_apart(moe, monkeypatch, int4, dtype):
    """(bfloat16: on a GPU, below: the interpreter rounds float32 to bfloat16 by truncation, unlike the GPU and
    torch.)"""
    check_oai_epilogue(moe, monkeypatch, int4, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("int4", [False, True], ids=["float", "int4"])
def test_oai_epilogue_in_bfloat16_on_gpu(moe, monkeypatch, int4):
    check_oai_epilogue(moe, monkeypatch, int4, torch.bfloat16)


# ------------------------------------------------------------------------------------------------- the benches
def counted_clock(fns, reps=3):
    """A stand-in for gptq_tune.time_graph on CPU: each callable run once, microseconds a call by the wall clock."""
    import time
    t0 = time.perf_counter()
    for f in fns:
        f()
    return (time.perf_counter() - t0) * 1e6 / len(fns)


@interpreted
def test_the_kernels_bench_times_the_gated_epilogues_beside_the_launch_after(gemm, monkeypatch, capsys):
    """`infer.bench.kernels`' rows of a gate_up layer (interpreted, a wall-clock timer): where the tile applies the
    activation in its epilogue, silu's and gelu_tanh's times fused and apart and their ratio; other layers none;
    the table prints them."""
    from infer.bench import kernels as bench
    from infer.kernels import gptq_tune
    monkeypatch.setattr(gptq_tune, "time_graph", counted_clock)
    monkeypatch.setattr(gptq_tune, "L2_BUST_BYTES", 1)
    rows = bench.measure_shape("7B", "gate_up", 256, 256, [1, 3], 1e12, device="cpu")
    rows += bench.measure_shape("7B", "down", 256, 256, [1], 1e12, device="cpu")
    for r in rows[:2]:
        wp = gptq_configs.interleave_for(128, 256, 8)  # (the bench's layout)
        assert gemm.gated_fits(*gemm._choice(r["M"], 256, 256, 4, 128, wp, None, torch.device("cpu"))[:2], 256), r
        for act in ("silu", "gelu"):
            assert r[f"{act}_us"] > 0 and r[f"{act}_gain"] == r[f"{act}_apart_us"] / r[f"{act}_us"], r
    assert "silu_us" not in rows[2] and "gelu_gain" not in rows[2]
    monkeypatch.setenv("COLUMNS", "250")
    bench.print_table(rows, "cpu", bench.GATED_COLS)
    assert "gelu_gain" in capsys.readouterr().out


@interpreted
def test_the_moe_bench_times_gpt_oss_experts_fused_and_apart(moe, monkeypatch, capsys):
    """`python -m infer.bench.moe --oai`'s measuring code (interpreted, a wall-clock timer, tiny experts): each row
    times the int4 and the bf16 experts with the biases and the activation in the epilogue and apart, and their
    ratios; --oai with --tune is refused by name."""
    from infer.bench import moe as bench
    from infer.kernels import gptq_tune
    monkeypatch.setattr(gptq_tune, "time_graph", counted_clock)
    rows = bench.measure([1, 5], 4, 2, 64, 32, 32, False, 1e12, oai=True, device="cpu")
    for r in rows:
        for kind in ("int4", "bf16"):
            assert r[f"{kind}_apart_us"] > 0 and r[f"{kind}_epilogue_gain"] == round(
                r[f"{kind}_apart_us"] / r[f"{kind}_us"], 3), r
    assert "int4_apart_us" not in bench.measure([1], 4, 2, 64, 32, 32, False, 1e12, device="cpu")[0]
    with pytest.raises(SystemExit) as exc:
        bench.main(["--oai", "--tune"])
    assert exc.value.code == 2 and "--oai times gpt-oss's experts fused and apart" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_benches_print_fused_and_apart_side_by_side_on_gpu(tmp_path, capsys):
    """One command each on a GPU: the kernels bench's gate_up rows of up to 32 rows carry silu's and gelu's fused and
    apart times and their ratio; the MoE bench's --oai rows the epilogue's gains (times are not asserted)."""
    import csv

    from infer.bench import kernels as kbench
    from infer.bench import moe as mbench
    assert kbench.main(["--out", str(tmp_path / "k.csv"), "--m", "1", "16", "--models", "7B"]) == 0
    rows = [r for r in csv.DictReader(open(tmp_path / "k.csv")) if r["layer"] == "gate_up"]
    assert rows and all(float(r["gelu_gain"]) > 0 and float(r["silu_gain"]) > 0 for r in rows), rows
    assert mbench.main(["--oai", "--experts", "32", "--top-k", "4", "--hidden", "2880", "--intermediate", "2880",
                        "--group-size", "32", "--tokens", "1", "64", "--out", str(tmp_path / "m.csv")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "m.csv")))
    assert len(rows) == 2 and all(float(r["int4_epilogue_gain"]) > 0 and float(r["bf16_epilogue_gain"]) > 0
                                  for r in rows), rows


# ------------------------------------------------------------------------------------------------- the engines
def record_gated(monkeypatch) -> list:
    """The GATED constexpr of every int4 kernel launch of the engines built from now on (gptq_gemm._launch)."""
    from infer.kernels import gptq_gemm
    return _gated_launches(gptq_gemm, monkeypatch)


@interpreted
def test_gemma3_gptq_engine_applies_the_geglu_in_the_gate_up_epilogue(tmp_path, monkeypatch):
    """A GPTQ Gemma 3 (`infer quantize`'s) on the GPU code path (interpreted; emulated decode and piecewise graphs):
    every MLP's act_in_gate_up (EngineConfig.silu_in_gate_up covers the GeGLU), its gate_up kernels launched with
    GATED 2 and no gelu_tanh_and_mul after them; the CPU path's greedy tokens. With silu_in_gate_up=False: the
    activation launched apart again, the same tokens."""
    from typer.testing import CliRunner

    from infer import LLM, SamplingParams, kernels
    from infer.cli.main import app
    from helpers import random_prompts
    from quant_helpers import check_gpu_path_interpreted
    from test_probes_session55_gemma3 import FULL, SL, build
    build(tmp_path / "f", num_hidden_layers=2, layer_types=[SL, FULL], sliding_window=8)
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(tmp_path / "q"), "--group-size", "32",
                                   "--num-samples", "8", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    prompts = random_prompts(512, (5, 13), seed=4)
    with LLM(str(tmp_path / "q"), block_size=4) as llm:
        want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert len({t for tokens in want for t in tokens}) > 3  # (varied tokens: the comparison means something)
    gated = record_gated(monkeypatch)
    apart = []
    real = kernels.gelu_tanh_and_mul
    monkeypatch.setattr(kernels, "gelu_tanh_and_mul", lambda *a, **kw: (apart.append(1), real(*a, **kw))[1])
    check_gpu_path_interpreted(tmp_path / "q", monkeypatch, prompts, want)
    assert 2 in gated and 1 not in gated and apart == [], (sorted(set(gated)), len(apart))
    gated.clear()
    with LLM(str(tmp_path / "q"), block_size=4, max_model_len=32, silu_in_gate_up=False) as llm:
        assert not any(layer.mlp.act_in_gate_up for layer in llm.engine.runner.model.layers)
        assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))] == want
    assert set(gated) == {0} and apart, (sorted(set(gated)), len(apart))


@interpreted
def test_gpt_oss_engine_runs_its_experts_in_two_launches(tmp_path, monkeypatch):
    """A float gpt-oss on the GPU code path (interpreted; emulated graphs): the fused MoE's matmuls add the biases
    and compute the clamped SwiGLU (reference.oai_swiglu never runs, no bias index_select), transformers' tokens."""
    from infer.kernels import reference
    from helpers import greedy_each, random_prompts
    from quant_helpers import check_gpu_path_interpreted
    from test_probes_session60_gptoss import build
    hf = build(tmp_path, num_hidden_layers=2)
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    monkeypatch.setattr(reference, "oai_swiglu", lambda *a: pytest.fail("oai_swiglu ran apart"))
    check_gpu_path_interpreted(tmp_path, monkeypatch, prompts, want)


def test_an_engine_start_compiles_the_gelu_tanh_gated_variant(monkeypatch):
    """gptq_tune.compile_model (an engine start) on a Gemma MLP whose gate_up applies the GeGLU in its epilogue:
    every gated call it queues is gelu_tanh's (the variant the steps launch), none silu's."""
    from infer.kernels import gptq_gemm, gptq_tune
    from quant_helpers import int4_merged_linear
    gate_up = int4_merged_linear(256, [128, 128], ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"])
    mlp = torch.nn.Module()
    mlp.gate_up_proj, mlp.act_in_gate_up, mlp.act = gate_up, True, "gelu_tanh"
    queued = []
    monkeypatch.setattr(gptq_gemm, "gptq_matmul", lambda *a, **kw: queued.append(kw.get("gated")))
    monkeypatch.setattr(gptq_tune, "compile_parallel", lambda calls, workers=None: len([c() for c in calls]))
    assert gptq_tune.compile_model(torch.nn.ModuleList([mlp]), 32, torch.float16) > 0
    assert "gelu_tanh" in queued and not {"silu", True} & set(queued), queued
