"""The two ways `infer warmup` gets its figures: measured on the loaded model (the engine's profile run), or
estimated from files alone (config.json and the checkpoint's tensor headers)."""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..engine.config import RANGES, EngineConfig
from ..engine.setup import (check_lora_targets, checkpoint_dtype, context_limit, load_tokenizer, model_max_len,
                            warn_unused_memory_option)
from ..errors import ConfigError, OutOfMemoryError
from ..memory.plan import (MemoryPlan, bound_room, budget_bytes, check_rope_table, cuda_graph_bytes,
                           draft_activation_bytes, draft_graph_bytes, make_plan, speculative_logit_bytes)
from ..memory.sizes import (DEQUANT_MIN_TOKENS, activation_bytes, element_bytes, int4_layer_bytes, lora_slot_bytes,
                            step_tokens, weights_bytes)


def _model_parts(engine_config: EngineConfig):
    """(path, config, device, dtype) of the model, with the checks an engine start makes before its weights load
    (engine.setup.load_engine_parts): --lora-target-modules against the model, and the tokenizer, which `infer run`
    and `infer serve` load and a model folder without one (or with a damaged one) cannot serve."""
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    path = resolve_model(engine_config.model)
    model_config = load_config(path)
    check_lora_targets(engine_config, model_config)
    device = engine_config.torch_device()
    warn_unused_memory_option(engine_config, device)
    load_tokenizer(path, engine_config.chat_template)
    return path, model_config, device, engine_config.torch_dtype(checkpoint_dtype(model_config))


@functools.lru_cache(maxsize=8)
def _draft_model_config(name: str):
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    return load_config(resolve_model(name))


def _draft_cfg(engine_config: EngineConfig):
    """The draft model's config (--speculative-config {"model": ...}), or None: its KV shares every block, its
    weights and steps count beside the target's (checked against the target by engine.draft.draft_config)."""
    spec = engine_config.speculative_config
    if spec and spec.get("method") == "eagle3":  # an EAGLE head's (models.eagle): one layer's KV, its weights
        from ..models.eagle import load_eagle3_config
        from ..models.resolve import resolve_model
        return load_eagle3_config(resolve_model(spec["model"]))
    if spec and spec.get("method") == "eagle":
        from transformers import LlamaConfig
        from ..models.resolve import resolve_model
        return LlamaConfig.from_pretrained(resolve_model(spec["model"]))
    return _draft_model_config(spec["model"]) if spec and spec.get("method") == "draft_model" else None


DEFAULT_LENGTH = 4096  # warmup's --max-length when none is given, where the model's context is no shorter


def default_length(engine_config: EngineConfig) -> int:
    """--max-length when none is given: DEFAULT_LENGTH, or the model's context where that is shorter (a draft
    model's shorter context does not cap it: past it a sequence goes on without drafts, engine.draft)."""
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    model_config = load_config(resolve_model(engine_config.model))
    return min(DEFAULT_LENGTH, context_limit(model_config)[0])


def check_length(engine_config: EngineConfig, max_length: int, flag: str = "--max-length") -> None:
    """Refuse a `max_length` past the model's context, naming it as given (`flag`: --max-length or --max-model-len)."""
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    _check_length(load_config(resolve_model(engine_config.model)), engine_config, max_length, flag)


def _check_length(model_config, engine_config: EngineConfig, max_length: int, flag: str = "--max-length") -> int:
    """The model's context limit, which `max_length` must not pass (a draft model's shorter context is no limit: an
    engine start takes it, its sequences going on without drafts past it)."""
    limit = model_max_len(model_config, EngineConfig(model=engine_config.model, device=engine_config.device))
    if max_length > limit:
        why = context_limit(model_config)[1]  # a cap below max_position_embeddings: its field named
        raise ConfigError(f"{flag} {max_length} is above the model's context of {limit}"
                          + (f" ({why})" if why else ""),
                          f"use {flag} {limit} or less")
    return limit


