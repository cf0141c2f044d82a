"""Programmatic dependent launch (infer.kernels.pdl): when it is used, that every launcher sets the kernel's
constexpr and the launch attribute together, that a kernel compiled for sm_90 with it waits before it touches the
step's data, the benchmark's rows, and (-m gpu) that it changes no token."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from infer.bench import e2e_report  # noqa: E402
from infer.engine.sampling_params import SamplingParams  # noqa: E402
from infer.kernels import pdl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_supported_only_on_hopper_and_newer_with_compiled_kernels(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.supported((9, 0)) and pdl.supported((10, 0)) and pdl.supported((12, 1))
    assert not pdl.supported((8, 9)) and not pdl.supported((8, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no launch attribute to honour
    assert not pdl.supported((9, 0))


def test_on_follows_the_device_and_forced_wins():
    dev = torch.device("cuda", 7)  # a device no engine configured
    assert not pdl.on(dev) and pdl.launch(dev) == {}
    assert not pdl.on(torch.device("cpu"))
    with pdl.forced(True):
        assert pdl.on(torch.device("cpu")) and pdl.launch(dev) == {"launch_pdl": True}
        with pdl.forced(False):
            assert not pdl.on(dev) and pdl.launch(dev) == {}
        assert pdl.on(dev)
    assert not pdl.on(dev)


def test_configure_leaves_a_cpu_off_whatever_is_asked():
    for want in (None, True, False):
        assert pdl.configure(torch.device("cpu"), want) is False
        assert not pdl.on(torch.device("cpu"))


def test_configure_is_off_unless_asked_on_a_gpu_that_has_it(monkeypatch):
    """PDL measured slower on an H100 (2026-11-27): an engine uses it only when asked (True), even on a GPU where
    it is supported and the probe passes."""
    dev = torch.device("cuda", 7)
    probes = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(pdl, "supported", lambda cap: True)
    monkeypatch.setattr(pdl, "probe", lambda d: probes.append(d))  # None: the probe graph replayed correctly
    try:
        assert pdl.configure(dev, None) is False and not pdl.on(dev) and probes == []
        assert pdl.configure(dev, False) is False and probes == []
        assert pdl.configure(dev, True) is True and pdl.on(dev) and probes == [dev]
        assert pdl.launch(dev) == {"launch_pdl": True}
    finally:
        pdl._ON.pop(dev, None)


def test_prefetch_steps_from_the_environment(monkeypatch):
    from infer.errors import ConfigError
    monkeypatch.setattr(pdl, "prefetch_steps", None)
    monkeypatch.delenv("INFER_PDL_PREFETCH", raising=False)
    assert pdl.prefetch() == 2
    for value, want in (("0", 0), (" 8", 8), ("16", 16)):
        monkeypatch.setattr(pdl, "prefetch_steps", None)
        monkeypatch.setenv("INFER_PDL_PREFETCH", value)
        assert pdl.prefetch() == want
    for bad in ("3", "-1", "two", "32"):
        monkeypatch.setattr(pdl, "prefetch_steps", None)
        monkeypatch.setenv("INFER_PDL_PREFETCH", bad)
        with pytest.raises(ConfigError, match="INFER_PDL_PREFETCH") as e:
            pdl.prefetch()
        assert "0, 1, 2, 4, 8, 16" in e.value.hint


def test_engine_config_checks_pdl():
    from infer.engine.config import ConfigError, EngineConfig
    assert EngineConfig("tiny-llama").pdl is None
    assert EngineConfig("tiny-llama", pdl=False).pdl is False
    with pytest.raises(ConfigError, match="pdl must be True, False or None"):
        EngineConfig("tiny-llama", pdl="yes")


def test_cpu_engine_does_not_use_pdl():
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig("tiny-llama", device="cpu", pdl=True, max_model_len=64))
    try:
        assert engine.pdl is False
    finally:
        engine.close()


# ----------------------------------------------------------------------------------------------- compiled code
PTX_SCRIPT = r'''
import json, sys, importlib.machinery, types
import triton
from triton.backends.compiler import GPUTarget
loader = importlib.machinery.SourceFileLoader("kernel_sass", sys.argv[1])
kernel_sass = types.ModuleType("kernel_sass")
kernel_sass.__file__ = sys.argv[1]
loader.exec_module(kernel_sass)
from infer.kernels import fused, gptq_gemv, gptq_kernels, pdl

def compile_(fn, sig, const, warps=4, stages=1):
    src = triton.compiler.ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in const}), constexprs=const)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages,
                                                                         launch_pdl=const["PDL"]))
    return k.asm["ptx"]

out = {}
rms = {"x_ptr": "*fp16", "res_ptr": "*fp16", "w_ptr": "*fp16", "y_ptr": "*fp16", "h_ptr": "*fp16", "n": "i32",
       "eps": "fp32", "s_x": "i32", "s_r": "i32", "s_y": "i32", "s_h": "i32"}
mma = dict(BITS=4, ZEROS_V1=True, F32=False, WP=16, EVEN_K=True, BLOCK_N=128, BLOCK_K=128, SPLIT=True,
           DOT_F32=False, BLOCK_M=16, GROUP_M=1, FIELD_DOTS=True, SCALE_W=False, TRANS=True, PAIRS=False, ASM=True,
           BYTES=True, BYTE_DOTS=True, PRE_S=True, GS_LOG2=7, SYNC=0, **kernel_sass.NO_LORA)
gemv = dict(BITS=4, ZEROS_V1=True, F32=False, WP=16, EVEN_K=True, BLOCK_N=64, BLOCK_K=128, SPLIT=True,
            FIELD_LOOP=False, INPLACE=True, ASM=True, AHEAD=True, GS_LOG2=7, **kernel_sass.NO_LORA)
for on in (False, True):
    out[f"rms {on}"] = compile_(fused._rms_norm_kernel, rms, dict(HAS_RES=True, BLOCK=1024, PDL=on, UNIT=False, F32W=False))
    out[f"mmat {on}"] = compile_(gptq_kernels.mma_kernel, kernel_sass.ARGS, dict(mma, PDL=on), 4, 3)
    out[f"gemv {on}"] = compile_(gptq_gemv.gemv_kernel, kernel_sass.ARGS, dict(gemv, PDL=on), 4, 1)
out["mmat nothing"] = compile_(gptq_kernels.mma_kernel, kernel_sass.ARGS, dict(mma, PDL=True, PREFETCH=0), 4, 3)
out["order"] = {k: kernel_sass.pdl_order(v) for k, v in out.items()}
out["prefetches"] = {k: v.count("prefetch.global.L2") for k, v in out.items() if isinstance(v, str)}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def ptx():
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-c", PTX_SCRIPT, str(ROOT / "scripts" / "kernel-sass")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_pdl_kernels_wait_before_touching_step_data_at_sm90(ptx):
    """Compiled for sm_90 with PDL: the entry lets the next kernel launch, then waits, and nothing before the wait
    loads, stores, branches or returns; the int4 matmuls prefetch their first weights into L2 before the wait."""
    for name in ("rms", "mmat", "gemv"):
        assert ptx["order"][f"{name} True"] is None, (name, ptx["order"][f"{name} True"])
    for name in ("mmat", "gemv"):
        entry = ptx[f"{name} True"]
        assert -1 < entry.find("prefetch.global.L2") < entry.find("griddepcontrol.wait"), name
        # the packed words, the scales and the zeros of the first K steps: each a prefetch of its own
        assert ptx["prefetches"][f"{name} True"] >= 3, (name, ptx["prefetches"])
    assert "prefetch.global.L2" not in ptx["rms True"]
    # INFER_PDL_PREFETCH=0: the same start without the prefetch
    assert ptx["order"]["mmat nothing"] is None and "prefetch.global" not in ptx["mmat nothing"]


def test_kernels_without_pdl_compile_as_before(ptx):
    for name in ("rms", "mmat", "gemv"):
        code = ptx[f"{name} False"]
        assert "griddepcontrol" not in code and "prefetch.global" not in code, name
        assert ptx["order"][f"{name} False"] == "no griddepcontrol.wait / launch_dependents in its entry"


LAUNCH_SCRIPT = r'''
launch = jit.JITFunction.run
launched = []
def record(self, *args, grid, warmup, **kwargs):
    launched.append({"fn": self.fn.__name__, **{k: kwargs.get(k) for k in ("PDL", "PREFETCH", "launch_pdl")}})
    return launch(self, *args, grid=grid, warmup=True, **kwargs)
jit.JITFunction.run = record
from infer.kernels import fused, gptq_configs, gptq_gemm, gptq_tune, pdl
k, n = 256, 256
qw, qz, s, g = gptq_tune.random_gptq(k, n, 4, 128, "cpu")
wp = gptq_configs.interleave_for(128, k, 8)
for on, steps in ((True, 8), (True, 0), (False, 8)):
    pdl.prefetch_steps = steps
    with pdl.forced(on):
        for m in (1, 16):
            gptq_gemm.gptq_matmul(torch.zeros(m, k, dtype=torch.float16), qw, qz, s, g, 4, True, 128, wp,
                                  compile_only=True)
        fused.rms_norm(torch.zeros(2, 64, dtype=torch.float16), torch.ones(64, dtype=torch.float16), 1e-6)
print(json.dumps(launched))
'''


def test_launchers_pass_pdl_and_the_prefetch_together():
    """Through the real launchers (compiled for sm_90, nothing run): with PDL, every launch sets the constexpr and
    the attribute, and the int4 matmuls take INFER_PDL_PREFETCH's steps; without it, neither is set."""
    from helpers import COMPILE_ONLY_PREAMBLE, run_compile_only
    launched = run_compile_only(COMPILE_ONLY_PREAMBLE + LAUNCH_SCRIPT, 600)
    assert len(launched) == 9, launched
    for i, (on, steps) in enumerate(((True, 8), (True, 0), (False, 8))):
        mm1, mm16, norm = launched[3 * i:3 * i + 3]
        assert {mm1["fn"], mm16["fn"]} <= {"gemv_kernel", "mma_kernel"} and norm["fn"] == "_rms_norm_kernel"
        for rec in (mm1, mm16, norm):
            assert bool(rec["PDL"]) is on and bool(rec["launch_pdl"]) is on, rec
        for rec in (mm1, mm16):
            assert rec["PREFETCH"] == (steps if on else None), rec


