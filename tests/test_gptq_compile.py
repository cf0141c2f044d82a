"""Parallel compilation of the GPTQ kernels (gptq_tune.compile_parallel / compile_model, gptq_matmul's
compile_only): the kernels are compiled for an H100 (sm_90) on this machine without a GPU, through the real
launcher, with the compile side of a Triton driver (scripts/kernel-sass's CompileOnlyDriver), which cannot load a
kernel. What it shows: every queued call compiles on the thread pool, and the launch that follows with the same
arguments finds its kernel in Triton's cache (it fails only where that driver cannot load it), so neither a tuning
pass nor an engine's first steps compile again."""

import json
import textwrap

import pytest

from helpers import COMPILE_ONLY_PREAMBLE, run_compile_only

triton = pytest.importorskip("triton")
pytest.importorskip("triton.runtime._async_compile")

SCRIPT = COMPILE_ONLY_PREAMBLE + textwrap.dedent('''

    from infer.kernels import gptq_configs, gptq_gemm, gptq_tune
    from infer.models.layers import MergedLinear
    from infer.quant import packing
    from infer.quant.config import GPTQConfig
    from infer.quant.gptq_linear import GPTQLinearMethod

    def launch_all(calls):
        """Launch each call; return how many compiled again (the loads fail on the stand-in driver)."""
        before, failed = len(compiled), 0
        for call in calls:
            try:
                call()
            except AttributeError as e:
                assert "launcher_cls" in str(e), e  # past the cache lookup, at the kernel's load
                failed += 1
        assert failed == len(calls), (failed, len(calls))
        return len(compiled) - before

    out = {}
    # 1. tuning: one candidate of each kernel kind, compiled together, then launched with the same arguments
    k, n = 256, 256
    qw, qz, s, g = gptq_tune.random_gptq(k, n, 4, 128, "cpu")
    wp = gptq_configs.interleave_for(128, k, 8)
    cfgs = [(1, gptq_tune._inplace(64, 4, 2, 1)),
            (1, dict(kernel="gemv", BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=1)),
            (16, gptq_tune._field("mma", 16, 128, 4, 2, 3, False, True)),
            (16, gptq_tune._field("mmat", 16, 128, 4, 2, 3, False)),
            (5, dict(kernel="gemv", BLOCK_M=4, BLOCK_N=32, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=2)),
            (64, gptq_tune._field("mma", 64, 128, 4, 1, 3, True, True))]
    xs = {m: torch.randn(m, k, dtype=torch.float16) for m, _ in cfgs}
    calls = [lambda m=m, c=c: gptq_gemm.gptq_matmul(xs[m], qw, qz, s, g, 4, True, 128, wp, config=c,
                                                    compile_only=True) for m, c in cfgs]
    tried = []  # what compile_parallel hands to _load: every kernel it compiled (loading fails on this driver)
    real_load = gptq_tune._load
    gptq_tune._load = lambda kernels: real_load([tried.append(k) or k for k in kernels])
    out["queued"] = gptq_tune.compile_parallel(calls, workers=2)
    gptq_tune._load = real_load
    out["compiled"] = len(compiled)
    out["load_tried"] = sum(k is not None and hasattr(k, "_init_handles") for k in tried)
    out["recompiled"] = launch_all([lambda m=m, c=c: gptq_gemm.gptq_matmul(xs[m], qw, qz, s, g, 4, True, 128, wp,
                                                                           config=c) for m, c in cfgs])

    # 2. an engine start: compile_model on kernel-mode GPTQ layers (one act-order), then every row count the
    # engine can launch up to max_tokens goes through the layers' own call (past 256 rows: dequantize + cuBLAS,
    # whose dequantize kernel compile_model compiles too)
    cfg = GPTQConfig(bits=4, group_size=128, desc_act=False, sym=True)
    layers = torch.nn.ModuleList()
    for i, (sizes, perm) in enumerate((([256, 128], None), ([128], torch.randperm(256)))):
        names = [f"model.layers.{i}.p{j}" for j in range(len(sizes))]
        layer = MergedLinear(256, sizes, names, False, GPTQLinearMethod(cfg, True), torch.float16)
        for j, size in enumerate(sizes):
            tensors = dict(zip(("qweight", "qzeros", "scales", "g_idx"),
                               packing.quantize_rtn(torch.randn(size, 256), 4, 128, True, perm)))
            for name, t in tensors.items():
                layer.load_shard(name, j, t)
        layer.finish_loading()
        layers.append(layer)
    assert layers[1].act_perm is not None and layers[0].gptq_interleave > 1
    # an MLP's gate|up layer whose kernel applies silu_and_mul in its epilogue (EngineConfig.silu_in_gate_up)
    gate_up = MergedLinear(256, [128, 128], ["model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj"], False,
                           GPTQLinearMethod(cfg, True), torch.float16)
    for j in range(2):
        for name, t in zip(("qweight", "qzeros", "scales", "g_idx"),
                           packing.quantize_rtn(torch.randn(128, 256), 4, 128, True)):
            gate_up.load_shard(name, j, t)
    gate_up.finish_loading()
    mlp = torch.nn.Module()
    mlp.gate_up_proj, mlp.act_in_gate_up = gate_up, True
    layers.append(mlp)
    before = len(compiled)
    out["model_queued"] = gptq_tune.compile_model(layers, 300, torch.float16, workers=2)
    out["model_compiled"] = len(compiled) - before
    rows = gptq_tune.bucket_rows(300)
    cpu = torch.device("cpu")
    out["dequant_rows"] = [r for r in rows if gptq_gemm._choice(r, 384, 256, 4, 128, 1, None, cpu)[0] == "dequant"]
    out["model_recompiled"] = launch_all([
        lambda l=l, r=r: gptq_gemm.gptq_matmul(
            torch.randn(r, 256, dtype=torch.float16).index_select(-1, l.act_perm) if l.act_perm is not None
            else torch.randn(r, 256, dtype=torch.float16), l.qweight, l.qzeros, l.scales, l.g_idx, 4, True,
            l.gptq_group_size, l.gptq_interleave) for l in layers[:2] for r in rows])
    fused = [r for r in rows if gptq_gemm._choice(r, 256, 256, 4, 128, 1, None, cpu)[2]]
    out["gated_rows"] = [r for r in fused if gptq_gemm.gated_fits(*gptq_gemm._choice(r, 256, 256, 4, 128, 1, None,
                                                                                      cpu)[:2], 256)]
    out["gated_recompiled"] = launch_all([  # its fused rows, with silu_and_mul in the epilogue where it fits
        lambda r=r: gptq_gemm.gptq_matmul(torch.randn(r, 256, dtype=torch.float16), gate_up.qweight, gate_up.qzeros,
                                          gate_up.scales, gate_up.g_idx, 4, True, gate_up.gptq_group_size,
                                          gate_up.gptq_interleave, gated=True) for r in out["gated_rows"]])
    print(json.dumps(out))
''')