def _formula(engine_config: EngineConfig, model_config, dtype, concurrency: int, max_length: int, rank: int,
             tokens: int | None = None, int4_layer: int = 0) -> int:
    """The activations an engine of `concurrency` sequences of `max_length` tokens (and steps of up to `tokens`,
    default --max-num-batched-tokens) reserves: a step, the CUDA graphs' pool, and the scratch an int4 prefill
    dequantizes its biggest layer into (`int4_layer` bytes, memory.sizes.int4_layer_bytes) when steps can take
    that path, as the engine's start reserves it (memory.plan.start_activation_bytes)."""
    # an engine of more sequences than its step's tokens is refused (EngineConfig): a figure for one (the room for
    # more sequences) is for the least token budget such an engine takes, one token a sequence
    tokens = max(tokens or engine_config.max_num_batched_tokens, concurrency)
    cfg = replace(engine_config, max_num_seqs=concurrency, max_model_len=max_length, max_num_batched_tokens=tokens)
    step = step_tokens(cfg.max_num_batched_tokens, concurrency, max_length)
    return activation_bytes(model_config, dtype, step, concurrency, max_length, rank,
                            kv_dtype=engine_config.kv_dtype(dtype), lora_targets=engine_config.lora_target_modules,
                            logits=not engine_config.pooling(), triton=engine_config.torch_device().type == "cuda") \
        + cuda_graph_bytes(cfg, model_config, dtype) + speculative_logit_bytes(cfg, model_config) \
        + draft_activation_bytes(cfg, _draft_cfg(engine_config), dtype, max_length, concurrency) \
        + (draft_graph_bytes(cfg, _draft_cfg(engine_config), dtype) if cfg.use_cuda_graphs() else 0) \
        + (int4_layer if cfg.max_num_batched_tokens > DEQUANT_MIN_TOKENS else 0)


def _blocks_at(plan: MemoryPlan, engine_config: EngineConfig, model_config, dtype, device, rank: int,
               scale: float = 1.0, int4_layer: int = 0):
    """blocks_at(concurrency, length, tokens=None): the KV blocks a plan of another size leaves in `plan`'s budget:
    its formula's activations times `scale` (how far the measured peak came above the formula at the plan's size:
    the measured excess grows with the step), and its rotary table; none past the most --concurrency takes."""
    from ..models.rope import rope_table_bytes

    def blocks_at(concurrency: int, length: int, tokens: int | None = None) -> int:
        if concurrency > RANGES["max_num_seqs"][1]:
            return 0
        act = int(_formula(engine_config, model_config, dtype, concurrency, length, rank, tokens, int4_layer) * scale)
        rope = (rope_table_bytes(model_config, length, dtype, device)
                - rope_table_bytes(model_config, plan.max_length, dtype, device))
        return make_plan(engine_config, model_config, dtype, device, plan.weights_bytes + rope, act, length,
                         concurrency, plan.max_length_limit, plan.lora_bytes, budget=plan.budget_bytes,
                         draft_config=_draft_cfg(engine_config), slots=concurrency).usable_blocks
    return blocks_at


def _fitting_tokens(plan: MemoryPlan, blocks_at, tokens: int) -> int | None:
    """When `plan` does not fit: the largest --max-num-batched-tokens below `tokens` with which it does (smaller
    steps, prefills in more chunks), or None if none does."""
    need, least = plan.concurrency * plan.blocks_for(plan.max_length), plan.concurrency  # a token a sequence at least
    if plan.fits or tokens <= least or blocks_at(plan.concurrency, plan.max_length, least) < need:
        return None
    lo, hi = least, tokens - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if blocks_at(plan.concurrency, plan.max_length, mid) >= need else (lo, mid - 1)
    return lo