def test_pdl_order_finds_early_loads_and_branches():
    """The order check itself, on hand-written entries: it must reject what would read a kernel's inputs early."""
    loader_env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = r'''
import importlib.machinery, sys, types
loader = importlib.machinery.SourceFileLoader("kernel_sass", sys.argv[1])
ks = types.ModuleType("kernel_sass"); ks.__file__ = sys.argv[1]; loader.exec_module(ks)
head = ".visible .entry k(\n{\n\tld.param.u64 %rd1, [k_param_0];\n"
good = head + "\tprefetch.global.L2 [%rd1];\n\tgriddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;\n\tld.global.b32 %r1, [%rd1];\n"
print(ks.pdl_order(good))
print(ks.pdl_order(head + "\tld.global.b32 %r1, [%rd1];\n\tgriddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;\n"))
print(ks.pdl_order(head + "\tgriddepcontrol.launch_dependents;\n\t@%p1 bra $L__BB0_2;\n\tgriddepcontrol.wait;\n"))
print(ks.pdl_order(head + "\tgriddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n"))
print(ks.pdl_order(head + "\tgriddepcontrol.launch_dependents;\n\tst.global.b32 [%rd1], %r1;\n\tgriddepcontrol.wait;\n"))
'''
    res = subprocess.run([sys.executable, "-c", script, str(ROOT / "scripts" / "kernel-sass")], capture_output=True,
                         text=True, timeout=300, env=loader_env)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()[-5:]
    assert lines == ["None", "'ld.global' before griddepcontrol.wait", "'bra' before griddepcontrol.wait",
                     "launch_dependents after the wait", "'st.global' before griddepcontrol.wait"], lines


