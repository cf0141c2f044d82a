"""Triton versions of the small per-token ops: rms_norm (+ residual add, + the LoRA delta of the o or down
projection before it; or of the tokens' embedding rows, gathered: embed_rms_norm), rotary embedding (alone, or with
k and v written straight into the KV cache: rotary_store_kv), silu_and_mul (+ the gate_up layer's LoRA delta),
store_kv. Each kernel's PDL constexpr: launched with programmatic dependent launch (`pdl`).

Same signatures and semantics as their references in `reference.py`: like them, every op returns new tensors
(inputs are never modified) except store_kv and rotary_store_kv, which write into the caches. One program per token
(row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra import libdevice

from . import fp8, pdl
from .intmath import cdiv, next_power_of_2


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as [rows, width] with unit stride along the last dim (a view when possible)."""
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# ----------------------------------------------------------------------------------------------- rms_norm
LORA_ROW_TILE = 65536  # rms_norm with a LoRA delta: B^T elements per tile [rank rows, the row's columns]


@triton.jit
def _norm_row(x, row, offs, mask, res_ptr, w_ptr, y_ptr, h_ptr, n, eps, s_r, s_y, s_h, HAS_RES: tl.constexpr,
              UNIT: tl.constexpr = False, F32W: tl.constexpr = False):
    """The row x (+ the residual, stored as the next residual) normalized and weighted into y (UNIT: Gemma's
    weighting by 1 + w, in float32 with the normalized row, rounded once; F32W: OLMo's weighting by w, likewise in
    float32 with the normalized row, rounded once)."""
    if HAS_RES:
        # in h's dtype (x's and the residual's promoted), as the reference: added in float32 and rounded once (the
        # same bits; also right under TRITON_INTERPRET, whose bf16 arithmetic adds the raw bits)
        r = tl.load(res_ptr + row * s_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * s_h + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    yt = y_ptr.dtype.element_ty
    if UNIT:
        y = (xf * inv * (1.0 + w.to(tl.float32))).to(yt)
    elif F32W:
        y = (xf * inv * w.to(tl.float32)).to(yt)
    else:
        y = (xf * inv).to(x.dtype)
        y = (w.to(yt).to(tl.float32) * y.to(yt).to(tl.float32)).to(yt)  # (in float32, rounded once: as above)
    tl.store(y_ptr + row * s_y + offs, y, mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, n, eps, s_x, s_r, s_y, s_h,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                     UNIT: tl.constexpr = False, F32W: tl.constexpr = False):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
    _norm_row(x, row, offs, mask, res_ptr, w_ptr, y_ptr, h_ptr, n, eps, s_r, s_y, s_h, HAS_RES, UNIT, F32W)


@triton.jit
def _embed_rms_norm_kernel(ids_ptr, t_ptr, w_ptr, y_ptr, h_ptr, n, eps, s_t, s_y, s_h, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False):
    """The token's embedding row (table row ids[row]) stored as h, and normed into y."""
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tok = tl.load(ids_ptr + row).to(tl.int64)
    x = tl.load(t_ptr + tok * s_t + offs, mask=mask, other=0.0)
    tl.store(h_ptr + row * s_h + offs, x, mask=mask)
    _norm_row(x, row, offs, mask, h_ptr, w_ptr, y_ptr, h_ptr, n, eps, 0, s_y, s_h, False)


@triton.jit
def gate_act(g, GELU: tl.constexpr):
    """The gated MLP's activation of gate values g (float32), in float32, for the caller to round to its dtype as
    torch's F.silu / F.gelu(approximate="tanh") round: silu, or with GELU gelu's tanh approximation (Gemma's GeGLU),
    torch's 0.5 g (1 + tanh(u)) with tanh(|u|) = 1 - 2 / (exp(2|u|) + 1) (Triton has no tanh): torch's bits but for
    ~0.1% of float16 / bfloat16 values an ulp apart (the identity g - g / (1 + exp(2u)) cancels for negative g: 3%
    were). Shared by silu_and_mul's kernel, the int4 gate_up epilogue (gptq_kernels._finish) and `up_act`."""
    if GELU:
        u = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        t = 1.0 - 2.0 / (tl.exp(2.0 * tl.abs(u)) + 1.0)
        return 0.5 * g * (1.0 + tl.where(u < 0, -t, t))
    return g / (1.0 + tl.exp(-g))


UNGATED_ACTS = {"gelu_tanh": 1, "relu2": 2, "xielu": 3}  # an MLP without gate's activation: the kernels' ACT constexpr


@triton.jit
def _expm1(x, LIBDEVICE: tl.constexpr):
    """exp(x) - 1 in float32: libdevice's expm1f on a GPU (torch's CUDA expm1 of a float: the same bits); under
    TRITON_INTERPRET (no libdevice) Kahan's u = exp(x), (u - 1) x / log(u) in float64, rounded once to float32 (in
    float32 it lands an ulp off torch's now and then, enough to round float16 the other way)."""
    if LIBDEVICE:
        return libdevice.expm1(x)
    w = x.to(tl.float64)
    u = tl.exp(w)
    d = u - 1.0
    return tl.where(u == 1.0, w, tl.where(d == -1.0, -1.0, d * w / tl.log(u))).to(tl.float32)


@triton.jit
def up_act(x, s, ACT: tl.constexpr, LIBDEVICE: tl.constexpr):
    """An MLP without gate's activation of x (in its dtype), in x's dtype, each op in float32 rounded to that dtype
    where torch's op rounds (models.llama.UngatedMLP; reference.ungated_act): ACT 1 gelu's tanh approximation
    (StarCoder2's: `gate_act`, rounded once), 2 relu(x)² (Arcee's, Nemotron's: the square rounded once), 3 xIELU
    (Apertus's, as models.llama.XIELU's ops) of the four scalars s = (softplus(alpha_p), beta + softplus(alpha_n),
    beta, eps), each already rounded to x's dtype. Shared by `ungated_act`'s kernel and the int4 up_proj / c_fc
    epilogue (gptq_kernels._finish)."""
    dt = x.dtype
    v = x.to(tl.float32)
    if ACT == 1:
        if LIBDEVICE:  # torch's CUDA formula and order, its tanhf: the same bits as F.gelu(approximate="tanh")
            inner = 0.7978845608028654 * (v + 0.044715 * (v * v * v))
            y = (0.5 * v * (1.0 + libdevice.tanh(inner))).to(dt)
        else:  # (the interpreter has no tanh: `gate_act`'s, an ulp of x's dtype apart now and then)
            y = gate_act(v, True).to(dt)
    elif ACT == 2:
        r = tl.maximum(v, 0.0)
        y = (r * r).to(dt)
    else:
        bx = (s[2] * v).to(dt).to(tl.float32)
        pos = (s[0] * v).to(dt).to(tl.float32)
        pos = (pos * v).to(dt).to(tl.float32)
        pos = (pos + bx).to(dt)
        neg = _expm1(tl.minimum(v, s[3]), LIBDEVICE).to(dt).to(tl.float32)
        neg = (neg - v).to(dt).to(tl.float32)
        neg = (neg * s[1]).to(dt).to(tl.float32)
        neg = (neg + bx).to(dt)
        y = tl.where(v > 0, pos, neg)
    return y


@triton.jit
def _ungated_act_kernel(x_ptr, n, s, BLOCK: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl.start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(x_ptr + offs, up_act(x, s, ACT, LIBDEVICE), mask=mask)


def ungated_act(x: torch.Tensor, act: str, scalars=None, compile_only: bool = False) -> torch.Tensor:
    """Triton version of reference.ungated_act, in place (x is the up projection's own output): one launch where
    torch takes two (relu2: relu_, square_) or a dozen (xIELU). scalars: xIELU's (`up_act`), Python floats."""
    code = UNGATED_ACTS[act]
    s = tuple(float(v) for v in scalars) if code == 3 else (0.0, 0.0, 0.0, 0.0)
    if not x.is_contiguous():
        raise ValueError("ungated_act works in place on a contiguous tensor (an up projection's output)")
    n = x.numel()
    if not n and not compile_only:
        return x
    block = 1024
    grid = (max(1, cdiv(n, block)),)
    run = _ungated_act_kernel.warmup if compile_only else _ungated_act_kernel[grid]
    run(x, n, s, BLOCK=block, ACT=code, LIBDEVICE=libdevice_on(), PDL=pdl.on(x.device), **pdl.launch(x.device),
        **({"grid": grid} if compile_only else {}))
    return x


def libdevice_on() -> bool:
    """Whether kernels may call libdevice (compiled for a GPU; not under TRITON_INTERPRET, which has none)."""
    import os
    return os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit(do_not_specialize=["sh_p"])  # (T * R: its divisibility by 16 follows T's parity at small ranks)
def _rms_norm_lora_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, n, eps, s_x, s_r, s_y, s_h,
                          hp_ptr, lb_ptr, slot_ptr, rank_ptr, scal_ptr, S, R, sh_p, sh_t, sr_s, sc_s,
                          HAS_RES: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, CHUNK_R: tl.constexpr,
                          S_P2: tl.constexpr, PDL: tl.constexpr = False, UNIT: tl.constexpr = False,
                          F32W: tl.constexpr = False):
    """_rms_norm_kernel after adding the one-shard layer's adapter delta (a LoRADelta by token of the layer whose
    output x is: hp [SPLIT, T, R], B^T [S, R, n]) to the row, rounded to x's dtype as the layer's expand leaves it,
    so that the expand needs no launch of its own. B^T's rows of the row's slot are read CHUNK_R at a time, as many
    as its adapter's rank (a [CHUNK_R, BLOCK] tile: the whole row's columns, as the norm needs them all; unrolled
    over the slots' padded rank, the tiles of every chunk would be requested at once and spill)."""
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
    # the row's slot, and every slot's rank and scaling (picked by the slot after), requested beside x: B's tiles
    # then wait for one round trip only
    slot = tl.load(slot_ptr + row).to(tl.int32)
    s = tl.arange(0, S_P2)
    ranks = tl.load(rank_ptr + s * sr_s, mask=s < S, other=0)
    scals = tl.load(scal_ptr + s * sc_s, mask=s < S, other=0.0)
    if slot >= 0:
        pick = s == slot
        rank = tl.sum(tl.where(pick, ranks, 0), 0)
        b = lb_ptr + slot.to(tl.int64) * R * n
        p = tl.arange(0, SPLIT)[:, None]
        d = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(0, rank, CHUNK_R):
            r = c + tl.arange(0, CHUNK_R)
            h = tl.sum(tl.load(hp_ptr + p * sh_p + row * sh_t + r[None, :], mask=r[None, :] < rank, other=0.0), 0)
            bb = tl.load(b + r[:, None] * n + offs[None, :], mask=(r[:, None] < rank) & mask[None, :], other=0.0)
            d += tl.sum(h[:, None] * bb.to(tl.float32), 0)
        x = (x.to(tl.float32) + d * tl.sum(tl.where(pick, scals, 0.0), 0)).to(x.dtype)
    _norm_row(x, row, offs, mask, res_ptr, w_ptr, y_ptr, h_ptr, n, eps, s_r, s_y, s_h, HAS_RES, UNIT, F32W)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, lora=None,
             compile_only: bool = False, unit_offset: bool = False, float_weight: bool = False):
    """Triton version of reference.rms_norm: y, or (y, x + residual) when residual is given; with `lora` (the
    `lora_reference.LoRADelta` by token of the one-shard layer whose output x is: o_proj, down_proj) added to x
    first. compile_only: compile the kernel this call would launch, launch nothing (y and h are then unwritten)."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    y2 = y.view(-1, n)
    if residual is not None:
        r2 = _rows(residual, n)
        h = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    else:
        r2, h = x2, y
    h2 = h.view(-1, n)
    out = y if residual is None else (y, h)
    rows, block = x2.shape[0], next_power_of_2(n)
    if not rows:
        return out
    args = [x2, r2, weight.contiguous(), y2, h2, n, float(eps), x2.stride(0), r2.stride(0), y2.stride(0),
            h2.stride(0)]
    consts = dict(HAS_RES=residual is not None, BLOCK=block, PDL=pdl.on(x.device), **pdl.launch(x.device))
    if unit_offset:  # (Gemma's norm: a variant of its own; the others' compiled as before)
        consts["UNIT"] = True
    if float_weight:  # (OLMo's norm: likewise)
        consts["F32W"] = True
    if lora is None:
        _rms_norm_kernel[(rows,)](*args, num_warps=max(1, min(16, block // 512)), **consts)
        return out
    if list(lora.bounds) != [0, n]:
        raise ValueError(f"rms_norm adds the delta of a one-shard layer of width {n}, not of bounds "
                         f"{list(lora.bounds)}")
    split, t, rank = lora.hp.shape
    if t != rows:
        raise ValueError(f"rms_norm: the LoRA delta has {t} rows, x has {rows}")
    num_slots = lora.scalings.shape[1]
    run = _rms_norm_lora_kernel.warmup if compile_only else _rms_norm_lora_kernel[(rows,)]
    run(*args, lora.hp, lora.lora_b, lora.token_slots, lora.ranks, lora.scalings, num_slots, rank,
        lora.hp.stride(0), lora.hp.stride(1), lora.ranks.stride(1), lora.scalings.stride(1), SPLIT=split,
        CHUNK_R=max(1, min(next_power_of_2(rank), LORA_ROW_TILE // block)),
        S_P2=max(2, next_power_of_2(num_slots)), num_warps=16, **consts,
        **({"grid": (rows,)} if compile_only else {}))
    return out


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float):
    """Triton version of reference.embed_rms_norm: (the norm of the tokens' embedding rows, those rows), in one
    launch instead of a gather and a norm (ids [T] int32/int64, table [V, hidden] with unit stride along hidden)."""
    n = table.shape[-1]
    t = ids.shape[0]
    h = torch.empty(t, n, dtype=table.dtype, device=table.device)
    y = torch.empty(t, n, dtype=torch.promote_types(weight.dtype, table.dtype), device=table.device)
    if t:
        block = next_power_of_2(n)
        _embed_rms_norm_kernel[(t,)](ids, table, weight.contiguous(), y, h, n, float(eps), table.stride(0),
                                     y.stride(0), h.stride(0), BLOCK=block, num_warps=max(1, min(16, block // 512)),
                                     PDL=pdl.on(table.device), **pdl.launch(table.device))
    return y, h


# ----------------------------------------------------------------------------------------------- layer_norm
@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, n, eps, s_x, s_y, W_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One row normed over its n columns (mean subtracted), weighted by weight row (row % W_ROWS), in float32."""
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    xf = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.where(mask, xf - tl.sum(xf, 0) / n, 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(d * d, 0) / n + eps)
    wrow = (row % W_ROWS) * n
    y = d * inv * tl.load(w_ptr + wrow + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + wrow + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None):
    """Triton version of reference.layer_norm (weight [n], or [H, n] for x [..., H * n]: each head by its row)."""
    n = weight.shape[-1]
    x2 = _rows(x, n)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, block = x2.shape[0], next_power_of_2(n)
    if rows:
        w = weight.contiguous()
        _layer_norm_kernel[(rows,)](x2, w, w if bias is None else bias.contiguous(), y.view(-1, n), n, float(eps),
                                    x2.stride(0), n, W_ROWS=w.numel() // n, HAS_BIAS=bias is not None, BLOCK=block,
                                    num_warps=max(1, min(16, block // 512)), PDL=pdl.on(x.device),
                                    **pdl.launch(x.device))
    return y


# ----------------------------------------------------------------------------------------------- rotary
@triton.jit
def _rotate_heads(src, dst, cos, sin, heads, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_R: tl.constexpr, PASS: tl.constexpr, BLOCK_P: tl.constexpr, FP8: tl.constexpr = 0):
    """Rotate the `heads` heads of one row (src: its first element) into dst, rounded to src's dtype first (as the
    reference returns them), then stored in dst's (the KV cache's, when dst is a cache slot: FP8, fp8.to_cache)."""
    h = tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    mask = (h[:, None] < heads) & (r[None, :] < HALF)
    x_at = src + h[:, None] * HEAD_DIM + r[None, :]
    o_at = dst + h[:, None] * HEAD_DIM + r[None, :]
    x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_at, fp8.to_cache((x1 * cos[None, :] - x2 * sin[None, :]).to(src.dtype.element_ty), dst, FP8),
             mask=mask)
    tl.store(o_at + HALF, fp8.to_cache((x2 * cos[None, :] + x1 * sin[None, :]).to(src.dtype.element_ty), dst,
                                       FP8), mask=mask)
    if PASS > 0:  # dims past rot_dim pass through
        p = tl.arange(0, BLOCK_P)
        pmask = (h[:, None] < heads) & (p[None, :] < PASS)
        off = h[:, None] * HEAD_DIM + 2 * HALF + p[None, :]
        tl.store(dst + off, fp8.to_cache(tl.load(src + off, mask=pmask, other=0.0), dst, FP8), mask=pmask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, cache_ptr, s_q, s_k, s_qo, s_ko, s_c, hq, hk,
                   v_ptr, vc_ptr, slot_ptr, s_v, s_row, kv_width,
                   HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_R: tl.constexpr, PASS: tl.constexpr, BLOCK_P: tl.constexpr, KV: tl.constexpr = False,
                   BLOCK_KV: tl.constexpr = 16, PDL: tl.constexpr = False, FP8: tl.constexpr = 0):
    """One token: q rotated into qo; k rotated into ko, or with KV into the token's KV-cache slot (ko_ptr / vc_ptr:
    the caches as rows of kv_width = Hk * D elements, s_row apart), with v copied beside it (slot -1: no write;
    FP8: the caches' float8 format, fp8.code)."""
    pdl.start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    cos = tl.load(cache_ptr + pos * s_c + r, mask=r < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * s_c + HALF + r, mask=r < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + tok * s_q, qo_ptr + tok * s_qo, cos, sin, hq, HEAD_DIM, HALF, BLOCK_HQ, BLOCK_R, PASS,
                  BLOCK_P)
    if KV:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            _rotate_heads(k_ptr + tok * s_k, ko_ptr + slot * s_row, cos, sin, hk, HEAD_DIM, HALF, BLOCK_HK, BLOCK_R,
                          PASS, BLOCK_P, FP8)
            c = tl.arange(0, BLOCK_KV)
            val = tl.load(v_ptr + tok * s_v + c, mask=c < kv_width)
            tl.store(vc_ptr + slot * s_row + c, fp8.to_cache(val, vc_ptr, FP8), mask=c < kv_width)
    else:
        _rotate_heads(k_ptr + tok * s_k, ko_ptr + tok * s_ko, cos, sin, hk, HEAD_DIM, HALF, BLOCK_HK, BLOCK_R, PASS,
                      BLOCK_P)


def _rotary_args(q, k, cos_sin_cache, head_dim, t):
    q2, k2 = _rows(q, q.numel() // t), _rows(k, k.numel() // t)
    half = cos_sin_cache.shape[-1] // 2
    hq, hk = q2.shape[1] // head_dim, k2.shape[1] // head_dim
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    passthrough = head_dim - 2 * half
    consts = dict(HEAD_DIM=head_dim, HALF=half, BLOCK_HQ=next_power_of_2(hq),
                  BLOCK_HK=next_power_of_2(hk), BLOCK_R=next_power_of_2(max(half, 1)), PASS=passthrough,
                  BLOCK_P=next_power_of_2(max(passthrough, 1)), PDL=pdl.on(q.device), **pdl.launch(q.device))
    return q2, k2, hq, hk, cache, consts


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_dim: int):
    """Triton version of reference.rotary_embedding: returns new (q, k), NeoX-rotated by their positions."""
    t = q.shape[0]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    q2, k2, hq, hk, cache, consts = _rotary_args(q, k, cos_sin_cache, head_dim, t)
    qo, ko = q_out.view(t, -1), k_out.view(t, -1)
    _rotary_kernel[(t,)](positions, q2, k2, qo, ko, cache, q2.stride(0), k2.stride(0), qo.stride(0), ko.stride(0),
                         cache.stride(0), hq, hk, q2, qo, positions, 0, 0, 0, **consts)
    return q_out, k_out


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin_cache: torch.Tensor, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """Triton version of reference.rotary_store_kv: one launch rotates q (returned) and writes the rotated k and v
    straight into their KV-cache slots (two launches and a k round trip through memory fewer than rotary_embedding
    then store_kv). The caches must be contiguous [num_blocks, block_size, Hk, D]."""
    t = q.shape[0]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rotary_store_kv needs contiguous KV caches")
    q2, k2, hq, hk, cache, consts = _rotary_args(q, k, cos_sin_cache, head_dim, t)
    v2 = _rows(v, v.numel() // t)
    width = hk * head_dim
    if k_cache.shape[-2] * k_cache.shape[-1] != width or v2.shape[1] != width:
        raise ValueError(f"k/v of {hk} heads x {head_dim} do not match the cache's {tuple(k_cache.shape[-2:])}")
    qo = q_out.view(t, -1)
    _rotary_kernel[(t,)](positions, q2, k2, qo, k_cache, cache, q2.stride(0), k2.stride(0), qo.stride(0), 0,
                         cache.stride(0), hq, hk, v2, v_cache, slot_mapping, v2.stride(0), width, width, KV=True,
                         BLOCK_KV=next_power_of_2(width), FP8=fp8.code(k_cache.dtype), **consts)
    return q_out


# ----------------------------------------------------------------------------------------------- silu_and_mul
LORA_BLOCK = 256  # silu_and_mul with a LoRA delta: columns per program (B's tiles of both shards in registers)


@triton.jit
def _plus_delta(v, h, b_ptr, rank, scale, offs, mask, n, BLOCK_R: tl.constexpr):
    """v + scale * h @ B^T[:, offs] (h: the row's products with A, [BLOCK_R]; b_ptr: the slot's B^T [R, n] of this
    shard, rows past `rank` never read), in float32, rounded to v's dtype as the expand adds it."""
    r = tl.arange(0, BLOCK_R)
    bb = tl.load(b_ptr + r[:, None] * n + offs[None, :], mask=(r[:, None] < rank) & mask[None, :], other=0.0)
    d = tl.sum(tl.where(r < rank, h, 0.0)[:, None] * bb.to(tl.float32), 0) * scale
    return (v.to(tl.float32) + d).to(v.dtype)


@triton.jit(do_not_specialize=["sh_p"])  # (T * 2R: its divisibility by 16 follows T's parity at small ranks)
def _silu_and_mul_kernel(x_ptr, y_ptr, n, s_x, s_y, hp_ptr, lb_ptr, slot_ptr, rank_ptr, scal_ptr, S, R, sh_p, sh_t,
                         sr_i, sr_s, sc_i, sc_s, BLOCK: tl.constexpr, LORA: tl.constexpr = False,
                         SPLIT: tl.constexpr = 1, BLOCK_R: tl.constexpr = 16, S_P2: tl.constexpr = 2,
                         PDL: tl.constexpr = False, GELU: tl.constexpr = False):
    """GELU: gelu's tanh approximation in place of silu (gelu_tanh_and_mul: Gemma's GeGLU).
    With LORA: the gate_up layer's adapter delta (a LoRADelta by token: hp [SPLIT, T, 2R], B^T shard after shard)
    is added to the row's gate and up first, so that the layer's expand needs no launch of its own."""
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * s_x + n + offs, mask=mask, other=0.0)
    if LORA:
        # the row's slot, and both shards' ranks and scalings of every slot (picked by the slot after), requested
        # beside gate and up: B's tiles then wait for one round trip only
        slot = tl.load(slot_ptr + row).to(tl.int32)
        s = tl.arange(0, S_P2)
        rank_g = tl.load(rank_ptr + s * sr_s, mask=s < S, other=0)
        rank_u = tl.load(rank_ptr + sr_i + s * sr_s, mask=s < S, other=0)
        scal_g = tl.load(scal_ptr + s * sc_s, mask=s < S, other=0.0)
        scal_u = tl.load(scal_ptr + sc_i + s * sc_s, mask=s < S, other=0.0)
        if slot >= 0:
            pick = s == slot
            p = tl.arange(0, SPLIT)[:, None]
            r = tl.arange(0, BLOCK_R)[None, :]
            at = hp_ptr + p * sh_p + row * sh_t + r
            hg = tl.sum(tl.load(at, mask=r < R, other=0.0), 0)
            hu = tl.sum(tl.load(at + R, mask=r < R, other=0.0), 0)
            b_g = lb_ptr + slot.to(tl.int64) * R * n
            gate = _plus_delta(gate, hg, b_g, tl.sum(tl.where(pick, rank_g, 0), 0),
                               tl.sum(tl.where(pick, scal_g, 0.0), 0), offs, mask, n, BLOCK_R)
            up = _plus_delta(up, hu, b_g + tl.cast(S, tl.int64) * R * n, tl.sum(tl.where(pick, rank_u, 0), 0),
                             tl.sum(tl.where(pick, scal_u, 0.0), 0), offs, mask, n, BLOCK_R)
    act = gate_act(gate.to(tl.float32), GELU).to(gate.dtype)
    # the product in float32, rounded once: a product in x's dtype's bits, also under TRITON_INTERPRET (whose bf16
    # arithmetic is wrong: it multiplies the raw bits)
    tl.store(y_ptr + row * s_y + offs, (act.to(tl.float32) * up.to(tl.float32)).to(act.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, lora=None, compile_only: bool = False, gelu: bool = False) -> torch.Tensor:
    """Triton version of reference.silu_and_mul: silu(x[..., :n]) * x[..., n:], after adding `lora` (a gate_up
    layer's `lora_reference.LoRADelta`, by token) to x. compile_only: compile the kernel this call would launch
    (with `lora`), launch nothing (y is then unwritten). gelu: reference.gelu_tanh_and_mul instead."""
    act = {"GELU": True} if gelu else {}  # (a variant of its own; silu's compiled as before)
    n = x.shape[-1] // 2
    x2 = _rows(x, 2 * n)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, n)
    if not (x2.shape[0] and n):
        return y
    if lora is None:
        block = min(1024, next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], cdiv(n, block))](x2, y2, n, x2.stride(0), y2.stride(0),
                                                                   x2, x2, x2, x2, x2, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                   BLOCK=block, PDL=pdl.on(x.device),
                                                                   **pdl.launch(x.device), **act)
        return y
    if list(lora.bounds) != [0, n, 2 * n]:
        raise ValueError(f"silu_and_mul adds the delta of a gate|up layer of widths {n}|{n}, not of bounds "
                         f"{list(lora.bounds)}")
    split, t, nr = lora.hp.shape
    if t != x2.shape[0]:
        raise ValueError(f"silu_and_mul: the LoRA delta has {t} rows, x has {x2.shape[0]}")
    rank, num_slots = nr // 2, lora.scalings.shape[1]
    block = min(LORA_BLOCK, next_power_of_2(n))
    grid = (x2.shape[0], cdiv(n, block))
    run = _silu_and_mul_kernel.warmup if compile_only else _silu_and_mul_kernel[grid]
    run(x2, y2, n, x2.stride(0), y2.stride(0), lora.hp, lora.lora_b, lora.token_slots, lora.ranks, lora.scalings,
        num_slots, rank, lora.hp.stride(0), lora.hp.stride(1), *lora.ranks.stride(), *lora.scalings.stride(),
        BLOCK=block, LORA=True, SPLIT=split, BLOCK_R=next_power_of_2(rank), S_P2=max(2, next_power_of_2(num_slots)),
        PDL=pdl.on(x.device), **pdl.launch(x.device), **act, **({"grid": grid} if compile_only else {}))
    return y


