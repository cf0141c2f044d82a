"""Triton GPTQ matmul (W4A16 / W8A16): y = x @ W^T from the GPTQ tensors, three ways chosen by the shape.

- `gemv` (one activation row per program row, CUDA cores): for M = 1. Each program owns BLOCK_N columns and a
  K range; it loads BLOCK_K / pack int32 words per column (coalesced along N, read once, `evict_first`), splits
  them into their `pack` fields with shifts, turns each field into a float without a conversion instruction
  (OR-ing the 4-bit value into the mantissa of 2^23 gives the float 2^23 + q), and accumulates x * (q - z) in
  a [BLOCK_K / pack, BLOCK_N] float32 tile that is reduced once, at the end; the group's scale multiplies the
  step's partial sum, not every weight. With INPLACE each field is OR-ed into the mantissa where it lies (no
  shift: one lop3 per weight) and one fused multiply-add makes it q - z: three instructions per weight.
- `mma` (tensor cores, tl.dot): for M >= 2. The same loads; a field becomes the fp16 1024 + q the same way
  (0x6400 | q), the fp16 difference with 1024 + z is the exact small integer q - z, and the scale multiplies the
  dot product of the step. Two ways to build the operand: the whole [BLOCK_K, BLOCK_N] tile by a reshape of the
  unpacked fields (x loaded in the same permuted K order, which leaves the sum unchanged), or, with FIELD, one
  dot per packed field whose tile keeps the loaded words' register layout; the second avoids a round trip of
  every weight through shared memory (the fastest for M = 2-16 on an H100); SCALE_W folds the group's scale
  into the weights instead (one accumulator: tiles of 32-128 rows); PAIRS (4-bit) makes two fields of each word
  the two K rows of one operand register, one lop3 for both: four dots per step. `mmat` computes y^T = W^T x^T
  so the weight is the first (register) operand of Hopper's wgmma (few activation rows: a tuning candidate up to
  256).
- `dequant`: the weight is dequantized into a scratch buffer and multiplied by cuBLAS (torch.matmul). For large
  M (prefill), where cuBLAS at tensor-core speed beats any fused kernel, and for an irregular g_idx. With CHUNK_N
  a block of columns at a time, so that each block's fp16 weight can stay in L2 between the two kernels.

Split-K: when the N tiles alone cannot fill the GPU, SPLIT_K programs share a tile's K range. Each writes its
float32 partial tile to a workspace and bumps a per-tile counter; the program that arrives last sums the partial
tiles in a fixed order, writes y in x's dtype and resets the counter to 0. One launch, no memset, no extra
reduction kernel, deterministic, and safe to replay inside a CUDA graph (the counters are zero between calls;
kernels of one engine run on one stream, so two matmuls never share a counter at the same time).

With float32 activations (the tests' and the CPU oracle's precision) every weight is rounded to fp16 after its
scale, exactly as the reference and GPTQ runtimes compute it, and the dot product runs in IEEE float32.
`group_size` promises g_idx[i] == i // group_size (act-order checkpoints are sorted at load by the linear
method); a K step then lies inside one group and reads one row of scales and zeros. `interleave` says the rows
were repacked at load so that each packed field covers consecutive input rows (`packing.field_rows`; the linear
method does it on CUDA): the field-by-field kernels then read x with contiguous, vectorizable loads instead of
gathering every `pack`-th element. Same signature and semantics as `reference.gptq_matmul`; the kernels are in
`gptq_kernels` (tensor cores) and `gptq_gemv` (CUDA cores), the configuration comes from `gptq_configs` (tuned per
GPU, or a heuristic).
"""

from __future__ import annotations

import logging
import os

import torch

from . import gptq_configs, lora_ops, pdl
from .gptq_dequant import dequantize_into_scratch, release_scratch, scratch_bytes  # noqa: F401 (the API)
from .gptq_gemv import gemv_kernel, gemv_rows_kernel
from .fused import UNGATED_ACTS, libdevice_on
from .gptq_kernels import mma_kernel
from .intmath import cdiv, next_power_of_2
from .options import env_choice


log = logging.getLogger("infer")

