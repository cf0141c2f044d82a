"""The tensor-core GPTQ matmul kernel (W4A16 / W8A16: `mma`, and `mmat` as its TRANS variant) and the K-step helpers every kernel shares;
`gptq_gemm` launches them (its docstring says when), the CUDA-core `gemv` kernels are in `gptq_gemv`.

Every kernel reads a K step of BLOCK_K input rows as BLOCK_K / pack int32 words per column and splits the words
into their `pack` fields with shifts. `WP` is the weight's interleave (`packing.field_rows`): 1 for GPTQ order,
where field j of word i is row i * pack + j, so a field's x values lie `pack` apart; WP words per block after the
load-time repack, where field j of a block's words covers WP consecutive rows and x is read contiguously (the
kernels require BLOCK_K <= WP * pack then). The x row of field j of the step's word i is
`_xrow0(k0, j) + i * XS` either way.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _zeros_scales(qz_ptr, s_ptr, g, offs_n, mask_n, sz_g, ss_g, BITS: tl.constexpr, ZEROS_V1: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    zw = tl.load(qz_ptr + g * sz_g + offs_n // PACK, mask=mask_n, other=0)
    z = (zw >> ((offs_n % PACK) * BITS)) & MASK
    if ZEROS_V1:
        z = (z + 1) & MASK
    s = tl.load(s_ptr + g * ss_g + offs_n, mask=mask_n, other=0.0)
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
def _field_f16(words, j, zf, BITS: tl.constexpr):
    """Field j of every word as the exact fp16 q - z: OR-ing q into the mantissa of 1024 gives the fp16 1024 + q
    without a conversion instruction; zf is 1024 + z in fp16."""
    qj = ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x6400
    return qj.to(tl.int16).to(tl.float16, bitcast=True) - zf


@triton.jit
def _epilogue(acc, y_ptr, ws_ptr, lock_ptr, tile, pid_k, offs_m, offs_n, M, N, sy_m, n_split,
              SPLIT: tl.constexpr):
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * sy_m + offs_n[None, :]
    if not SPLIT:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves (release below)
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if arrived == n_split - 1:
            total = tl.zeros_like(acc)
            for s in range(n_split):
                total += tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def _step_words(qw_ptr, qz_ptr, s_ptr, k0, k_end, group_size, offs_w, offs_n, mask_n, sq_k, sz_g, ss_g,
                BITS: tl.constexpr, ZEROS_V1: tl.constexpr, EVEN_K: tl.constexpr, TRANS: tl.constexpr):
    """One K step's packed words ([BKW, BLOCK_N], or [BLOCK_N, BKW] with TRANS; coalesced along N, read once),
    which of them lie in range, and the step's group zeros and scales."""
    PACK: tl.constexpr = 32 // BITS
    wrow = k0 // PACK + offs_w
    wv = _kmask(wrow, k_end, PACK, EVEN_K)
    if TRANS:
        words = tl.load(qw_ptr + wrow[None, :] * sq_k + offs_n[:, None], mask=wv[None, :] & mask_n[:, None], other=0,
                        eviction_policy="evict_first")
    else:
        words = tl.load(qw_ptr + wrow[:, None] * sq_k + offs_n[None, :], mask=wv[:, None] & mask_n[None, :], other=0,
                        eviction_policy="evict_first")
    z, s = _zeros_scales(qz_ptr, s_ptr, k0 // group_size, offs_n, mask_n, sz_g, ss_g, BITS, ZEROS_V1)
    return words, wv, z, s


@triton.jit
def _dot_fields(acc, x_rows, mask_m, k0, words, wv, z, s, offs_w, BITS: tl.constexpr, WP: tl.constexpr,
                BKW: tl.constexpr, SCALE_W: tl.constexpr, TRANS: tl.constexpr):
    """acc += one K step as one tensor-core dot per packed field, each field tile straight from the loaded words'
    registers. x_rows: pointers to the rows' first element ([BLOCK_M, 1], or [1, BLOCK_M] with TRANS: acc is then
    y^T and the weight the first operand). The group's scale multiplies the step's sum, or with SCALE_W the weights
    themselves ((q - z) * s rounded to fp16, as the reference computes; one accumulator instead of two)."""
    PACK: tl.constexpr = 32 // BITS
    XS: tl.constexpr = PACK if WP == 1 else 1
    part = tl.zeros(acc.shape, dtype=tl.float32)
    zf = (z + 1024).to(tl.float16)[:, None] if TRANS else (z + 1024).to(tl.float16)[None, :]
    sw = s[:, None] if TRANS else s[None, :]
    for j in tl.static_range(PACK):
        ks = _xrow0(k0, j, WP, PACK, BKW) + offs_w * XS
        wj = _field_f16(words, j, zf, BITS)
        if SCALE_W:
            wj = wj * sw
        if TRANS:
            xj = tl.load(x_rows + ks[:, None], mask=mask_m[None, :] & wv[:, None], other=0.0)
            d = tl.dot(wj.to(xj.dtype), xj)
        else:
            xj = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & wv[None, :], other=0.0)
            d = tl.dot(xj, wj.to(xj.dtype))
        if SCALE_W:
            acc += d
        else:
            part += d
    if not SCALE_W:
        acc += part * sw.to(tl.float32)
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


@triton.jit
def mma_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_SPLIT, n_split, group_size,
               sx_m, sq_k, sz_g, ss_g, sy_m,
               BITS: tl.constexpr, ZEROS_V1: tl.constexpr, F32: tl.constexpr, DOT_F32: tl.constexpr,
               WP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, GROUP_M: tl.constexpr, FIELD_DOTS: tl.constexpr = False,
               SCALE_W: tl.constexpr = False, TRANS: tl.constexpr = False):
    """Tensor cores (tl.dot), y tile [BLOCK_M, BLOCK_N]: one dot per packed field (FIELD_DOTS, `_dot_fields`) or
    one dot over the reshaped tile (`_dot_tile`). TRANS (`mmat`) computes y^T = W^T x^T, so the dequantized weight
    is the first (register) operand of the tensor-core instruction and the activation rows the second (as Machete
    does); BLOCK_N is then the instruction's M side. Grouped tile order: GROUP_M row tiles walk the same column
    tiles (L2 reuse)."""
    BKW: tl.constexpr = BLOCK_K // (32 // BITS)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_in_group
    pid_n = (pid % width) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    offs_w = tl.arange(0, BKW)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    if TRANS:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        x_rows = x_ptr + offs_m[None, :] * sx_m
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_rows = x_ptr + offs_m[:, None] * sx_m
    for k0 in range(k_begin, k_end, BLOCK_K):
        words, wv, z, s = _step_words(qw_ptr, qz_ptr, s_ptr, k0, k_end, group_size, offs_w, offs_n, mask_n, sq_k,
                                      sz_g, ss_g, BITS, ZEROS_V1, EVEN_K, TRANS)
        if FIELD_DOTS:
            acc = _dot_fields(acc, x_rows, mask_m, k0, words, wv, z, s, offs_w, BITS, WP, BKW, SCALE_W, TRANS)
        else:
            acc = _dot_tile(acc, x_rows, mask_m, k0, k_end, words, z, s, BITS, WP, BKW, EVEN_K, F32, DOT_F32, TRANS)
    if TRANS:
        acc = tl.trans(acc)
    _epilogue(acc, y_ptr, ws_ptr, lock_ptr, pid, pid_k, offs_m, offs_n, M, N, sy_m, n_split, SPLIT)