def gelu_tanh_and_mul(x: torch.Tensor, lora=None, compile_only: bool = False) -> torch.Tensor:
    """Triton version of reference.gelu_tanh_and_mul (silu_and_mul's kernel with gelu's tanh approximation)."""
    return silu_and_mul(x, lora, compile_only, gelu=True)


# ----------------------------------------------------------------------------------------------- store_kv
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, heads, head_dim, s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
                     s_cb, s_cs, s_ch, s_cd, s_db, s_ds, s_dh, s_dd,
                     PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
                     FP8: tl.constexpr = 0):
    pdl.start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        block, off = slot // PAGE, slot % PAGE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < heads) & (d < head_dim)
        k = tl.load(k_ptr + tok * s_kt + h * s_kh + d * s_kd, mask=mask)
        v = tl.load(v_ptr + tok * s_vt + h * s_vh + d * s_vd, mask=mask)
        tl.store(kc_ptr + block * s_cb + off * s_cs + h * s_ch + d * s_cd, fp8.to_cache(k, kc_ptr, FP8), mask=mask)
        tl.store(vc_ptr + block * s_db + off * s_ds + h * s_dh + d * s_dd, fp8.to_cache(v, vc_ptr, FP8), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Triton version of reference.store_kv: k, v [T, Hk, D] into the flat slots of [num_blocks, bs, Hk, D]."""
    t, heads, head_dim = k.shape
    if t == 0:
        return
    _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, heads, head_dim, *k.stride(), *v.stride(),
                           *k_cache.stride(), *v_cache.stride(), PAGE=k_cache.shape[1],
                           BLOCK_H=next_power_of_2(heads), BLOCK_D=next_power_of_2(head_dim), PDL=pdl.on(k.device),
                           FP8=fp8.code(k_cache.dtype), **pdl.launch(k.device))
