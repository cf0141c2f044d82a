"""Session 61: an MLP without gate (models.llama.UngatedMLP: StarCoder2's gelu_tanh, Arcee's and Nemotron's relu²,
Apertus's xIELU) has its activation applied by the int4 up_proj / c_fc kernel's epilogue (the kernels' ACT constexpr:
1 gelu_tanh, 2 relu2, 3 xIELU of four scalar arguments), and on a float model on the GPU by one Triton kernel
(fused.ungated_act) where torch takes several launches. Kernels under TRITON_INTERPRET=1 against the torch ops
(outputs NaN-filled first); the engines' greedy tokens against the CPU path."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import gptq_configs
from infer.kernels import reference as ref
from infer.quant import packing

from helpers import fused, gemm, nan_filled_empty, recorded_launch_arg  # noqa: F401 (fixtures: kernel modules)
from test_gptq_kernel import DECODE, GEMV, MMAT_SCALED, PREFILL, ROWS, make_weights

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# (bfloat16 on a GPU only: TRITON_INTERPRET rounds float32 to bfloat16 toward zero, every kernel's stores alike)
DTYPES = (torch.float16, torch.float32) + ((torch.bfloat16,) if CUDA else ())
ACTS = ("gelu_tanh", "relu2", "xielu")


def xielu_module(dtype, alpha_p=0.8, alpha_n=0.3, beta=0.5, eps=-1e-6):
    """A models.llama.XIELU of these (pre-softplus) parameters, as Apertus's checkpoints store them."""
    from infer.models.llama import XIELU
    mod = XIELU(dtype)
    for name, v in (("alpha_p", alpha_p), ("alpha_n", alpha_n), ("beta", beta), ("eps", eps)):
        getattr(mod, name).data.fill_(v)
    return mod


def assert_act_equal(got, want, act):
    """Bit for bit in float16 / bfloat16; gelu_tanh under TRITON_INTERPRET (no tanh: fused.gate_act's) to an ulp of
    the dtype, all but ~1% of values bit for bit; float32 close (the formulas' float32 ulps apart)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    elif act == "gelu_tanh" and not CUDA:
        ulp = 2.0 ** -10 if got.dtype == torch.float16 else 2.0 ** -7
        torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=ulp)
        assert (got != want).float().mean() < 0.02, (got != want).float().mean()
    else:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def torch_act(x, act, dtype):
    """The activation as UngatedMLP's torch ops compute it (a copy: x is left alone)."""
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if act == "relu2":
        return torch.relu(x).square()
    return xielu_module(dtype).to(x.device)(x)


def _launch_acts(gemm, monkeypatch) -> list:
    """The ACT constexpr of every fused int4 launch (gptq_gemm._launch) from now on."""
    return recorded_launch_arg(gemm, monkeypatch, 17, "act")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32), ids=str)
def test_xielu_scalars_and_reference_equal_the_module_bit_for_bit(dtype):
    """XIELU.scalars (softplus(alpha_p), beta + softplus(alpha_n), beta, eps, each rounded to the dtype) and
    reference.ungated_act of them compute XIELU's values bit for bit, both signs and the eps corner."""
    mod = xielu_module(dtype)
    x = torch.cat([torch.randn(4000, generator=torch.Generator().manual_seed(1)) * 3,
                   torch.tensor([0.0, -0.0, -1e-6, 1e-6, -30.0, 30.0])]).to(dtype)
    s = mod.scalars()
    assert s == (torch.nn.functional.softplus(mod.alpha_p).item(),
                 (mod.beta + torch.nn.functional.softplus(mod.alpha_n)).item(), mod.beta.item(), mod.eps.item())
    assert torch.equal(ref.ungated_act(x.clone(), "xielu", s), mod(x))
    for act in ("gelu_tanh", "relu2"):
        assert torch.equal(ref.ungated_act(x.clone(), act), torch_act(x, act, dtype))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ungated_act_kernel_equals_torch(fused, act, dtype):
    """fused.ungated_act (one launch, in place) computes UngatedMLP's torch ops bit for bit (float32: gelu's and
    expm1's float32 formulas a few ulps apart, so close)."""
    x = (torch.randn(5, 1000, generator=torch.Generator().manual_seed(2)) * 2).to(dtype).to(DEV)
    want = torch_act(x, act, dtype)
    got = fused.ungated_act(x.clone(), act, xielu_module(dtype).scalars())
    assert_act_equal(got, want, act)


@pytest.mark.parametrize("cfg", [DECODE, GEMV, ROWS, MMAT_SCALED, PREFILL],
                         ids=["mma-split3", "gemv", "gemv-rows", "mmat", "mma-32"])