# ----------------------------------------------------------------------------------------------- benchmark rows
def _row(lora: str, tok_s: float, tpot: float, roof: float = 1000.0) -> dict:
    return {"model": "m", "engine": "infer", "lora": lora, "output_tok_s": tok_s, "mean_tpot_ms": tpot,
            "mean_ttft_ms": 30.0, "roofline_tok_s": roof, "pdl": "with PDL" in lora}


def test_pdl_gains_compare_like_with_like():
    rows = [_row("none", 1000.0, 4.4), _row(f"none, {e2e_report.WITH_PDL}", 1100.0, 4.0),
            _row("16 mixed r16", 800.0, 5.5, 800.0), _row(f"16 mixed r16, {e2e_report.WITH_PDL}", 880.0, 5.0, 800.0)]
    gains = e2e_report.pdl_gains(rows)
    assert len(gains) == 2
    assert "m infer, none: programmatic dependent launch gives 1.100x the throughput and 1.100x" in gains[0]
    assert "m infer, 16 mixed r16: programmatic dependent launch gives 1.100x" in gains[1]
    # each adapter row against the plain row of its own variant: 880 / 1100 and 800 / 1000, both 20%
    costs = e2e_report.adapter_costs(rows)
    assert [c.split(": costs ")[1][:3] for c in costs] == ["20%", "20%"], costs
    assert f"16 mixed r16, {e2e_report.WITH_PDL}" in costs[1]


def test_gpu_e2e_compare_pdl_adds_the_modes(tmp_path):
    from types import SimpleNamespace

    from infer.bench import gpu_e2e
    args = gpu_e2e.parse_args(["--out", str(tmp_path), "--compare-pdl", "--num-adapters", "0"])
    run = SimpleNamespace(args=args)
    modes = gpu_e2e.engine_modes(run, tmp_path)
    assert [m[0] for m in modes] == ["none", f"none, {e2e_report.WITH_PDL}"]
    assert "pdl" in e2e_report.COLUMNS


