"""Session 66: DeepSeek's latent KV cache in float8 (--kv-cache-dtype fp8 / fp8_e5m2, as vLLM serves MLA): one latent
row a token and layer, kv_lora_rank + qk_rope_head_dim values of one byte (saturated, rounded to nearest even, scale
1.0, as infer's other fp8 caches). The Triton MLA kernels (kernels.mla) reading a float8 cache, interpreted, against
their definition over the same values upcast, outputs and partials poisoned with NaN first; the engine's greedy
tokens on tiny-deepseek-v3 and tiny-deepseek-v2 against transformers whose cache rounds the same latent rows through
the same float8 (its DeepSeek attention caches the latent itself), batched, in chunks, from the prefix cache, and
through the GPU code path (interpreted); the memory plan's bytes of the float8 latent (warmup) and of a GPTQ
kv_b_proj's float copy (the estimate, and what the model holds)."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

from infer import LLM, SamplingParams, kernels
from infer.kernels import reference
from infer.kernels.moe import SM90_SMEM

from helpers import (estimated_plan, hf_greedy, hf_model, interpreted_module, nan_filled_empty, random_prompts,
                     run_compile_only)
from test_fp8_kv_cache import hf_fp8_greedy
from test_probes_session65_mla import (DEV, LENS, MIXED, MLA_COMPILE_HOOK, TOL, _batch, _definition, _float64,
                                      _half_bound)

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")


@pytest.fixture
def mla():
    """kernels.mla, its op through the Triton kernels on every tensor (interpreted on CPU tensors) for one test (the
    engine's tests after these run the CPU path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "use_triton", lambda t: True)
        yield from interpreted_module("infer.kernels.mla")


def _fp8_batch(seed: int, lens, queries, heads: int, latent: int, rope: int, kv: torch.dtype,
               dtype=torch.float32) -> list:
    """session 65's `_batch` (rows past a sequence's keys 30, spare blocks NaN) with its cache stored as `kv` holds it
    (reference.to_cache), the values scaled by 3 (e4m3's steps of 1/8 to 1/2 there)."""
    q, cache, tables, lens_t, starts = _batch(torch.Generator().manual_seed(seed), lens, queries, heads, latent, rope,
                                              dtype)
    return [q, reference.to_cache(cache * 3, kv), tables, lens_t, starts]


def _check_against_definition(got: torch.Tensor, q, cache, tables, lens, starts, scale: float, latent: int) -> None:
    """got equals the definition over the float8 cache, which is the definition over its values upcast (exactly)."""
    want = _definition(q, cache, tables, lens, starts, scale, latent)
    assert torch.equal(want, _definition(q, cache.to(q.dtype), tables, lens, starts, scale, latent))
    assert torch.isfinite(want).all()
    assert torch.allclose(got.cpu(), want, atol=TOL, rtol=TOL), float((got.cpu() - want).abs().max())


@pytest.mark.parametrize("kv, heads, latent, rope", [(torch.float8_e4m3fn, 4, 32, 16),
                                                     (torch.float8_e5m2, 6, 48, 8)], ids=["e4m3", "e5m2"])
def test_decode_over_a_float8_cache_equals_the_definition(mla, kv, heads, latent, rope):
    """Decode rows over contexts across blocks, uneven, of one key, read from a float8 cache in tiles of 16 keys: the
    plan's launch (one split), 8 splits (most past a context's 3 tiles: they write nothing), 3 splits of 4 heads a
    program (in rows of 16): the output (NaN first, as the partials) equals reference.paged_attention over the cache
    (its values upcast)."""
    assert mla.decode_tile(kv) == 16 and mla.decode_tile(torch.float32) == mla.BLOCK_N
    q, cache, tables, lens_t, starts = _fp8_batch(heads, LENS, [1] * len(LENS), heads, latent, rope, kv)
    assert cache.dtype == kv
    for parts, per_program in ((None, None), (8, None), (3, 4)):
        out = torch.full((q.shape[0], heads, latent), float("nan"), device=DEV)
        with nan_filled_empty(mla):
            if parts is None:
                assert mla.mla_paged_attention(q, cache, tables, lens_t, starts, 0.3, latent, 1, out=out) is out
            else:
                mla._decode(q, cache, tables, lens_t, starts, 0.3 * mla.LOG2E, out, mla._widths(q, cache, latent),
                            parts=parts, heads=per_program)
        _check_against_definition(out, q, cache, tables, lens_t, starts, 0.3, latent)


@pytest.mark.parametrize("kv", FP8.values(), ids=FP8)
def test_prefill_and_mixed_batches_over_a_float8_cache_equal_the_definition(mla, kv):
    """A step mixing decodes, a chunk after 10 cached tokens, 20 new of 50, whole prompts of 33 and 9 tokens over a
    float8 cache: causal within each sequence's new tokens, every row (NaN first) the definition's."""
    q, cache, tables, lens, starts = _fp8_batch(7, *MIXED, 6, 48, 8, kv)
    with nan_filled_empty(mla):
        got = mla.mla_paged_attention(q, cache, tables, lens, starts, 0.25, 48)
    _check_against_definition(got, q, cache, tables, lens, starts, 0.25, 48)


@pytest.mark.parametrize("lens, queries", [(LENS, [1] * len(LENS)), MIXED], ids=["decode", "mixed"])
def test_float16_queries_over_an_e4m3_cache_within_its_rounding_of_float64(mla, lens, queries):
    """float16 q over an e4m3 cache (the half-precision tl.dot a GPU takes, each tile upcast to float16): within
    the half-precision bound of the float64 attention of the same values."""
    q, cache, tables, lens_t, starts = _fp8_batch(1, lens, queries, 16, 64, 16, torch.float8_e4m3fn, torch.float16)
    with nan_filled_empty(mla):
        got = mla.mla_paged_attention(q, cache, tables, lens_t, starts, 0.2, 64)
    wide = cache.to(torch.float16)
    want = _float64(q, wide, tables, lens_t, starts, 0.2, 64)
    assert got.dtype == torch.float16
    err, bound = float((got.cpu().double() - want).abs().max()), _half_bound(wide, tables, lens_t, 64)
    assert err <= bound, (err, bound)


def test_the_model_attends_a_float8_cache_through_the_mla_kernels(mla, monkeypatch):
    """models.deepseek.mla_attention on the GPU path (kernels.use_triton) over a float8 cache runs kernels.mla's
    kernels, not the generic paged attention (which read every row twice, padded to a power of two): the latent
    part of the definition. A cache of another dtype than q's that is not float8 is refused naming both."""
    from infer.models.deepseek import mla_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **k: pytest.fail("the generic attention ran"))
    for lens, queries in ((LENS, [1] * len(LENS)), MIXED):
        q, cache, tables, lens_t, starts = _fp8_batch(3, lens, queries, 4, 32, 16, torch.float8_e4m3fn)
        with nan_filled_empty(mla):
            got = mla_attention(q, cache, tables, lens_t, starts, 0.2, max(queries), 32)
        _check_against_definition(got, q, cache, tables, lens_t, starts, 0.2, 32)
    with pytest.raises(ValueError, match=re.escape("store the cache in q's dtype, or in float8 (torch.float8_e4m3fn")):
        mla.mla_paged_attention(q, cache.double(), tables, lens_t, starts, 0.2, 32)