_BYTES: dict = {}  # device -> whether the field tiles take 4-bit fields by byte permute (configure_byte_fields)
# When the int4 kernels load a K step's data (where a config does not say: its "AHEAD"): None: INFER_INT4_LOADS,
# "ahead" (the default) or "late". Ahead, the tensor-core tiles (`mma_kernel`'s PRE_S) load each step's scales during
# the step before (their 2-byte loads are the one global load Triton's pipeliner leaves synchronous: late, each step
# waits a memory round trip for them), and the one-row gemv (`gemv_kernel`'s AHEAD), which has no pipeline stages,
# loads each step's words, zeros and scales during the step before. `python -m infer.bench.kernels` times both.
int4_loads: str | None = None
_LOCKS: dict = {}
_RETIRED_LOCKS: dict = {}  # (device, owner) -> counters a larger buffer replaced (graphs may hold their addresses)
_NO_WS: dict = {}


def loads_ahead() -> bool:
    """Whether the int4 kernels load a K step's scales (tensor-core tiles) or whole step (one-row gemv) during the
    step before (`int4_loads`, else the environment's INFER_INT4_LOADS, else "ahead"); ConfigError for another
    value."""
    global int4_loads
    if int4_loads is None:
        int4_loads = env_choice("INFER_INT4_LOADS", ("ahead", "late"), "when the int4 kernels load a step's weights")
    return int4_loads == "ahead"


GEMV_AHEAD_WORDS = 8  # the most words of a K step per thread with which the one-row gemv loads a step ahead