def test_gpu_e2e_compare_silu_adds_the_mode_and_its_note(tmp_path):
    """--compare-silu: the engine without adapters with silu_and_mul launched apart, and the note that sets the
    default engine (its gate_up kernel applies it) against it."""
    from types import SimpleNamespace

    from infer.bench import gpu_e2e
    args = gpu_e2e.parse_args(["--out", str(tmp_path), "--compare-silu", "--num-adapters", "0"])
    assert [m[0] for m in gpu_e2e.engine_modes(SimpleNamespace(args=args), tmp_path)] == [
        "none", f"none, {e2e_report.SILU_APART}"]
    fp16 = gpu_e2e.parse_args(["--out", str(tmp_path), "--compare-silu", "--num-adapters", "0", "--fp16"])
    assert [m[0] for m in gpu_e2e.engine_modes(SimpleNamespace(args=fp16), tmp_path)] == ["none"]  # no int4 kernel
    row = dict(model="7b", engine="infer", output_tok_s=4400.0, mean_tpot_ms=3.5, mean_ttft_ms=14.0)
    rows = [dict(row, lora="none"), dict(row, lora=f"none, {e2e_report.SILU_APART}", output_tok_s=4300.0,
                                         mean_tpot_ms=3.6)]
    [note] = e2e_report.silu_gains(rows)
    assert "1.023x the throughput" in note and "1.029x the decode speed" in note, note


# ----------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_changes_no_token_on_the_gpu():
    """The same fp16 model's greedy tokens and logprobs with the kernels launched with and without PDL, CUDA graphs
    on (decode graphs and the pieces: more prompts than sequences, so prompts join running decodes): identical, bit
    for bit (PDL only moves when a kernel's programs start; every kernel is deterministic)."""
    from infer import LLM
    from infer.models.tiny import ensure_builtin
    cap = torch.cuda.get_device_capability()
    if not pdl.supported(cap):
        pytest.skip(f"compute capability {cap[0]}.{cap[1]}: no PDL")
    path = ensure_builtin("tiny-llama")
    prompts = [[3 + (i * 7 + j) % 200 for j in range(5 + 9 * i)] for i in range(8)]
    params = [SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True, logprobs=2) for i in range(8)]
    outs = {}
    for want in (True, False):
        llm = LLM(str(path), device="cuda", dtype="float16", max_num_seqs=3, block_size=16, pdl=want,
                  cuda_graph_max_tokens=64)
        try:
            assert llm.engine.pdl is want
            outs[want] = [(o.token_ids, repr(o.logprobs)) for o in llm.generate(prompts, params)]
        finally:
            llm.close()
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_with_int4_and_mixed_adapters_changes_no_token_on_the_gpu(tmp_path):
    """Where PDL meets everything else: a random int4 model (Llama-2-7B layer shapes, 2 layers) with 4 mixed rank-16
    adapters, the LoRA shrink on the second stream beside the int4 matmul (its edges cross streams in the recorded
    graphs), decode graphs and the pieces (more prompts than sequences, staggered lengths). The tokens with PDL
    equal those without it, request by request."""
    from infer.bench import e2e_models
    from infer.bench import gpu_e2e as e2e
    cap = torch.cuda.get_device_capability()
    if not pdl.supported(cap):
        pytest.skip(f"compute capability {cap[0]}.{cap[1]}: no PDL")
    cfg = e2e_models.hf_config("llama-2-7b", num_hidden_layers=2)
    model, _ = e2e_models.build_model(cfg, torch.float16, "cuda", quantized=True)
    adapters = e2e_models.write_random_adapters(cfg, tmp_path, 4, 16)
    reqs = e2e.make_requests(cfg.vocab_size, 12, prompt_len=20, output_len=24, adapters=list(adapters) + [None],
                             stagger=True)
    got = {}
    for want in (True, False):
        engine = e2e.build_engine(model, cfg, e2e_models.make_tokenizer(cfg.vocab_size), "cuda", adapters, 16, 4,
                                  max_len=128, pdl=want)
        try:
            assert engine.pdl is want
            for i, r in enumerate(reqs):
                engine.add_request(str(i), r.prompt_token_ids, SamplingParams(max_new_tokens=r.output_len,
                                                                              ignore_eos=True), lora=r.lora)
            out = {}
            while engine.has_unfinished_requests():
                out.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            got[want] = out
            assert engine.stats()["piecewise_graph_steps"] > 0
        finally:
            engine.close()
    assert len(got[True]) == len(reqs) and got[True] == got[False]