def _finish(plan: MemoryPlan, extra: dict, engine_config: EngineConfig, model_config, dtype, device, rank: int,
            scale: float = 1.0, int4_layer: int = 0) -> tuple[MemoryPlan, dict]:
    """The plan with its room figures above its own size bounded by the plans of that size (memory.plan.bound_room),
    and, when it does not fit, the --max-num-batched-tokens that makes it fit (`fitting_batched_tokens`)."""
    blocks_at = _blocks_at(plan, engine_config, model_config, dtype, device, rank, scale, int4_layer)
    tokens = _fitting_tokens(plan, blocks_at, engine_config.max_num_batched_tokens)
    return bound_room(plan, blocks_at), {**extra, "fitting_batched_tokens": tokens}


def estimate_plan(engine_config: EngineConfig, max_length: int, concurrency: int) -> tuple[MemoryPlan, dict]:
    from ..memory.checkpoint import checkpoint_load_bytes
    from ..models.loader import weight_files
    path, model_config, device, dtype = _model_parts(engine_config)
    limit = _check_length(model_config, engine_config, max_length)
    from ..models.loader import check_weights
    from ..quant.config import GPTQConfig
    gptq = GPTQConfig.from_model_dir(path)  # as the loader: another quant_method, or 3-bit GPTQ, is refused
    weights = checkpoint_load_bytes(path, model_config, dtype, device)
    check_weights(path, device)  # what a load on `device` refuses of the layers and tensors, from the headers (read
    # above: a damaged one named as such) alone
    from ..models.rope import rope_table_bytes  # the rotary table an engine of this config builds at load
    weights += rope_table_bytes(model_config, model_max_len(model_config, engine_config), dtype, device)
    weights += _draft_weights(engine_config, model_config, dtype, device, max_length)
    from ..lora.adapter import load_adapter
    copies = []  # on a CPU the adapters' copies count, as many as the engine's CPU LRU keeps (LoRAManager)
    for name, adapter in engine_config.loras.items():  # the checks an engine start makes (files, rank, shapes)
        copies.append(load_adapter(name, Path(adapter).expanduser(), model_config, engine_config.max_lora_rank,
                                   dtype).nbytes)
    copies = copies[-engine_config.max_cpu_loras:] if engine_config.max_cpu_loras else copies
    rank = engine_config.max_lora_rank if engine_config.loras or engine_config.enable_lora else 0
    int4_layer = 0  # the int4 prefill's dequantize scratch, which an engine start on CUDA reserves
    if gptq and device.type == "cuda":
        from ..memory.checkpoint import checkpoint_int4_layer_elements
        int4_layer = checkpoint_int4_layer_elements(weight_files(path), gptq.bits) * element_bytes(dtype)
    act = _formula(engine_config, model_config, dtype, concurrency, max_length, rank, int4_layer=int4_layer)
    budget = budget_bytes(engine_config, device, weights, loaded=False)
    lora = lora_slot_bytes(model_config, engine_config.max_loras, rank, dtype,
                           engine_config.lora_target_modules) if rank else 0
    lora += sum(copies) if device.type == "cpu" else 0
    plan = make_plan(engine_config, model_config, dtype, device, weights, act, max_length, concurrency, limit,
                     lora=lora, budget=budget, draft_config=_draft_cfg(engine_config))
    return _finish(plan, {"model": str(path), "dtype": str(dtype).replace("torch.", ""), "estimate": True},
                   engine_config, model_config, dtype, device, rank, int4_layer=int4_layer)