def loads_ahead_for(kind: str, cfg: dict, bits: int) -> bool:
    """Whether kernel `cfg` issues a K step's loads during the step before: the config's "AHEAD", else
    `loads_ahead()` for the tensor-core tiles, and for the one-row gemv where a step holds at most GEMV_AHEAD_WORDS
    packed words per thread (sm_90, Triton 3.6: 64 columns on 4 warps go from 80 to 96 registers, 128 columns on 4
    warps from 128 to 160, and Triton 3.9 spills the latter); False for the other kernels (no K-step loads to move)."""
    if "AHEAD" in cfg:
        return bool(cfg["AHEAD"])
    if kind in ("mma", "mmat"):
        return loads_ahead()
    if kind == "gemv" and cfg.get("BLOCK_M", 1) == 1:
        words = cfg["BLOCK_N"] * (cfg["BLOCK_K"] // (32 // bits)) // (32 * cfg["num_warps"])
        return words <= GEMV_AHEAD_WORDS and loads_ahead()
    return False


def _no_workspace(device: torch.device) -> torch.Tensor:
    """The split-K workspace argument of a launch without split-K (never read or written; float32 like a real
    one, so that both compile to the same kernel): one per device, not a fresh allocation per launch."""
    have = _NO_WS.get(device)
    if have is None:
        have = _NO_WS[device] = torch.empty((1,), device=device, dtype=torch.float32)
    return have


def _locks(device: torch.device, tiles: int, owner: str = "gemm") -> torch.Tensor:
    """Per-tile arrival counters, zero between calls (the last program of a tile resets its counter); one buffer per
    device and owner (the split-K tiles here, the decode attention's partitions). When a launch needs more, a larger
    buffer takes over and the old one is kept (`_RETIRED_LOCKS`): a CUDA graph recorded its address and still uses
    it (freed, it could be handed to another tensor that the graph would then write)."""
    key = (device, owner)
    have = _LOCKS.get(key)
    if have is None or have.numel() < tiles:
        if have is not None:
            _RETIRED_LOCKS.setdefault(key, []).append(have)
        have = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
        _LOCKS[key] = have
    return have


MAX_LORA_SHARDS = 3  # shards whose LoRA expand the epilogue adds (a merged qkv has 3); more: a separate launch
MAX_LORA_ROWS = 32  # the tallest mma tile whose epilogue adds the expand
SHORT_WALK = 2  # chunks of 16 (slot, rank) rows a tile may walk per shard for the automatic choice (fuse None)


def fuses_lora(kind: str, cfg: dict, lora) -> bool:
    """Whether the kernel `cfg` adds this LoRADelta in its epilogue; else an expand launch adds it after the matmul.

    Where the compiled code says the epilogue costs the main loop nothing (Triton 3.6, sm_90, `scripts/kernel-sass
    --loop "SPEC lora"`): `gemv` and `mma` tiles of up to 32 rows keep their main loop and registers (mma PAIRS 16 x
    128: 464 -> 464 instructions per K step, 127 -> 128 registers; 32 x 128: 577 -> 575, 168 -> 168). Not `mmat` (its
    main loop grows 466 -> 535) nor taller tiles (their epilogue would need 255 registers and a stack).

    The epilogue walks the tile's slots one chunk of 16 (slot, rank) rows after the other, each chunk's B load
    waiting for the one before: about one memory latency per chunk, against the expand launch's many programs
    that each read one slot at once. So by default (`lora.fuse` None) it is used only where the walk is short: a
    one-row gemv (one adapter per tile), or at most SHORT_WALK chunks over all the slots (one adapter of rank up to
    32, two up to 16); `fuse` True uses it wherever it compiles well (the benchmark's comparison)."""
    if lora is None or len(lora.bounds) - 1 > MAX_LORA_SHARDS or lora.fuse is False:
        return False
    one_row = kind == "gemv" and cfg.get("BLOCK_M", 1) == 1
    can = kind == "gemv" or (kind == "mma" and cfg.get("BLOCK_M", 16) <= MAX_LORA_ROWS)
    if lora.fuse is None:
        walk = lora.scalings.shape[1] * -(-lora.rank // 16)
        return one_row or (can and walk <= SHORT_WALK)
    return can


GATED_MAX_ROWS = 32  # the tallest tile that applies silu_and_mul in its epilogue
GATE_ACTS = {"silu": 1, "gelu_tanh": 2}  # a gated epilogue's activation: the kernels' GATED constexpr


def gate_code(gated: bool | str) -> int:
    """The kernels' GATED constexpr of `gptq_matmul`'s gated argument: 0 (False: no activation), 1 (True or
    "silu"), 2 ("gelu_tanh": Gemma's GeGLU); anything else is refused."""
    if gated is False or gated is None:
        return 0
    if gated is True:
        return 1
    if gated not in GATE_ACTS:
        raise ValueError(f"gptq_matmul: gated={gated!r} is no activation of a gate|up layer: use True, 'silu' or "
                         f"'gelu_tanh'")
    return GATE_ACTS[gated]


def gated_fits(kind: str, cfg: dict, n: int) -> bool:
    """Whether the fused kernel `cfg` applies SiLU-and-multiply in its epilogue for a gate|up layer of n columns
    (`gptq_kernels.gated_cols`): every tile holds BLOCK_N / 2 gate and as many up columns (whole tiles: the split-K
    partials of a tile stay its own), both halves aligned to 16 columns (loads as wide as the plain tile's), in tiles
    of up to GATED_MAX_ROWS rows.
    The sm_90 code (Triton 3.6, `scripts/kernel-sass --loop "SPEC gated"`): the 16- and 32-row tiles keep their
    registers' occupancy (mma 16 x 128: 119 -> 122 registers, 427 -> 438 instructions per K step; mmat 16 x 128:
    115 -> 125, 470 -> 459; 32 rows: 160 -> 160, 167 -> 163), the gemv its 80; the 64-row transposed tile would
    go from 164 to 208 registers (three programs per SM to two), so taller tiles launch silu_and_mul after."""
    half, h = n // 2, cfg.get("BLOCK_N", 0) // 2
    return (kind in ("gemv", "mma", "mmat") and cfg.get("BLOCK_M", 1) <= GATED_MAX_ROWS and n % 2 == 0 and h >= 16
            and h % 16 == 0 and half % h == 0)


def _epilogue_args(y, bias, lora, m: int, n: int, block_m: int, block_n: int) -> tuple[tuple, dict]:
    """The epilogue's pointer and integer arguments and constexprs (see gptq_kernels._finish): y stands in for
    what is absent, so that the kernel's signature never changes."""
    if lora is None:
        return (y if bias is None else bias, y, y, y, y, y, 0, 0, 0, 0, 0), dict(HAS_BIAS=bias is not None)
    nsh = len(lora.bounds) - 1
    ends = (list(lora.bounds[1:nsh]) + [n] * 3)[:3]  # end of shards 0, 1, 2 (N past the last)
    hp = lora.hp
    if hp.shape[1] != m or not hp.is_contiguous():
        raise ValueError(f"a LoRADelta of {hp.shape[1]} tokens for {m} rows of x (partials must be contiguous)")
    rank, slots = lora.rank, lora.scalings.shape[1]
    pm = next_power_of_2(block_m)
    jb = 16 if block_m >= 16 else max(1, min(16, 2048 // (pm * block_n)))  # (B's pointer tile stays small)
    # the epilogue indexes ranks and scalings [n, S] and token_slots [T] as dense (no strides, unlike the expand
    # launch): a strided view (a transposed [S, n] table, a slice) is made dense here, not read wrong
    args = (y if bias is None else bias, hp, lora.lora_b, lora.token_slots.contiguous(), lora.ranks.contiguous(),
            lora.scalings.contiguous(), hp.shape[2], hp.shape[0], *ends)
    return args, dict(HAS_BIAS=bias is not None, LORA_S=slots, LORA_R=rank, LORA_RP=next_power_of_2(rank),
                      LORA_NSH=nsh, LORA_JB=jb)


def probe_byte_fields(device) -> str | None:
    """None when an int4 field tile computes the same on `device` with its 4-bit fields taken by byte permute
    (`gptq_kernels._byte_fields`: inline PTX on a GPU, two words per instance) as with the fields shifted out one
    at a time, bit for bit; else what went wrong. The two ways dequantize to the same fp16 values, so a difference
    means the PTX or its operands' packing is wrong there. The tile is the shipped 2-16-row one (`mmat` 16 x 128,
    split-K 4 on interleaved rows), whose byte-permute variant an engine compiles anyway: one extra compile."""
    from .gptq_tune import random_gptq
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        k, n = 512, 128
        qw, qz, s, gi = random_gptq(k, n, 4, 128, device)  # (random words: any row layout is random words)
        x = torch.randn(16, k, generator=g).to(device=device, dtype=torch.float16)
        cfg = dict(kernel="mmat", BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3,
                   FIELD=True, SCALE_W=False)
        wp = gptq_configs.interleave_for(128, k, 8)
        got = gptq_matmul(x, qw, qz, s, gi, 4, True, 128, wp, config=dict(cfg, BYTES=True))
        want = gptq_matmul(x, qw, qz, s, gi, 4, True, 128, wp, config=dict(cfg, BYTES=False))
        if not torch.equal(got, want):
            return "the byte-permuted fields give other outputs than the shifted ones"
    except Exception as e:  # noqa: BLE001 - any failure means: keep the fields shifted out one at a time
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def configure_byte_fields(device) -> bool:
    """At an engine start (before anything compiles: the variants depend on it), decide whether the field tiles
    on a GPU take 4-bit fields by byte permute: yes unless `probe_byte_fields` finds a difference, which logs a
    warning and keeps the fields shifted out one at a time. Elsewhere (CPUs): yes, no probe."""
    device = pdl.device_key(device)
    use = True
    if device.type == "cuda":
        _BYTES.pop(device, None)
        problem = probe_byte_fields(device)
        if problem is not None:
            log.warning("int4 field tiles keep shifting their fields out one at a time: %s", problem)
        use = problem is None
    _BYTES[device] = use
    return use


def group_shift(group_size: int) -> int:
    """log2(group_size) where it is a power of two (the kernels find a row's group by a shift: `GS_LOG2`), else -1
    (by a division)."""
    return group_size.bit_length() - 1 if group_size > 0 and group_size & (group_size - 1) == 0 else -1


def _launch(kind: str, cfg: dict, x2, qweight, qzeros, scales, bits, zeros_v1, gs, wp, m, n, k,
            compile_only: bool = False, bias=None, lora=None, gated: int = 0, act: int = 0,
            act_s: tuple = (0.0,) * 4) -> torch.Tensor:
    """Launch the kernel `cfg` names, or with compile_only only compile it (Triton's `warmup`: same arguments, so
    the same specialization and cache entry as the launch; inside an AsyncCompileMode the compile is queued).
    bias / lora: added in the kernel's epilogue (`fuses_lora` must hold for lora). gated (`gate_code`: 0 none, 1
    silu, 2 gelu_tanh): y [m, n / 2] = act(gate) * up (`gated_fits` must hold; no lora). act
    (`fused.UNGATED_ACTS`; no lora): y = that activation of the tile (act_s: xIELU's scalars)."""
    split = cfg["SPLIT_K"]
    k_split = cdiv(cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = cdiv(k, k_split)
    width = n // 2 if gated else n
    # compile_only: stand-ins of the same dtypes (the kernel's specialization does not depend on their sizes)
    y = torch.empty((1,) if compile_only else (m, width), device=x2.device, dtype=x2.dtype)
    ws = torch.empty((split, m, n), device=x2.device, dtype=torch.float32) if split > 1 and not compile_only \
        else _no_workspace(x2.device)
    f32 = x2.dtype == torch.float32
    common = dict(BITS=bits, ZEROS_V1=bool(zeros_v1), F32=f32, WP=wp, EVEN_K=k % cfg["BLOCK_K"] == 0,
                  GS_LOG2=group_shift(gs),
                  BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT=split > 1, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"], PDL=pdl.on(x2.device), GATED=gated, **pdl.launch(x2.device),
                  ACT=act, act_s=tuple(act_s), LIBDEVICE=libdevice_on())
    if common["PDL"]:
        common["PREFETCH"] = pdl.prefetch()
    rows = cfg.get("BLOCK_M", 1) if kind != "gemv" or cfg.get("BLOCK_M", 1) > 1 else 1
    epi, epi_c = _epilogue_args(y, bias, lora, m, n, rows, cfg["BLOCK_N"])
    common.update(epi_c)
    args = (m, n, k, k_split, split, gs, x2.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0),
            width, *epi)  # y's row stride: y is a contiguous [m, width]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    interp_bf16 = x2.dtype == torch.bfloat16 and interpreted
    field = bool(cfg.get("FIELD", False)) and not (f32 or interp_bf16) and cfg["BLOCK_K"] // (32 // bits) >= 16
    asm = not interpreted  # inline PTX only where it runs: not in the interpreter
    dots = dict(BLOCK_M=cfg.get("BLOCK_M", 1), DOT_F32=interp_bf16, FIELD_DOTS=field,
                SCALE_W=field and bool(cfg.get("SCALE_W", False)), ASM=asm,
                PAIRS=field and bits == 4 and bool(cfg.get("PAIRS", False)))
    # 4-bit fields one at a time: by byte permute (gptq_kernels._byte_fields) unless the config says BYTES=False,
    # or the engine start's probe found it wrong on this GPU (configure_byte_fields)
    dots["BYTES"] = field and bits == 4 and not dots["PAIRS"] and bool(cfg.get("BYTES", _BYTES.get(
        x2.device, True)))  # (a tensor's CUDA device has its index)
    # and one dot per byte's two fields on the transposed 4-warp tiles where the config says BYTE_DOTS=True (with 8
    # warps the joined operand goes through shared memory: `scripts/kernel-sass`); off by default: half the wgmma
    # waits, but on an H100 (2026-11-27) the same tiles ran 5-15% faster with one dot per field at 128-256 rows
    dots["BYTE_DOTS"] = dots["BYTES"] and kind == "mmat" and cfg["num_warps"] == 4 and bool(cfg.get("BYTE_DOTS",
                                                                                                   False))
    # the fields' dots as warp-synchronous mma.sync, one slice of BLOCK_N / num_warps weight columns per warp, where
    # a transposed field tile's config says SYNC_MMA=True (`gptq_kernels._dot_fields`: no dot waits for its wgmma)
    sync = field and kind == "mmat" and not dots["PAIRS"] and not dots["BYTE_DOTS"] and bool(cfg.get("SYNC_MMA"))
    dots["SYNC"] = cfg["num_warps"] if sync and cfg["BLOCK_N"] % (16 * cfg["num_warps"]) == 0 else 0
    ahead = loads_ahead_for(kind, cfg, bits)  # a K step's scales (tiles) or whole step (gemv) during the one before
    if kind == "gemv" and cfg.get("BLOCK_M", 1) == 1:
        grid = (cdiv(n, cfg["BLOCK_N"]), split, m)
        inplace = bool(cfg.get("INPLACE", False)) and not f32
        run = gemv_kernel.warmup if compile_only else gemv_kernel[grid]
        run(x2, qweight, qzeros, scales, y, ws, _locks(x2.device, grid[0] * m), *args,
            FIELD_LOOP=bool(cfg.get("FIELD", False)) and not f32, INPLACE=inplace, ASM=asm, AHEAD=ahead, **common,
            **({"grid": grid} if compile_only else {}))
    elif kind == "gemv":
        grid = (cdiv(n, cfg["BLOCK_N"]), split, cdiv(m, cfg["BLOCK_M"]))
        run = gemv_rows_kernel.warmup if compile_only else gemv_rows_kernel[grid]
        run(x2, qweight, qzeros, scales, y, ws, _locks(x2.device, grid[0] * grid[2]), *args, BLOCK_M=cfg["BLOCK_M"],
            **common, **({"grid": grid} if compile_only else {}))
    else:
        tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
        grid = (tiles, split)
        run = mma_kernel.warmup if compile_only else mma_kernel[grid]
        run(x2, qweight, qzeros, scales, y, ws, _locks(x2.device, tiles), *args, GROUP_M=cfg.get("GROUP_M", 1),
            TRANS=kind == "mmat", PRE_S=ahead, **dots, **common, **({"grid": grid} if compile_only else {}))
    return y


def _choice(m: int, n: int, k: int, bits: int, group_size: int | None, interleave: int, config: dict | None,
            device) -> tuple[str, dict, bool]:
    """(kernel kind, its config, whether it is one of our fused kernels) for m rows: `config`, else the tuned or
    heuristic choice, capped to the K step the group layout allows (no step: dequantize + cuBLAS)."""
    pack = 32 // bits
    step = gptq_configs.block_k_limit(group_size, k, pack)
    if interleave > 1:
        step = min(step, interleave * pack)  # a K step stays inside one interleaved block
    cfg = config if config is not None else gptq_configs.choose(m, n, k, device)
    kind = cfg.get("kernel", "mma") if step else "dequant"
    if kind != "dequant":
        cfg = dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], step))
    return kind, cfg, kind == "gemv" or (kind in ("mma", "mmat") and cfg["BLOCK_K"] >= 16)


def lora_in_epilogue(m: int, n: int, k: int, bits: int, group_size: int | None, interleave: int, lora,
                     device) -> bool:
    """Whether `gptq_matmul` of m rows adds the LoRADelta `lora` in its kernel's epilogue (else it launches the
    expand after the matmul): what an engine start needs to know to compile that expand beforehand."""
    kind, cfg, fused = _choice(m, n, k, bits, group_size, interleave, None, device)
    return fused and fuses_lora(kind, cfg, lora)


def gptq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, bits: int, zeros_v1: bool = True, group_size: int | None = None,
                interleave: int = 1, config: dict | None = None, compile_only: bool = False,
                bias: torch.Tensor | None = None, lora=None, gated: bool | str = False, act: str | None = None,
                act_scalars=None) -> torch.Tensor | None:
    """Same as `reference.gptq_matmul` (see there). `config` overrides the tuned / heuristic choice (tests,
    tuning): {"kernel": "gemv" | "mma" | "mmat" | "dequant", BLOCK_*, SPLIT_K, GROUP_M, num_warps, num_stages,
    FIELD, SCALE_W, INPLACE, PAIRS, AHEAD, CHUNK_N}. compile_only: compile the fused kernel this call would launch and
    return None (nothing is computed; `gptq_tune.compile_parallel` runs many such calls on a thread pool).
    bias and lora (a `lora_reference.LoRADelta`) are added in the fused kernels' epilogue, so that neither costs a
    launch (the expand where `fuses_lora` says so); after dequantize + cuBLAS, by a bias add and an expand launch.
    gated (a merged gate|up layer): act(gate) * up, [..., n / 2], act silu (True or "silu") or gelu's tanh
    approximation ("gelu_tanh": Gemma's GeGLU), applied by the fused kernels' epilogue where `gated_fits` holds and
    no lora is given (the MLP's silu_and_mul / gelu_tanh_and_mul launch and half the output saved); otherwise by
    `fused.silu_and_mul` (gelu=...) after the matmul. act (an MLP without gate's up projection: "gelu_tanh",
    "relu2" or "xielu", of the Python floats act_scalars: reference.ungated_act): that activation of y, [..., n],
    applied by the fused kernels' epilogue where no lora is given (any tile holds it: one launch fewer per layer);
    otherwise by `fused.ungated_act` (torch's gelu) after the matmul."""
    up_act = UNGATED_ACTS.get(act, 0) if act else 0
    if act and not up_act:
        raise ValueError(f"gptq_matmul: act={act!r} is no activation of an MLP without gate: use one of "
                         f"{sorted(UNGATED_ACTS)}")
    if up_act and gated:
        raise ValueError("gptq_matmul: gated (a gate|up layer's activation-and-multiply) and act (an up projection's "
                         "activation) are exclusive")
    act_s = tuple(float(v) for v in act_scalars) if up_act == UNGATED_ACTS["xielu"] else (0.0,) * 4
    if up_act == UNGATED_ACTS["xielu"] and len(act_s) != 4:
        raise ValueError(f"gptq_matmul: xielu takes its four scalars (a_p, a_n, beta, eps), not {act_scalars!r}")
    act = gate_code(gated)
    pack = 32 // bits
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, qweight holds {k}")
    if interleave > 1 and (group_size is None or k % (interleave * pack)
                           or interleave * pack > gptq_configs.block_k_limit(group_size, k, pack)):
        raise ValueError(f"an interleave of {interleave} words needs plain groups that hold whole blocks of "
                         f"{interleave * pack} rows (K {k}, group size {group_size}): see gptq_configs.interleave_for")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return None if compile_only else x.new_empty(*lead, n // 2 if act else n)
    kind, cfg, fused = _choice(m, n, k, bits, group_size, interleave, config, x.device)
    epi_lora = lora if fused and fuses_lora(kind, cfg, lora) else None
    epi_gated = act if act and fused and lora is None and gated_fits(kind, cfg, n) else 0
    epi_act = up_act if fused and lora is None else 0
    if fused:
        gs = k if group_size in (None, -1) else group_size
        y = _launch(kind, cfg, x2, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), bits, zeros_v1,
                    gs, interleave, m, n, k, compile_only, bias, epi_lora, epi_gated, epi_act, act_s)
        if compile_only:
            return None
        if epi_gated:
            return y.reshape(*lead, n // 2)
        if epi_act:
            return y.reshape(*lead, n)
    elif compile_only:  # dequantize + cuBLAS: the dequantize kernel(s) it launches
        if cfg.get("CHUNK_N") and n > cfg["CHUNK_N"]:
            _dequant_chunks(x2, qweight, qzeros, scales, g_idx, bits, zeros_v1, interleave, cfg["CHUNK_N"], True)
        else:
            dequantize_into_scratch(qweight, qzeros, scales, g_idx, bits, zeros_v1, x.dtype, interleave, True)
        return None
    elif cfg.get("CHUNK_N") and n > cfg["CHUNK_N"]:
        y = _dequant_chunks(x2, qweight, qzeros, scales, g_idx, bits, zeros_v1, interleave, cfg["CHUNK_N"])
    else:
        w = dequantize_into_scratch(qweight, qzeros, scales, g_idx, bits, zeros_v1, x.dtype, interleave)
        y = torch.matmul(x2, w)
    if bias is not None and not fused:
        y.add_(bias)
    if lora is not None and epi_lora is None:
        lora_ops.add_delta(lora, y)
    if up_act:  # (gelu_tanh: torch's one launch; relu2 and xIELU: one Triton launch for torch's two or a dozen)
        from . import fused, reference
        run = reference.ungated_act if up_act == UNGATED_ACTS["gelu_tanh"] else fused.ungated_act
        return run(y, next(a for a, c in UNGATED_ACTS.items() if c == up_act), act_s).reshape(*lead, n)
    if act:
        from .fused import silu_and_mul
        return silu_and_mul(y, gelu=act == GATE_ACTS["gelu_tanh"]).reshape(*lead, n // 2)
    return y.reshape(*lead, n)


def _dequant_chunks(x2, qweight, qzeros, scales, g_idx, bits, zeros_v1, interleave, chunk: int,
                    compile_only: bool = False) -> torch.Tensor | None:
    """`dequant` a block of columns at a time: each block's fp16 weight (K x chunk) is written to a scratch small
    enough to stay in the GPU's L2 cache and read from there by cuBLAS, which writes its columns of y in place (a
    column slice is a matrix with a leading dimension to cuBLAS). Only the int4 words come from memory, where the
    whole-matrix `dequant` writes and reads back the fp16 weight: four times the int4 bytes, twice. compile_only:
    compile the dequantize kernels (a full block and a ragged last one), compute nothing."""
    pack = 32 // bits
    chunk = max(32, chunk // 32 * 32)  # whole words of zeros per block
    m, n = x2.shape[0], qweight.shape[1]
    y = None if compile_only else torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        w = dequantize_into_scratch(qweight[:, a:b], qzeros[:, a // pack:-(-b // pack)], scales[:, a:b], g_idx,
                                    bits, zeros_v1, x2.dtype, interleave, compile_only)
        if not compile_only:
            torch.mm(x2, w, out=y[:, a:b])
    return y