def test_parallel_compile_fills_the_cache_the_launch_reads():
    out = run_compile_only(SCRIPT, 900)
    assert out["queued"] == out["compiled"] == out["load_tried"] == 6, out
    assert out["recompiled"] == 0, out
    # two layer shapes (the merged 384-column one, the 128-column act-order one) x the kernels their row counts
    # choose: several compiles, none left for the launches
    assert out["model_queued"] > 0 and out["model_compiled"] >= 4 and out["dequant_rows"], out
    assert out["model_recompiled"] == 0, out
    # the gate|up layer's gated variants (sm_90 code of the epilogue's split into gate and up) compiled at start
    assert out["gated_rows"] and out["gated_recompiled"] == 0, out


@pytest.mark.gpu
def test_parallel_compile_on_a_gpu_leaves_nothing_to_compile_at_launch(monkeypatch):
    """The same on a real GPU, at a 7B layer's size: the quick tuning candidates of M = 1 and 16 compiled on the
    pool, then launched, compile nothing more and compute what dequantize + cuBLAS computes."""
    import torch
    import triton.runtime.jit as jit

    from infer.kernels import gptq_configs, gptq_gemm, gptq_tune
    compiled = []
    real = jit.JITFunction._do_compile
    monkeypatch.setattr(jit.JITFunction, "_do_compile",
                        lambda self, key, *a, **k: compiled.append(key) or real(self, key, *a, **k))
    k, n = 4096, 4096
    qw, qz, s, g = gptq_tune.random_gptq(k, n, 4, 128, "cuda")
    wp, step = gptq_configs.interleave_for(128, k, 8), gptq_configs.block_k_limit(128, k, 8)
    jobs = [(m, c) for m in (1, 16) for c in gptq_tune.candidates(m, step, quick=True) if c["kernel"] != "dequant"]
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.float16) for m in (1, 16)}
    assert gptq_tune.compile_parallel([lambda m=m, c=c: gptq_gemm.gptq_matmul(
        xs[m], qw, qz, s, g, 4, True, 128, wp, config=c, compile_only=True) for m, c in jobs]) == len(jobs)
    want = {m: gptq_gemm.gptq_matmul(x, qw, qz, s, g, 4, True, 128, wp, config={"kernel": "dequant"}).float()
            for m, x in xs.items()}
    from triton.compiler.compiler import CompiledKernel
    loaded_at_launch = []  # a kernel's first launch loads it and builds its launcher (gcc): compile_parallel did
    real_init = CompiledKernel._init_handles
    monkeypatch.setattr(CompiledKernel, "_init_handles",
                        lambda self: (self.module is None and loaded_at_launch.append(self)) or real_init(self))
    before = len(compiled)
    for m, c in jobs:
        got = gptq_gemm.gptq_matmul(xs[m], qw, qz, s, g, 4, True, 128, wp, config=c)
        assert ((got.float() - want[m]).abs().max() / want[m].abs().max()) < 1e-2, c
    assert len(compiled) == before, f"{len(compiled) - before} kernels compiled at launch after compile_parallel"
    assert not loaded_at_launch, f"{len(loaded_at_launch)} kernels loaded at their first launch"