COMPILED = MLA_COMPILE_HOOK + textwrap.dedent('''
    arch[0], label[0] = 90, "e4m3"
    triton.runtime.driver.set_active(Driver(arch[0]))
    q, cache = torch.zeros(4, 128, 576, dtype=bf16), torch.zeros(8, 16, 1, 576, dtype=torch.float8_e4m3fn)
    tables, lens = torch.zeros(4, 2, dtype=torch.int32), torch.full((4,), 20, dtype=torch.int32)
    out, meta = torch.zeros(4, 128, 512, dtype=bf16), mla._widths(q, cache, 512)
    mla._decode(q, cache, tables, lens, torch.arange(5, dtype=torch.int32), 1.0, out, meta, parts=1)
    mla._prefill(q, cache, tables, lens, torch.tensor([0, 4, 4, 4, 4], dtype=torch.int32), 1.0, out, meta)
    print(json.dumps(seen))
''')


def test_kernels_compile_for_sm90_over_an_e4m3_cache_without_spills():
    """The decode and prefill kernels over an e4m3 cache at DeepSeek-V3's widths (128 heads, L 512, R 64, bf16 q)
    compile for sm_90 as the launchers launch them, within a program's shared memory there, no spilled registers in
    their main loops (decode tiles of 32 keys spilled: 16 over float8, `decode_tile`). (e5m2's cheaper upcast, and
    sm_89, were checked alike once: no spills, at most 63,488 bytes of shared memory.)"""
    seen = run_compile_only(COMPILED, 600)
    assert sorted(seen) == [f"{n} e4m3 sm_90" for n in ("_decode_kernel", "_prefill_kernel")], seen
    for key, (used, local) in seen.items():
        assert used <= SM90_SMEM and local == 0, (key, used, local)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", FP8.values(), ids=FP8)
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("lens, queries", [([1000, 1, 37, 515, 4096], [1] * 5), ([700, 300, 1, 64], [1, 100, 1, 20])])
def test_gpu_real_widths_over_a_float8_cache_within_bf16_rounding(mla, kv, heads, lens, queries):
    """V2-Lite's and V3's heads at L 512, R 64, bf16 q over a float8 cache on the GPU (compiled kernels, the plan's
    heads and splits): decode and mixed steps within bf16's bound of the float64 attention of the values upcast."""
    q, cache, tables, lens_t, starts = _fp8_batch(heads, lens, queries, heads, 512, 64, kv, torch.bfloat16)
    got = mla.mla_paged_attention(q, cache, tables, lens_t, starts, 576 ** -0.5, 512)
    wide = cache.to(torch.bfloat16)
    want = _float64(q, wide, tables, lens_t, starts, 576 ** -0.5, 512)
    assert float((got.cpu().double() - want).abs().max()) <= _half_bound(wide, tables, lens_t, 512)