def _draft_weights(engine_config: EngineConfig, model_config, dtype, device, max_length: int) -> int:
    """A draft model's weights from its files (and its rotary table), after the checks an engine start makes; 0
    without one."""
    from ..engine.draft import draft_config, draft_context
    from ..memory.checkpoint import checkpoint_load_bytes, checkpoint_weights_bytes
    from ..models.loader import check_weights, weight_files
    from ..models.rope import rope_table_bytes
    spec = engine_config.speculative_config or {}
    if spec.get("method") in ("eagle3", "eagle"):  # an EAGLE head (models.eagle): its tensors in the target's
        # dtype, and its rotary table of the target's positions (load_draft builds it so)
        from ..models.resolve import resolve_model
        head, config = resolve_model(spec["model"]), _draft_cfg(engine_config)
        weights = checkpoint_weights_bytes(weight_files(head), config, dtype, device)
        return weights + rope_table_bytes(config, model_max_len(model_config, engine_config))
    found = draft_config(engine_config, model_config, max_length)
    if found is None:
        return 0
    path, config = found
    weights = checkpoint_load_bytes(path, config, dtype, device)
    check_weights(path, device)  # (as the target's: what its load refuses)
    # (its table: its own positions)
    return weights + rope_table_bytes(config, draft_context(config, max_length), dtype, device)


def _lora_manager(model, engine_config: EngineConfig, device, dtype):
    """(manager with every adapter registered, name of the largest-rank one or None), or (None, None) without
    adapter slots (no --lora, no --enable-lora)."""
    if not engine_config.loras and not engine_config.enable_lora:
        return None, None
    from ..lora.manager import LoRAManager
    manager = LoRAManager(model, max_loras=engine_config.max_loras, max_lora_rank=engine_config.max_lora_rank,
                          max_cpu_loras=engine_config.max_cpu_loras, device=device, dtype=dtype,
                          target_modules=engine_config.lora_target_modules)
    for name, adapter in engine_config.loras.items():
        manager.register(name, adapter)
    return manager, max(engine_config.loras, key=manager.rank_of, default=None)


def _slots_past_budget(model, model_config, engine_config: EngineConfig, device, dtype) -> int:
    """The bytes of the adapter slots (--max-loras x --max-lora-rank) when they and the weights pass the budget,
    else 0 (no slots, or they fit)."""
    from ..memory.plan import lora_rank
    rank = lora_rank(engine_config)
    if not rank:
        return 0
    slots = lora_slot_bytes(model_config, engine_config.max_loras, rank, dtype, engine_config.lora_target_modules)
    weights = weights_bytes(model)
    return slots if weights + slots > budget_bytes(engine_config, device, weights) else 0


def _slots_plan(model, model_config, engine_config: EngineConfig, device, dtype, max_length: int, concurrency: int,
                limit: int, slots: int, extra: dict, draft_weights: int = 0) -> tuple[MemoryPlan, dict]:
    """The plan (which does not fit) of slots that pass the budget, without allocating them: the adapters checked
    as an engine start checks them, the activations by the formula."""
    from ..lora.adapter import load_adapter
    for name, adapter in engine_config.loras.items():
        load_adapter(name, Path(adapter).expanduser(), model_config, engine_config.max_lora_rank, dtype)
    rank = engine_config.max_lora_rank
    int4_layer = int4_layer_bytes(model, dtype)
    act = _formula(engine_config, model_config, dtype, concurrency, max_length, rank, int4_layer=int4_layer)
    weights = weights_bytes(model) + draft_weights
    plan = make_plan(engine_config, model_config, dtype, device, weights, act, max_length, concurrency, limit, slots,
                     budget=budget_bytes(engine_config, device, weights), draft_config=_draft_cfg(engine_config))
    return _finish(plan, {**extra, "activation_estimate_bytes": act}, engine_config, model_config, dtype, device, rank,
                   int4_layer=int4_layer)


def measured_plan(engine_config: EngineConfig, max_length: int, concurrency: int) -> tuple[MemoryPlan, dict]:
    """Load the model and run the worst case (`infer warmup`): the plan measured, and the report's extra fields."""
    from ..memory.meter import survivors_frozen
    with survivors_frozen():  # (the meters' garbage collections scan only what the load and the runs allocate)
        return _measured_plan(engine_config, max_length, concurrency)


