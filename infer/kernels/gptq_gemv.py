"""The CUDA-core GPTQ matmul kernels (`gemv`, for M = 1, and `gemv` over a few rows) that `gptq_gemm` launches;
the shared K-step helpers and the layout (`WP`) are described in `gptq_kernels`."""

from __future__ import annotations

import triton
import triton.language as tl

from .gptq_kernels import LORA_INTS, _epilogue, _fields, _pdl_start, _step_words, _xrow0, gated_cols, group_of


@triton.jit
def _gemv_step(acc, x_row, k0, words, wv, z, s, offs_w, BITS: tl.constexpr, WP: tl.constexpr, BKW: tl.constexpr,
               F32: tl.constexpr, FIELD_LOOP: tl.constexpr):
    """acc [BKW, BLOCK_N] += one K step of x_row (a pointer to one activation row) times the step's weights."""
    PACK: tl.constexpr = 32 // BITS
    XS: tl.constexpr = PACK if WP == 1 else 1
    if FIELD_LOOP:
        part = tl.zeros(acc.shape, dtype=tl.float32)
        zf = (z | 0x4B000000).to(tl.float32, bitcast=True)[None, :]  # 2^23 + z, without a conversion
        if BKW == WP:  # field j's rows: a constant offset of the step's base pointer
            x_step = x_row + k0 + offs_w
        for j in tl.static_range(PACK):
            xp = x_step + j * WP if BKW == WP else x_row + _xrow0(k0, j, WP, PACK, BKW) + offs_w * XS
            xj = tl.load(xp, mask=wv, other=0.0).to(tl.float32)
            qj = ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x4B000000
            part += xj[:, None] * (qj.to(tl.float32, bitcast=True) - zf)
        acc += part * s.to(tl.float32)[None, :]
    else:
        xk = _xrow0(k0, tl.arange(0, PACK)[:, None], WP, PACK, BKW) + offs_w[None, :] * XS  # [PACK, BKW]
        xv = tl.load(x_row + xk, mask=wv[None, :], other=0.0).to(tl.float32)
        q = _fields(words, BITS)
        if F32:
            w = ((q - z[None, None, :]).to(tl.float16) * s[None, None, :]).to(tl.float32)
            acc += tl.sum(xv[:, :, None] * w, axis=0)
        else:
            zm = (z | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + z, as the fields are 2^23 + q
            v = (q | 0x4B000000).to(tl.float32, bitcast=True) - zm[None, None, :]
            acc += tl.sum(xv[:, :, None] * v, axis=0) * s.to(tl.float32)[None, :]
    return acc


# `_mantissa` on a GPU (a module constant: tests/test_ptx_fields.py runs it through a PTX emulator)
MANTISSA_PTX = tl.constexpr("lop3.b32 $0, $1, $2, 0x4B000000, 0xEA;")
MANTISSA_CONSTRAINTS = tl.constexpr("=r,r,r")


@triton.jit
def _mantissa(a, b, ASM: tl.constexpr):
    """(a & b) | 0x4B000000 (the bits of a under mask b in the mantissa of 2^23), as one lop3 instruction when
    compiled for a GPU (ptxas emits two when both constants are immediates); plain Triton in the interpreter."""
    if ASM:
        out = tl.inline_asm_elementwise(MANTISSA_PTX, MANTISSA_CONSTRAINTS, [a, tl.full(a.shape, b, tl.int32)],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = (a & b) | 0x4B000000
    return out


@triton.jit
def _gemv_step_inplace(acc, x_row, k0, words, wv, z, s, offs_w, BITS: tl.constexpr, WP: tl.constexpr,
                       BKW: tl.constexpr, ASM: tl.constexpr):
    """`_gemv_step` with one integer instruction per weight: field j is OR-ed into the mantissa of 2^23 where it
    lies (bits j * BITS up), giving the float 2^23 + q * 2^(j * BITS); one fused multiply-add by 2^-(j * BITS)
    minus (2^(23 - j * BITS) + z) turns it into the exact q - z, and the fields above bit 23 are shifted down once
    per word. Layout of the words' tile throughout (x loaded per field along the words' rows)."""
    PACK: tl.constexpr = 32 // BITS
    LOW: tl.constexpr = 23 // BITS  # fields 0 .. LOW-1 lie below the exponent
    XS: tl.constexpr = PACK if WP == 1 else 1
    MASK: tl.constexpr = (1 << BITS) - 1
    part = tl.zeros(acc.shape, dtype=tl.float32)
    zm = (z | 0x4B000000).to(tl.float32, bitcast=True)[None, :]  # 2^23 + z by a logic operation, not a conversion
    high = words >> (LOW * BITS)
    if BKW == WP:  # field j's rows: the step's first field's + j * WP, a constant offset of one base pointer
        x_step = x_row + k0 + offs_w
    for j in tl.static_range(PACK):
        xp = x_step + j * WP if BKW == WP else x_row + _xrow0(k0, j, WP, PACK, BKW) + offs_w * XS
        xj = tl.load(xp, mask=wv, other=0.0).to(tl.float32)
        at = j * BITS if j < LOW else (j - LOW) * BITS
        src = words if j < LOW else high
        v = _mantissa(src, MASK << at, ASM).to(tl.float32, bitcast=True)
        q = v * (1.0 / (1 << at)) - (zm + ((1 << (23 - at)) - (1 << 23)))  # 2^(23 - at) + z, exact
        part += xj[:, None] * q
    acc += part * s.to(tl.float32)[None, :]
    return acc


@triton.jit(do_not_specialize=LORA_INTS)
def gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_SPLIT, n_split, group_size,
                sx_m, sq_k, sz_g, ss_g, sy_m,
                bias_ptr, hp_ptr, lb_ptr, slot_ptr, rank_ptr, scal_ptr, NR, n_lsplit, c1, c2, c3,
                BITS: tl.constexpr, ZEROS_V1: tl.constexpr, F32: tl.constexpr, WP: tl.constexpr, EVEN_K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, FIELD_LOOP: tl.constexpr = False,
                INPLACE: tl.constexpr = False, ASM: tl.constexpr = True, HAS_BIAS: tl.constexpr = False,
                LORA_S: tl.constexpr = 0, LORA_R: tl.constexpr = 0, LORA_RP: tl.constexpr = 1,
                LORA_NSH: tl.constexpr = 1, LORA_JB: tl.constexpr = 16, PDL: tl.constexpr = False,
                PREFETCH: tl.constexpr = 2, GATED: tl.constexpr = 0, AHEAD: tl.constexpr = False,
                GS_LOG2: tl.constexpr = -1, act_s=(0.0,) * 4, ACT: tl.constexpr = 0, LIBDEVICE: tl.constexpr = True):
    """M = 1 on CUDA cores: fields become floats by OR-ing them into the mantissa of 2^23 (the float 2^23 + q),
    x * (q - z) accumulates in a [BLOCK_K / pack, BLOCK_N] float32 tile reduced once at the end, and the group's
    scale multiplies the step's partial sum, not every weight. FIELD_LOOP: field by field, x loaded per field.
    INPLACE: `_gemv_step_inplace` (fields in place, one lop3 each; ASM: the lop3 as inline PTX, off in the
    interpreter, which cannot run PTX). AHEAD: each step's words, zeros and scales are loaded into registers during
    the step before (the last step loads its own again, unused), so that a program has two steps' weights in
    flight where it would wait for each step's (without pipeline stages nothing else overlaps them)."""
    BKW: tl.constexpr = BLOCK_K // (32 // BITS)
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n, mask_n = gated_cols(pid_n, N, BLOCK_N, GATED)
    offs_w = tl.arange(0, BKW)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    _pdl_start(qw_ptr, qz_ptr, s_ptr, k_begin, k_end, group_size, tl.min(offs_n, 0), N, sq_k, sz_g, ss_g, BITS, BKW,
               BLOCK_N, PDL, PREFETCH, GS_LOG2)
    acc = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
    if AHEAD:
        words_n, wv_n, z_n, s_n = _step_words(qw_ptr, qz_ptr, s_ptr, k_begin, k_end,
                                              group_of(k_begin, group_size, GS_LOG2), offs_w, offs_n, mask_n, sq_k,
                                              sz_g, ss_g, BITS, ZEROS_V1, EVEN_K, False)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if AHEAD:
            words, wv, z, s = words_n, wv_n, z_n, s_n
            k1 = tl.where(k0 + BLOCK_K < k_end, k0 + BLOCK_K, k0)
            words_n, wv_n, z_n, s_n = _step_words(qw_ptr, qz_ptr, s_ptr, k1, k_end, group_of(k1, group_size, GS_LOG2),
                                                  offs_w, offs_n, mask_n, sq_k, sz_g, ss_g, BITS, ZEROS_V1, EVEN_K,
                                                  False)
        else:
            words, wv, z, s = _step_words(qw_ptr, qz_ptr, s_ptr, k0, k_end, group_of(k0, group_size, GS_LOG2), offs_w,
                                          offs_n, mask_n, sq_k, sz_g, ss_g, BITS, ZEROS_V1, EVEN_K, False)
        if INPLACE:
            acc = _gemv_step_inplace(acc, x_ptr + pid_m * sx_m, k0, words, wv, z, s, offs_w, BITS, WP, BKW, ASM)
        else:
            acc = _gemv_step(acc, x_ptr + pid_m * sx_m, k0, words, wv, z, s, offs_w, BITS, WP, BKW, F32, FIELD_LOOP)
    out = tl.sum(acc, axis=0)[None, :]
    offs_m = pid_m + tl.zeros((1,), dtype=tl.int32)
    _epilogue(out, y_ptr, ws_ptr, lock_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, offs_m, offs_n, M, N, sy_m,
              n_split, bias_ptr, hp_ptr, lb_ptr, slot_ptr, rank_ptr, scal_ptr, NR, n_lsplit, c1, c2, c3, SPLIT,
              HAS_BIAS, LORA_S, LORA_R, LORA_RP, LORA_NSH, LORA_JB, 1, BLOCK_N, F32, GATED, act_s, ACT, LIBDEVICE)


@triton.jit(do_not_specialize=LORA_INTS)
def gemv_rows_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_SPLIT, n_split, group_size,
                     sx_m, sq_k, sz_g, ss_g, sy_m,
                     bias_ptr, hp_ptr, lb_ptr, slot_ptr, rank_ptr, scal_ptr, NR, n_lsplit, c1, c2, c3,
                     BITS: tl.constexpr, ZEROS_V1: tl.constexpr, F32: tl.constexpr, WP: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr = False, LORA_S: tl.constexpr = 0, LORA_R: tl.constexpr = 0,
                     LORA_RP: tl.constexpr = 1, LORA_NSH: tl.constexpr = 1, LORA_JB: tl.constexpr = 16,
                     PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 2, GATED: tl.constexpr = 0,
                     GS_LOG2: tl.constexpr = -1, act_s=(0.0,) * 4, ACT: tl.constexpr = 0,
                     LIBDEVICE: tl.constexpr = True):
    """`gemv` for BLOCK_M rows at once: each weight is loaded and unpacked once and used for every row."""
    PACK: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PACK
    XS: tl.constexpr = PACK if WP == 1 else 1
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n, mask_n = gated_cols(pid_n, N, BLOCK_N, GATED)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_w = tl.arange(0, BKW)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    _pdl_start(qw_ptr, qz_ptr, s_ptr, k_begin, k_end, group_size, tl.min(offs_n, 0), N, sq_k, sz_g, ss_g, BITS, BKW,
               BLOCK_N, PDL, PREFETCH, GS_LOG2)
    acc = tl.zeros((BLOCK_M, BKW, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        words, wv, z, s = _step_words(qw_ptr, qz_ptr, s_ptr, k0, k_end, group_of(k0, group_size, GS_LOG2), offs_w,
                                      offs_n, mask_n, sq_k, sz_g, ss_g, BITS, ZEROS_V1, EVEN_K, False)
        xk = _xrow0(k0, tl.arange(0, PACK)[:, None], WP, PACK, BKW) + offs_w[None, :] * XS  # [PACK, BKW]
        xv = tl.load(x_ptr + offs_m[:, None, None] * sx_m + xk[None, :, :],
                     mask=mask_m[:, None, None] & wv[None, None, :], other=0.0).to(tl.float32)
        q = _fields(words, BITS)
        if F32:
            w = ((q - z[None, None, :]).to(tl.float16) * s[None, None, :]).to(tl.float32)
            acc += tl.sum(xv[:, :, :, None] * w[None, :, :, :], axis=1)
        else:
            zm = (z | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + z, as the fields are 2^23 + q
            v = (q | 0x4B000000).to(tl.float32, bitcast=True) - zm[None, None, :]
            acc += tl.sum(xv[:, :, :, None] * v[None, :, :, :], axis=1) * s.to(tl.float32)[None, None, :]
    out = tl.sum(acc, axis=1)
    _epilogue(out, y_ptr, ws_ptr, lock_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, offs_m, offs_n, M, N, sy_m,
              n_split, bias_ptr, hp_ptr, lb_ptr, slot_ptr, rank_ptr, scal_ptr, NR, n_lsplit, c1, c2, c3, SPLIT,
              HAS_BIAS, LORA_S, LORA_R, LORA_RP, LORA_NSH, LORA_JB, BLOCK_M, BLOCK_N, F32, GATED, act_s, ACT,
              LIBDEVICE)
