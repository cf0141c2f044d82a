"""--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2 (vLLM's): K and V stored as float8 (saturated to the format's finite
range, rounded to nearest even, scale 1.0), every read upcast. The kernels against the torch reference (under
TRITON_INTERPRET=1 on CPU), the engine against transformers whose cache rounds K and V through the same float8,
and the memory plan's bytes."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import reference as ref
from test_triton_kernels import DEV, assert_close, ops, paged_batch, rand  # noqa: F401

pytestmark = pytest.mark.usefixtures("poisoned_outputs")  # (tests/conftest.py)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ref.to_cache(t, dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
def test_reference_saturates_and_rounds_to_nearest_even(dtype):
    most = torch.finfo(dtype).max
    x = torch.tensor([1e9, -1e9, most, 0.3, -0.0])
    got = ref.to_cache(x, dtype).float()
    assert got.tolist()[:3] == [most, -most, most]  # not NaN (e4m3fn) or inf (e5m2)
    assert got[3] == torch.tensor(0.3).to(dtype).float() and ref.to_cache(x, torch.float16).dtype == torch.float16


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.float16])
def test_store_kv_and_rotary_store_kv_write_the_references_bytes(ops, gen, dtype, src):
    """Both Triton writers store bit for bit the reference's float8 (values past the range saturated), padding
    slots untouched."""
    t, hq, hk, d, bs, nb = 11, 4, 2, 16, 4, 5
    qkv = rand(gen, t, (hq + 2 * hk) * d, dtype=src) * 4
    qkv[0, hq * d] = 1e4  # past e4m3's 448
    qkv[1, (hq + hk) * d + 1] = -1e4
    # halfway between two e4m3 (and e5m2) values: to the even one
    qkv[2, hq * d:hq * d + 6] = torch.tensor([1.0625, 1.1875, -1.0625, 1.125, 1.375, 0.5625 / 256])
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[torch.tensor([4, 10])] = -1
    cos_sin = rand(gen, 50, d)
    pos = torch.randint(0, 50, (t,), generator=gen).to(DEV)
    for name in ("store_kv", "rotary_store_kv"):
        got = [torch.zeros(nb, bs, hk, d, dtype=dtype, device=DEV) for _ in range(2)]
        want = [c.cpu().clone() for c in got]
        if name == "store_kv":
            ops[0].store_kv(k.view(t, hk, d), v.view(t, hk, d), *got, slots.to(DEV))
            ref.store_kv(k.cpu().view(t, hk, d), v.cpu().view(t, hk, d), *want, slots)
        else:
            ops[0].rotary_store_kv(pos, q, k, v, cos_sin, d, *got, slots.to(DEV))
            ref.rotary_store_kv(pos.cpu(), q.cpu(), k.cpu(), v.cpu(), cos_sin.cpu(), d, *want, slots)
        for g_c, w_c in zip(got, want):
            assert g_c.dtype == dtype and _same_bytes(g_c, w_c), name
            assert torch.isfinite(g_c.cpu().float()).all(), name


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.float16])
def test_paged_attention_reads_a_float8_cache(ops, gen, dtype, src):
    """Decodes and prefill chunks over float8 caches: the Triton kernels, and the reference, equal the reference over
    the same values held in the model's dtype (the upcast is exact)."""
    check_paged_fp8(ops, gen, [37, 5, 20, 9], [1, 5, 1, 4], 4, 4, 2, 16, dtype, src)


def check_paged_fp8(ops, gen, ctx, new, bs, hq, hk, d, dtype, src):
    q, _, clean, meta = paged_batch(gen, ctx, new, bs, hq, hk, d, src)
    caches = [_fp8(c * 3, dtype) for c in clean]
    wide = [c.to(src) for c in caches]
    for mql in (None, 1):
        rows = new if mql is None else [1] * len(new)
        if mql == 1:  # decodes only
            q = q[:len(rows)]
            meta = dict(meta, query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32))
        scale = d ** -0.5
        want = ref.paged_attention(q, *wide, scale=scale, max_query_len=mql, **meta)
        assert torch.equal(ref.paged_attention(q, *caches, scale=scale, max_query_len=mql, **meta), want)
        got = ops[1].paged_attention(q.to(DEV), *(c.to(DEV) for c in caches), scale=scale, max_query_len=mql,
                                     **{key: t.to(DEV) for key, t in meta.items()})
        assert got.dtype == src
        assert_close(got, want, src, gen, f"mql {mql}")


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.float16])
def test_decode_attention_rounds_the_new_key_through_the_cache(ops, gen, dtype, src):
    """The fused decode (rotary, KV write, attention) writes the reference's float8 bytes and attends to the new
    key and value as the cache holds them (rounded), as the reference, which reads them back from the cache."""
    check_decode_fp8(ops, gen, [9, 1, 30, 4], 4, 4, 2, 16, dtype, src)