def test_bench_row_over_a_float8_cache(mla, monkeypatch):
    """`python -m infer.bench.mla --kv-cache-dtype fp8`'s row (a tiny shape, interpreted, a stand-in timer of 1 us a
    call, a copy bandwidth of 1 GB/s): the MLA output within bf16 rounding of the generic kernel's over the same
    float8 rows, the bytes moved counting the cache rows at one byte an element."""
    from infer.bench import mla as bench
    monkeypatch.setitem(bench.MODELS, "tiny", (4, 32, 16))
    row = bench.measure("tiny", 3, 40, 1e9, lambda fn: (fn(), 1e-3)[1], torch.Generator(device=DEV).manual_seed(0),
                        DEV, kv=torch.float8_e4m3fn)
    moved = 3 * (40 * 48 * 1 + 4 * (64 + 16) * 2 + 3 * 4)
    assert bench.bytes_moved("tiny", 3, 40, cache_e=1) == moved < bench.bytes_moved("tiny", 3, 40)
    assert row["GBps"] == round(moved / 1e3, 1) and row["of_copy"] == round(moved / 1e3, 2)
    assert row["gain"] == 1.0 and row["max_abs_err"] <= 2 ** -6
    assert bench.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"


# ----------------------------------------------------------------------------------------------- engine vs HF
N = 6
MODELS = ["tiny-deepseek-v3", "tiny-deepseek-v2"]


