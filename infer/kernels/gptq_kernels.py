"""The tensor-core GPTQ matmul kernel (W4A16 / W8A16: `mma`, and `mmat` as its TRANS variant) and the K-step helpers every kernel shares;
`gptq_gemm` launches them (its docstring says when), the CUDA-core `gemv` kernels are in `gptq_gemv`.

Every kernel reads a K step of BLOCK_K input rows as BLOCK_K / pack int32 words per column and splits the words
into their `pack` fields: with shifts, or (4-bit field tiles) a byte permute of two words and one lop3 per nibble
(`_byte_fields`). `WP` is the weight's interleave (`packing.field_rows`): 1 for GPTQ order,
where field j of word i is row i * pack + j, so a field's x values lie `pack` apart; WP words per block after the
load-time repack, where field j of a block's words covers WP consecutive rows and x is read contiguously (the
kernels require BLOCK_K <= WP * pack then). The x row of field j of the step's word i is
`_xrow0(k0, j) + i * XS` either way.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl
from .fused import gate_act, up_act

# a LoRADelta's number of partials follows the batch size, so it must not pick a variant (the shard bounds are
# fixed per layer: specialized, they tell the compiler that B's rows are aligned, so its loads are vectorized)
LORA_INTS = ["n_lsplit"]


@triton.jit
def _xrow0(k0, j, WP: tl.constexpr, PACK: tl.constexpr, BKW: tl.constexpr):
    """Input row of field j of the word that starts the step at input row k0 (any later word i: + i * XS)."""
    if BKW == WP:  # a step is one interleaved block: the compiler sees the rows' alignment (vector loads)
        rows = k0 + j * WP
    else:
        w0 = k0 // PACK
        rows = (w0 // WP) * (WP * PACK) + j * WP + w0 % WP
    return rows


@triton.jit
def _kmask(words, k_end, PACK: tl.constexpr, EVEN_K: tl.constexpr):
    """Which of these word indices lie before k_end. EVEN_K (every step whole): all of them, as a constant, so the
    compiler keeps vector loads along K."""
    if EVEN_K:
        valid = tl.full(words.shape, 1, tl.int1)
    else:
        valid = words < k_end // PACK
    return valid


@triton.jit
def group_of(k, group_size, GS_LOG2: tl.constexpr):
    """The group of input row k (>= 0): a shift where the launcher found group_size a power of two (GS_LOG2 =
    its log2, `gptq_gemm.group_shift`), else a division (13-15 more instructions a K step on sm_90)."""
    if GS_LOG2 >= 0:
        return k >> GS_LOG2
    else:
        return k // group_size


@triton.jit
def _scales(s_ptr, g, offs_n, mask_n, ss_g):
    """Group g's scales of the tile's columns (fp16: 2 bytes a column, too small for an asynchronous copy, so the
    pipeliner leaves the load where it is written)."""
    return tl.load(s_ptr + g * ss_g + offs_n, mask=mask_n, other=0.0)


@triton.jit
def _zeros_scales(qz_ptr, s_ptr, g, offs_n, mask_n, sz_g, ss_g, BITS: tl.constexpr, ZEROS_V1: tl.constexpr,
                  LOAD_S: tl.constexpr = True):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    zw = tl.load(qz_ptr + g * sz_g + offs_n // PACK, mask=mask_n, other=0)
    z = (zw >> ((offs_n % PACK) * BITS)) & MASK
    if ZEROS_V1:
        z = (z + 1) & MASK
    if LOAD_S:
        s = _scales(s_ptr, g, offs_n, mask_n, ss_g)
    else:  # the caller has them (loaded a step ahead)
        s = z
    return z, s


@triton.jit
def _fields(words, BITS: tl.constexpr):
    """int32 words [W, N] -> their fields [PACK, W, N]: row (j, i) is field j of word i.
    An arithmetic shift of a negative word followed by the mask is still the right field."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    shifts = (tl.arange(0, PACK) * BITS)[:, None, None]
    return (words[None, :, :] >> shifts) & MASK