def test_tuning_pass_on_cpu_interpreted(monkeypatch, tmp_path):
    """The engine start's tuning code (tune_model -> tune_shape -> compile_parallel, the correctness filter, the
    cache file) run on CPU with the kernels interpreted and a wall-clock stand-in for the CUDA-graph timer: every
    bucket gets a winner that computes y, a candidate that raises is skipped, and the winners are saved for the GPU's
    name, and a candidate that computes a wrong y never wins however fast it is."""
    import time

    import torch

    from infer.kernels import gptq_configs, gptq_gemm, gptq_tune, reference
    from infer.models.layers import MergedLinear
    from infer.quant import packing
    from infer.quant.config import GPTQConfig
    from infer.quant.gptq_linear import GPTQLinearMethod
    if torch.cuda.is_available():
        pytest.skip("a GPU tunes for real (scripts/gpu-check kernels)")

    def wall_clock(fns, reps=3):
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(fns)
    monkeypatch.setenv("INFER_CACHE", str(tmp_path))
    monkeypatch.setattr(gptq_tune, "time_graph", wall_clock)
    monkeypatch.setattr(gptq_tune, "L2_BUST_BYTES", 1)  # two copies of the layer
    monkeypatch.setattr(gptq_configs, "gpu_name", lambda device: "CPU_TEST")
    gptq_configs.load.cache_clear()
    few = gptq_tune.quick_candidates

    def sample(m, step, k=None):  # a handful per bucket (the interpreter is slow), and one that cannot run
        cands = few(m, step, k)
        return cands[:2] + cands[-2:] + [dict(cands[-1], kernel="mma", BLOCK_M=16, BLOCK_N=48, BLOCK_K=128,
                                              SPLIT_K=1, num_warps=4, num_stages=2),  # BLOCK_N not a power of 2
                                     dict(kernel="dequant", WRONG=True)]  # fails the correctness check
    monkeypatch.setattr(gptq_tune, "quick_candidates", sample)
    real = gptq_gemm.gptq_matmul

    def with_a_wrong_one(x, *args, config=None, compile_only=False, **kw):  # WRONG: the fastest, a wrong y
        if config is not None and config.get("WRONG"):
            return None if compile_only else torch.ones(x.shape[0], args[0].shape[1], dtype=x.dtype)
        return real(x, *args, config=config, compile_only=compile_only, **kw)
    monkeypatch.setattr(gptq_gemm, "gptq_matmul", with_a_wrong_one)
    cfg = GPTQConfig(bits=4, group_size=128, desc_act=False, sym=True)
    layer = MergedLinear(256, [64], ["model.layers.0.p"], False, GPTQLinearMethod(cfg, True), torch.float16)
    tensors = dict(zip(("qweight", "qzeros", "scales", "g_idx"), packing.quantize_rtn(torch.randn(64, 256), 4, 128)))
    for name, t in tensors.items():
        layer.load_shard(name, 0, t)
    layer.finish_loading()
    model = torch.nn.ModuleList([layer])
    assert gptq_tune.layer_shapes(model) == {(64, 256, 4, 128)}
    logged = []
    shapes, seconds = gptq_tune.tune_model(model, 40, torch.device("cpu"), log=logged.append, quick=True)
    assert shapes == 1 and seconds > 0
    skipped = [line for line in logged if line.startswith("  skip")]
    assert len(skipped) == 7 and all("'BLOCK_N': 48" in line for line in skipped), logged
    saved = json.loads(gptq_configs.cache_file("CPU_TEST").read_text())["64,256"]
    assert sorted(int(b) for b in saved) == [1, 2, 4, 8, 16, 32, 64]
    for b, chosen in saved.items():
        assert chosen.get("BLOCK_N") != 48 and not chosen.get("WRONG"), chosen
        x = torch.randn(int(b), 256).half()
        got = gptq_gemm.gptq_matmul(x, layer.qweight, layer.qzeros, layer.scales, layer.g_idx, 4, True, 128,
                                    layer.gptq_interleave, config=chosen)
        want = reference.gptq_matmul(x, layer.qweight, layer.qzeros, layer.scales, layer.g_idx, 4, True, 128,
                                     layer.gptq_interleave)
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()) < 1e-2, (b, chosen)
    gptq_configs.load.cache_clear()