def _measured_plan(engine_config: EngineConfig, max_length: int, concurrency: int) -> tuple[MemoryPlan, dict]:
    from ..memory.checkpoint import checkpoint_load_bytes
    from ..memory.meter import fixed_mmap_threshold, resident_bytes
    from ..models.loader import load_model
    path, model_config, device, dtype = _model_parts(engine_config)
    limit = _check_length(model_config, engine_config, max_length)
    if device.type == "cpu":
        fixed_mmap_threshold()
    _warm_libraries(dtype, device)
    before = resident_bytes(device)
    # the rope table an engine of this config holds (engine.setup.load_engine_parts)
    check_rope_table(engine_config, model_config, device, model_max_len(model_config, engine_config),
                     lambda: checkpoint_load_bytes(path, model_config, dtype, device))
    model, model_config = load_model(path, dtype, device, max_positions=model_max_len(model_config, engine_config))
    from ..engine.draft import load_draft  # (draft-model speculation: loaded as an engine start loads it)
    draft = load_draft(engine_config, model_config, dtype, device, model_max_len(model_config, engine_config), model)
    draft_weights = weights_bytes(draft.model) if draft is not None else 0
    resident = resident_bytes(device) - before
    slots = _slots_past_budget(model, model_config, engine_config, device, dtype)
    if slots:  # as an engine start refuses them before it allocates them (memory.plan.check_lora_slots): allocated,
        # they were the allocator's error (or on a CPU the machine's memory filling) instead of "does not fit"
        return _slots_plan(model, model_config, engine_config, device, dtype, max_length, concurrency, limit, slots,
                           {"model": str(path), "dtype": str(dtype).replace("torch.", ""), "estimate": False,
                            "weights_resident_bytes": resident, "lora_adapter": None, "kernel_tuning_s": None,
                            "moe_kernel_tuning_s": None,
                            "kernel_compile_s": None, "pdl": None, "int4_byte_fields": None,
                            "int4_loads_ahead": None, "lora_expand_gather": None, "worst_case_run": False},
                           draft_weights)
    lora_manager, largest = _lora_manager(model, engine_config, device, dtype)
    weights = weights_bytes(model) + draft_weights
    # the budget as an engine start reads it (memory.plan.make_plan): by default on a CPU, half the free RAM plus
    # the weights it holds, not the resident growth, which holds whatever the load also allocated
    budget = budget_bytes(engine_config, device, weights)
    tuning_s = moe_s = compile_s = use_pdl = byte_fields = loads_ahead = gather = None
    if device.type == "cuda":  # what an engine start adds on this GPU: tuning the int4 matmul for shapes not in a
        from ..kernels import gptq_gemm, pdl  # table, then compiling the kernels it will launch (with PDL where
        from ..kernels.gptq_tune import compile_model, tune_model  # it will use it)
        use_pdl = pdl.configure(device, engine_config.pdl)
        byte_fields = gptq_gemm.configure_byte_fields(device)
        loads_ahead = gptq_gemm.loads_ahead()  # INFER_INT4_LOADS (a bad value stops here, before anything compiles)
        if lora_manager is not None:  # INFER_LORA_EXPAND (the same)
            from ..kernels import lora_ops
            gather = lora_ops.gather_limit()
        tuning_s = tune_model(model, engine_config.max_num_batched_tokens, device)[1]
        from ..kernels import moe_tune  # (the fused MoE's, where the model has sparse layers)
        if moe_tune.moe_layers(model):
            moe_s = moe_tune.tune_model(model, engine_config.max_num_batched_tokens, device)[1]
        t0 = time.perf_counter()
        compile_model(model, engine_config.max_num_batched_tokens, dtype)
        compile_s = time.perf_counter() - t0
    extra = {"model": str(path), "dtype": str(dtype).replace("torch.", ""), "estimate": False,
             "weights_resident_bytes": resident, "lora_adapter": largest, "kernel_tuning_s": tuning_s,
             "moe_kernel_tuning_s": moe_s,
             "kernel_compile_s": compile_s, "pdl": use_pdl, "int4_byte_fields": byte_fields,
             "int4_loads_ahead": loads_ahead, "lora_expand_gather": gather}
    rank = engine_config.max_lora_rank if lora_manager is not None else 0
    int4_layer = int4_layer_bytes(model, dtype)  # (0 on CPU)
    act = _formula(engine_config, model_config, dtype, concurrency, max_length, rank, int4_layer=int4_layer)
    lora = lora_manager.budget_bytes() if lora_manager is not None else 0
    kv_only = make_plan(engine_config, model_config, dtype, device, weights, 0, max_length, concurrency, limit,
                        lora, budget=budget, draft_config=_draft_cfg(engine_config))
    formula = make_plan(engine_config, model_config, dtype, device, weights, act, max_length, concurrency,
                        limit, lora, budget=budget, draft_config=_draft_cfg(engine_config))
    # the KV cache alone cannot fit, or the formula's activations (what an engine start sizes by) leave it no
    # block: running the worst case would only try to allocate what is known not to fit
    if not kv_only.fits or formula.kv_blocks == 0:
        return _finish(formula, {**extra, "activation_estimate_bytes": act, "worst_case_run": False},
                       engine_config, model_config, dtype, device, rank, int4_layer=int4_layer)
    with torch.inference_mode():
        plan, estimate = _profile(model, model_config, engine_config, dtype, device, max_length, concurrency,
                                  limit, lora_manager, largest, budget, weights, draft)
    if engine_config.use_cuda_graphs():
        extra.update(graph_capture(model, engine_config, dtype, device, max_length, lora_manager, draft=draft))
    # (the measured peak holds the dequantize scratch where the worst case's prefill took that path: the scale the
    # room figures take from it covers it)
    return _finish(plan, {**extra, "activation_estimate_bytes": estimate, "worst_case_run": True}, engine_config,
                   model_config, dtype, device, rank, max(1.0, plan.activation_peak_bytes / max(estimate, 1)))


