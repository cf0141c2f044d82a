"""Tune the fused MoE kernels (kernels.moe) per sparse layer shape and bucket of tokens on this GPU, and remember
the winners in gptq_configs' files of section "moe" (shipped: `kernels/configs/moe/<GPU name>.json`; the user's:
`$INFER_CACHE/kernels/moe/<GPU name>.json`; over both, a folder named by $INFER_TUNED_CONFIG_FOLDER), so a restart
does not tune again (a cache that cannot be written: a warning, the winners kept for the process; an entry no
launch can take, `moe.config_error`: skipped with a warning and tuned again).

An entry is {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} for both matmuls of a step (gate_up and down share
the alignment, so BLOCK_M is the step's; vLLM's fused_moe configs, `E=..,N=..,device_name=...json` keyed by M, also
hold one config for both), or {"BLOCK_M"} alone where the heuristics won (the rest then theirs, per matmul). BLOCK_K
is never tuned: it stays the layer's (`moe.tiles` / `moe.int4_tiles`), so each row's sums over K run in the same
order whatever the step or the entry. The key (`moe.layer_key`) and the bucket are functions of the layer and of the
step's static count of tokens, never of the routing: a CUDA graph replays the config it captured.

Every candidate is checked against the reference (reference.fused_moe over the experts dequantized, on one
routing) and then timed as the engine runs it: from a CUDA graph (gptq_tune.time_graph), cycling through enough
routings (and, for small layers, copies of the weights) that the experts it reads do not sit in the L2 cache.
Called at an engine start on a GPU (`tune_model`, for the buckets up to max_num_batched_tokens the table lacks:
no user request waits for tuning), by `infer warmup` (its time reported) and by `python -m infer.bench.moe --tune`.
"""

from __future__ import annotations

import re
import time

import torch
import triton

from . import gptq_configs, moe
from .intmath import cdiv

BLOCK_MS = (16, 32, 64, moe.MAX_BLOCK_M)
BLOCK_NS = (16, 32, 64, 128)
MAX_ROUTINGS = 32  # routings (and weight copies) a timing cycles through at most


def _n_tiles(n13: int, n2: int) -> tuple[int, ...]:
    """BLOCK_N candidates: up to the narrower matmul's outputs (a wider tile is all masked columns there)."""
    return tuple(bn for bn in BLOCK_NS if bn <= max(16, triton.next_power_of_2(min(n13, n2))))


def fits(cfg: dict, layer: dict) -> bool:
    """Whether `cfg` fits sm_90's shared memory (moe.smem_bytes) in both matmuls of `layer` (`layer_shape`)."""
    return all(moe.smem_bytes(cfg, bk, layer["elem"], layer["int4"]) <= moe.SM90_SMEM for bk, _ in layer["steps"])


KEY = re.compile(r"(\d+),(\d+),(\d+),(\d+),(?:int4-g(-?\d+)p?/(-?\d+)p?-)?(float32|float16|bfloat16)(?![a-z0-9])")
ELEM = {"float32": 4, "float16": 2, "bfloat16": 2}


def entry_error(key: str, cfg: dict) -> str | None:
    """Why a table entry `cfg` (moe.config_error passed) of the layer `key` (moe.layer_key) cannot launch on sm_90:
    its shared memory (moe.smem_bytes, BLOCK_N and num_stages the heuristics' where the entry has none) over
    moe.SM90_SMEM in either matmul, as `candidates` never times such a config; None where it fits, or where the key
    is not one this infer can read (no layer looks it up)."""
    got = KEY.match(key)
    if got is None or len(cfg) == 1:  # (BLOCK_M alone: the heuristics' tiles, which fit)
        return None
    _, hidden, inter, top_k, g13, g2, dtype = got.groups()
    hidden, inter, top_k = int(hidden), int(inter), int(top_k)
    int4 = g13 is not None
    for (n, k), gs in (((2 * inter, hidden), g13), ((hidden, inter), g2)):
        block_n, block_k = moe.int4_tiles(n, k, int(gs), top_k)[:2] if int4 else moe.tiles(n, k, top_k)
        full = {**moe.launch_options(cfg["BLOCK_M"], int4), "BLOCK_N": block_n, **cfg}
        need = moe.smem_bytes(full, block_k, ELEM[dtype], int4)
        if need > moe.SM90_SMEM:
            return (f"it takes {need} bytes of shared memory (BLOCK_K {block_k}), more than sm_90's {moe.SM90_SMEM}"
                    f" (moe.smem_bytes: the tuner never times such a config)")
    return None


