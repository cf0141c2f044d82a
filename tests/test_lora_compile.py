"""An engine start compiles every LoRA kernel variant a step can launch (`LoRALayer.compile_calls`, run by
`LLMEngine.compile_kernels`), so no shrink or expand compiles on a user's request. The kernels are compiled for an
H100 (sm_90) on this machine without a GPU (scripts/kernel-sass's CompileOnlyDriver, as in test_gptq_compile.py),
every launch turned into a compile. Two layers: a merged qkv on the `apply` path (shrink + expand launches, as on a
float base), a one-shard layer on the `delta` path whose stand-in int4 kernel adds the expand in its epilogue
for steps of up to 16 rows: its expand must be compiled for every longer step, and not for the plan of 1-16
tokens, which never launches it; and a gate|up layer whose consumer adds its delta (`MergedLinear.lora_consumer`:
silu_and_mul), and a one-shard layer whose consumer is the rms_norm after it (o_proj, down_proj), in steps of up to
64 tokens, the expand launched in longer ones. Rank 8 makes the partials' row
stride (T x 24 or T x 8 elements) divisible by 16 only for even T, and 32 slots make the shrink's split of K depend
on the token count: both vary between steps of one plan."""

import textwrap

import pytest

from helpers import COMPILE_ONLY_LAUNCHES, COMPILE_ONLY_PREAMBLE, run_compile_only

pytest.importorskip("triton")
pytest.importorskip("triton.runtime._async_compile")

SCRIPT = COMPILE_ONLY_LAUNCHES + textwrap.dedent('''
    from types import SimpleNamespace

    import functools

    from infer.kernels import fused, gptq_tune, lora_ops
    from infer.kernels.compiles import watch_compiles
    from infer.kernels.lora_reference import LoRADelta
    from infer.models import llama
    from infer.lora.batch import lora_groups
    from infer.lora.layer import LoRALayer

    class Int4Method:  # the int4 kernels: the expand in the epilogue of steps of up to 16 rows only
        def fuses_lora(self, layer):
            return True

        def kernel_key(self, layer):
            return ("int4",)

        def lora_in_epilogue(self, layer, m, lora):
            return m <= 16

    class FloatMethod:
        pass

    def base(outs, method, consumer=None):
        offsets = [sum(outs[:i]) for i in range(len(outs))]
        return SimpleNamespace(names=[f"p{i}" for i in range(len(outs))], out_sizes=outs, in_features=K,
                               shard_offset=lambda i: offsets[i], method=method, lora_consumer=consumer)

    lora_ops.expand_by = EXPAND_BY  # INFER_LORA_EXPAND: the decode expands by segments or as gathers
    K, SLOTS, RANK, MAX_TOKENS = 11008, 32, 8, 300  # (splits of K 16, 8 and 4 at 1-16, 17-32, 33+ tokens)
    g = torch.Generator().manual_seed(0)
    out = {}
    silu = functools.partial(llama._compile_silu_and_mul, torch.float16, False)  # the MLP's gate_up consumer
    for name, outs, method, consumer in (("apply", [64, 32, 32], FloatMethod(), None),
                                         ("delta", [64], Int4Method(), None),
                                         ("deferred", [48, 48], FloatMethod(), silu),
                                         ("norm", [64], FloatMethod(), llama._NormConsumer(torch.float16))):
        b = base(outs, method, consumer)
        layer = LoRALayer(b, SLOTS, RANK, "cpu", torch.float16)
        layer.rank_t.fill_(RANK)
        layer.fused = name == "deferred"  # EngineConfig.lora_expand_fused (off by default; the norm's is on)
        calls = layer.compile_calls(b, MAX_TOKENS)
        before = len(compiled)
        with watch_compiles() as watched:
            queued = gptq_tune.compile_parallel(calls, workers=2)
        start = compiled[before:]
        late, steps = [], 0
        with watch_compiles() as watched_late:
            for t in list(range(1, 41)) + [63, 64, 255, 256, 257, 300]:
                slots = torch.randint(-1, SLOTS, (t,), generator=g).sort().values
                groups = lora_groups(slots, SLOTS, in_order=True)
                x = torch.randn(t, K, generator=g).half()
                y = torch.zeros(t, sum(outs), dtype=torch.float16)
                n0 = len(compiled)
                if name == "deferred" and t <= 64:  # the shrink by token, silu_and_mul adding the delta
                    hp = lora_ops.shrink(x, layer.lora_a, 2, groups, layer.rank_t, by_token=True)
                    fused.silu_and_mul(y, LoRADelta(hp, layer.lora_bt, slots, layer.scalings, layer.rank_t,
                                                    layer.bounds, groups, False))
                elif name == "norm" and t <= 64:  # the shrink by token, the rms_norm (with the residual) adding it
                    hp = lora_ops.shrink(x, layer.lora_a, 1, groups, layer.rank_t, by_token=True)
                    fused.rms_norm(y, torch.ones(64, dtype=torch.float16), 1e-5, y,
                                   LoRADelta(hp, layer.lora_bt, slots, layer.scalings, layer.rank_t, layer.bounds,
                                             groups, False))
                elif name in ("apply", "deferred", "norm"):
                    lora_ops.lora_apply(x, y, layer.lora_a, layer.lora_bt, layer.scalings, layer.bounds, groups,
                                        layer.rank_t)
                    if name == "apply":  # and what a decode graph launches (LoRALayer.apply_beside)
                        gather = lora_ops.gathers(t)
                        hs = lora_ops.shrink(x, layer.lora_a, 3, groups, layer.rank_t, by_token=gather)
                        layer._expand(hs, y, slots, groups, gather)
                else:  # the shrink by token; the expand launched where the int4 kernel does not add it
                    hp = lora_ops.shrink(x, layer.lora_a, 1, groups, layer.rank_t, by_token=True)
                    if t > 16:
                        lora_ops.add_delta(LoRADelta(hp, layer.lora_bt, slots, layer.scalings, layer.rank_t,
                                                     layer.bounds, groups, False), y)
                    # and what a decode graph launches (LoRALayer.apply_beside): the shrink beside the matmul, by
                    # token where the expand is a gather, then the expand
                    gather = lora_ops.gathers(t)
                    hs = lora_ops.shrink(x, layer.lora_a, 1, groups, layer.rank_t, by_token=gather)
                    layer._expand(hs, y, slots, groups, gather)
                late += [(t, c) for c in compiled[n0:]]
                steps += 1
        out[name] = dict(calls=len(calls), queued=queued, start=start, late=late, steps=steps, watched=watched,
                         watched_late=watched_late)
    print(json.dumps(out))
''')