def check_decode_fp8(ops, gen, ctx, bs, hq, hk, d, dtype, src):
    n = len(ctx)
    _, _, clean, meta = paged_batch(gen, ctx, [1] * n, bs, hq, hk, d, src)
    caches = [_fp8(c, dtype) for c in clean]
    tables = meta["block_tables"]
    slots = torch.tensor([int(tables[b, (c - 1) // bs]) * bs + (c - 1) % bs for b, c in enumerate(ctx)])
    qkv = rand(gen, n, (hq + 2 * hk) * d, dtype=src) * 8
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    cos_sin = rand(gen, max(ctx) + 3, d)
    pos = torch.tensor([c - 1 for c in ctx]).to(DEV)
    want_caches = [c.clone() for c in caches]
    want = ref.decode_attention(pos.cpu(), q.cpu(), k.cpu(), v.cpu(), cos_sin.cpu(), d, *want_caches, slots,
                                scale=d ** -0.5, **meta)
    got_caches = [c.to(DEV) for c in caches]
    got = ops[1].decode_attention(pos, q, k, v, cos_sin, d, *got_caches, slots.to(DEV), scale=d ** -0.5,
                                  **{key: t.to(DEV) for key, t in meta.items()})
    for g_c, w_c in zip(got_caches, want_caches):
        assert _same_bytes(g_c, w_c)
    assert_close(got, want, src, gen, "decode")
    # the reference with the step's K and V kept in the model's dtype differs: the new key went through float8
    wide = [c.to(src) for c in caches]
    unrounded = ref.decode_attention(pos.cpu(), q.cpu(), k.cpu(), v.cpu(), cos_sin.cpu(), d, *wide, slots,
                                     scale=d ** -0.5, **meta)
    assert not torch.equal(unrounded, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("hk", [32, 8])
def test_float8_attention_real_sizes_gpu(ops, gen, dtype, hk):
    """The fused decode and the paged attention over float8 caches at Llama-2-7B (32 KV heads) and Llama-3-8B (8)
    head shapes, contexts up to 4096, float16 (the fused decode's new key and value rounded as the cache holds them)."""
    lens = [int(x) for x in torch.randint(2, 4096, (14,), generator=gen)]
    check_decode_fp8(ops, gen, lens + [4096, 1], 16, 32, hk, 128, dtype, torch.float16)
    check_paged_fp8(ops, gen, lens[:12] + [1512, 3000, 4096, 44], [1] * 12 + [512, 300, 1, 44], 16, 32, hk, 128, dtype,
                    torch.float16)


# ----------------------------------------------------------------------------------------------- engine vs HF
KV = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
N = 10


def fp8_cache(dtype: torch.dtype):
    """A transformers DynamicCache whose layers round the new key and value states through `dtype` (saturated, as
    infer's cache stores them) before storing and returning them: attention reads every key as the cache holds it."""
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

    class Layer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            k = ref.to_cache(key_states, dtype).to(key_states.dtype)
            v = ref.to_cache(value_states, dtype).to(value_states.dtype)
            return super().update(k, v, *args, **kwargs)

    class Fp8Cache(DynamicCache):
        def __init__(self):
            Cache.__init__(self, layer_class_to_replicate=Layer)

    return Fp8Cache()


def hf_fp8_greedy(model, prompt: list[int], n: int, dtype: torch.dtype) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             cache=fp8_cache(dtype))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny_llama():
    from helpers import hf_model

    from infer.models.tiny import ensure_builtin
    path = ensure_builtin("tiny-llama")
    return path, hf_model(str(path))


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_greedy_tokens_equal_transformers_with_a_float8_rounding_cache(tiny_llama, kv):
    """Prompts over several KV blocks, batched, then a prefix-cache hit: the tokens of transformers whose cache
    rounds K and V through the same float8, and not (somewhere) those of the model-dtype cache."""
    from infer import LLM, SamplingParams

    from helpers import hf_greedy, random_prompts
    path, hf = tiny_llama
    llm = LLM(str(path), block_size=4, kv_cache_dtype=kv)
    assert llm.engine.runner.kv_cache.dtype == KV[kv]
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(vocab, (5, 13, 22, 31), seed=21)
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    outs = llm.generate(prompts, params)
    want = [hf_fp8_greedy(hf, p, N, KV[kv]) for p in prompts]
    assert [o.token_ids for o in outs] == want
    again = llm.generate([prompts[3][:24] + prompts[0]], params)[0]  # 24 tokens (6 blocks) from the cache
    assert again.num_cached_tokens == 24
    assert again.token_ids == hf_fp8_greedy(hf, prompts[3][:24] + prompts[0], N, KV[kv])
    assert want != [hf_greedy(path, p, N) for p in prompts]  # the rounding is real: fp8 is not a no-op here


def test_lora_adapters_equal_peft_with_the_same_rounding(tmp_path):
    """A batch that mixes two adapters and the base model, with an fp8 cache: peft's greedy tokens on the same
    rounding cache."""
    from peft import PeftModel

    from infer import LLM, SamplingParams
    from infer.models.tiny import ensure_builtin

    from helpers import random_prompts
    from lora_helpers import THREE, hf_float, save_adapter
    base = ensure_builtin("tiny-llama")
    hf = hf_float(base)
    paths = {n: save_adapter(hf, tmp_path / n, seed=i + 7, **THREE[n]) for i, n in enumerate(("a", "c"))}
    llm = LLM(str(base), loras={n: str(p) for n, p in paths.items()}, max_loras=2, max_lora_rank=8, block_size=4,
              kv_cache_dtype="fp8")
    prompts = random_prompts(llm.engine.model_config.vocab_size, (9, 14, 6), seed=8)
    names = ["a", None, "c"]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=N, ignore_eos=True), lora=names)
    model = PeftModel.from_pretrained(hf, str(paths["a"]), adapter_name="a")
    model.load_adapter(str(paths["c"]), adapter_name="c")
    want = []
    try:
        for name, p in zip(names, prompts):
            if name is None:
                with model.disable_adapter():
                    want.append(hf_fp8_greedy(model, p, N, torch.float8_e4m3fn))
            else:
                model.set_adapter(name)
                want.append(hf_fp8_greedy(model, p, N, torch.float8_e4m3fn))
    finally:
        model.unload()
    assert [o.token_ids for o in outs] == want


# ----------------------------------------------------------------------------------------------- memory plan
@pytest.mark.parametrize("dtype, ratio", [(torch.float16, 2), (torch.bfloat16, 2), (torch.float32, 4)])
def test_plan_counts_one_byte_an_element(dtype, ratio):
    """At the same budget an fp8 cache gets the blocks of 1 byte an element: twice a float16 model's, four times a
    float32 one's; the plan names the cache's dtype."""
    from infer.engine.config import EngineConfig
    from infer.memory.plan import make_plan
    from infer.memory.sizes import kv_bytes_per_token
    from infer.models.loader import load_config
    from infer.models.tiny import ensure_builtin
    model_config = load_config(ensure_builtin("tiny-llama"))
    plans = {}
    for kv in ("auto", "fp8_e5m2"):
        cfg = EngineConfig("tiny-llama", kv_cache_dtype=kv, device="cpu")
        plans[kv] = make_plan(cfg, model_config, dtype, torch.device("cpu"), 10 << 20, 20 << 20, 256, 4, 2048,
                              budget=1 << 30)
    auto, fp8 = plans["auto"], plans["fp8_e5m2"]
    assert fp8.kv_bytes_per_token * ratio == auto.kv_bytes_per_token == kv_bytes_per_token(model_config, dtype)
    assert fp8.kv_block_bytes == fp8.kv_bytes_per_token * fp8.block_size
    assert ratio * auto.kv_blocks <= fp8.kv_blocks < ratio * (auto.kv_blocks + 1)
    assert (auto.kv_cache_dtype, fp8.kv_cache_dtype) == (str(dtype)[6:], "float8_e5m2")
    assert fp8.to_dict()["kv_cache_dtype"] == "float8_e5m2"


def test_num_kv_blocks_and_memory_limit_are_sized_at_one_byte():
    """num_kv_blocks that a float32 cache cannot hold under --memory-limit fits as fp8, and the engine allocates
    that many float8 blocks."""
    from infer import LLM
    from infer.errors import OutOfMemoryError
    kw = dict(memory_limit="48MB", num_kv_blocks=12000, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=256)
    with pytest.raises(OutOfMemoryError, match="num_kv_blocks=12,000"):
        LLM("tiny-llama", **kw)
    llm = LLM("tiny-llama", kv_cache_dtype="fp8", **kw)
    cache = llm.engine.runner.kv_cache
    assert cache.dtype == torch.float8_e4m3fn and cache.shape[2] == 12000 == llm.engine.stats()["kv_blocks_total"]
    assert llm.engine.stats()["kv_cache_dtype"] == "fp8"


# ----------------------------------------------------------------------------------------------- options
def test_the_option_takes_vllms_values_and_refuses_others_naming_them(monkeypatch):
    from typer.testing import CliRunner

    from infer import LLM
    from infer.cli.main import app
    from infer.engine.config import EngineConfig
    from infer.errors import ConfigError
    assert EngineConfig("tiny-llama").kv_cache_dtype == "auto"
    for kv, want in (("auto", torch.float16), *KV.items()):
        assert EngineConfig("tiny-llama", kv_cache_dtype=kv).kv_dtype(torch.float16) == want
    for bad in ("int8", "fp16", "FP8", None):
        with pytest.raises(ConfigError, match="is not one of auto, fp8, fp8_e4m3, fp8_e5m2"):
            LLM("tiny-llama", kv_cache_dtype=bad)
    for command in (["run", "tiny-llama", "in.jsonl"], ["serve", "tiny-llama"], ["bench", "tiny-llama"],
                    ["warmup", "tiny-llama"]):
        res = CliRunner().invoke(app, [*command, "--kv-cache-dtype", "fp4"])
        assert res.exit_code == 2 and "--kv-cache-dtype 'fp4' is not one of auto, fp8" in res.output, res.output
        assert "vLLM's option" not in res.output


def test_e4m3_is_refused_on_a_gpu_below_compute_capability_8_9(monkeypatch):
    """Triton has no float8 e4m3 before Ada / Hopper: refused at start, not as a compile error mid-request."""
    from infer.engine.config import EngineConfig
    from infer.errors import ConfigError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cap = [(8, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    with pytest.raises(ConfigError, match="capability 8.9 or more; this one has 8.0"):
        EngineConfig("tiny-llama", device="cuda", kv_cache_dtype="fp8")
    assert EngineConfig("tiny-llama", device="cuda", kv_cache_dtype="fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    cap[0] = (9, 0)
    assert EngineConfig("tiny-llama", device="cuda", kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"


COMPILE = '''
from infer.kernels import attention, fused
out = {}
for qd, kd in ((torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2)):
    bs, hq, hk, d = 16, 4, 2, 32
    kc, vc = (torch.zeros(8, bs, hk, d, dtype=kd) for _ in range(2))
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([20, 5], dtype=torch.int32)
    q = torch.randn(9, hq, d, dtype=qd)
    before = len(compiled)
    attention.paged_attention(q, kc, vc, tables, lens, torch.tensor([0, 5, 9], dtype=torch.int32), 0.1, 5)
    qkv = torch.randn(2, (hq + 2 * hk) * d, dtype=qd)
    qq, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    pos, slots, cs = torch.tensor([19, 4]), torch.tensor([3, 40]), torch.randn(32, d)
    attention.decode_attention(pos, qq, k, v, cs, d, kc, vc, slots, tables, lens,
                               torch.tensor([0, 1, 2], dtype=torch.int32), 0.1, parts=2)
    fused.rotary_store_kv(pos, qq, k, v, cs, d, kc, vc, slots)
    fused.store_kv(k.view(2, hk, d), v.view(2, hk, d), kc, vc, slots)
    out[str(kd)] = compiled[before:]
print(json.dumps(out))
'''


def test_the_kernels_compile_for_sm90_with_float8_caches():
    """The GPU path (float8 loads upcast, saturated and rounded stores) compiles for an H100 on this machine:
    attention (unified and decode), the fused decode with its KV write, rotary_store_kv and store_kv."""
    pytest.importorskip("triton")
    from helpers import COMPILE_ONLY_LAUNCHES, run_compile_only
    out = run_compile_only(COMPILE_ONLY_LAUNCHES + COMPILE, 600)
    names = ["_unified_kernel", "_decode_kernel", "_rotary_kernel", "_store_kv_kernel"]
    assert out == {"torch.float8_e4m3fn": names, "torch.float8_e5m2": names}, out


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_triton_path_interpreted_equals_the_cpu_path(monkeypatch, kv):
    """Every op through its Triton kernel (interpreted on CPU; the engine's GPU path: rotary_store_kv, the unified
    attention for prefills, the fused decode attention with its KV write, emulated CUDA graphs) over an fp8 cache:
    the CPU path's greedy tokens (which equal transformers', above)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels")
    from infer import LLM, SamplingParams, kernels

    from helpers import random_prompts
    prompts = random_prompts(256, (5, 11, 7), seed=3)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    kw = dict(block_size=4, max_num_seqs=4, max_model_len=64, kv_cache_dtype=kv)
    cpu = [o.token_ids for o in LLM("tiny-llama", **kw).generate(prompts, params)]
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    seen = []
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a, **k: (seen.append(a[6].dtype), real(*a, **k))[1])
    llm = LLM("tiny-llama", cuda_graph_max_tokens=32, **kw)
    llm.engine.runner.capture_graphs(64, emulate=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == cpu
    assert seen and set(seen) == {KV[kv]}
    assert sum(llm.engine.runner.graphs.replays.values()) >= 4 and llm.engine.stats()["piecewise_graph_steps"] >= 1


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    from typer.testing import CliRunner

    from infer.cli.main import app
    out = tmp_path_factory.mktemp("q") / "tiny-llama-gptq"
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "-o", str(out), "--group-size", "32", "--num-samples",
                                   "8", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    return out


def test_int4_model_follows_transformers_on_its_dequantized_weights(int4_checkpoint):
    """A GPTQ int4 checkpoint with an fp8 cache against transformers on the dequantized weights with the same
    rounding. The int4 matmul and F.linear differ in the last float32 bits, which can flip a K or V element to the
    neighbouring float8 value (1/16 of it): so each of infer's greedy tokens must be transformers' argmax up to a
    near-tie (its logit within 0.05 of the largest, the sequence fed as infer generated it)."""
    from quant_helpers import has_gptqmodel
    if not has_gptqmodel():
        pytest.skip("needs the quantize extra (gptqmodel)")
    from infer import LLM, SamplingParams
    from infer.models.tiny import ensure_builtin

    from helpers import random_prompts
    from quant_helpers import dequantized_float_model
    llm = LLM(str(int4_checkpoint), block_size=4, kv_cache_dtype="fp8")
    assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.qweight is not None
    assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    prompts = random_prompts(llm.engine.model_config.vocab_size, (6, 19, 11), seed=12)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=N, ignore_eos=True))
    hf = dequantized_float_model(ensure_builtin("tiny-llama"), int4_checkpoint)
    hf.generation_config.eos_token_id = None
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p + o.token_ids]), cache=fp8_cache(torch.float8_e4m3fn)).logits[0]
        steps = logits[len(p) - 1:-1]
        picked = steps.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert (steps.max(1).values - picked).max() < 0.05, (p, o.token_ids, steps.argmax(1).tolist())


def test_serve_takes_the_option_and_warmup_shows_the_cache_dtype(monkeypatch):
    from typer.testing import CliRunner

    from infer.cli.main import app
    from test_probes_session39_options import _serve_options
    assert _serve_options(monkeypatch, "--kv-cache-dtype", "fp8")["engine"].kv_cache_dtype == "fp8"
    res = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", "--memory-limit", "64MB", "--max-length",
                                   "128", "--concurrency", "2", "--kv-cache-dtype", "fp8_e5m2"])
    assert res.exit_code == 0, res.output
    assert "float8_e5m2" in res.output and "KV cache dtype" in res.output


def test_the_cpu_decode_gather_counts_its_upcast_copy():
    """The CPU decode gathers a float8 cache's K and V and upcasts a copy: the formula counts both."""
    from infer.memory.sizes import activation_bytes
    from infer.models.loader import load_config
    from infer.models.tiny import ensure_builtin
    cfg = load_config(ensure_builtin("tiny-llama"))
    args = (cfg, torch.float32, 4, 4, 4096)
    plain = activation_bytes(*args)
    assert activation_bytes(*args, kv_dtype=torch.float32) == plain < activation_bytes(*args, kv_dtype=KV["fp8"])