def layer_shape(w13, w2, top_k: int, dtype: torch.dtype) -> dict:
    """What the candidates depend on: E, both matmuls' N, their (BLOCK_K, one group a K step) as the launch takes
    them (moe.tiles / moe.int4_tiles), x's element size, int4 or float."""
    int4 = hasattr(w13, "qweight")
    if int4:
        e, n13, n2 = w13.qweight.shape[0], w13.out_features, w2.out_features
        steps = [moe.int4_tiles(w.out_features, w.in_features, w.group_size, top_k)[1:] for w in (w13, w2)]
    else:
        e, n13, n2 = w13.shape[0], w13.shape[1], w2.shape[1]
        steps = [(moe.tiles(w.shape[1], w.shape[2], top_k)[1], True) for w in (w13, w2)]
    return {"experts": e, "n13": n13, "n2": n2, "top_k": top_k, "steps": steps, "int4": int4,
            "elem": torch.empty(0, dtype=dtype).element_size()}


def candidates(tokens: int, layer: dict, quick: bool = False) -> list[dict]:
    """The configs worth timing at a step of `tokens` tokens: BLOCK_M from 16 to the step's pairs (T * k rows: a
    taller block is padding only; quick: the heuristic's and its neighbours), BLOCK_N up to the narrower matmul's
    width (quick: from 32 where the layer allows), 4 or 8 warps, 2-5 stages (quick: 3 or 4), each fitting sm_90's
    shared memory (`fits`); the heuristics' own ({"BLOCK_M": choose_block_m}) first, so a tuned table never chooses
    worse than it measured."""
    top_k, e = layer["top_k"], layer["experts"]
    heur = moe.choose_block_m(tokens, top_k, e)
    most = max(moe.BLOCK_M, triton.next_power_of_2(tokens * top_k))
    bms = [m for m in BLOCK_MS if m <= most and (not quick or heur // 2 <= m <= 2 * heur)]
    stages = (3, 4) if quick else (2, 3, 4, 5)
    ns = _n_tiles(layer["n13"], layer["n2"])
    ns = [n for n in ns if n >= 32] or ns if quick else ns
    out = [{"BLOCK_M": heur}]
    out += [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s} for m in bms for n in ns for w in (4, 8)
            for s in stages]
    return [c for c in out if len(c) == 1 or fits(c, layer)]


def _clone(w):
    return type(w)(*(f.clone() if isinstance(f, torch.Tensor) else f for f in w)) if hasattr(w, "qweight") \
        else w.clone()


def _bytes(w) -> int:
    return sum(f.numel() * f.element_size() for f in (w if hasattr(w, "qweight") else (w,))
               if isinstance(f, torch.Tensor))


def _routing(t: int, experts: int, top_k: int, dtype: torch.dtype, seed: int, device):
    gen = torch.Generator(device=device).manual_seed(seed)
    weights, ids = torch.topk(torch.randn(t, experts, device=device, generator=gen).softmax(-1), top_k, -1)
    return weights.to(dtype), ids


def default_timer(fns, cfg: dict) -> float:
    """Microseconds per call of `fns` (gptq_tune.time_graph: replayed from a CUDA graph)."""
    from .gptq_tune import time_graph
    return time_graph(fns)


def tune_layer(w13, w2, top_k: int, buckets, dtype: torch.dtype, weight_dtype: torch.dtype | None = None,
               quick: bool = True, timer=None, log=None, max_tokens: int | None = None) -> dict:
    """{bucket: (best config, its microseconds, the heuristics' microseconds)} of one sparse layer's experts (float
    [E, N, K] tensors or reference.Int4Experts) at a step of each bucket's tokens (at most max_tokens): every
    candidate's output checked against the reference first (one that is wrong or cannot run is skipped), then
    timed by `timer(fns, cfg)` (default_timer) over calls that cycle through routings and weight copies whose
    experts exceed the L2 cache (gptq_tune.L2_BUST_BYTES). weight_dtype: the routing weights' (x's by default;
    Mixtral's float32)."""
    from . import reference
    from .gptq_tune import L2_BUST_BYTES
    timer = timer or default_timer
    int4 = hasattr(w13, "qweight")
    device = (w13.qweight if int4 else w13).device
    layer = layer_shape(w13, w2, top_k, dtype)
    e = layer["experts"]
    run = moe.fused_moe_int4 if int4 else moe.fused_moe
    f13, f2 = (w13.dequantize(dtype), w2.dequantize(dtype)) if int4 else (w13, w2)
    layer_bytes = _bytes(w13) + _bytes(w2)
    copies = [(w13, w2)] + [(_clone(w13), _clone(w2)) for _ in range(min(MAX_ROUTINGS, cdiv(L2_BUST_BYTES,
                                                                                            layer_bytes)) - 1)]
    cands = {b: candidates(min(b, max_tokens or b), layer, quick) for b in buckets}
    if device.type == "cuda":  # every candidate's kernels compiled on a thread pool first (as gptq_tune's)
        from .gptq_tune import compile_parallel
        every = {tuple(sorted(c.items())): c for cs in cands.values() for c in cs}
        compile_parallel(moe.compile_variants(torch.empty(1, f13.shape[2], dtype=dtype, device=device), w13, w2,
                                              top_k, weight_dtype or dtype, list(every.values())))
    result = {}
    for b in buckets:
        t = min(b, max_tokens or b)
        gen = torch.Generator(device=device).manual_seed(t)
        x = torch.randn(t, f13.shape[2], device=device, generator=gen).to(dtype)
        touched = layer_bytes * min(e, t * top_k) // e
        count = max(2, len(copies), min(MAX_ROUTINGS, cdiv(L2_BUST_BYTES, max(touched, 1))))
        routes = [_routing(t, e, top_k, weight_dtype or dtype, t * MAX_ROUTINGS + i, device) for i in range(count)]
        want = reference.fused_moe(x, f13, f2, *routes[0]).float()
        scale = want.abs().max().clamp_min(1e-6)

        def timed(cfg: dict, x=x, routes=routes, want=want, scale=scale) -> float | None:
            try:
                got = run(x, *copies[0], *routes[0], config=cfg).float()
                if not bool(((got - want).abs().max() / scale) < 2e-2):
                    if log:
                        log(f"  wrong {cfg}")
                    return None
                return timer([lambda i=i: run(x, *copies[i % len(copies)], *routes[i], config=cfg)
                              for i in range(len(routes))], cfg)
            except Exception as err:  # noqa: BLE001 - a config the compiler or the GPU cannot run
                if log:
                    log(f"  skip {cfg}: {type(err).__name__}")
                return None
        heur_us = timed(cands[b][0])
        best = (cands[b][0], heur_us if heur_us is not None else float("inf"))
        for cfg in cands[b][1:]:
            us = timed(cfg)
            if us is not None and us < best[1]:
                best = (cfg, us)
        result[b] = (best[0] if best[1] < float("inf") else None, best[1], heur_us)
        if log:
            log(f"MoE E={e} N={layer['n13']}/{layer['n2']} k={top_k} tokens={t}: {best[1]:.1f} us {best[0]} "
                f"(heuristic {heur_us if heur_us is None else round(heur_us, 1)} us)")
    return result


def moe_layers(model) -> dict:
    """{moe.layer_key: (w13, w2, top_k, x's dtype, the routing weights' dtype)} of the model's sparse layers (a
    module's `moe_experts()`: models.moe.SparseMoeBlock), each shape once."""
    out = {}
    for mod in model.modules():
        fn = getattr(mod, "moe_experts", None)
        if callable(fn):
            w13, w2, top_k, dtype, weight_dtype = fn()
            out.setdefault(moe.experts_key(w13, w2, top_k, dtype), (w13, w2, top_k, dtype, weight_dtype))
    return out


def compile_calls(model, max_tokens: int) -> list:
    """Compile-only callables (moe.compile_variants) of every launch config the model's sparse layers choose for
    steps of 1 to max_tokens tokens (moe.config_steps: the tuned table, else the heuristics), for an engine start's
    parallel compile (LLMEngine.compile_kernels) after tuning."""
    calls = []
    for key, (w13, w2, top_k, dtype, weight_dtype) in moe_layers(model).items():
        int4 = hasattr(w13, "qweight")
        e, device = (w13.qweight.shape[0], w13.qweight.device) if int4 else (w13.shape[0], w13.device)
        x = torch.empty(1, w13.in_features if int4 else w13.shape[2], dtype=dtype, device=device)
        steps = moe.config_steps(max_tokens, top_k, e, key, device)
        calls += moe.compile_variants(x, w13, w2, top_k, weight_dtype, [dict(c) for c in steps])
    return calls


def tune_model(model, max_tokens: int, device, log=None, quick: bool | None = None, timer=None,
               name: str | None = None) -> tuple[int, float]:
    """Tune every bucket of tokens up to max_tokens of the model's sparse layers that this GPU's table (shipped
    or cached) lacks; save the winners to the cache file (`name`: the GPU's, gptq_configs.gpu_name). Returns
    (layer shapes tuned, seconds). The quick candidate set unless INFER_TUNE=full."""
    if quick is None:
        from .options import env_choice
        quick = env_choice("INFER_TUNE", ("quick", "full"), "a tuning of the int4 kernels") == "quick"
    t0 = time.perf_counter()
    from .gptq_tune import BUCKETS
    buckets = [b for b in BUCKETS if b <= gptq_configs.bucket(max_tokens)]
    name = name or gptq_configs.gpu_name(device)
    tuned = 0
    for key, (w13, w2, top_k, dtype, weight_dtype) in sorted(moe_layers(model).items()):
        if hasattr(w13, "blocks"):  # MXFP4 experts (reference.Mxfp4Experts): not tuned, the heuristics' tiles
            continue
        have = gptq_configs.load(name, moe.SECTION).get(key, {})
        missing = [b for b in buckets if b not in have]
        if not missing:
            continue
        res = tune_layer(w13, w2, top_k, missing, dtype, weight_dtype, quick, timer, log, max_tokens)
        found = {b: cfg for b, (cfg, _, _) in res.items() if cfg is not None}
        if found:
            gptq_configs.save(name, {key: found}, moe.SECTION)
        tuned += 1
    if tuned and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # (the timing's copies must not look like the engine's own memory)
    return tuned, time.perf_counter() - t0