@pytest.mark.parametrize("name, kv", [("tiny-deepseek-v3", "fp8"), ("tiny-deepseek-v2", "fp8_e5m2")])
def test_greedy_tokens_equal_transformers_rounding_the_latent_through_float8(name, kv):
    """Prompts of 5, 13 and 31 tokens batched in steps of 12 tokens (prompts cut into chunks beside decodes), then one
    whose first 24 tokens (6 blocks) come from the prefix cache: the tokens of transformers whose cache rounds each
    latent row (kv_a_layernorm's c_kv, the roped k_pe) through the same float8, and (somewhere) not those of the
    float cache. The cache is one float8 row of kv_lora_rank + qk_rope_head_dim a token and layer."""
    from infer.models.tiny import ensure_builtin
    path = ensure_builtin(name)
    hf = hf_model(str(path))
    with LLM(str(path), block_size=4, kv_cache_dtype=kv, max_num_batched_tokens=12, max_num_seqs=4) as llm:
        cache = llm.engine.runner.kv_cache
        assert cache.dtype == FP8[kv] and cache.shape[:2] == (3, 1) and cache.shape[-2:] == (1, 32 + 16)
        prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 13, 31), seed=21)
        params = SamplingParams(max_new_tokens=N, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        again = llm.generate([prompts[2][:24] + prompts[0]], params)[0]
    want = [hf_fp8_greedy(hf, p, N, FP8[kv]) for p in prompts]
    assert got == want
    assert again.num_cached_tokens == 24
    assert again.token_ids == hf_fp8_greedy(hf, prompts[2][:24] + prompts[0], N, FP8[kv])
    # the rounding is real: fp8 is not a no-op here
    assert any(hf_greedy(path, p, N) != w for p, w in zip(prompts, want))


@interpreted
def test_gpu_code_path_interpreted_reads_the_float8_cache_with_the_mla_kernels(monkeypatch):
    """tiny-deepseek-v3 with every op through its Triton kernel (interpreted), decodes through emulated CUDA graphs,
    over an fp8 cache: the latent rows written by the store kernel (rounded as the reference rounds them) and read
    by kernels.mla's kernels, never the generic attention's: transformers' tokens with the same rounding."""
    from infer.models.tiny import ensure_builtin
    from quant_helpers import int4_kernel_path
    path = ensure_builtin("tiny-deepseek-v3")
    prompts = random_prompts(512, (5, 9), seed=4)
    want = [hf_fp8_greedy(hf_model(str(path)), p, 4, torch.float8_e4m3fn) for p in prompts]
    int4_kernel_path(monkeypatch)
    mod = kernels._triton("mla")
    seen, real = [], mod.mla_paged_attention
    monkeypatch.setattr(mod, "mla_paged_attention", lambda q, cache, *a, **k: (seen.append(cache.dtype),
                                                                                 real(q, cache, *a, **k))[1])
    with LLM(str(path), block_size=4, max_model_len=32, max_num_seqs=2, cuda_graph_max_tokens=0,
             kv_cache_dtype="fp8") as llm:
        llm.engine.runner.capture_graphs(32, emulate=True)
        assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))] == want
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert seen and set(seen) == {torch.float8_e4m3fn}


# ----------------------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("name", MODELS)
def test_warmup_counts_one_byte_an_element_of_the_latent_row(name):
    """`infer warmup --estimate` of the tiny DeepSeeks (float32): 3 layers x (32 + 16) latent values, 4 bytes each
    in the model's dtype, 1 as fp8 and fp8_e5m2 (named); the blocks, within what the budget leaves after the
    weights, activations and reserve, more than 3 times as many at a quarter of the bytes a block (the CPU decode's
    upcast copy of a float8 row counted among the activations); the engine allocates that many bytes a token."""
    from infer.memory.sizes import kv_bytes_per_token
    from infer.models.loader import load_config
    from infer.models.tiny import ensure_builtin
    args = ("--memory-limit", "64MB", "--max-length", "128", "--concurrency", "2")
    plans = {kv: estimated_plan(name, "--kv-cache-dtype", kv, *args) for kv in ("auto", "fp8", "fp8_e5m2")}
    assert plans["auto"]["kv_bytes_per_token"] == 3 * 48 * 4
    for kv in ("fp8", "fp8_e5m2"):
        plan = plans[kv]
        assert plan["kv_bytes_per_token"] == 3 * 48 and plan["kv_block_bytes"] == 3 * 48 * plan["block_size"]
        assert plan["kv_cache_dtype"] == str(FP8[kv]).removeprefix("torch.")
        left = plan["budget_bytes"] - plan["weights_bytes"] - plan["activation_peak_bytes"] - plan["reserve_bytes"]
        assert 0 < plan["kv_blocks"] * plan["kv_block_bytes"] <= left, plan
        assert plan["kv_blocks"] > 3 * plans["auto"]["kv_blocks"], (plan, plans["auto"])
    cfg = load_config(ensure_builtin(name))
    assert kv_bytes_per_token(cfg, torch.float8_e4m3fn) == 3 * 48
    with LLM(name, block_size=4, num_kv_blocks=10, max_model_len=40, kv_cache_dtype="fp8") as llm:
        cache = llm.engine.runner.kv_cache
        assert cache.numel() * cache.element_size() == 10 * 4 * 3 * 48


