"""Mixed-adapter batches through MergedLinear + LoRALayer against peft (each adapter alone) on the same weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from infer.errors import LoRAError
from infer.lora import LoRAManager
from infer.models.layers import MergedLinear

from test_lora_adapter import ALL, make_adapter, tiny_llama

ADAPTERS = {  # name -> LoraConfig arguments: ranks 4..64, rslora, patterns, different targets
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=16, target_modules=ALL),
    "c": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "down_proj"]),
    "d": dict(r=64, lora_alpha=32, target_modules=["gate_proj", "up_proj", "v_proj"],
              rank_pattern={"up_proj": 32}, alpha_pattern={"v_proj": 5}),
}
GROUPS = [("self_attn", ["q_proj", "k_proj", "v_proj"]), ("self_attn", ["o_proj"]),
          ("mlp", ["gate_proj", "up_proj"]), ("mlp", ["down_proj"])]


class MergedStack(nn.Module):
    """Every projection of an HF Llama as infer's MergedLinear layers (qkv and gate_up merged)."""

    def __init__(self, hf):
        super().__init__()
        self.config = hf.config
        self.linears = nn.ModuleList()
        for i, layer in enumerate(hf.model.layers):
            for parent, projs in GROUPS:
                mods = [getattr(getattr(layer, parent), p) for p in projs]
                names = [f"model.layers.{i}.{parent}.{p}" for p in projs]
                ml = MergedLinear(mods[0].in_features, [m.out_features for m in mods], names, False, None,
                                  torch.float32)
                for shard, m in enumerate(mods):
                    ml.load_shard("weight", shard, m.weight.detach())
                ml.finish_loading()
                self.linears.append(ml)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from peft import PeftModel
    tmp = tmp_path_factory.mktemp("adapters")
    paths = {n: make_adapter(tmp, n, seed=i + 1, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    hf = tiny_llama(seed=0)
    stack = MergedStack(hf)  # built before peft wraps the Linear layers
    peft = PeftModel.from_pretrained(hf, str(paths["a"]), adapter_name="a")
    for n in list(ADAPTERS)[1:]:
        peft.load_adapter(str(paths[n]), adapter_name=n)
    return SimpleNamespace(paths=paths, stack=stack, peft=peft.eval())


def peft_outputs(peft, ml: MergedLinear, x: torch.Tensor, adapter: str | None) -> torch.Tensor:
    """peft's output of the shards of `ml` with one adapter active (None: the base layer)."""
    outs = []
    with torch.no_grad():
        for name in ml.names:
            mod = peft.get_submodule(f"base_model.model.{name}")
            if adapter is None:
                with peft.disable_adapter():
                    outs.append(mod(x))
            else:
                peft.set_adapter(adapter)
                outs.append(mod(x))
    return torch.cat(outs, dim=-1)


def expected(peft, ml, x, token_adapters):
    y = torch.empty(x.shape[0], ml.out_features)
    for adapter in set(token_adapters):
        rows = [t for t, a in enumerate(token_adapters) if a == adapter]
        y[rows] = peft_outputs(peft, ml, x[rows], adapter)
    return y


def run_batch(mgr, setup, token_adapters, seed=0):
    """Max |infer - peft| over every layer for a batch whose token t uses token_adapters[t]."""
    ctx = SimpleNamespace(lora=mgr.make_batch([mgr.slot_of(a) for a in token_adapters]))
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for ml in setup.stack.linears:
        x = torch.randn(len(token_adapters), ml.in_features, generator=g)
        got = ml(x, ctx)
        worst = max(worst, (got - expected(setup.peft, ml, x, token_adapters)).abs().max().item())
    return worst


def test_oracle_is_not_trivial(setup):
    """The adapters change every layer they target (random non-zero B), so equality below means something."""
    ml = setup.stack.linears[0]
    x = torch.randn(5, ml.in_features)
    base = peft_outputs(setup.peft, ml, x, None)
    assert (peft_outputs(setup.peft, ml, x, "b") - base).abs().max() > 0.1


def test_mixed_batch_matches_peft(setup):
    mgr = LoRAManager(setup.stack, max_loras=4, max_lora_rank=64, device="cpu", dtype=torch.float32)
    for n, p in setup.paths.items():
        mgr.register(n, p)
        mgr.acquire(n)
    g = torch.Generator().manual_seed(3)
    names = [None, *ADAPTERS]
    tokens = [names[i] for i in torch.randint(0, len(names), (41,), generator=g).tolist()]
    assert run_batch(mgr, setup, tokens) < 1e-4
    for only in ["a", "c", None]:  # one adapter for every token (the fast path), and a subset of shards
        assert run_batch(mgr, setup, [only] * 7 + [None]) < 1e-4
        assert run_batch(mgr, setup, [only] * 5) < 1e-4
    assert mgr.make_batch([-1, -1]) is None and mgr.make_batch(torch.tensor([-1])) is None
    batch = mgr.make_batch(torch.tensor([3, -1, 0, 3]))
    assert batch.active_slots == (0, 3) and batch.token_slots.tolist() == [3, -1, 0, 3]


def test_no_lora_context_is_the_base_layer(setup):
    mgr = LoRAManager(setup.stack, max_loras=1, max_lora_rank=64)
    mgr.register("b", setup.paths["b"])
    mgr.acquire("b")
    ml = setup.stack.linears[2]
    x = torch.randn(3, ml.in_features)
    base = peft_outputs(setup.peft, ml, x, None)
    assert torch.allclose(ml(x, SimpleNamespace(lora=None)), base, atol=1e-5)
    assert torch.allclose(ml(x, None), base, atol=1e-5)


def test_slot_eviction_lru_and_pins(setup, tmp_path):
    paths = {f"e{i}": make_adapter(tmp_path, f"e{i}", seed=10 + i, r=4 * (1 + i % 3), target_modules=ALL)
             for i in range(8)}
    for n, p in paths.items():
        setup.peft.load_adapter(str(p), adapter_name=n)
    mgr = LoRAManager(setup.stack, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    for n, p in paths.items():
        mgr.register(n, p)
    assert mgr.cpu_resident() == ["e5", "e6", "e7"] and mgr.disk_loads == 8
    assert (mgr.acquire("e0"), mgr.acquire("e1")) == (0, 1) and mgr.disk_loads == 10  # e0, e1 read again
    assert not mgr.can_acquire("e2")  # both slots pinned by running requests
    with pytest.raises(LoRAError, match="e2"):
        mgr.acquire("e2")
    assert run_batch(mgr, setup, ["e0", "e1", None, "e1", "e0"]) < 1e-4
    mgr.release("e1")
    assert mgr.can_acquire("e2") and mgr.acquire("e2") == 1  # the only unpinned slot
    assert mgr.resident() == {"e0": 0, "e2": 1} and mgr.swaps == 3
    assert run_batch(mgr, setup, ["e2", "e0", "e2"]) < 1e-4
    mgr.release("e0"), mgr.release("e2")
    assert mgr.acquire("e2") == 1 and mgr.swaps == 3  # already resident: no swap, now most recently used
    mgr.release("e2")
    assert mgr.acquire("e5") == 0  # e0 is the least recently used
    assert mgr.acquire("e0") == 1  # and e2 is now
    assert mgr.resident() == {"e5": 0, "e0": 1} and mgr.swaps == 5 and mgr.pins("e0") == 1
    assert run_batch(mgr, setup, ["e0", None, "e5", "e0"]) < 1e-4  # identical results after swaps
    assert mgr.slot_of(None) == -1 and mgr.acquire(None) == -1 and mgr.can_acquire(None)
    with pytest.raises(LoRAError, match="not in a device slot"):
        mgr.slot_of("e3")
    with pytest.raises(LoRAError, match="unknown LoRA adapter 'zz'"):
        mgr.acquire("zz")


def test_register_errors_name_the_adapter(setup, tmp_path):
    mgr = LoRAManager(setup.stack, max_loras=2, max_lora_rank=8)
    with pytest.raises(LoRAError, match="'big'.*rank 16"):
        mgr.register("big", setup.paths["c"])
    mgr.register("a", setup.paths["a"])
    with pytest.raises(LoRAError, match="'a' is already registered"):
        mgr.register("a", setup.paths["b"])
    assert mgr.names() == ["a"] and mgr.has("a") and not mgr.has("big")
    mgr.acquire("a")
    with pytest.raises(LoRAError, match="in use"):
        mgr.unregister("a")
    mgr.release("a")
    mgr.unregister("a")
    assert mgr.names() == [] and mgr.resident() == {}
    assert all(not layer.targets(0) for layer in mgr.layers)


@pytest.mark.gpu
def test_gpu_swaps_queue_their_copies_without_waiting_for_the_device(setup):
    """Swapping adapters into device slots (a new one, a second, one into a slot whose previous adapter targeted
    other shards, a clear) makes no synchronising call, so it never drains a step in flight; once the copies have
    run, every slot tensor equals the same swaps done on the CPU."""
    import copy
    packs = {ml: ml.packed_weight for ml in setup.stack.linears}  # oneDNN's packed CPU weights: no deepcopy, no .to
    for ml in packs:
        ml.packed_weight = None
    try:
        gpu_stack = copy.deepcopy(setup.stack).to("cuda")
        cpu_stack = copy.deepcopy(setup.stack)
    finally:
        for ml, packed in packs.items():
            ml.packed_weight = packed
    managers = [LoRAManager(s, max_loras=2, max_lora_rank=64) for s in (gpu_stack, cpu_stack)]
    for mgr in managers:
        for name, path in setup.paths.items():
            mgr.register(name, path)
    torch.cuda.synchronize()

    def swaps(mgr):
        mgr.acquire("b"), mgr.acquire("d")
        mgr.release("b")
        mgr.acquire("c")  # into b's slot: c targets k, o and down only, so b's other shards are cleared
        mgr.release("c")
        mgr.unregister("c")
    torch.cuda.set_sync_debug_mode("error")
    try:
        swaps(managers[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    swaps(managers[1])
    torch.cuda.synchronize()
    assert managers[0].resident() == managers[1].resident() == {"d": 1}
    for g, c in zip(*(m.layers for m in managers)):
        for name in ("lora_a", "lora_bt", "scalings", "rank_t"):
            assert torch.equal(getattr(g, name).cpu(), getattr(c, name)), name


def test_the_shrink_goes_beside_the_matmul_only_while_a_cuda_graph_is_captured(setup, monkeypatch):
    """LoRALayer.beside: the second-stream path is taken for a CUDA input while a graph is captured, unless
    EngineConfig.lora_streams switched it off; never for a CPU input or outside a capture (eager steps and prefills
    keep one stream: a fork and join there would cost host time for nothing). The path itself runs on a GPU
    (test_overlap.py::test_gpu_lora_shrink_beside_the_matmul_gives_the_tokens_of_one_stream)."""
    mgr = LoRAManager(setup.stack, max_loras=2, max_lora_rank=8)
    base = setup.stack.linears[0]
    layer = mgr.layers[0]

    class CudaInput:  # what beside() reads of x, on a machine without a GPU
        is_cuda = True
        shape = (16, base.in_features)

        def reshape(self, *shape):
            return torch.empty(16, base.in_features)
    x_gpu, x_cpu = CudaInput(), torch.randn(16, base.in_features)
    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    assert not layer.beside(base, x_gpu) and not layer.beside(base, x_cpu)
    capturing["now"] = True
    assert layer.beside(base, x_gpu) and not layer.beside(base, x_cpu)
    layer.streams = False
    assert not layer.beside(base, x_gpu)
    layer.streams = True
    assert layer.beside(base, x_gpu)


@pytest.mark.parametrize("expand_by", ["segments", "gather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_beside_gives_the_one_stream_result_bit_for_bit(setup, monkeypatch, dtype, expand_by):
    """LoRALayer.apply_beside, the decode graphs' path, with the Triton kernels interpreted and the two streams
    stood in for (the concurrency itself needs a GPU: test_overlap.py's -m gpu test): the shrink into a
    preallocated hp, the expand after the join, or (lora_expand_beside) the expand into a float32 delta added after
    the join, each give exactly what the one-stream path gives (the float32 sum rounded once), on every merged
    projection, for mixed adapters of ranks 4-64 with a base-model token among them. With the expands as gathers
    (INFER_LORA_EXPAND=gather: the shrink stores by token) the two ways give each other's result bit for bit and
    the one-stream path's up to the order of the rank's sum."""
    from infer import kernels
    from infer.kernels import lora_ops
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real streams (test_overlap.py)")
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    monkeypatch.setattr(lora_ops, "expand_by", expand_by)
    gathered = []
    real_gather = lora_ops.expand_gather
    monkeypatch.setattr(lora_ops, "expand_gather", lambda *a, **kw: (gathered.append(1), real_gather(*a, **kw)))
    _stand_in_streams(monkeypatch)
    stack = MergedStack(tiny_llama(seed=0))
    for ml in stack.linears:
        ml.weight.data, ml.dtype, ml.packed_weight = ml.weight.data.to(dtype), dtype, None
    mgr = LoRAManager(stack, max_loras=4, max_lora_rank=64, device="cpu", dtype=dtype)
    for name, path in setup.paths.items():
        mgr.register(name, path)
    slot = {name: mgr.acquire(name) for name in "abcd"}
    tokens = ["a", "b", None, "d", "c", "b", "d"]
    batch = mgr.make_batch([slot[n] if n else -1 for n in tokens])
    torch.manual_seed(3)
    for ml in stack.linears[:4]:
        x = torch.randn(len(tokens), ml.in_features).to(dtype)
        want = ml.method.apply(ml, x)
        base = want.clone()
        ml.lora.apply(x, want, batch)
        assert not torch.equal(want, base)
        got = {}
        for expand_beside in (False, True):
            ml.lora.expand_beside = expand_beside
            got[expand_beside] = ml.lora.apply_beside(ml, x, batch)
            if expand_by == "segments":
                assert torch.equal(got[expand_beside], want), (ml.names, expand_beside)
        if expand_by == "gather":
            tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
            assert torch.equal(got[False], got[True]) and torch.allclose(got[False], want, **tol), ml.names
    assert len(gathered) == (8 if expand_by == "gather" else 0)  # 4 projections x 2 ways


def _deferral_batch(setup, tokens):
    """(a manager holding adapters a-d on the CPU, a step context whose token t uses adapter tokens[t]) for the
    deferral tests, which interpret the Triton kernels (skipped on a GPU)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (test_overlap.py, test_cuda_graphs.py)")
    mgr = LoRAManager(setup.stack, max_loras=4, max_lora_rank=64)
    for name, path in setup.paths.items():
        mgr.register(name, path)
    slot = {name: mgr.acquire(name) for name in "abcd"}
    return mgr, SimpleNamespace(lora=mgr.make_batch([slot[n] if n else -1 for n in tokens]))


def _stand_in_streams(monkeypatch, capturing: bool | None = None) -> None:
    """CUDA's two streams stood in for on the CPU, and graph capture (`capturing`: as if a graph were recorded or
    not; None: left as it is)."""
    import contextlib

    from infer.lora import layer as layer_mod

    class Stream:
        def wait_stream(self, other):
            pass
    monkeypatch.setattr(layer_mod, "_streams", lambda device: (Stream(), Stream()))
    monkeypatch.setattr(layer_mod, "_on", lambda stream: contextlib.nullcontext())
    if capturing is not None:
        monkeypatch.setattr(layer_mod, "_capturing", lambda t: capturing)


@pytest.mark.parametrize("capturing", [False, True])
def test_gate_up_expand_left_to_silu_and_mul_gives_the_apply_result(setup, monkeypatch, capturing):
    """MergedLinear.forward_deferred on the MLP's gate_up (lora_consumer), the Triton kernels interpreted: the
    layer's y without the adapters plus their delta by token, which silu_and_mul adds, equals silu_and_mul of the
    layer's forward (shrink and expand); while a graph is captured, with the shrink on the side stream (the streams
    stood in for). Other layers, a CPU step, a step of more than DEFER_MAX_TOKENS tokens and lora_expand_fused off
    (the default) leave the expand in the layer."""
    from infer import kernels
    from infer.lora import layer as layer_mod
    tokens = ["d", "b", None, "d", "c", "b", "a"]
    mgr, ctx = _deferral_batch(setup, tokens)
    gate_up, qkv = setup.stack.linears[2], setup.stack.linears[0]
    x = torch.randn(len(tokens), gate_up.in_features, generator=torch.Generator().manual_seed(4))
    gate_up.lora_consumer = lambda delta: None
    try:
        gate_up.lora.fused = True
        assert not gate_up.lora.defers(gate_up, x)  # a CPU step: the torch path
        monkeypatch.setattr(kernels, "use_triton", lambda t: True)
        assert gate_up.lora.defers(gate_up, x) and not qkv.lora.defers(qkv, x)
        assert not gate_up.lora.defers(gate_up, torch.zeros(layer_mod.DEFER_MAX_TOKENS + 1, x.shape[1]))
        gate_up.lora.fused = False
        assert not gate_up.lora.defers(gate_up, x)
        assert gate_up.forward_deferred(x, ctx)[1] is None
        gate_up.lora.fused = True
        _stand_in_streams(monkeypatch, capturing)
        want = kernels.silu_and_mul(gate_up(x, ctx))
        y, delta = gate_up.forward_deferred(x, ctx)
        assert delta is not None and torch.equal(y, gate_up.method.apply(gate_up, x))
        got = kernels.silu_and_mul(y, delta)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert (got - kernels.silu_and_mul(y)).abs().max() > 1e-3  # the adapters do change it
        none = SimpleNamespace(lora=mgr.make_batch([-1] * len(tokens)))
        assert gate_up.forward_deferred(x, none)[1] is None
    finally:
        gate_up.lora_consumer = None


@pytest.mark.parametrize("capturing", [False, True])
def test_o_and_down_expands_left_to_the_rms_norm_after_them(setup, monkeypatch, capturing):
    """forward_deferred on o_proj and down_proj, whose consumer is the rms_norm after them (an `into_norm`
    lora_consumer), the Triton kernels interpreted: the layer's y without the adapters plus their delta, which
    rms_norm adds before the residual, gives the norm's output and the next residual of the layer's forward (shrink
    and expand), with the shrink on the side stream while a graph is captured. The switches are apart: by default
    these expands go to the norm and gate_up's stays in its layer; lora_expand_in_norm off (LoRALayer.fused_norm)
    leaves these in their layers, also with gate_up's left to silu_and_mul (lora_expand_fused)."""
    from infer import kernels
    tokens = ["c", "b", None, "c", "a", "b", "d"]
    mgr, ctx = _deferral_batch(setup, tokens)
    o, gate_up, down = setup.stack.linears[1], setup.stack.linears[2], setup.stack.linears[3]

    def norm_consumer(delta):
        pass
    norm_consumer.into_norm = True
    g = torch.Generator().manual_seed(5)
    o.lora_consumer = down.lora_consumer = norm_consumer
    gate_up.lora_consumer = lambda delta: None
    try:
        monkeypatch.setattr(kernels, "use_triton", lambda t: True)
        x = torch.randn(len(tokens), o.in_features, generator=g)
        xg = torch.randn(len(tokens), gate_up.in_features, generator=g)
        assert o.lora.defers(o, x) and down.lora.defers(down, torch.randn(len(tokens), down.in_features))
        assert not gate_up.lora.defers(gate_up, xg)
        for ml in (o, down, gate_up):
            ml.lora.fused_norm, ml.lora.fused = False, True
        assert not o.lora.defers(o, x) and o.forward_deferred(x, ctx)[1] is None
        assert gate_up.lora.defers(gate_up, xg)
        for ml in (o, down, gate_up):
            ml.lora.fused_norm, ml.lora.fused = True, False
        _stand_in_streams(monkeypatch, capturing)
        for ml in (o, down):
            x = torch.randn(len(tokens), ml.in_features, generator=g)
            res = torch.randn(len(tokens), ml.out_features, generator=g)
            w = 1 + 0.1 * torch.randn(ml.out_features, generator=g)
            want, want_h = kernels.rms_norm(ml(x, ctx), w, 1e-5, res)
            y, delta = ml.forward_deferred(x, ctx)
            assert delta is not None and torch.equal(y, ml.method.apply(ml, x))
            got, got_h = kernels.rms_norm(y, w, 1e-5, res, delta)
            assert (got_h - want_h).abs().max() <= 1e-5 * want_h.abs().max(), ml.names
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), ml.names
            assert (got_h - kernels.rms_norm(y, w, 1e-5, res)[1]).abs().max() > 1e-3  # the adapters do change it
    finally:
        o.lora_consumer = down.lora_consumer = gate_up.lora_consumer = None