@pytest.mark.parametrize("act", ACTS)
def test_ungated_epilogue_equals_the_act_launch_after_the_matmul(gemm, fused, monkeypatch, cfg, act):
    """act=...: the kernel's epilogue applies the activation (ACT 1-3) to the rounded tile (after the bias, after
    split-K's partials are summed), bit for bit what the plain matmul's output and the torch ops after compute in
    float16 and bfloat16; no launch after it."""
    g = torch.Generator().manual_seed(62)
    n = 96
    qw, qz, s, gi = make_weights(g, 4, 32, 128, n, True, False)
    wp = gptq_configs.interleave_for(32, 128, 8)
    qi = packing.interleave_rows(qw, 4, wp)
    launches = _launch_acts(gemm, monkeypatch)
    after = []
    monkeypatch.setattr(fused, "ungated_act", lambda *a, **kw: after.append(a))
    for dtype in DTYPES:
        scalars = xielu_module(dtype).scalars()
        m = 1 if cfg["kernel"] == "gemv" and "BLOCK_M" not in cfg else 19
        x = (torch.randn(m, 128, generator=g) * 0.3).to(dtype).to(DEV)
        bias = (torch.randn(n, generator=g) * 0.5).to(dtype).to(DEV)
        plain = gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 32, wp, config=cfg, bias=bias)
        launches.clear()
        with nan_filled_empty(gemm):
            y = gemm.gptq_matmul(x, qi, qz, s, gi, 4, True, 32, wp, config=cfg, bias=bias, act=act,
                                 act_scalars=scalars)
        assert launches == [{"gelu_tanh": 1, "relu2": 2, "xielu": 3}[act]] and after == [], (launches, after)
        assert y.shape == (m, n) and y.dtype == dtype
        want = torch_act(plain, act, dtype)
        assert_act_equal(y, want, act)
        assert (y < 0).any() if act != "relu2" else not torch.equal(y, torch.relu(plain))


def test_an_unknown_or_doubled_activation_is_refused(gemm):
    """act names one of the epilogue's activations, and does not come with gated; xIELU needs its four scalars."""
    qw, qz, s, gi = make_weights(torch.Generator().manual_seed(3), 4, 32, 128, 64, True, False)
    x = torch.randn(2, 128).to(DEV)
    with pytest.raises(ValueError, match="act='silu' is no activation of an MLP without gate"):
        gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 32, act="silu")
    with pytest.raises(ValueError, match="gated .* and act .* are exclusive"):
        gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 32, act="relu2", gated=True)
    with pytest.raises(ValueError, match="xielu takes its four scalars"):
        gemm.gptq_matmul(x, qw, qz, s, gi, 4, True, 32, act="xielu", act_scalars=(1.0, 2.0))
    with pytest.raises(ValueError, match="'swish' is no activation of an MLP without gate"):
        ref.ungated_act(x, "swish")


# ------------------------------------------------------------------------------------------------- the bench
@pytest.mark.skipif(CUDA, reason="a GPU runs the real kernels (pytest -m gpu)")
def test_the_kernels_bench_times_the_ungated_epilogues_beside_the_launch_after(gemm, fused, monkeypatch, capsys):
    """`infer.bench.kernels`' fused gate_up rows (interpreted, a wall-clock timer) also time the shape as an up
    projection: each activation fused and apart and their ratio, relu2's and xIELU's with torch's ops too; other
    layers none; a table of their own prints them."""
    from infer.bench import kernels as bench
    from infer.kernels import gptq_tune
    from test_probes_session61_epi import counted_clock
    monkeypatch.setattr(gptq_tune, "time_graph", counted_clock)
    monkeypatch.setattr(gptq_tune, "L2_BUST_BYTES", 1)
    rows = bench.measure_shape("7B", "gate_up", 256, 256, [1], 1e12, device="cpu")
    rows += bench.measure_shape("7B", "down", 256, 256, [1], 1e12, device="cpu")
    for label in ("gelu_up", "relu2", "xielu"):
        r = rows[0]
        assert r[f"{label}_us"] > 0 and r[f"{label}_gain"] == r[f"{label}_apart_us"] / r[f"{label}_us"], r
    assert rows[0]["relu2_torch_us"] > 0 and rows[0]["xielu_torch_us"] > 0 and "gelu_up_torch_us" not in rows[0]
    assert "relu2_us" not in rows[1]
    monkeypatch.setenv("COLUMNS", "250")
    bench.print_table(rows[:1], "cpu", bench.UNGATED_COLS)
    assert "xielu_torch_us" in capsys.readouterr().out


@pytest.mark.gpu
def test_the_kernels_bench_prints_the_ungated_rows_on_gpu(tmp_path):
    """One command on a GPU: the kernels bench's fused gate_up rows carry each ungated activation's fused and apart
    times and their ratio, and relu2's / xIELU's with torch's ops after (times are not asserted)."""
    import csv

    from infer.bench import kernels as kbench
    assert kbench.main(["--out", str(tmp_path / "k.csv"), "--m", "1", "16", "--models", "7B"]) == 0
    rows = [r for r in csv.DictReader(open(tmp_path / "k.csv")) if r["layer"] == "gate_up"]
    assert rows and all(float(r[f"{label}_gain"]) > 0 for r in rows for label in ("gelu_up", "relu2", "xielu"))
    assert all(float(r["xielu_torch_us"]) > 0 and float(r["relu2_torch_us"]) > 0 for r in rows), rows


