"""Probes of the memory plan against what the engine allocates, session 50: the formulas `infer warmup` proves a
config by (and an engine start reserves) must be an upper bound of the real peak.

The peaks here are counted on the CPU: every tensor a step's torch ops create, alive until its last reference goes
(a TorchDispatchMode that keeps weak references: `LiveBytes`), without the weights and the step's inputs."""

from __future__ import annotations

import contextlib
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig

from infer.engine.config import EngineConfig


class LiveBytes(TorchDispatchMode):
    """The most bytes of CPU tensors alive at once among those the ops run under it create (storages counted once,
    however many views share them; `exclude`: tensors that exist before, such as weights and inputs; `existing`:
    every tensor alive when it starts, which views of them do not count)."""

    def __init__(self, exclude=(), existing: bool = False):
        super().__init__()
        self.refs: dict[int, tuple[int, list]] = {}
        self.peak = 0
        # data_ptr -> the tensors (views too) that held it when the meter started: an address counts as excluded only
        # while one of them lives (one freed during the step may hand its address to a new tensor, which counts)
        self.exclude: dict[int, list] = {}
        for t in exclude:
            if isinstance(t, torch.Tensor):
                self._exclude(t)
        self.existing = existing

    def __enter__(self):
        if self.existing:
            gc.collect()
            for t in gc.get_objects():
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                    with contextlib.suppress(NotImplementedError, RuntimeError):  # (an opaque prepacked weight)
                        self._exclude(t)
        return super().__enter__()

    def _exclude(self, t: torch.Tensor) -> None:
        self.exclude.setdefault(t.untyped_storage().data_ptr(), []).append(weakref.ref(t))

    def _live(self) -> int:
        total = 0
        for ptr, (n, refs) in list(self.refs.items()):
            alive = [r for r in refs if r() is not None]
            if alive:
                self.refs[ptr] = (n, alive)
                total += n
            else:
                del self.refs[ptr]
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if any(r() is not None for r in self.exclude.get(ptr, ())) or not storage.nbytes():
                    continue
                n, refs = self.refs.get(ptr, (0, []))
                refs = [r for r in refs if r() is not None]  # a dead storage's address taken by a new one: its size
                self.refs[ptr] = (max(n if refs else 0, storage.nbytes()), refs + [weakref.ref(t)])
        live = self._live()
        if live > self.peak:
            self.peak, self.at = live, (str(func), sorted((n for n, _ in self.refs.values()), reverse=True))
        return out