def test_engine_start_compiles_every_lora_kernel_a_step_launches():
    """With the decode expand by segments, as a gather, and by the step's tokens (INFER_LORA_EXPAND's auto, the
    default: gathers up to GATHER_AUTO_TOKENS tokens), one after the other: the later ones find the kernels they
    share (the shrink, the consumers) in triton's cache."""
    for expand_by in ("segments", "gather", "auto"):
        _start_compiles_every_lora_kernel(expand_by)


def _start_compiles_every_lora_kernel(expand_by: str) -> None:
    out = run_compile_only(SCRIPT.replace("EXPAND_BY", repr(expand_by)), 900)
    for name in ("apply", "delta", "deferred", "norm"):
        got = out[name]
        assert got["queued"] == got["calls"] > 0 and got["steps"] == 46, (name, got)
        assert got["late"] == [], (name, got)  # a step compiled what the start missed
        # kernels.compiles.watch_compiles (what gpu_e2e reports) saw the start's compiles and nothing after
        assert got["watched"] == got["start"] and got["watched_late"] == [], (name, got)
    # 1-300 tokens make plans of two tile heights (shrink variants) and four splits of K (expand variants)
    assert out["apply"]["start"].count("_shrink_kernel") >= 2, out["apply"]
    assert out["apply"]["start"].count("_expand_kernel") >= 4, out["apply"]
    # the delta path's expand (by token) is compiled for every plan but the one whose steps all add it in the
    # epilogue; and, for the decode graphs' shrink beside the matmul (EngineConfig.lora_streams), the apply path's
    # variants by sorted position too
    expands = out["apply"]["start"].count("_expand_kernel")
    if expand_by == "auto":  # gathers up to 32 tokens (the 1-16- and 17-32-token plans' tile shapes), by segments
        # above
        assert out["delta"]["start"].count("_expand_gather_kernel") == 6, out["delta"]
        assert out["apply"]["start"].count("_expand_gather_kernel") == 6, out["apply"]
        assert 0 < out["delta"]["start"].count("_expand_kernel") < (expands - 1) + expands, out
        return
    if expand_by == "gather":  # up to 64 tokens the delta layer's expands are gathers: one variant per tile shape
        # (1, 2, 4, 8 and 16 tokens a program at rank 8 with the 1-16-token plan's split of K, 16 with the 17-32- and
        # 33-64-token plans'), and by segments for the longer steps only
        assert out["delta"]["start"].count("_expand_gather_kernel") == 7, out["delta"]
        assert 0 < out["delta"]["start"].count("_expand_kernel") < (expands - 1) + expands, out
        # and the apply path's for the decode graphs' launches (`apply_beside`: the shrink beside the matmul)
        assert out["apply"]["start"].count("_expand_gather_kernel") == 7, out["apply"]
        return
    assert out["delta"]["start"].count("_expand_kernel") == (expands - 1) + expands, out
    # a layer whose consumer adds its delta (the MLP's gate_up): silu_and_mul's variants for the steps of up to
    # DEFER_MAX_TOKENS tokens (one per split of K there), the expand only for the longer ones
    assert out["deferred"]["start"].count("_silu_and_mul_kernel") >= 3, out["deferred"]
    assert 0 < out["deferred"]["start"].count("_expand_kernel") < expands, out["deferred"]
    # o_proj's and down_proj's consumer (the rms_norm after them): its variants for the same steps (its shrink and
    # the longer steps' expand are the one-shard delta layer's variants, compiled before: the late steps' check
    # above says nothing was missing)
    assert out["norm"]["start"].count("_rms_norm_lora_kernel") >= 3, out["norm"]