def _gptq_deepseek(tmp_path):
    """A DeepSeek-V2 (q_proj) of session 65's shape written as a GPTQ checkpoint (round to nearest, groups of 32:
    every projection kv_b_proj too, and the experts)."""
    from test_probes_session56_review_moeq import rtn_gptq
    from test_probes_session65_deepseek import build
    build(tmp_path / "f", "deepseek_v2", q_lora_rank=None)
    rtn_gptq(tmp_path / "f", tmp_path / "q")
    return tmp_path / "q"


def _held(model, *left_out: str) -> int:
    """weights_bytes(model) less its buffers named `left_out` (the rotary table, which the estimate leaves out)."""
    from infer.memory.sizes import weights_bytes
    return weights_bytes(model) - sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                                      if n.endswith(left_out))


def test_a_gptq_kv_b_projs_float_copy_is_held_as_weights_and_estimated(tmp_path, monkeypatch):
    """A GPTQ kv_b_proj on the GPU's path (int4 tensors in the kernels' layout) is dequantized once at load into a
    buffer that W_UK and W_UV are views of, which the memory plan counts with the weights and `warmup --estimate`
    for a GPU counts from the checkpoint (it did not: 3 x H x (nope + v) x rank floats an engine held beyond its
    plan, 2 GB in bf16 at DeepSeek-V3's 61 layers). On the CPU's path the layer's dequantized weight is read as it
    is (no copy) and not prepacked (it is never multiplied), as the CPU's estimate counts it."""
    from infer.memory.checkpoint import checkpoint_weights_bytes
    from infer.models.loader import load_model, weight_files
    from quant_helpers import int4_kernel_path
    folder = _gptq_deepseek(tmp_path)
    files = weight_files(folder)
    model, cfg = load_model(folder, torch.float32, torch.device("cpu"))
    for layer in model.layers:
        kv_b = layer.self_attn.kv_b_proj
        assert kv_b.weight is not None and kv_b.packed_weight is None and layer.self_attn.kv_b_float is None
        assert layer.self_attn.kv_b_weight().data_ptr() == kv_b.weight.data_ptr()
    assert checkpoint_weights_bytes(files, cfg, torch.float32, torch.device("cpu"), 4) == _held(model, "cos_sin")
    int4_kernel_path(monkeypatch)
    model, cfg = load_model(folder, torch.float32, torch.device("cpu"))
    buffers = [b for b in model.buffers() if b is not None]
    for layer in model.layers:
        attn = layer.self_attn
        assert attn.kv_b_proj.weight is None and attn.kv_b_float.shape == (4 * (16 + 16), 32)
        assert torch.equal(attn.kv_b_float, attn.kv_b_proj.dequantized_weight())
        assert attn.kv_b_weight().data_ptr() == attn.kv_b_float.data_ptr()
        assert any(b is attn.kv_b_float for b in buffers)  # (what weights_bytes counts)
    held = _held(model, "cos_sin", "packed_weight", "packed_head")  # (the CPU's prepacked copies: no GPU's)
    assert checkpoint_weights_bytes(files, cfg, torch.float32, torch.device("cuda"), 4) == held