def graph_capture(model, engine_config: EngineConfig, dtype, device, max_length: int, lora_manager=None,
                  emulate: bool = False, draft=None) -> dict:
    """What an engine start's CUDA graph capture costs here (after its kernels are compiled, as in an engine): the
    seconds, the graphs recorded (decode buckets, piece x bucket, and a draft model's decode buckets), and on CUDA
    the device memory it kept (the allocator's reserved bytes: the graphs' pool and static buffers), beside the
    plan's formula for it. With a draft model (`draft`, engine.draft.DraftParts) the capture is the engine's:
    its one-token forwards recorded after the target's decode graphs, in their pool (ModelRunner.capture_graphs);
    the figures then also say the draft's part (`cuda_graphs_draft`, `cuda_graph_bytes_measured_draft` and
    `cuda_graph_bytes_formula_draft`, memory.plan.draft_graph_bytes) and the target's (`..._target`).
    `emulate`: the same capture replayed by calls (the tests' CPU stand-in; no memory figure)."""
    from ..engine.model_runner import ModelRunner
    blocks = -(-max_length // engine_config.block_size)
    runner = ModelRunner(engine_config, model, dtype=dtype, device=device, num_blocks=blocks,
                         lora_manager=lora_manager)
    drafter, draft_kept = None, []
    if draft is not None:  # its KV in the target's block layout, as the engine holds it (LLMEngine)
        from ..engine.eagle import make_drafter  # (an EAGLE head: EagleRunner, which keeps the target's aux states)
        drafter = make_drafter(draft, engine_config.kv_dtype(dtype), blocks, engine_config.block_size, device, model)
        runner.draft = drafter
        capture = drafter.capture_graphs

        def measured_capture(*args, **kwargs):  # the draft's share: what its capture adds to the pool
            at = _reserved(device, emulate)
            capture(*args, **kwargs)
            after = _reserved(device, emulate)
            draft_kept.append(None if at is None else after - at)
        drafter.capture_graphs = measured_capture
    before = _reserved(device, emulate)
    t0 = time.perf_counter()
    runner.capture_graphs(max_length, emulate=emulate)
    seconds = time.perf_counter() - t0
    # what the graphs hold: the eager runs before each recording leave cached blocks, given back first
    after = _reserved(device, emulate)
    kept = None if before is None else after - before
    pieces = runner.pieces
    recorded = (len(runner.graphs.buckets) if runner.graphs is not None else 0) \
        + (len(pieces.buckets) * pieces.num_pieces if pieces else 0)
    target_formula = cuda_graph_bytes(engine_config, model.config, dtype)
    out = {"cuda_graphs_s": seconds, "cuda_graphs": recorded, "cuda_graph_bytes_measured": kept,
           "cuda_graph_bytes_formula": target_formula}
    if drafter is not None:
        ours = len(drafter.graphs.buckets) if drafter.graphs is not None else 0
        draft_measured = draft_kept[0] if draft_kept else None
        draft_formula = draft_graph_bytes(engine_config, draft.model_config, dtype)
        out.update(cuda_graphs=recorded + ours, cuda_graphs_draft=ours,
                   cuda_graph_bytes_formula=target_formula + draft_formula,
                   cuda_graph_bytes_formula_target=target_formula, cuda_graph_bytes_formula_draft=draft_formula,
                   cuda_graph_bytes_measured_draft=draft_measured,
                   cuda_graph_bytes_measured_target=None if kept is None or draft_measured is None
                   else kept - draft_measured)
        drafter.close()  # its KV cache and graphs go with it
    for m in model.modules():  # the runner's KV cache and graphs go with it
        if hasattr(m, "k_cache"):
            m.k_cache = m.v_cache = None
    runner.graphs = runner.pieces = runner.kv_cache = runner.draft = None
    del runner, pieces, drafter
    if before is not None:
        torch.cuda.empty_cache()
    return out


def _reserved(device, emulate: bool = False) -> int | None:
    """The allocator's reserved bytes on a CUDA device, its cached blocks given back first (None: not measured, on
    a CPU or with emulated graphs)."""
    if device.type != "cuda" or emulate:
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def _profile(*args):
    """The engine's profile run; an allocation that fails inside it means the worst case does not fit."""
    from ..engine.profile import profile_run
    try:
        return profile_run(*args)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError; so is CPU's ENOMEM
        if not isinstance(e, MemoryError) and "memory" not in str(e).lower():
            raise
        engine_config, device = args[2], args[4]
        more = "raise --gpu-memory-utilization" if device.type == "cuda" else \
            "raise --memory-limit only as far as the machine has memory"
        err = OutOfMemoryError(f"the worst case ran out of memory while it was measured "
                               f"({str(e)[:200] or type(e).__name__})",
                               f"lower --concurrency, --max-length or --max-num-batched-tokens "
                               f"({engine_config.max_num_batched_tokens:,}: the worst case's prefill), or {more}")
        err.exit_code = 1  # as a plan that does not fit
        raise err from None


def _warm_libraries(dtype: torch.dtype, device: torch.device) -> None:
    """Load the math libraries' code and thread pools first, so their memory is not counted as weights."""
    import safetensors.torch  # noqa: F401
    from ..kernels import cpu_gemm
    w = torch.randn(64, 64, dtype=dtype, device=device)
    x = torch.randn(4, 64, dtype=dtype, device=device)
    cpu_gemm.linear(x, w, None, cpu_gemm.prepack(w))
    torch.nn.functional.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None], is_causal=True)
    # (no meta-device embedding: its init imported torch._dynamo, 2.6 s and ~100 MB, which no model's load does any more:
    # models.llama._uninitialized gives an embedding its weight; every built-in's load was checked to import none)
