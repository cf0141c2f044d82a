"""Session 59: the fused MoE kernels' tuned launch configs (kernels.moe_tune, kernels.moe.step_config): a table per
GPU in gptq_configs' files of section "moe" (shipped + the user's cache), keyed by the layer's shape and the step's
bucket of tokens; the candidate space (fits sm_90's shared memory, no duplicates, BLOCK_K never tuned); the launch
taking a tuned entry; every candidate computing the reference; the tuner on a fake timer picking the fastest,
writing the cache, and a second start reading it instead of tuning again; the warm-up reaching every config the
table can choose."""

from __future__ import annotations

import json
import re

import pytest
import torch

from infer.kernels import gptq_configs, moe, moe_tune, reference

from helpers import nan_filled_empty
from test_probes_session56_moeq import int4_experts, routing

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")


@pytest.fixture
def moe_cache(tmp_path, monkeypatch):
    """An empty user cache and shipped folder; gptq_configs' loaded tables forgotten before and after."""
    monkeypatch.setenv("INFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gptq_configs, "SHIPPED", tmp_path / "shipped")
    gptq_configs.load.cache_clear()
    yield tmp_path
    gptq_configs.load.cache_clear()


def use_table(monkeypatch, name: str) -> None:
    """The launches on this (CPU) device read GPU `name`'s tables, as a GPU's launches read its own."""
    monkeypatch.setattr(gptq_configs, "table", lambda device, section="": gptq_configs.load(name, section))


def meta_int4(e: int, k: int, n: int, group_size: int, perm: bool = False) -> reference.Int4Experts:
    """Int4Experts of these shapes on the meta device (what the candidates depend on: shapes and group layout)."""
    t = dict(device="meta", dtype=torch.int32)
    groups = k // group_size if group_size > 0 else k // 128
    return reference.Int4Experts(torch.empty(e, k // 8, n, **t), torch.empty(e, groups, n // 8, **t),
                                 torch.empty(e, groups, n, device="meta", dtype=torch.float16),
                                 torch.empty(e, k, **t), group_size, True, torch.empty(e, k, **t) if perm else None)


# ------------------------------------------------------------------------------------------------ the table
def test_the_moe_table_is_its_own_section_of_the_gptq_config_files(moe_cache):
    """Shipped entries under configs/moe/<GPU>.json, the user's under $INFER_CACHE/kernels/moe/<GPU>.json winning
    per bucket; saving merges into the file and the loaded table; the dense GPTQ table of the same GPU (its own
    files) neither sees nor loses them; the bucket of a step is its next power of two, capped at 4096."""
    key = moe.layer_key(128, 2048, 768, 8, torch.bfloat16)
    assert key == "128,2048,768,8,bfloat16"
    w = int4_experts(2, 64, 32, 32, False, True, True, 0)
    assert moe.experts_key(w, w, 2, torch.float16) == "2,64,64,2,int4-g32/32-float16"  # (w as both stacks)
    shipped = moe_cache / "shipped" / "moe"
    shipped.mkdir(parents=True)
    (shipped / "GPU_X.json").write_text(json.dumps({key: {"1": {"BLOCK_M": 16, "BLOCK_N": 32},
                                                          "64": {"BLOCK_M": 32}}}))
    gptq_configs.save("GPU_X", {"4096,4096": {1: {"kernel": "dequant"}}})  # the dense table, its own file
    path = gptq_configs.save("GPU_X", {key: {64: {"BLOCK_M": 64, "BLOCK_N": 128}, 2: {"BLOCK_M": 16}}}, moe.SECTION)
    assert path == moe_cache / "cache" / "kernels" / "moe" / "GPU_X.json"
    assert json.loads(path.read_text()) == {key: {"2": {"BLOCK_M": 16}, "64": {"BLOCK_M": 64, "BLOCK_N": 128}},
                                        gptq_configs.FORMAT_KEY: gptq_configs.FORMAT[moe.SECTION]}
    for fresh in (False, True):  # the table saved into, and a restart's read of the files
        if fresh:
            gptq_configs.load.cache_clear()
        table = gptq_configs.load("GPU_X", moe.SECTION)
        assert table == {key: {1: {"BLOCK_M": 16, "BLOCK_N": 32}, 2: {"BLOCK_M": 16},
                               64: {"BLOCK_M": 64, "BLOCK_N": 128}}}
        assert gptq_configs.load("GPU_X") == {"4096,4096": {1: {"kernel": "dequant"}}}
    assert [gptq_configs.bucket(t) for t in (1, 2, 3, 33, 64, 65, 5000)] == [1, 2, 4, 64, 64, 128, 4096]
    assert moe.tuned_config(key, 40, torch.device("cpu")) is None  # (off a GPU no table)


def test_the_step_config_is_the_tuned_entry_of_its_bucket_else_the_heuristics(moe_cache, monkeypatch):
    """step_config: the entry of the step's bucket (a pure function of the count of tokens), else choose_block_m
    alone; config_steps lists each config a step of 1 to max_tokens tokens chooses with its fewest tokens."""
    key = moe.layer_key(8, 64, 32, 2, torch.float32)
    cpu = torch.device("cpu")
    tuned = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    gptq_configs.save("GPU_X", {key: {4: {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
                                      256: tuned}}, moe.SECTION)
    use_table(monkeypatch, "GPU_X")
    assert moe.step_config(key, 1, 2, 8, cpu) == {"BLOCK_M": 16}
    assert moe.step_config(key, 3, 2, 8, cpu)["BLOCK_N"] == moe.step_config(key, 4, 2, 8, cpu)["BLOCK_N"] == 32
    assert moe.step_config(key, 129, 2, 8, cpu) == moe.step_config(key, 256, 2, 8, cpu) == tuned
    assert moe.step_config(key, 128, 2, 8, cpu) == {"BLOCK_M": 32}  # bucket 128: untuned, choose_block_m's
    assert moe.step_config("other", 256, 2, 8, cpu) == {"BLOCK_M": 64}
    steps = moe.config_steps(300, 2, 8, key, cpu)
    assert {t: dict(c) for c, t in steps.items()} == {
        1: {"BLOCK_M": 16}, 3: {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
        128: {"BLOCK_M": 32}, 129: tuned, 257: {"BLOCK_M": 64}}
    assert {t for t in moe.config_steps(300, 2, 8, "other", cpu).values()} == set(moe.block_m_steps(300, 2, 8)
                                                                                 .values())


# ------------------------------------------------------------------------------------------------ candidates
LAYERS = [  # experts, top-k, hidden, expert width, group sizes (gate_up, down; None: float), x's dtype
    (128, 8, 2048, 768, (128, 128), torch.bfloat16),  # Qwen3-30B-A3B
    (8, 2, 4096, 14336, (128, 128), torch.float16),  # Mixtral-8x7B
    (8, 2, 4096, 14336, (0, 0), torch.bfloat16),  # act-order read per row
    (60, 4, 2048, 1408, None, torch.bfloat16),  # Qwen2-MoE float
    (16, 2, 64, 32, None, torch.float32),
]


@pytest.mark.parametrize("case", LAYERS)
def test_every_candidate_fits_sm90_shared_memory_and_none_is_repeated(case):
    """Every candidate of every bucket (full and quick) fits sm_90's shared memory by moe.smem_bytes in both
    matmuls, none twice, BLOCK_K never among the keys (the layer's, moe.tiles), BLOCK_M at most the step's pairs
    (from 16); the heuristics' own first; the quick set within the full one; and the good regions there (a
    vLLM-like decode tile: 16 rows, 64 columns, 4 warps; a prefill one: 64 rows, 128 columns, 4 stages)."""
    e, k, h, i, groups, dtype = case
    w13, w2 = (meta_int4(e, h, 2 * i, groups[0]), meta_int4(e, i, h, groups[1])) if groups else (
        torch.empty(e, 2 * i, h, device="meta", dtype=dtype), torch.empty(e, h, i, device="meta", dtype=dtype))
    layer = moe_tune.layer_shape(w13, w2, k, dtype)
    elem = torch.empty(0, dtype=dtype).element_size()
    for t in (1, 2, 16, 64, 512, 4096):
        full, quick = moe_tune.candidates(t, layer), moe_tune.candidates(t, layer, quick=True)
        assert full[0] == quick[0] == {"BLOCK_M": moe.choose_block_m(t, k, e)}
        keys = [json.dumps(c, sort_keys=True) for c in full]
        assert len(set(keys)) == len(keys) and set(json.dumps(c, sort_keys=True) for c in quick) <= set(keys)
        for c in full[1:]:
            assert set(c) == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
            assert 16 <= c["BLOCK_M"] <= max(16, 2 ** (t * k - 1).bit_length())
            for bk, _ in layer["steps"]:
                assert moe.smem_bytes(c, bk, elem, groups is not None) <= moe.SM90_SMEM, (c, bk)
        if t >= 64 and e <= 8:
            assert {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4} in full
        if t == 1:
            assert {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3} in quick
            assert all(c["BLOCK_M"] == 16 for c in full)
    # the formula, by hand: int4 64 x 128 tiles of a 128-step, 4 stages, bf16: 4 x (A 16 KiB + words 8 KiB + a row
    # of zeros and scales) + the dequantized tile (32 KiB)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "num_stages": 4}
    assert moe.smem_bytes(cfg, 128, 2, True) == 4 * (64 * 128 * 2 + 128 * 64 + 6 * 128) + 128 * 128 * 2
    assert moe.smem_bytes(cfg, 128, 2) == 4 * (64 + 128) * 128 * 2
    too_big = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 5}  # 5 x 64 KiB in bf16
    assert not moe_tune.fits(too_big, moe_tune.layer_shape(*LAYER_F, 2, torch.bfloat16))


LAYER_F = (torch.empty(8, 256, 256, device="meta", dtype=torch.bfloat16),
           torch.empty(8, 256, 128, device="meta", dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------ the launches
def record(monkeypatch, kernel: str) -> list:
    """The launch kwargs of moe.`kernel` (the interpreted kernel still runs)."""
    seen = []
    real = getattr(moe, kernel)

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(dict(kwargs, grid=grid))
                return real[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(moe, kernel, Recorder())
    return seen


@interpreted
@pytest.mark.parametrize("int4", [False, True])
def test_the_launch_takes_the_tuned_entry_of_its_bucket(moe_cache, monkeypatch, int4):
    """With a tuned entry for the step's bucket both matmuls launch its BLOCK_M, BLOCK_N, warps and stages, BLOCK_K
    still the layer's (moe.tiles / int4_tiles); a step of another bucket the heuristics'; the outputs the
    reference's either way."""
    e, k, h, i = 8, 2, 64, 32
    w13, w2 = int4_experts(e, h, 2 * i, 32, False, False, True, 0), int4_experts(e, i, h, 32, False, False, True, 1)
    f13, f2 = w13.dequantize(torch.float32), w2.dequantize(torch.float32)
    run, a13, a2 = (moe.fused_moe_int4, w13, w2) if int4 else (moe.fused_moe, f13, f2)
    key = moe.experts_key(a13, a2, k, torch.float32)
    tuned = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    gptq_configs.save("GPU_X", {key: {8: tuned}}, moe.SECTION)
    use_table(monkeypatch, "GPU_X")
    seen = record(monkeypatch, "_moe_gemm_int4" if int4 else "_moe_gemm")
    for t, want_cfg in ((7, tuned), (9, None)):
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t))
        w, ids = routing(t, e, k, seed=t)
        seen.clear()
        got = run(x, a13, a2, w, ids)
        assert torch.allclose(got, reference.fused_moe(x, f13, f2, w, ids), atol=1e-5, rtol=1e-5)
        assert len(seen) == 2
        for launch, (n, kk) in zip(seen, ((2 * i, h), (h, i))):
            bk = moe.int4_tiles(n, kk, 32, k)[1] if int4 else moe.tiles(n, kk, k)[1]
            if want_cfg is None:
                bm = moe.choose_block_m(t, k, e)
                want = {"BLOCK_M": bm, "BLOCK_N": moe.tiles(n, kk, k, bm)[0], **moe.launch_options(bm, int4)}
            else:
                want = want_cfg
            assert {o: launch[o] for o in want} == want and launch["BLOCK_K"] == bk, launch


@interpreted
@pytest.mark.parametrize("int4", [False, True])
def test_every_candidate_computes_the_reference(int4):
    """Each distinct (BLOCK_M, BLOCK_N) among the candidates of a step (warps and stages do not change what the
    interpreter computes) gives the reference's output, the outputs poisoned first; a wrong launch would not
    (one bit of every weight word flipped)."""
    e, k, h, i, t = 6, 2, 64, 48, 21
    w13 = int4_experts(e, h, 2 * i, 16, False, False, True, 3)
    w2 = int4_experts(e, i, h, 16, False, False, True, 4)
    f13, f2 = w13.dequantize(torch.float32), w2.dequantize(torch.float32)
    a13, a2 = (w13, w2) if int4 else (f13, f2)
    run = moe.fused_moe_int4 if int4 else moe.fused_moe
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5))
    w, ids = routing(t, e, k, seed=6)
    want = reference.fused_moe(x, f13, f2, w, ids)
    tiles = {(c["BLOCK_M"], c.get("BLOCK_N")): c
             for c in moe_tune.candidates(t, moe_tune.layer_shape(a13, a2, k, torch.float32))}
    assert {bm for bm, _ in tiles} == {16, 32, 64} and {bn for _, bn in tiles} >= {16, 32, 64}
    for cfg in tiles.values():
        with nan_filled_empty(moe):
            got = run(x, a13, a2, w, ids, config=cfg)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (cfg, (got - want).abs().max())


# ------------------------------------------------------------------------------------------------ the tuner
class FakeModel(torch.nn.Module):
    """A model whose sparse layers give these experts (as SparseMoeBlock.moe_experts), twice the same shape."""

    def __init__(self, w13, w2, top_k: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList([FakeBlock(w13, w2, top_k), FakeBlock(w13, w2, top_k)])


class FakeBlock(torch.nn.Module):
    def __init__(self, w13, w2, top_k: int):
        super().__init__()
        self.w = (w13, w2, top_k)

    def moe_experts(self):
        return (*self.w, torch.float32, torch.float32)


FASTEST = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 4}


@interpreted
def test_the_tuner_picks_the_fastest_saves_it_and_a_restart_does_not_tune_again(moe_cache, monkeypatch):
    """tune_model on a fake timer (FASTEST 1 us, the heuristics 3, the rest 5; each timed callable runs): each
    bucket up to max_tokens tuned once per layer shape, the winner saved to the cache file and launched by a step
    of that bucket; a config that computes a wrong output (a broken kernel) is never timed; after a restart
    (tables read from disk again) nothing is tuned, the timer never called; a larger max_tokens tunes only the
    new bucket."""
    e, k, h, i = 8, 2, 64, 32
    w13, w2 = int4_experts(e, h, 2 * i, 32, False, False, True, 0), int4_experts(e, i, h, 32, False, False, True, 1)
    model = FakeModel(w13, w2, k)
    timed = []

    def timer(fns, cfg):
        timed.append(cfg)
        fns[-1]()  # (a timed call runs: another routing, another copy of the weights)
        return 1.0 if cfg == FASTEST else (3.0 if len(cfg) == 1 else 5.0)
    assert moe_tune.tune_model(model, 2, torch.device("cpu"), timer=timer, name="GPU_X", quick=True)[0] == 1
    key = moe.experts_key(w13, w2, k, torch.float32)
    quick = [moe_tune.candidates(t, moe_tune.layer_shape(w13, w2, k, torch.float32), True) for t in (1, 2)]
    assert timed == quick[0] + quick[1]  # every candidate of both buckets, once
    path = gptq_configs.cache_file("GPU_X", moe.SECTION)
    assert json.loads(path.read_text()) == {key: {"1": FASTEST, "2": FASTEST},
                                            gptq_configs.FORMAT_KEY: gptq_configs.FORMAT[moe.SECTION]}
    use_table(monkeypatch, "GPU_X")
    seen = record(monkeypatch, "_moe_gemm_int4")
    x = torch.randn(2, h)
    w, ids = routing(2, e, k, seed=0)
    moe.fused_moe_int4(x, w13, w2, w, ids)
    assert [{o: s[o] for o in FASTEST} for s in seen] == [FASTEST, FASTEST]
    gptq_configs.load.cache_clear()  # a restart
    timed.clear()
    assert moe_tune.tune_model(model, 2, torch.device("cpu"), timer=timer, name="GPU_X", quick=True)[0] == 0
    assert timed == []
    # a bigger token budget: the new bucket alone; a config whose kernel computes wrong rows is skipped untimed
    real = moe._gemm_int4
    broken = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}

    def gemm(a, w, out, weights, aligned, top_k, row_div, weighted, cfg=None, compile_only=False, **epilogue):
        real(a, w, out, weights, aligned, top_k, row_div, weighted, cfg, compile_only, **epilogue)
        if cfg == broken:
            out.mul_(2)
    monkeypatch.setattr(moe, "_gemm_int4", gemm)
    assert moe_tune.tune_model(model, 4, torch.device("cpu"), timer=timer, name="GPU_X", quick=True)[0] == 1
    quick4 = moe_tune.candidates(4, moe_tune.layer_shape(w13, w2, k, torch.float32), True)
    assert broken in quick4 and broken not in timed and len(timed) == len(quick4) - 1
    assert sorted(json.loads(path.read_text())[key]) == ["1", "2", "4"]


def test_a_sparse_block_gives_its_experts_to_the_tuner():
    """SparseMoeBlock.moe_experts: the float stacks, top-k, the model's dtype and the routing weights' (float32 for
    Mixtral) — what moe_tune.moe_layers keys by moe.experts_key."""
    for model_type, weights in (("qwen3_moe", torch.bfloat16), ("mixtral", torch.float32)):
        block = sparse_block(model_type)
        w13, w2, top_k, dtype, wdt = block.moe_experts()
        assert w13 is block.experts.w13 and w2 is block.experts.w2 and (top_k, dtype, wdt) == (2, torch.bfloat16,
                                                                                                 weights)
        layers = moe_tune.moe_layers(torch.nn.ModuleList([block]))
        assert list(layers) == ["4,16,8,2,bfloat16"]


def sparse_block(model_type: str = "qwen3_moe", dtype=torch.bfloat16):
    """A SparseMoeBlock of 4 float experts (H 16, I 8, top-2)."""
    from types import SimpleNamespace

    from infer.models.moe import SparseMoeBlock
    cfg = SimpleNamespace(model_type=model_type, num_experts=4, num_local_experts=4, hidden_size=16,
                          moe_intermediate_size=8, intermediate_size=8, num_experts_per_tok=2, norm_topk_prob=True)
    return SparseMoeBlock(cfg, "model.layers.0.mlp", lambda names: None, dtype)


@interpreted
def test_the_warm_up_launches_every_config_the_table_chooses(moe_cache, monkeypatch):
    """SparseMoeBlock.warm_block_sizes (an engine start's LLMEngine.warm_kernels) runs a step of each launch config
    a step of up to max_tokens tokens can choose: the tuned buckets' entries (at each bucket's fewest tokens) beside
    the heuristics' BLOCK_M; every config a step then launches was launched by the warm-up first."""
    from quant_helpers import int4_kernel_path
    block = sparse_block(dtype=torch.float32)
    for p in (block.experts.w13, block.experts.w2, block.gate.weight):
        p.data.normal_(0, 0.1)
    int4_kernel_path(monkeypatch)
    key = moe.experts_key(block.experts.w13, block.experts.w2, 2, torch.float32)
    gptq_configs.save("GPU_X", {key: {8: FASTEST, 64: dict(FASTEST, BLOCK_M=32)}}, moe.SECTION)
    use_table(monkeypatch, "GPU_X")
    seen = record(monkeypatch, "_moe_gemm")

    def configs() -> set:
        out = {tuple((o, s[o]) for o in FASTEST) for s in seen}
        seen.clear()
        return out
    assert block.warm_block_sizes(64) == [5, 33]  # (decode's 16 rows: the warm-up's requests reach them)
    warmed = configs()
    assert {(("BLOCK_M", 16), ("BLOCK_N", 32), ("num_warps", 8), ("num_stages", 4)),
            (("BLOCK_M", 32), ("BLOCK_N", 32), ("num_warps", 8), ("num_stages", 4))} <= warmed
    for t in (6, 8, 40, 64):
        block(torch.randn(t, 16))
        assert configs() <= warmed, t


def test_warmup_prints_the_moe_tuning_time(capsys):
    """`infer warmup`'s table names the fused MoE's tuning time at start where it was measured (a GPU engine of a
    model with sparse layers), and has no such row otherwise."""
    from infer.cli.warmup import print_plan
    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.config import EngineConfig
    from infer.models.tiny import ensure_builtin
    plan, extra = estimate_plan(EngineConfig(str(ensure_builtin("tiny-llama"))), 64, 2)
    print_plan(plan, extra)
    assert "fused MoE kernel tuning" not in capsys.readouterr().out
    print_plan(plan, dict(extra, moe_kernel_tuning_s=12.34))
    assert re.search(r"fused MoE kernel tuning at start \(s\)\s*│\s*12\.3", capsys.readouterr().out)


def test_the_moe_bench_tune_rows_put_both_times_side_by_side():
    """`python -m infer.bench.moe --tune`'s row of a bucket: the heuristics' and the tuned time and their ratio."""
    from infer.bench.moe import main, tuned_row
    row = tuned_row(64, FASTEST, 20.0, 30.0)
    assert row == {"bucket": 64, "heuristic_us": 30.0, "tuned_us": 20.0, "tuned_vs_heuristic": 1.5,
                   "config": json.dumps(FASTEST, sort_keys=True)}
    assert tuned_row(1, None, float("inf"), None)["tuned_vs_heuristic"] is None
    if not torch.cuda.is_available():
        assert main(["--tune", "--quick"]) == 2  # (no GPU: refused, the kernels need one)


@pytest.mark.gpu
def test_tuning_a_qwen3_layer_on_the_gpu_saves_configs_the_launch_takes(moe_cache, monkeypatch):
    """On a GPU: Qwen3-30B-A3B's int4 experts at 1 and 256 tokens, quick set: every bucket gets a winner and a
    heuristic time (the heuristics ran), the launch takes the winner from the table, and computes the reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from infer.bench.moe import random_experts
    w13 = random_experts(128, 2048, 1536, 128, False, 0)
    w2 = random_experts(128, 768, 2048, 128, False, 1)
    res = moe_tune.tune_layer(w13, w2, 8, [1, 256], torch.bfloat16)
    name = gptq_configs.gpu_name(torch.device("cuda"))
    gptq_configs.save(name, {moe.experts_key(w13, w2, 8, torch.bfloat16): {b: c for b, (c, _, _) in res.items()}},
                      moe.SECTION)
    for b, (cfg, us, heur) in res.items():
        assert cfg is not None and heur is not None and us < float("inf"), (b, cfg, us, heur)
        x = torch.randn(b, 2048, device="cuda").bfloat16()
        w, ids = torch.topk(torch.randn(b, 128, device="cuda").softmax(-1), 8, -1)
        assert moe.step_config(moe.experts_key(w13, w2, 8, torch.bfloat16), b, 8, 128, x.device) == cfg
        got = moe.fused_moe_int4(x, w13, w2, w.bfloat16(), ids)
        want = reference.fused_moe(x, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16), w.bfloat16(),
                                   ids)
        assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < 2e-2


def test_compile_variants_compile_what_the_launches_take_within_sm90_shared_memory():
    """Compiled for sm_90 (the compile side of a driver, no GPU): moe.compile_variants of a launch config compiles
    both matmuls' variants (the gate_up, the weighted down), after which a step launched with that config compiles
    no matmul of its own; for the candidates of the largest moe.smem_bytes (int4 and bf16 experts, BLOCK_K 128)
    the compiled kernels' shared memory is at most that bound (an upper bound: the candidates' filter is safe)."""
    import inspect
    import textwrap

    from helpers import COMPILE_ONLY_LAUNCHES, run_compile_only
    script = COMPILE_ONLY_LAUNCHES + "from infer.kernels import packing, reference\n" + inspect.getsource(
        int4_experts) + textwrap.dedent('''
        from infer.kernels import moe, moe_tune
        out = []
        w13 = int4_experts(8, 256, 512, 128, False, False, True, 0)
        w2 = int4_experts(8, 256, 256, 128, False, False, True, 1)
        x = torch.randn(40, 256, dtype=torch.bfloat16)
        w, ids = torch.topk(torch.randn(40, 8).softmax(-1), 2, -1)
        for a13, a2 in ((w13, w2), (w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16))):
            layer = moe_tune.layer_shape(a13, a2, 2, torch.bfloat16)
            cands = sorted(moe_tune.candidates(40, layer)[1:], key=lambda c: -moe.smem_bytes(c, 128, 2, layer["int4"]))
            for cfg in cands[:2]:
                before = len(compiled)
                kernels = [c() for c in moe.compile_variants(x, a13, a2, 2, torch.bfloat16, [cfg])]
                variants = compiled[before:]
                before = len(compiled)
                (moe.fused_moe_int4 if layer["int4"] else moe.fused_moe)(x, a13, a2, w.bfloat16(), ids, config=cfg)
                out.append({"cfg": cfg, "variants": variants, "launched": compiled[before:], "int4": layer["int4"],
                            "shared": [k.metadata.shared for k in kernels],
                            "bound": moe.smem_bytes(cfg, 128, 2, layer["int4"])})
        print(json.dumps(out))
    ''')
    for r in run_compile_only(script, 600):
        kernel = "_moe_gemm_int4" if r["int4"] else "_moe_gemm"
        assert r["variants"] == [kernel, kernel] and kernel not in r["launched"], r
        assert max(r["shared"]) <= r["bound"] <= moe.SM90_SMEM, r