@triton.jit
def _f16_1024(z):
    """int32 zeros 0 <= z < 1024 -> the fp16 1024 + z, by OR-ing z into the mantissa of 1024 (one logic op where a
    conversion takes the slower integer-to-float unit)."""
    return (z | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _field_f16(words, j, zf, BITS: tl.constexpr):
    """Field j of every word as the exact fp16 q - z: OR-ing q into the mantissa of 1024 gives the fp16 1024 + q
    without a conversion instruction; zf is 1024 + z in fp16."""
    qj = ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x6400
    return qj.to(tl.int16).to(tl.float16, bitcast=True) - zf


# `_byte_fields` on a GPU, for byte b of two words of one column on consecutive K rows (the two values one 32-bit
# register of a tensor-core operand holds; $2, $3) and their zeros as 1024 + z and 64 + z in both halves ($4, $5):
# one byte permute puts byte b of both words in the register's two 16-bit halves; one lop3 per nibble ORs both
# halves' fields into fp16 mantissas where they lie, the low nibble (field 2b) into 1024's (1024 + q), the high one
# (field 2b + 1, bits 4-7 of the half) into 64's, whose mantissa ulp is 1/16 (64 + q); one packed subtract per
# field gives q - z exactly. Five instructions for 4 weights, each pair already where the operand wants it.
BYTE_FIELDS_PTX = tl.constexpr(tuple(
    "{ .reg .b32 t, h;\n"
    f"prmt.b32 t, $2, $3, 0x{4 + b}{4 + b}{b}{b};\n"
    "lop3.b32 h, t, 0x000F000F, 0x64006400, 0xEA;\n"
    "sub.f16x2 $0, h, $4;\n"
    "lop3.b32 h, t, 0x00F000F0, 0x54005400, 0xEA;\n"
    "sub.f16x2 $1, h, $5; }" for b in range(4)))
BYTE_FIELDS_CONSTRAINTS = tl.constexpr("=r,=r,r,r,r,r")


@triton.jit
def _byte_fields(words, zf, zo, b: tl.constexpr, ASM: tl.constexpr):
    """4-bit words and their columns' zeros as fp16 1024 + z and 64 + z (broadcast to the words' shape) -> fields
    2b and 2b + 1 (byte b) as q - z, fp16 tensors of the words' shape, exact. ASM: inline PTX, two words at a time
    (a GPU: BYTE_FIELDS_PTX, 1.25 instructions per weight with the subtraction, where `_field_f16` takes about 2.5);
    the interpreter, which cannot run PTX, computes the same values with Triton ops."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(BYTE_FIELDS_PTX[b], BYTE_FIELDS_CONSTRAINTS, [words, zf, zo],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        lo = (((words >> (8 * b)) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - zf
        hi = (((words >> (8 * b)) & 0xF0) | 0x5400).to(tl.int16).to(tl.float16, bitcast=True) - zo
    return lo, hi


@triton.jit(noinline=True)
def _lora_add(y_ptr, m0, n0, M, N, sy_m, hp_ptr, lb_ptr, slot_ptr, rank_ptr, scal_ptr, NR, n_lsplit, c1, c2, c3,
              S: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, NSH: tl.constexpr, JB: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """y[tile] += every row's adapter delta over the tile's columns (rows m0.., columns n0..; the tile is already
    stored in y): the expand of a LoRADelta (lora_reference.add_delta): for row m of slot s >= 0 and column n of
    shard i, sum over r of scal[i, s] * h[m, i*R + r] * Bt_i[s, r, n], h the sum of the n_lsplit partials
    hp [n_lsplit, M, NR] (by token), added in float32 to y's value and rounded once, as the expand launch does.

    The tile's rows may hold several adapters (a decode step where every request has its own): the slots the
    tile uses are walked in chunks of JB (slot, rank) rows of the padded [S * RP] space; a row's h is read only
    in its own slot's rows (zero elsewhere), so one dot per chunk gives every row its own adapter's product.
    Only the B rows of slots that some row of the tile uses, within their rank, are read: each B element once
    per column tile, which is the unfused expand's traffic without its launch. A call, not inlined: the main
    loop's code and registers stay those of the kernel without adapters (it only takes scalars)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    slot = tl.load(slot_ptr + offs_m, mask=mask_m, other=-1).to(tl.int32)
    s_lo = tl.min(tl.where(slot >= 0, slot, S), 0)
    s_hi = tl.max(slot, 0) + 1  # 0 when no row of the tile has an adapter: no chunk at all
    if s_hi > 0:
        j = tl.arange(0, JB)
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in tl.static_range(NSH):
            lo = n0 * 0 if i == 0 else (c1 if i == 1 else (c2 if i == 2 else c3))
            hi = c1 if i == 0 else (c2 if i == 1 else (c3 if i == 2 else N))  # (the host passes N past the last)
            if (lo < n0 + BLOCK_N) & (hi > n0):
                w = hi - lo
                in_cols = (offs_n >= lo) & (offs_n < hi)
                scal = tl.load(scal_ptr + i * S + slot, mask=slot >= 0, other=0.0)  # each row's, this shard's
                for g0 in range(s_lo * RP, s_hi * RP, JB):
                    g = g0 + j
                    s, r = g // RP, g % RP
                    rank = tl.load(rank_ptr + i * S + s, mask=s < s_hi, other=0)
                    mine = (slot[:, None] == s[None, :]) & (r < rank)[None, :]
                    used = tl.max(mine.to(tl.int32), 0) > 0
                    h = tl.zeros((BLOCK_M, JB), dtype=tl.float32)
                    for p in range(n_lsplit):
                        h += tl.load(hp_ptr + p * M * NR + offs_m[:, None] * NR + (i * R + r)[None, :], mask=mine,
                                     other=0.0)
                    h = h * scal[:, None]  # (scaled before the product: one accumulator for every shard)
                    b = tl.load(lb_ptr + lo.to(tl.int64) * S * R + s[:, None].to(tl.int64) * R * w + r[:, None] * w
                                + (offs_n - lo)[None, :], mask=used[:, None] & in_cols[None, :], other=0.0)
                    if BLOCK_M >= 16:
                        if IEEE:
                            # (float32, or bf16 under TRITON_INTERPRET, whose bf16 tl.dot is wrong: the same values)
                            delta = tl.dot(h.to(b.dtype).to(tl.float32), b.to(tl.float32), delta,
                                           input_precision="ieee")
                        else:
                            delta = tl.dot(h.to(b.dtype), b, delta)
                    else:
                        delta += tl.sum(h[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * sy_m + offs_n[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


@triton.jit
def gated_cols(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """(offs_n, mask_n): the weight columns of column tile pid_n. GATED (a merged gate|up layer of N = 2 x half
    columns, whose epilogue applies SiLU-and-multiply): the tile's first BLOCK_N / 2 columns are gate columns
    pid_n * BLOCK_N / 2.., the others the up columns of the same outputs, half further (the launcher makes sure
    half is a multiple of BLOCK_N / 2, so every tile is full, and of 16; the compiler derives the halves'
    contiguity and alignment itself: the sm_90 code loads them as wide as the plain tile's, no hint needed)."""
    if GATED:
        H: tl.constexpr = BLOCK_N // 2
        c = tl.arange(0, BLOCK_N)
        offs = pid_n * H + (c % H) + (c // H) * (N // 2)
        return offs, offs < N
    offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs, offs < N


@triton.jit
def slice_cols(pid_n, N, BLOCK_N: tl.constexpr, SYNC: tl.constexpr, GATED: tl.constexpr):
    """`gated_cols` of column tile pid_n as [SYNC, BLOCK_N / SYNC]: row i holds the tile's columns i * C..(i + 1) *
    C - 1 (C = BLOCK_N / SYNC), each row contiguous in memory (a slice lies in one half of a GATED tile: C divides
    BLOCK_N / 2)."""
    C: tl.constexpr = BLOCK_N // SYNC
    first = tl.arange(0, SYNC) * C  # each slice's first column in the tile
    if GATED:
        H: tl.constexpr = BLOCK_N // 2
        base = pid_n * H + first % H + (first // H) * (N // 2)
    else:
        base = pid_n * BLOCK_N + first
    offs = base[:, None] + tl.arange(0, C)[None, :]
    return offs, offs < N


@triton.jit
def _finish(total, y_ptr, y_ptrs, mask, offs_m, offs_n, M, N, sy_m, bias_ptr, hp_ptr, lb_ptr, slot_ptr, rank_ptr,
            scal_ptr, NR, n_lsplit, c1, c2, c3, HAS_BIAS: tl.constexpr, LORA_S: tl.constexpr, LORA_R: tl.constexpr,
            LORA_RP: tl.constexpr, LORA_NSH: tl.constexpr, LORA_JB: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, IEEE: tl.constexpr, GATED: tl.constexpr, act_s, ACT: tl.constexpr,
            LIBDEVICE: tl.constexpr):
    """Store the tile in y's dtype, after what the layer adds to the product, in the reference's order and
    roundings: the bias (in y's dtype), then the adapters' delta (`_lora_add`: added in float32, rounded once).
    GATED (`gated_cols`; never with adapters): y [M, N / 2] = act(gate) * up of the rounded tile, as
    `fused.silu_and_mul` computes it from a stored gate|up output; act silu (GATED 1) or gelu's tanh approximation
    (GATED 2: Gemma's GeGLU, as `fused.gelu_tanh_and_mul`). ACT (an MLP without gate's up projection; never with
    adapters): y = `fused.up_act` of the rounded tile (1 gelu_tanh, 2 relu2, 3 xIELU of the scalars act_s)."""
    out = total.to(y_ptr.dtype.element_ty)
    if HAS_BIAS:
        # in float32, rounded once: the same bits as an add in y's dtype (float32 holds the exact sum of two fp16 or
        # bf16 values' roundings without double-rounding error), and right under TRITON_INTERPRET, whose bf16
        # arithmetic is wrong (it adds the raw bits)
        b = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(out.dtype)
        out = (out.to(tl.float32) + b.to(tl.float32)[None, :]).to(out.dtype)
    if ACT:
        out = up_act(out, act_s, ACT, LIBDEVICE)
    if GATED:
        H: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.permute(tl.reshape(out, (BLOCK_M, 2, H)), (0, 2, 1)))
        act = gate_act(gate.to(tl.float32), GATED == 2).to(gate.dtype)  # in float32, rounded as torch's F.silu / gelu
        cols = tl.min(offs_n, 0) + tl.arange(0, H)
        tl.store(y_ptr + offs_m[:, None] * sy_m + cols[None, :], (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype),
                 mask=(offs_m < M)[:, None] & (cols < N // 2)[None, :])
    else:
        tl.store(y_ptrs, out, mask=mask)
    if LORA_S > 0:
        tl.debug_barrier()  # the tile's stores, by every thread, before any thread reads them back
        _lora_add(y_ptr, tl.min(offs_m, 0), tl.min(offs_n, 0), M, N, sy_m, hp_ptr, lb_ptr, slot_ptr, rank_ptr,
                  scal_ptr, NR, n_lsplit, c1, c2, c3, LORA_S, LORA_R, LORA_RP, LORA_NSH, LORA_JB, BLOCK_M, BLOCK_N,
                  IEEE)


@triton.jit
def _epilogue(acc, y_ptr, ws_ptr, lock_ptr, tile, pid_k, offs_m, offs_n, M, N, sy_m, n_split,
              bias_ptr, hp_ptr, lb_ptr, slot_ptr, rank_ptr, scal_ptr, NR, n_lsplit, c1, c2, c3,
              SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, LORA_S: tl.constexpr, LORA_R: tl.constexpr,
              LORA_RP: tl.constexpr, LORA_NSH: tl.constexpr, LORA_JB: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, IEEE: tl.constexpr, GATED: tl.constexpr, act_s, ACT: tl.constexpr,
              LIBDEVICE: tl.constexpr):
    """The tile's result into y: directly, or with split-K by the program that arrives last at the tile, which
    sums the partial tiles in a fixed order; either way `_finish` adds the bias and the adapters' delta first. The
    partial tiles keep the weight's N columns (`offs_n`), GATED too."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * sy_m + offs_n[None, :]
    if not SPLIT:
        _finish(acc, y_ptr, y_ptrs, mask, offs_m, offs_n, M, N, sy_m, bias_ptr, hp_ptr, lb_ptr, slot_ptr, rank_ptr,
                scal_ptr, NR, n_lsplit, c1, c2, c3, HAS_BIAS, LORA_S, LORA_R, LORA_RP, LORA_NSH, LORA_JB, BLOCK_M,
                BLOCK_N, IEEE, GATED, act_s, ACT, LIBDEVICE)
    else:
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves (release below)
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if arrived == n_split - 1:
            total = tl.zeros_like(acc)
            for s in range(n_split):
                total += tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _finish(total, y_ptr, y_ptrs, mask, offs_m, offs_n, M, N, sy_m, bias_ptr, hp_ptr, lb_ptr, slot_ptr,
                    rank_ptr, scal_ptr, NR, n_lsplit, c1, c2, c3, HAS_BIAS, LORA_S, LORA_R, LORA_RP, LORA_NSH, LORA_JB,
                    BLOCK_M, BLOCK_N, IEEE, GATED, act_s, ACT, LIBDEVICE)
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def _pdl_start(qw_ptr, qz_ptr, s_ptr, k_begin, k_end, group_size, n0, N, sq_k, sz_g, ss_g, BITS: tl.constexpr,
               BKW: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
               GS_LOG2: tl.constexpr = -1):
    """With PDL (`pdl`): the program's first PREFETCH K steps of packed words, and their groups' zeros and scales
    (a step lies inside one group), asked into L2 (constants: no need to wait for the kernel before; without the
    zeros and scales the first step would still wait for memory), then `pdl.start` (let the next kernel launch,
    wait for the previous one)."""
    if PDL and PREFETCH > 0:
        PACK: tl.constexpr = 32 // BITS
        pdl.prefetch_rows(qw_ptr, k_begin // PACK, (k_end + PACK - 1) // PACK, sq_k, n0, N, PREFETCH * BKW, BLOCK_N,
                          32)
        g0 = group_of(k_begin, group_size, GS_LOG2)
        g_end = group_of(k_end + group_size - 1, group_size, GS_LOG2)
        pdl.prefetch_rows(s_ptr, g0, g_end, ss_g, n0, N, PREFETCH, BLOCK_N, 32)
        pdl.prefetch_rows(qz_ptr, g0, g_end, sz_g, n0 // PACK, (N + PACK - 1) // PACK, PREFETCH, BLOCK_N // PACK, 32)
    pdl.start(PDL)


@triton.jit
def _step_words(qw_ptr, qz_ptr, s_ptr, k0, k_end, g, offs_w, offs_n, mask_n, sq_k, sz_g, ss_g,
                BITS: tl.constexpr, ZEROS_V1: tl.constexpr, EVEN_K: tl.constexpr, TRANS: tl.constexpr,
                PRE_S: tl.constexpr = False, SLICES: tl.constexpr = 0):
    """One K step's packed words ([BKW, BLOCK_N], or [BLOCK_N, BKW] with TRANS; coalesced along N, read once),
    which of them lie in range, and group g's zeros and scales (with PRE_S the caller loaded the scales a step
    before: the zeros stand in for them here). SLICES (TRANS): offs_n and mask_n are [SLICES, BLOCK_N / SLICES]
    (`slice_cols`), the words [SLICES, BLOCK_N / SLICES, BKW], the zeros and scales [SLICES, BLOCK_N / SLICES]."""
    PACK: tl.constexpr = 32 // BITS
    wrow = k0 // PACK + offs_w
    wv = _kmask(wrow, k_end, PACK, EVEN_K)
    step_ptr = qw_ptr + (k0 // PACK) * sq_k  # the step's first word row, then offsets the loop does not change
    if SLICES:
        words = tl.load(step_ptr + (offs_w[None, None, :] * sq_k + offs_n[:, :, None]),
                        mask=wv[None, None, :] & mask_n[:, :, None], other=0, eviction_policy="evict_first")
    elif TRANS:
        words = tl.load(step_ptr + (offs_w[None, :] * sq_k + offs_n[:, None]), mask=wv[None, :] & mask_n[:, None],
                        other=0, eviction_policy="evict_first")
    else:
        words = tl.load(step_ptr + (offs_w[:, None] * sq_k + offs_n[None, :]), mask=wv[:, None] & mask_n[None, :],
                        other=0, eviction_policy="evict_first")
    z, s = _zeros_scales(qz_ptr, s_ptr, g, offs_n, mask_n, sz_g, ss_g, BITS, ZEROS_V1, not PRE_S)
    return words, wv, z, s


@triton.jit
def _dot_fields(acc, x_rows, mask_m, k0, words, wv, z, s, offs_w, BITS: tl.constexpr, WP: tl.constexpr,
                BKW: tl.constexpr, SCALE_W: tl.constexpr, TRANS: tl.constexpr, BYTES: tl.constexpr = False,
                ASM: tl.constexpr = True, k_end=0, EVEN_K: tl.constexpr = True, BYTE_DOTS: tl.constexpr = False,
                SYNC: tl.constexpr = 0, SLICED: tl.constexpr = False):
    """acc += one K step as one tensor-core dot per packed field, each field tile straight from the loaded words'
    registers. x_rows: pointers to the rows' first element ([BLOCK_M, 1], or [1, BLOCK_M] with TRANS: acc is then
    y^T and the weight the first operand). The group's scale multiplies the step's sum, or with SCALE_W the weights
    themselves ((q - z) * s rounded to fp16, as the reference computes; one accumulator instead of two). BYTES
    (4-bit): a byte's two fields' q - z at a time by byte permute (`_byte_fields`, just before their dots), else
    each field shifted out of the words (`_field_f16`); the same fp16 values either way. BYTE_DOTS (with BYTES and
    TRANS, where a K step is one interleaved block: the two fields' rows are consecutive): one dot over both fields
    (K = 2 * BKW, the two tiles joined in registers), half the dots and their waits for the tensor cores. SYNC (with
    TRANS, not BYTE_DOTS): acc is [SYNC, BLOCK_N / SYNC, BLOCK_M] and each field's dot a batched one over SYNC
    slices of the weight columns, x broadcast to every slice: Triton lowers a batched dot to the warp-synchronous
    mma.sync (MMAv2: one slice per warp, x read by each warp from shared memory), never to wgmma, so no dot waits
    for the tensor cores; only a use of its result does. SLICED (with SYNC): the words, zeros and scales come in
    the batched dot's slices already (`_step_words` with SLICES), else the unpacked fields are reshaped to them."""
    PACK: tl.constexpr = 32 // BITS
    XS: tl.constexpr = PACK if WP == 1 else 1
    part = tl.zeros(acc.shape, dtype=tl.float32)
    if SLICED:  # words [SYNC, BLOCK_N / SYNC, BKW], zeros and scales [SYNC, BLOCK_N / SYNC]
        zf, sw = _f16_1024(z)[:, :, None], s[:, :, None]
    elif TRANS:
        zf, sw = _f16_1024(z)[:, None], s[:, None]
    else:
        zf, sw = _f16_1024(z)[None, :], s[None, :]
    if BYTES:
        zfb = tl.broadcast_to(zf, words.shape)
        zob = zfb - 960.0  # 64 + z, exact
    if BYTES and BYTE_DOTS and TRANS and WP == BKW:  # a byte's two fields cover 2 * BKW consecutive rows: one dot
        r2 = tl.arange(0, 2 * BKW)
        wv2 = _kmask(k0 // PACK + r2 % BKW, k_end, PACK, EVEN_K)  # row r: word r % BKW
        x_step = x_rows + (k0 + r2)[:, None]  # byte b's rows: + 2 * b * WP, a constant offset
        for b in tl.static_range(PACK // 2):
            lo, hi = _byte_fields(words, zfb, zob, b, ASM)
            if SCALE_W:
                lo, hi = lo * sw, hi * sw
            # [N, BKW] x 2 -> [N, 2 * BKW]: the columns of lo, then of hi (on 4 warps a renaming of registers)
            w2 = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (lo.shape[0], 2 * BKW))
            xj = tl.load(x_step + 2 * b * WP, mask=mask_m[None, :] & wv2[:, None], other=0.0)
            d = tl.dot(w2.to(xj.dtype), xj)
            if SCALE_W:
                acc += d
            else:
                part += d
    else:
        if BKW == WP:  # field j's rows: the step's first field's + j * WP, a constant offset of one base pointer
            if TRANS:
                x_step = x_rows + (k0 + offs_w * XS)[:, None]
            else:
                x_step = x_rows + (k0 + offs_w * XS)[None, :]
        for j in tl.static_range(PACK):
            ks = _xrow0(k0, j, WP, PACK, BKW) + offs_w * XS
            if BYTES:
                if j % 2 == 0:
                    lo, hi = _byte_fields(words, zfb, zob, j // 2, ASM)
                    wj = lo
                else:
                    wj = hi
            else:
                wj = _field_f16(words, j, zf, BITS)
            if SCALE_W:
                wj = wj * sw
            if TRANS:
                xp = x_step + j * WP if BKW == WP else x_rows + ks[:, None]
                xj = tl.load(xp, mask=mask_m[None, :] & wv[:, None], other=0.0)
                if SYNC:  # the weights as [SYNC, BLOCK_N / SYNC, BKW] (SLICED: their words' shape; else a reshape,
                    # a renaming of registers), x broadcast to each slice
                    w3 = wj.to(xj.dtype) if SLICED else tl.reshape(wj.to(xj.dtype), (SYNC, wj.shape[0] // SYNC,
                                                                                     wj.shape[1]))
                    x3 = tl.broadcast_to(xj[None, :, :], (SYNC, xj.shape[0], xj.shape[1]))
                    if SCALE_W:
                        acc = tl.dot(w3, x3, acc)
                    else:
                        part = tl.dot(w3, x3, part)
                else:
                    d = tl.dot(wj.to(xj.dtype), xj)
            else:
                xp = x_step + j * WP if BKW == WP else x_rows + ks[None, :]
                xj = tl.load(xp, mask=mask_m[:, None] & wv[None, :], other=0.0)
                d = tl.dot(xj, wj.to(xj.dtype))
            if SYNC:
                pass  # accumulated by the dot itself
            elif SCALE_W:
                acc += d
            else:
                part += d
    if not SCALE_W:  # the scales made float32 before they are broadcast (one layout conversion, not two)
        sf = s.to(tl.float32)
        if SLICED:
            acc += part * sf[:, :, None]
        elif SYNC:
            acc += part * tl.reshape(sf, (SYNC, sf.shape[0] // SYNC))[:, :, None]
        else:
            acc += part * (sf[:, None] if TRANS else sf[None, :])
    return acc


# `_pair_fields` on a GPU: lop3 with LUT 0xEA is (a & b) | c. Module constants so that a test can run this text
# through a PTX emulator against the interpreter's Triton-op path (tests/test_ptx_fields.py).
PAIR_FIELDS_PTX = tl.constexpr(
    "{ .reg .b32 t0, t1, t2, t3, s;\n"
    "lop3.b32 t0, $8, 0x000F000F, 0x64006400, 0xEA;\n"
    "lop3.b32 t1, $8, 0x00F000F0, 0x64006400, 0xEA;\n"
    "shr.u32 s, $8, 8;\n"
    "lop3.b32 t2, s, 0x000F000F, 0x64006400, 0xEA;\n"
    "lop3.b32 t3, s, 0x00F000F0, 0x64006400, 0xEA;\n"
    "mov.b32 {$0, $1}, t0;\nmov.b32 {$2, $3}, t1;\nmov.b32 {$4, $5}, t2;\nmov.b32 {$6, $7}, t3; }")
PAIR_FIELDS_CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r")


@triton.jit
def _pair_fields(words, ASM: tl.constexpr):
    """4-bit words -> eight fp16 tensors (fields 0, 4, 1, 5, 2, 6, 3, 7): the fields of each 16-bit half OR-ed
    into the mantissa of 1024 where they lie, both halves by one lop3: fields 0/4 and 2/6 (after one shift of the
    word by 8) as 1024 + q, fields 1/5 and 3/7 as 1024 + 16 q. Five integer instructions per word, where one
    field at a time takes three per field (shift, mask, or, and a byte permute to pair two words). ASM: as
    inline PTX (a GPU); the interpreter, which cannot run PTX, computes the same values with Triton ops."""
    if ASM:
        out = tl.inline_asm_elementwise(PAIR_FIELDS_PTX, PAIR_FIELDS_CONSTRAINTS, [words], dtype=(tl.float16,) * 8,
                                        is_pure=True, pack=1)
    else:
        out = (_half_field(words, 0, 0x0F), _half_field(words, 16, 0x0F), _half_field(words, 0, 0xF0),
               _half_field(words, 16, 0xF0), _half_field(words, 8, 0x0F), _half_field(words, 24, 0x0F),
               _half_field(words, 8, 0xF0), _half_field(words, 24, 0xF0))
    return out


@triton.jit
def _half_field(words, shift: tl.constexpr, mask: tl.constexpr):
    return (((words >> shift) & mask) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _pair_tile(a, b):
    """[W, N] and [W, N] -> [2W, N] with rows a[0], b[0], a[1], b[1], ...: two fields of one word become the two
    consecutive K rows that one register of the tensor-core operand holds (no byte permute)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (2 * a.shape[0], a.shape[1]))


@triton.jit
def _pair(a, b, TRANS: tl.constexpr):
    """Two fields' tiles as one K-paired operand: rows a[0], b[0], a[1], ... ([2W, N]), or with TRANS (tiles [N, W],
    the weight as the first operand) columns a[:, 0], b[:, 0], a[:, 1], ... ([N, 2W]). Either way the two values one
    register of the tensor-core operand holds are the two halves of one unpacked word."""
    if TRANS:
        out = tl.interleave(a, b)
    else:
        out = _pair_tile(a, b)
    return out


@triton.jit
def _dot_pairs(acc, x_rows, mask_m, k0, words, wv, z, s, offs_w, WP: tl.constexpr, BKW: tl.constexpr,
               SCALE_W: tl.constexpr, ASM: tl.constexpr, TRANS: tl.constexpr = False):
    """`_dot_fields` for 4-bit weights with two fields per dot: dot j pairs field j of every word with field
    j + 4 of the same word (`_pair_fields`), K = 2 * BKW rows ordered (word, half), and x is read as two rows of
    BKW values interleaved the same way. Four dots per step instead of eight, about one integer instruction per
    weight instead of three. TRANS: the weight is the first operand (`mmat`: wgmma's register operand on sm_90)."""
    XS: tl.constexpr = 8 if WP == 1 else 1
    part = tl.zeros(acc.shape, dtype=tl.float32)
    # fields as 1024 + q, and 1024 + 16 q (x 1/16); 64 + z with z in 64's mantissa (its ulp is 1/16)
    z0, z1 = _f16_1024(z), ((z << 4) | 0x5400).to(tl.int16).to(tl.float16, bitcast=True)
    if TRANS:  # words [BLOCK_N, BKW]: per-column values along axis 0
        z0, z1, sw = z0[:, None], z1[:, None], s[:, None]
    else:
        z0, z1, sw = z0[None, :], z1[None, :], s[None, :]
    f0, f4, f1, f5, f2, f6, f3, f7 = _pair_fields(words, ASM)
    if BKW == WP:
        x_step = x_rows + (k0 + offs_w)[:, None] if TRANS else x_rows + (k0 + offs_w)[None, :]
    for j in tl.static_range(4):
        if j == 0:
            wj = _pair(f0, f4, TRANS) - z0
        elif j == 1:
            wj = _pair(f1, f5, TRANS) * 0.0625 - z1
        elif j == 2:
            wj = _pair(f2, f6, TRANS) - z0
        else:
            wj = _pair(f3, f7, TRANS) * 0.0625 - z1
        if SCALE_W:
            wj = wj * sw
        if BKW == WP:  # fields j and j + 4: constant offsets of the step's base pointers (as in `_dot_fields`)
            pa, pb = x_step + j * WP, x_step + (j + 4) * WP
        else:
            ra, rb = _xrow0(k0, j, WP, 8, BKW) + offs_w * XS, _xrow0(k0, j + 4, WP, 8, BKW) + offs_w * XS
            pa, pb = (x_rows + ra[:, None], x_rows + rb[:, None]) if TRANS else \
                (x_rows + ra[None, :], x_rows + rb[None, :])
        if TRANS:
            xm = mask_m[None, :] & wv[:, None]
            xa = tl.load(pa, mask=xm, other=0.0)
            xb = tl.load(pb, mask=xm, other=0.0)
            d = tl.dot(wj.to(xa.dtype), _pair_tile(xa, xb))
        else:
            xm = mask_m[:, None] & wv[None, :]
            xa = tl.load(pa, mask=xm, other=0.0)
            xb = tl.load(pb, mask=xm, other=0.0)
            d = tl.dot(tl.interleave(xa, xb), wj.to(xa.dtype))
        if SCALE_W:
            acc += d
        else:
            part += d
    if not SCALE_W:  # the scales made float32 before they are broadcast (one layout conversion, not two)
        sf = s.to(tl.float32)
        acc += part * (sf[:, None] if TRANS else sf[None, :])
    return acc


@triton.jit
def _dot_tile(acc, x_rows, mask_m, k0, k_end, words, z, s, BITS: tl.constexpr, WP: tl.constexpr, BKW: tl.constexpr,
              EVEN_K: tl.constexpr, F32: tl.constexpr, DOT_F32: tl.constexpr, TRANS: tl.constexpr):
    """acc += one K step as one dot over the whole [BLOCK_K, BLOCK_N] weight tile, built by a reshape of the
    unpacked fields (row r of the tile is field r // BKW of word r % BKW; x is read in the same order)."""
    PACK: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BKW * PACK
    XS: tl.constexpr = PACK if WP == 1 else 1
    r = tl.arange(0, BLOCK_K)
    kk = _xrow0(k0, r // BKW, WP, PACK, BKW) + (r % BKW) * XS
    kv = _kmask(k0 // PACK + r % BKW, k_end, PACK, EVEN_K)
    if TRANS:  # words [BLOCK_N, BKW] -> the weight^T tile [BLOCK_N, BLOCK_K], column c = field c // BKW of word c % BKW
        xt = tl.load(x_rows + kk[:, None], mask=mask_m[None, :] & kv[:, None], other=0.0)
        shifts = (tl.arange(0, PACK) * BITS)[None, :, None]
        q = tl.reshape((words[:, None, :] >> shifts) & ((1 << BITS) - 1), (words.shape[0], BLOCK_K))
        zz, ss = z[:, None], s[:, None]
    else:
        xt = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & kv[None, :], other=0.0)
        q = tl.reshape(_fields(words, BITS), (BLOCK_K, words.shape[1]))
        zz, ss = z[None, :], s[None, :]
    if F32:
        w = ((q - zz).to(tl.float16) * ss).to(tl.float32)
        part = tl.dot(w, xt.to(tl.float32), input_precision="ieee") if TRANS else \
            tl.dot(xt.to(tl.float32), w, input_precision="ieee")
        acc += part
    else:
        w = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (zz + 1024).to(tl.float16)
        if DOT_F32:  # the interpreter's bf16 tl.dot is wrong: multiply the same bf16 values in float32
            part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee") if TRANS else \
                tl.dot(xt.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(w.to(xt.dtype), xt) if TRANS else tl.dot(xt, w.to(xt.dtype))
        acc += part * ss.to(tl.float32)
    return acc


@triton.jit(do_not_specialize=LORA_INTS)
def mma_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_SPLIT, n_split, group_size,
               sx_m, sq_k, sz_g, ss_g, sy_m,
               bias_ptr, hp_ptr, lb_ptr, slot_ptr, rank_ptr, scal_ptr, NR, n_lsplit, c1, c2, c3,
               BITS: tl.constexpr, ZEROS_V1: tl.constexpr, F32: tl.constexpr, DOT_F32: tl.constexpr,
               WP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, GROUP_M: tl.constexpr, FIELD_DOTS: tl.constexpr = False,
               SCALE_W: tl.constexpr = False, TRANS: tl.constexpr = False, PAIRS: tl.constexpr = False,
               ASM: tl.constexpr = True, HAS_BIAS: tl.constexpr = False, LORA_S: tl.constexpr = 0,
               LORA_R: tl.constexpr = 0, LORA_RP: tl.constexpr = 1, LORA_NSH: tl.constexpr = 1,
               LORA_JB: tl.constexpr = 16, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 2,
               BYTES: tl.constexpr = False, BYTE_DOTS: tl.constexpr = False, GATED: tl.constexpr = 0,
               PRE_S: tl.constexpr = False, GS_LOG2: tl.constexpr = -1, SYNC: tl.constexpr = 0, act_s=(0.0,) * 4,
               ACT: tl.constexpr = 0, LIBDEVICE: tl.constexpr = True):
    """Tensor cores (tl.dot), y tile [BLOCK_M, BLOCK_N]: one dot per packed field (FIELD_DOTS, `_dot_fields`) or
    one dot over the reshaped tile (`_dot_tile`). TRANS (`mmat`) computes y^T = W^T x^T, so the dequantized weight
    is the first (register) operand of the tensor-core instruction and the activation rows the second (as Machete
    does); BLOCK_N is then the instruction's M side. PAIRS (4-bit, with FIELD_DOTS): two fields per dot
    (`_dot_pairs`); BYTES (4-bit, with FIELD_DOTS): the fields by byte permute (`_byte_fields`), and with BYTE_DOTS
    one dot per byte's two fields where they cover consecutive input rows (interleaved). Grouped tile
    order: GROUP_M row tiles walk the same column tiles (L2 reuse). PDL: launched
    with programmatic dependent launch (`_pdl_start`: PREFETCH K steps of weights into L2 before the wait).
    GATED: a gate|up layer's tile with its activation-and-multiply in the epilogue (`gated_cols`; 1: silu, 2:
    gelu_tanh). PRE_S: each K step's scales loaded during the step before and carried in registers
    (`gptq_gemm.loads_ahead_for`; in their own step the step waits a memory round trip for them, as the pipeliner
    does not stage them). SYNC (TRANS with FIELD_DOTS,
    one dot per field): the fields' dots as mma.sync over SYNC column slices (`_dot_fields`), 0: off. ACT: an MLP
    without gate's activation in the epilogue (`_finish`; act_s: xIELU's scalars; LIBDEVICE: off under
    TRITON_INTERPRET)."""
    tl.static_assert(SYNC == 0 or (TRANS and FIELD_DOTS and not PAIRS and not BYTE_DOTS and BLOCK_N % SYNC == 0),
                     "SYNC: a transposed field tile with one dot per field")
    BKW: tl.constexpr = BLOCK_K // (32 // BITS)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_in_group
    pid_n = (pid % width) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n, mask_n = gated_cols(pid_n, N, BLOCK_N, GATED)
    # SYNC on 4 warps (slices of 32 columns): the main loop reads the words, zeros and scales in the batched dot's
    # shape, so that the words reach shared memory by 16-byte copies along N and their registers are the dot's
    # operand layout (reshaped after the load, each thread copied its words 4 bytes at a time along K: 25 copies a
    # K step where the 2-D tiles issue 13, and 64 x 128 took 250 registers where it now takes 168; sm_90, Triton
    # 3.6). On 8 warps the words stay reshaped: with Triton 3.9, 64 x 256 sliced keeps a 72-byte stack frame and
    # 128 x 128 (16 columns a slice) unpacks with 36 more byte permutes
    SLICED: tl.constexpr = SYNC == 4 and BLOCK_N >= 32 * SYNC
    if SLICED:
        offs_c, mask_c = slice_cols(pid_n, N, BLOCK_N, SYNC, GATED)
    else:
        offs_c, mask_c = offs_n, mask_n
    mask_m = offs_m < M
    offs_w = tl.arange(0, BKW)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    _pdl_start(qw_ptr, qz_ptr, s_ptr, k_begin, k_end, group_size, tl.min(offs_n, 0), N, sq_k, sz_g, ss_g, BITS, BKW,
               BLOCK_N, PDL, PREFETCH, GS_LOG2)
    if SYNC:  # the weight columns in SYNC slices, one per warp (`_dot_fields`)
        acc = tl.zeros((SYNC, BLOCK_N // SYNC, BLOCK_M), dtype=tl.float32)
        x_rows = x_ptr + offs_m[None, :] * sx_m
    elif TRANS:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        x_rows = x_ptr + offs_m[None, :] * sx_m
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_rows = x_ptr + offs_m[:, None] * sx_m
    if PRE_S:  # the scales one K step ahead (loaded into registers while the step before runs)
        g_next = group_of(k_begin, group_size, GS_LOG2)
        s_next = _scales(s_ptr, g_next, offs_c, mask_c, ss_g)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if PRE_S:
            g, s = g_next, s_next
            g_next = group_of(tl.minimum(k0 + BLOCK_K, k_end - 1), group_size, GS_LOG2)
            s_next = _scales(s_ptr, g_next, offs_c, mask_c, ss_g)
        else:
            g = group_of(k0, group_size, GS_LOG2)
        words, wv, z, s_step = _step_words(qw_ptr, qz_ptr, s_ptr, k0, k_end, g, offs_w, offs_c, mask_c, sq_k,
                                           sz_g, ss_g, BITS, ZEROS_V1, EVEN_K, TRANS, PRE_S, SYNC if SLICED else 0)
        if not PRE_S:
            s = s_step
        if PAIRS:
            acc = _dot_pairs(acc, x_rows, mask_m, k0, words, wv, z, s, offs_w, WP, BKW, SCALE_W, ASM, TRANS)
        elif FIELD_DOTS:
            acc = _dot_fields(acc, x_rows, mask_m, k0, words, wv, z, s, offs_w, BITS, WP, BKW, SCALE_W, TRANS, BYTES,
                              ASM, k_end, EVEN_K, BYTE_DOTS, SYNC, SLICED)
        else:
            acc = _dot_tile(acc, x_rows, mask_m, k0, k_end, words, z, s, BITS, WP, BKW, EVEN_K, F32, DOT_F32, TRANS)
    if SYNC:
        acc = tl.trans(tl.reshape(acc, (BLOCK_N, BLOCK_M)))
    elif TRANS:
        acc = tl.trans(acc)
    _epilogue(acc, y_ptr, ws_ptr, lock_ptr, pid, pid_k, offs_m, offs_n, M, N, sy_m, n_split,
              bias_ptr, hp_ptr, lb_ptr, slot_ptr, rank_ptr, scal_ptr, NR, n_lsplit, c1, c2, c3, SPLIT, HAS_BIAS,
              LORA_S, LORA_R, LORA_RP, LORA_NSH, LORA_JB, BLOCK_M, BLOCK_N, F32 or DOT_F32, GATED, act_s, ACT,
              LIBDEVICE)