def test_compile_parallel_inside_another_async_compile_leaves_the_compiles_to_the_launch():
    """Triton allows one AsyncCompileMode at a time: inside someone else's, compile_parallel queues nothing (each
    kernel compiles at its launch) instead of raising."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    from infer.kernels import gptq_tune
    ran = []
    with ThreadPoolExecutor(1) as pool, AsyncCompileMode(pool):
        assert gptq_tune.compile_parallel([lambda: ran.append(1)]) == 0
    assert ran == [] and gptq_tune.compile_parallel([lambda: ran.append(1)], workers=1) == 1 and ran == [1]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 15, 16, 17, 40, 48, 64, 100, 256, 300, 4096, 5000])
def test_bucket_rows_reach_every_kernel_variant_a_step_can_launch(max_tokens):
    """A step of r rows (1 <= r <= max_tokens) launches the configuration of r's M bucket, specialized by Triton
    on r == 1 and r % 16 == 0: compile_model's row counts cover every such (bucket, specialization), so no row
    count a user's request brings compiles a kernel, and none lies outside the engine's steps."""
    from infer.kernels import gptq_configs, gptq_tune

    def variant(r):
        return gptq_configs.bucket(r), r == 1, r % 16 == 0
    rows = gptq_tune.bucket_rows(max_tokens)
    assert all(1 <= r <= max_tokens for r in rows)
    assert {variant(r) for r in rows} == {variant(r) for r in range(1, max_tokens + 1)}


def test_load_does_what_a_first_launch_does_and_skips_what_cannot_load():
    """gptq_tune._load calls each compiled kernel's `_init_handles` (its binary onto the GPU, its launcher built),
    so that a user's first request does not; a failed compile (None) or a kernel that cannot load is skipped and
    left to fail at its launch."""
    from infer.kernels import gptq_tune

    class Kernel:
        def __init__(self, fails=False):
            self.calls, self.fails = 0, fails

        def _init_handles(self):
            self.calls += 1
            if self.fails:
                raise RuntimeError("no launcher")

    good, bad = Kernel(), Kernel(fails=True)
    assert gptq_tune._load([good, None, bad, good]) == 2
    assert good.calls == 2 and bad.calls == 1


def test_wave_splits_fill_whole_waves_of_programs():
    """gptq_tune.wave_splits at a 7B's shapes on an H100 (132 SMs): the split-K counts (as the launcher runs them)
    whose programs fill 1-4 whole waves, each program keeping two K steps; nothing for a kernel without split-K."""
    from infer.kernels import gptq_tune
    mma = dict(kernel="mma", BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=3, FIELD=True)
    # gate_up at 16 rows: 172 column tiles; 3 x 172 = 516 programs, 4 per SM less 12 (2 x 172 is the winner's own)
    assert [c["SPLIT_K"] for c in gptq_tune.wave_splits(mma, 16, 22016, 4096, 132)] == [3]
    # o: 32 tiles; 4 and 8 fill one and two waves, 12 rounds to 11 (3 K steps a program), 16 to 16
    o = gptq_tune.wave_splits(dict(mma, SPLIT_K=8), 16, 4096, 4096, 132)
    assert [c["SPLIT_K"] for c in o] == [4, 11, 16] and all(c["BLOCK_N"] == 128 for c in o)
    # a gemv of one row: its tiles are its column blocks times the rows
    gemv = dict(kernel="gemv", BLOCK_N=64, BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=1)
    assert [c["SPLIT_K"] for c in gptq_tune.wave_splits(gemv, 1, 4096, 4096, 132)] == [2, 4, 6]
    for cfg in (dict(mma, SPLIT_K=1), {"kernel": "dequant"}):
        assert gptq_tune.wave_splits(cfg, 16, 4096, 4096, 132) == []
    assert gptq_tune.wave_splits(mma, 16, 64, 256, 132) == []  # two K steps: no split leaves each program two


def test_tuning_times_other_gpus_shipped_winners(monkeypatch, tmp_path):
    """A GPU without a table of its own times, beside its candidates, what the tables shipped for other GPUs chose
    for the same shape and M bucket (each once, never its own table's), and such a config can win: an H200's first
    engine start then does no worse than the H100's full tune."""
    import torch

    from infer.kernels import gptq_configs, gptq_gemm, gptq_tune
    mma = dict(kernel="mma", BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=3, FIELD=True)
    theirs = dict(mma, kernel="mmat", SPLIT_K=5)
    (tmp_path / "GPU_A.json").write_text(json.dumps({"4096,4096": {"16": theirs, "1": {"kernel": "gemv"}}}))
    (tmp_path / "GPU_B.json").write_text(json.dumps({"4096,4096": {"16": theirs}, "12288,4096": {"16": mma}}))
    (tmp_path / "GPU_OWN.json").write_text(json.dumps({"4096,4096": {"16": dict(mma, SPLIT_K=7)}}))
    monkeypatch.setattr(gptq_configs, "SHIPPED", tmp_path)
    assert gptq_tune.shipped_winners(4096, 4096, 9, "GPU_OWN") == [theirs]  # bucket 16; deduplicated; not its own
    assert gptq_tune.shipped_winners(4096, 4096, 16, None) == [theirs, dict(mma, SPLIT_K=7)]
    assert gptq_tune.shipped_winners(4096, 11008, 16, None) == []
    monkeypatch.setattr(gptq_tune, "candidates", lambda m, step, quick, k: [dict(mma)])
    monkeypatch.setattr(gptq_tune, "compile_parallel", lambda calls: [c() for c in calls] and 0)
    monkeypatch.setattr(gptq_tune, "L2_BUST_BYTES", 1)
    monkeypatch.setattr(gptq_configs, "num_sms", lambda device: 2)  # no whole-wave split differs here
    seen, compiled = [], []

    def recording(x, *a, config=None, compile_only=False, **kw):
        (compiled if compile_only else seen).append(config)
        return torch.ones(x.shape[0], 4096)
    monkeypatch.setattr(gptq_gemm, "gptq_matmul", recording)
    monkeypatch.setattr(gptq_tune, "time_graph", lambda fns: 5.0 if seen[-1]["kernel"] == "mmat" else 9.0)
    monkeypatch.setattr(gptq_tune, "weight_copies", lambda *a: [(None,) * 4, (None,) * 4])
    res = gptq_tune.tune_shape(4096, 4096, [16], device="cpu")
    assert compiled == [mma, theirs, dict(mma, SPLIT_K=7)]  # a CPU has no table of its own: every shipped one
    assert res[16][0]["kernel"] == "mmat" and res[16][1] == 5.0


def test_tuning_times_the_winner_with_whole_wave_splits(monkeypatch):
    """tune_shape: after the candidate lists, the bucket's winner with its whole-wave splits is timed too, and a
    faster one wins (here, a stand-in timer that makes split 3 the fastest)."""
    import torch

    from infer.kernels import gptq_configs, gptq_gemm, gptq_tune
    mma = dict(kernel="mma", BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=3, FIELD=True)
    timed = []
    monkeypatch.setattr(gptq_tune, "candidates", lambda m, step, quick, k: [dict(mma), dict(mma, SPLIT_K=4)])
    monkeypatch.setattr(gptq_tune, "shipped_winners", lambda n, k, m, own: [])  # (timed in the test below)
    monkeypatch.setattr(gptq_tune, "compile_parallel", lambda calls: 0)
    monkeypatch.setattr(gptq_tune, "L2_BUST_BYTES", 1)
    monkeypatch.setattr(gptq_configs, "num_sms", lambda device: 132)
    seen = []  # the config of each call: the correctness check comes just before the timing

    def recording(x, *a, config=None, **kw):
        seen.append(config)
        return torch.ones(x.shape[0], 22016)

    def fake_time(fns):
        timed.append(seen[-1]["SPLIT_K"])
        return {2: 10.0, 4: 12.0, 3: 8.0}.get(seen[-1]["SPLIT_K"], 20.0)
    monkeypatch.setattr(gptq_gemm, "gptq_matmul", recording)
    monkeypatch.setattr(gptq_tune, "time_graph", fake_time)
    monkeypatch.setattr(gptq_tune, "weight_copies", lambda *a: [(None,) * 4, (None,) * 4])
    res = gptq_tune.tune_shape(22016, 4096, [16], device="cpu")
    assert timed == [2, 4, 3] and res[16] == (dict(mma, SPLIT_K=3), 8.0)