ONE_SLOT = COMPILE_ONLY_PREAMBLE + textwrap.dedent('''
    from infer.kernels import attention, fused
    from infer.kernels.lora_reference import LoRADelta
    caps = []
    warm = attention._decode_kernel.warmup
    def kept(*a, **k):  # each decode variant's register cap (ptxas's maxnreg; None: none)
        kernel = warm(*a, **k)
        caps.append(kernel.metadata.maxnreg)
        return kernel
    attention._decode_kernel.warmup = kept
    t, h, d, r, dt = 16, 8, 128, 16, torch.float16
    ints = torch.zeros(t, dtype=torch.int64)
    q, k, v = torch.empty(t, 3 * h * d, dtype=dt).split([h * d] * 3, -1)
    kc = torch.empty(64, 16, h, d, dtype=dt)
    for slots in (1, 2):  # one slot: the slot count is 1, which Triton compiles as a constant
        def delta(widths):
            n = len(widths)
            bounds = [sum(widths[:i]) for i in range(n + 1)]
            return LoRADelta(torch.empty(4, t, n * r), torch.empty(slots * r * bounds[-1], dtype=dt), ints,
                             torch.empty(n, slots), torch.empty(n, slots, dtype=torch.int32), bounds, None, False)
        attention.decode_attention(ints, q, k, v, torch.empty(1, d), d, kc, torch.empty_like(kc), ints,
                                   torch.zeros(t, 1, dtype=torch.int32), torch.ones(t, dtype=torch.int32),
                                   torch.arange(t + 1, dtype=torch.int32), 0.1, delta([h * d] * 3), compile_only=True)
        fused.silu_and_mul(torch.empty(t, 512, dtype=dt), delta([256, 256]), compile_only=True)
        x = torch.empty(t, 256, dtype=dt)
        fused.rms_norm(x, torch.empty(256, dtype=dt), 1e-5, x, delta([256]), compile_only=True)
    print(json.dumps({"compiled": compiled, "caps": caps}))
''')


def test_lora_consumers_compile_with_one_adapter_slot():
    """--max-loras 1 makes the slot count 1, which Triton compiles as a constant (an int, without tensor methods):
    the decode attention's, silu_and_mul's and rms_norm's LoRA variants still compile for sm_90, as with two slots,
    the decode one with its register cap."""
    out = run_compile_only(ONE_SLOT, 600)
    assert out["compiled"].count("_decode_kernel") == 2 and out["compiled"].count("_silu_and_mul_kernel") == 2, out
    assert out["compiled"].count("_rms_norm_lora_kernel") == 2, out
    # the LoRA variant capped at 128 registers a thread: four programs per SM, as the variant without adapters (on
    # Triton 3.6 ptxas would take about 145; tests/test_kernel_sass.py checks the registers it takes)
    from infer.kernels import attention
    assert out["caps"] == [attention.LORA_MAX_REGS] * 2 == [128] * 2, out