# ------------------------------------------------------------------------------------------------- the engines
FAMILIES = ("tiny-starcoder2", "tiny-arcee", "tiny-nemotron", "tiny-apertus")


@pytest.mark.skipif(CUDA, reason="a GPU runs the real kernels (pytest -m gpu)")
@pytest.mark.parametrize("name", FAMILIES)
def test_ungated_gptq_engine_applies_the_activation_in_the_up_epilogue(tmp_path, monkeypatch, name):
    """A GPTQ tiny model (`infer quantize`'s) without gate on the GPU code path (interpreted; emulated decode and
    piecewise graphs): every MLP's act_in_up, its up kernels launched with their ACT and no activation launched
    after them; the CPU path's greedy tokens."""
    from infer import LLM, SamplingParams, kernels
    from infer.kernels import gptq_gemm
    from helpers import random_prompts
    from quant_helpers import check_gpu_path_interpreted, infer_quantize
    q = infer_quantize(name, tmp_path / "q")
    prompts = random_prompts(512, (5, 13), seed=4)
    with LLM(str(q), block_size=4) as llm:
        want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
        act = llm.engine.runner.model.layers[0].mlp.act
    assert len({t for tokens in want for t in tokens}) > 3  # (varied tokens: the comparison means something)
    launches = _launch_acts(gptq_gemm, monkeypatch)
    apart = []
    real = kernels.ungated_act
    monkeypatch.setattr(kernels, "ungated_act", lambda *a, **kw: (apart.append(1), real(*a, **kw))[1])
    check_gpu_path_interpreted(q, monkeypatch, prompts, want)
    code = {"gelu_tanh": 1, "relu2": 2, "xielu": 3}[act]
    assert set(launches) == {0, code} and apart == [], (sorted(set(launches)), len(apart))


def test_an_engine_start_compiles_the_ungated_variant(monkeypatch):
    """gptq_tune.compile_model (an engine start) on an Apertus MLP whose up applies xIELU in its epilogue: every call
    it queues for up is the xielu variant with the layer's scalars (computed there, before any graph capture), none
    plain (no LoRA hook: no step takes it); down's its plain one; and xIELU's own kernel, which steps with adapters
    launch after up."""
    from infer.kernels import fused, gptq_gemm, gptq_tune
    from quant_helpers import int4_merged_linear
    mlp = torch.nn.Module()
    mlp.up = int4_merged_linear(256, [256], ["model.layers.0.mlp.up_proj"])
    mlp.down = int4_merged_linear(256, [256], ["model.layers.0.mlp.down_proj"])
    act_fn = xielu_module(torch.float16)
    mlp.act_in_up, mlp.act, mlp.act_scalars = True, "xielu", act_fn.scalars
    queued = []
    monkeypatch.setattr(gptq_gemm, "gptq_matmul", lambda *a, **kw: queued.append(
        (a[1] is mlp.up.qweight, kw.get("act"), kw.get("act_scalars"), kw.get("gated"))))
    monkeypatch.setattr(fused, "ungated_act", lambda x, act, s, compile_only: queued.append(("after", act,
                                                                                            compile_only)))
    monkeypatch.setattr(gptq_tune, "compile_parallel", lambda calls, workers=None: len([c() for c in calls]))
    assert gptq_tune.compile_model(torch.nn.ModuleList([mlp]), 32, torch.float16) > 0
    assert queued.pop() == ("after", "xielu", True)
    ups = [q for q in queued if q[0]]
    assert ups and all(q[1:] == ("xielu", act_fn.scalars(), False) for q in ups), queued
    assert all(q[1:] == (None, None, False) for q in queued if not q[0]), queued


@pytest.mark.skipif(CUDA, reason="a GPU runs the real kernels (pytest -m gpu)")
@pytest.mark.parametrize("family", ["arcee", "apertus"])
def test_float_gpu_path_runs_the_activation_as_one_triton_launch(tmp_path, monkeypatch, family):
    """A float Arcee / Apertus on the GPU code path (interpreted; emulated graphs): each MLP's relu² / xIELU is one
    fused.ungated_act launch (torch's ops are two / a dozen), transformers' greedy tokens."""
    from infer.kernels import fused as fused_mod
    from helpers import greedy_each, random_prompts
    from quant_helpers import check_gpu_path_interpreted
    from test_probes_session61_fam import build
    hf = build(tmp_path, family)
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    calls = []
    real = fused_mod.ungated_act
    monkeypatch.setattr(fused_mod, "ungated_act", lambda *a, **kw: (calls.append(a[1]), real(*a, **kw))[1])
    check_gpu_path_interpreted(tmp_path, monkeypatch, prompts, want)
    assert set(calls) == {"relu2" if family == "arcee" else "xielu"}, set(calls)