def _stand_in_capture(monkeypatch) -> None:
    """A CUDA graph's capture on the CPU: LoRALayer.beside sees one, and its two streams are stood in for."""
    from infer.lora import layer as layer_mod

    class Stream:
        def wait_stream(self, other):
            pass
    monkeypatch.setattr(layer_mod, "_streams", lambda device: (Stream(), Stream()))
    monkeypatch.setattr(layer_mod, "_on", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(layer_mod, "_capturing", lambda x: True)


def _mlp_peak(cfg, dtype, rank: int, tokens: int, expand_beside: bool, max_loras: int = 2) -> int:
    """The peak bytes of a decode graph's MLP step (llama.MLP with every adapter slot, LoRALayer.apply_beside with
    the Triton kernels interpreted) on `tokens` rows, with the MLP's input and the residual the model's loop holds."""
    from infer.lora import LoRAManager
    from infer.lora.batch import LoRABatch, lora_groups
    from infer.models.layers import UnquantizedLinearMethod
    from infer.models.llama import MLP
    torch.manual_seed(0)
    mlp = MLP(cfg, "model.layers.0.mlp", lambda names: UnquantizedLinearMethod(), dtype)
    for ml in (mlp.gate_up_proj, mlp.down_proj):
        ml.weight.data = (torch.randn(ml.weight.shape) * 0.05).to(dtype)
    holder = torch.nn.Module()
    holder.mlp, holder.config = mlp, cfg
    mgr = LoRAManager(holder, max_loras=max_loras, max_lora_rank=rank, device="cpu", dtype=dtype)
    for layer in mgr.layers:
        layer.expand_beside = expand_beside
    slots = torch.zeros(tokens, dtype=torch.long)
    groups = lora_groups(slots, max_loras, True)
    batch = LoRABatch(slots, tuple(range(max_loras)), groups, static=True)  # a graph's: every slot, full rank
    x = torch.randn(tokens, cfg.hidden_size).to(dtype)
    ctx = SimpleNamespace(lora=batch)
    keep = [x, slots, groups.order, groups.starts, *holder.parameters(), *holder.buffers()]
    keep += [t for layer in mgr.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    with torch.no_grad():
        mlp(x, ctx)  # (a first run: what the kernels set up once)
        meter = LiveBytes(keep)
        with meter:
            mlp(x, ctx)
    return meter.peak + 2 * x.numel() * x.element_size()  # the MLP's input and the residual


@pytest.mark.parametrize("expand_by", ["segments", "gather"])
def test_decode_graph_pool_counts_the_float32_delta_of_the_expand_beside(monkeypatch, expand_by):
    """With EngineConfig.lora_expand_beside a decode graph's layers expand into a float32 delta [T, out] on the
    side stream while the base matmul writes y [T, out]: at gate_up both are alive (with the shrink's float32
    partials), 2 * inter * (2 + 4) bytes a token in fp16, more than the 4 * inter * 2 the formula's MLP term
    holds. The pool's decode step (memory.plan._decode_graph_bytes) must hold the MLP's measured peak; it counted
    the one-stream step, 27% below it here. INFER_LORA_EXPAND's two ways allocate the same."""
    from infer.kernels import lora_ops
    from infer.memory.plan import _decode_graph_bytes
    monkeypatch.setattr(lora_ops, "expand_by", expand_by)
    _stand_in_capture(monkeypatch)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
    rank, tokens, dtype = 16, 64, torch.float16
    engine = EngineConfig("m", max_num_seqs=tokens, enable_lora=True, max_lora_rank=rank, max_model_len=64,
                          lora_expand_beside=True)
    beside = _mlp_peak(cfg, dtype, rank, tokens, True)
    assert beside > _mlp_peak(cfg, dtype, rank, tokens, False)
    assert beside <= _decode_graph_bytes(engine, cfg, dtype, rank)


def test_expand_beside_counts_only_where_the_side_stream_runs_it(monkeypatch):
    """The delta is there only with the second stream (lora_streams not False) and adapters: cuda_graph_bytes (the
    pool an engine start reserves and warmup proves) grows by it then, and only then."""
    from infer.memory.plan import cuda_graph_bytes
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)

    def pool(**kw) -> int:
        return cuda_graph_bytes(EngineConfig("m", max_num_seqs=256, max_lora_rank=16, max_model_len=2048,
                                             cuda_graph_max_tokens=512, **kw), cfg, torch.float16)
    assert pool(enable_lora=True, lora_expand_beside=True) > pool(enable_lora=True)
    assert pool(enable_lora=True, lora_expand_beside=True, lora_streams=False) == pool(enable_lora=True)
    assert pool(lora_expand_beside=True) == pool()


def _sampling_step(params, seqs: int, max_length: int = 16):
    """(the measured peak bytes of a decode step of `seqs` sequences of tiny-llama sampling with `params` on the
    CPU, from the forward to the sampled tokens, with the penalty table the step fills; the engine's config, the
    model's config and dtype)."""
    from infer import LLM
    from infer.engine.model_runner import ModelRunner
    from infer.engine.scheduler import ScheduledBatch
    from infer.engine.sequence import Sequence
    from infer.models.tiny import ensure_builtin
    llm = LLM(str(ensure_builtin("tiny-llama")), max_num_seqs=seqs, max_num_batched_tokens=seqs, block_size=4,
              num_kv_blocks=16, max_model_len=max_length)
    try:
        engine = llm.engine
        config, model, dtype = engine.config, engine.runner.model, engine.runner.dtype
        table = list(range(-(-max_length // config.block_size)))
        runner = ModelRunner(config, model, dtype=dtype, device=torch.device("cpu"), num_blocks=len(table))

        def batch():
            g = torch.Generator().manual_seed(0)
            out = ScheduledBatch([], [])
            for i in range(seqs):
                s = Sequence(f"m{i}", torch.randint(1, 500, (max_length - 1,), generator=g).tolist(), params, None)
                s.block_table, s.num_computed_tokens = table, max_length - 2
                out.seqs.append(s)
                out.num_new_tokens.append(1)
            return out
        runner.run(batch())  # (the penalty table's rows, the kernels' one-time set-up)
        table_bytes = runner.penalties.table.numel() * 4
        runner.penalties = type(runner.penalties)(runner.vocab_size, runner.device, seqs)
        step = batch()
        with torch.inference_mode():
            meter = LiveBytes(existing=True)
            with meter:
                runner.run(step)
        assert runner.penalties.table.numel() * 4 == table_bytes
        return meter.peak, config, model.config, dtype
    finally:
        llm.close()


def test_the_step_formula_holds_the_samplers_temporaries():
    """A decode step whose every sequence samples with penalties, temperature, top-k, top-p, min-p and 20 logprobs:
    at the sampler's peak (filter_top_k_top_p) a row holds its float32 logits, its penalty counts (int32), the
    penalised scores, their tempered copy, the sorted values and their int64 indices, the filtered copies and the
    drop mask: 37 bytes a vocabulary entry, where the formula counted 12 (logits, log-softmax, a copy). With a
    token budget of one token a sequence the forward's temporaries are small beside them, and the step (measured,
    with the penalty table it fills) passed activation_bytes, which an engine start reserves and warmup proves."""
    from infer.engine.sampling_params import SamplingParams
    from infer.memory.sizes import activation_bytes, step_tokens
    params = SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, logprobs=20,
                            repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5)
    seqs, length = 16, 16
    peak, config, model_config, dtype = _sampling_step(params, seqs, length)
    tokens = step_tokens(config.max_num_batched_tokens, seqs, length)
    assert peak <= activation_bytes(model_config, dtype, tokens, seqs, length)


@pytest.mark.parametrize("adapters", [False, True], ids=["base", "adapters"])
def test_the_mlp_frees_gate_ups_output_before_the_down_projection(adapters, monkeypatch):
    """llama.MLP.forward kept gate_up's output [T, 2 * inter] (a local) alive through the down projection, whose
    own peak (its input, its output, and on a CPU with adapters in half precision a float32 copy of its input for
    the shrink) then held it too: the step's peak passed the formula's (memory.sizes.activation_bytes). It is freed
    once silu_and_mul has read it, with or without the adapters' path."""
    from infer.models.layers import MergedLinear, UnquantizedLinearMethod
    from infer.models.llama import MLP
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
    mlp = MLP(cfg, "model.layers.0.mlp", lambda names: UnquantizedLinearMethod(), torch.float32)
    for ml in (mlp.gate_up_proj, mlp.down_proj):
        ml.weight.data = torch.randn(ml.weight.shape) * 0.05
    outputs, alive = [], []
    deferred = MergedLinear.forward_deferred

    def watched(self, x, ctx=None):
        if self is mlp.down_proj:
            alive.append(outputs[0]() is not None)
        y, d = deferred(self, x, ctx)
        if self is mlp.gate_up_proj:
            outputs.append(weakref.ref(y))
        return y, d
    monkeypatch.setattr(MergedLinear, "forward_deferred", watched)
    ctx = SimpleNamespace(lora=None)
    if adapters:  # the adapters' path: a hook that adds nothing, which the step's map reaches
        for ml in (mlp.gate_up_proj, mlp.down_proj):
            ml.lora = SimpleNamespace(beside=lambda base, x: False, takes_delta=lambda base: False,
                                      defers=lambda base, x: False, apply=lambda x, y, batch: None)
        ctx = SimpleNamespace(lora=object())
    with torch.no_grad():
        mlp(torch.randn(8, 64), ctx)
    assert alive == [False]


def _adapter(tmp_path, rank: int, targets: list[str] | None = None) -> str:
    """A peft adapter of every projection of tiny-llama (random, non-zero); `targets`: of those only."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from infer.models.tiny import ensure_builtin
    base = LlamaForCausalLM.from_pretrained(str(ensure_builtin("tiny-llama")), dtype=torch.float32)
    targets = targets or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(str(tmp_path / "adapter"))
    return str(tmp_path / "adapter")


def lora_prefill_peak(adapter: str, rank: int, targets: list[str] | None = None, path=None) -> tuple[int, int]:
    """(the bytes the worst case's prefill of a bf16 engine on the CPU (engine.profile's batches, 4 sequences of
    256 tokens) holds at its peak, every token with `adapter` (slots of `rank` on --lora-target-modules `targets`),
    the formula's figure for it: memory.sizes.activation_bytes, which an engine start reserves). Measured: every
    tensor the step creates. `path`: the model (tiny-llama)."""
    from pathlib import Path

    from infer.engine.model_runner import ModelRunner
    from infer.engine.profile import worst_case_batches
    from infer.lora.manager import LoRAManager
    from infer.memory.sizes import activation_bytes, step_tokens
    from infer.models.loader import load_model
    from infer.models.tiny import ensure_builtin
    path, dtype, seqs, length = path or ensure_builtin("tiny-llama"), torch.bfloat16, 4, 256
    engine = EngineConfig(str(path), max_num_seqs=seqs, max_model_len=length, block_size=16, max_lora_rank=rank,
                          loras={"a": adapter}, lora_target_modules=targets)
    model, model_config = load_model(Path(path), dtype, torch.device("cpu"), max_positions=length)
    manager = LoRAManager(model, max_loras=1, max_lora_rank=rank, device="cpu", dtype=dtype, target_modules=targets)
    manager.register("a", engine.loras["a"])
    manager.acquire("a")
    prefill, decodes, blocks = worst_case_batches(model_config, engine, length, seqs, engine.block_size)
    for s in prefill.seqs:
        s.lora = "a"
    runner = ModelRunner(engine, model, dtype=dtype, device=torch.device("cpu"), num_blocks=blocks,
                         lora_manager=manager)
    runner.zero_blocks(list(range(blocks)))
    with torch.inference_mode():
        runner.run(prefill)
        meter = LiveBytes(existing=True)
        with meter:
            runner.run(prefill)
    tokens = step_tokens(engine.max_num_batched_tokens, seqs, length)
    assert sum(prefill.num_new_tokens) <= tokens
    return meter.peak, activation_bytes(model_config, dtype, tokens, seqs, length, rank, lora_targets=targets)


@pytest.mark.parametrize("rank", [8, 64])
def test_the_step_formula_holds_the_cpu_adapter_paths_float32_copies(tmp_path, rank):
    """A bf16 engine on the CPU with an adapter on every projection: the worst case's prefill (engine.profile's
    batches, tiny-llama) runs each layer's LoRA through kernels.lora_reference, whose expand computes a shard's
    delta in float32 and casts a copy: at gate_up its output, one shard's float32 delta and the cast are alive
    together, 1,600 bytes a token against the formula's 1,312 (memory.sizes.activation_bytes, which an engine start
    reserves). Measured: every tensor the step creates."""
    peak, formula = lora_prefill_peak(_adapter(tmp_path, rank), rank)
    assert peak <= formula


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_step_formula_holds_the_cpu_rotarys_float32_temporaries(dtype):
    """tiny-qwen3 (head_dim 32: q is twice the hidden size) on the CPU: the worst case's prefill peaks in the torch
    rotary (kernels.reference.rotary_embedding), which rotates q in float32 halves beside the qkv output and the
    per-head normed q and k: 2,841 bytes a token in bf16 against the formula's 1,792 (memory.sizes.activation_bytes,
    which an engine start reserves). Measured: every tensor the step creates."""
    from pathlib import Path

    from infer.engine.model_runner import ModelRunner
    from infer.engine.profile import worst_case_batches
    from infer.memory.sizes import activation_bytes, step_tokens
    from infer.models.loader import load_model
    from infer.models.tiny import ensure_builtin
    path, seqs, length = ensure_builtin("tiny-qwen3"), 4, 256
    engine = EngineConfig(str(path), max_num_seqs=seqs, max_model_len=length, block_size=16)
    model, model_config = load_model(Path(path), dtype, torch.device("cpu"), max_positions=length)
    prefill, decodes, blocks = worst_case_batches(model_config, engine, length, seqs, engine.block_size)
    runner = ModelRunner(engine, model, dtype=dtype, device=torch.device("cpu"), num_blocks=blocks)
    runner.zero_blocks(list(range(blocks)))
    peaks = []
    with torch.inference_mode():
        for batch in (prefill, *decodes):
            runner.run(batch)
            meter = LiveBytes(existing=True)
            with meter:
                runner.run(batch)
            peaks.append(meter.peak)
    tokens = step_tokens(engine.max_num_batched_tokens, seqs, length)
    assert max(peaks) <= activation_bytes(model_config, dtype, tokens, seqs, length)


def test_the_measured_worst_case_samples_with_the_samplers_largest_temporaries():
    """engine.profile's worst case (the peak `infer warmup` measures) sampled greedily, whose rows hold their logits
    only: its sequences now sample with penalties, temperature, top-k, top-p, min-p and top logprobs, so that the
    measured peak holds the sampler's float32 copies and the sort's int64 indices (memory.sizes.sampler_row_bytes)."""
    from transformers import LlamaConfig as Config

    from infer.engine.profile import worst_case_batches
    cfg = Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    engine = EngineConfig("m", max_num_seqs=4, max_model_len=64, block_size=16,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    prefill, decodes, _ = worst_case_batches(cfg, engine, 64, 4, 16)
    for seq in prefill.seqs + [s for d in decodes for s in d.seqs]:
        p = seq.params
        assert not p.greedy and p.needs_penalties and p.top_k and p.top_p < 1 and p.min_p > 0 and p.logprobs


def test_the_advice_names_an_8_bit_kv_cache_where_the_kv_cache_does_not_fit():
    """A plan whose KV cache does not hold its sequences (the activations fit) named a shorter --max-length, fewer
    sequences and a larger budget, never --kv-cache-dtype fp8, which holds twice the tokens of a 16-bit cache (four
    times a float32 one's) in the same bytes; a plan already in fp8 is not told it."""
    from infer.memory.plan import MemoryPlan
    kw = dict(device="cpu", total_bytes=1 << 34, budget_bytes=1 << 30, weights_bytes=1 << 28,
              activation_peak_bytes=1 << 26, lora_bytes=0, reserve_bytes=1 << 24, kv_bytes_per_token=1 << 17,
              kv_block_bytes=1 << 21, block_size=16, kv_blocks=300, max_length=4096, concurrency=4,
              max_length_limit=8192)
    for dtype, times in (("float16", 2), ("bfloat16", 2), ("float32", 4)):
        plan = MemoryPlan(**kw, kv_cache_dtype=dtype)
        assert not plan.fits and "lower --max-length to" in plan.advice()
        assert plan.advice().endswith(f"or use --kv-cache-dtype fp8 (1 byte a value instead of {times}: "
                                      f"{times}x the tokens)")
    assert "fp8" not in MemoryPlan(**kw, kv_cache_dtype="float8_e4m3fn").advice()
