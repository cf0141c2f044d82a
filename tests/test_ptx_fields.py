"""The inline PTX that unpacks int4 words on a GPU (`gptq_kernels.BYTE_FIELDS_PTX` for the field tiles,
`gptq_kernels.PAIR_FIELDS_PTX` for PAIRS, `gptq_gemv.MANTISSA_PTX` for the in-place gemv) cannot run in the
interpreter, which takes the Triton-op path of the same helpers instead. Here the PTX text runs through an emulator
of the instructions it uses (lop3.b32 with any LUT, shr.u32, prmt.b32, sub.f16x2, mov.b32 of a register or a
constant, or of a register into its two 16-bit halves) on random words, every sign bit included, and must give the
interpreter's Triton-op values bit for bit; on a GPU the helpers also run with their inline PTX, compiled, against
the emulator.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from infer.kernels import gptq_gemv, gptq_kernels

CUDA = torch.cuda.is_available()
U32 = 0xFFFFFFFF


def _lop3(a, b, c, lut: int):
    """Bitwise lop3: result bit = lut bit number (a << 2 | b << 1 | c) of the operands' bits."""
    out = np.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            term = np.full_like(a, U32)
            for bit, x in ((i >> 2 & 1, a), (i >> 1 & 1, b), (i & 1, c)):
                term &= x if bit else ~x & U32
            out |= term
    return out


def run_ptx(text: str, constraints: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Outputs of an inline-asm block ($i numbered as constraints list them: outputs first) on uint32 arrays;
    16-bit outputs ("=h") as uint16. Only the instructions these kernels use; anything else fails the test."""
    cons = constraints.split(",")
    regs: dict = {}
    ins = iter(inputs)
    for i, c in enumerate(cons):
        if not c.startswith("="):
            regs[f"${i}"] = next(ins).astype(np.uint32)

    def val(tok: str):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return np.uint32(int(tok, 0))
        raise AssertionError(f"unknown operand {tok!r}")
    body = text.strip().removeprefix("{").removesuffix("}")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):
            halves, src = re.fullmatch(r"\{\s*([^}]*)\}\s*,\s*(\S+)", rest).groups()
            lo, hi = (h.strip() for h in halves.split(","))
            v = val(src)
            regs[lo], regs[hi] = (v & 0xFFFF).astype(np.uint32), (v >> 16).astype(np.uint32)
            continue
        args = [a.strip() for a in rest.split(",")]
        if op == "mov.b32":
            regs[args[0]] = np.broadcast_to(val(args[1]), regs_shape(regs)).astype(np.uint32)
        elif op == "prmt.b32":  # default mode: result byte i = byte (selector nibble i) of the 8 bytes b:a
            a, b, sel = val(args[1]), val(args[2]), int(args[3], 0)
            eight = [(a >> np.uint32(8 * i)) & 0xFF for i in range(4)] + [(b >> np.uint32(8 * i)) & 0xFF for i in range(4)]
            regs[args[0]] = sum((eight[(sel >> (4 * i)) & 7].astype(np.uint32) << np.uint32(8 * i)) for i in range(4))
        elif op == "sub.f16x2":  # round to nearest, per 16-bit half
            halves = [(v & 0xFFFF).astype(np.uint16).view(np.float16) for v in (val(args[1]), val(args[2]))]
            highs = [(v >> np.uint32(16)).astype(np.uint16).view(np.float16) for v in (val(args[1]), val(args[2]))]
            lo, hi = (halves[0] - halves[1]).view(np.uint16), (highs[0] - highs[1]).view(np.uint16)
            regs[args[0]] = lo.astype(np.uint32) | (hi.astype(np.uint32) << np.uint32(16))
        elif op == "lop3.b32":
            regs[args[0]] = _lop3(*(np.broadcast_to(val(a), regs_shape(regs)).astype(np.uint32) for a in args[1:4]),
                                  int(args[4], 0))
        elif op == "shr.u32":
            regs[args[0]] = (val(args[1]) >> np.uint32(int(args[2], 0))).astype(np.uint32)
        else:
            raise AssertionError(f"the emulator does not know {op!r}: extend it with the new instruction")
    outs = [i for i, c in enumerate(cons) if c.startswith("=")]
    return [regs[f"${i}"].astype(np.uint16 if cons[i] == "=h" else np.uint32) for i in outs]


def regs_shape(regs: dict) -> tuple:
    return next(v.shape for v in regs.values() if np.ndim(v))


def test_emulator_knows_lop3():
    a, b, c = (np.array([x], dtype=np.uint32) for x in (0xF0F0F0F0, 0xFF00FF00, 0x0000FFFF))
    assert _lop3(a, b, c, 0xEA)[0] == (0xF0F0F0F0 & 0xFF00FF00) | 0x0000FFFF  # (a & b) | c
    assert _lop3(a, b, c, 0x96)[0] == 0xF0F0F0F0 ^ 0xFF00FF00 ^ 0x0000FFFF  # a ^ b ^ c
    assert _lop3(a, b, c, 0xF0)[0] == 0xF0F0F0F0 and _lop3(a, b, c, 0xAA)[0] == 0x0000FFFF


@triton.jit
def _pair_probe(w_ptr, o_ptr, N: tl.constexpr, ASM: tl.constexpr):
    offs = tl.arange(0, N)
    f = gptq_kernels._pair_fields(tl.load(w_ptr + offs), ASM)
    for i in tl.static_range(8):
        tl.store(o_ptr + i * N + offs, f[i].to(tl.int16, bitcast=True))


@triton.jit
def _byte_probe(w_ptr, z_ptr, o_ptr, N: tl.constexpr, ASM: tl.constexpr):
    offs = tl.arange(0, N)
    words, zf = tl.load(w_ptr + offs), tl.load(z_ptr + offs)
    for b in tl.static_range(4):
        lo, hi = gptq_kernels._byte_fields(words, zf, zf - 960.0, b, ASM)
        tl.store(o_ptr + 2 * b * N + offs, lo.to(tl.int16, bitcast=True))
        tl.store(o_ptr + (2 * b + 1) * N + offs, hi.to(tl.int16, bitcast=True))


@triton.jit
def _mantissa_probe(w_ptr, o_ptr, N: tl.constexpr, MASK: tl.constexpr, ASM: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(o_ptr + offs, gptq_gemv._mantissa(tl.load(w_ptr + offs), MASK, ASM))


def _words(n: int = 256) -> torch.Tensor:
    w = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32)
    w[:4] = torch.tensor([-1, 0, -2 ** 31, 2 ** 31 - 1], dtype=torch.int32)  # every field 15 / 0, sign bit alone
    return w


def _probe_pairs(words: torch.Tensor, asm: bool) -> np.ndarray:
    dev = "cuda" if CUDA else "cpu"
    out = torch.empty(8 * words.numel(), dtype=torch.int16, device=dev)
    _pair_probe[(1,)](words.to(dev), out, N=words.numel(), ASM=asm)
    return out.cpu().view(8, -1).numpy().view(np.uint16)


def _zeros_f16(n: int = 256) -> torch.Tensor:
    """Each word's zero as fp16 1024 + z, z in 0-15, both ends included."""
    z = torch.randint(0, 16, (n,), dtype=torch.int32)
    z[:4] = torch.tensor([0, 15, 15, 0], dtype=torch.int32)
    return (z + 1024).half()


def _probe_bytes(words: torch.Tensor, zf: torch.Tensor, asm: bool) -> np.ndarray:
    dev = "cuda" if CUDA else "cpu"
    out = torch.empty(8 * words.numel(), dtype=torch.int16, device=dev)
    _byte_probe[(1,)](words.to(dev), zf.to(dev), out, N=words.numel(), ASM=asm)
    return out.cpu().view(8, -1).numpy().view(np.uint16)


def _probe_mantissa(words: torch.Tensor, mask: int, asm: bool) -> np.ndarray:
    dev = "cuda" if CUDA else "cpu"
    out = torch.empty_like(words, device=dev)
    _mantissa_probe[(1,)](words.to(dev), out, N=words.numel(), MASK=mask, ASM=asm)
    return out.cpu().numpy().view(np.uint32)


def test_pair_fields_ptx_gives_the_triton_op_values():
    words = _words()
    want = _probe_pairs(words, False)
    got = run_ptx(gptq_kernels.PAIR_FIELDS_PTX.value, gptq_kernels.PAIR_FIELDS_CONSTRAINTS.value,
                  [words.numpy().view(np.uint32)])
    for i, name in enumerate(("0", "4", "1", "5", "2", "6", "3", "7")):
        assert np.array_equal(got[i], want[i]), f"field {name}: the PTX differs from the Triton-op path"
    # and what both mean: fp16 1024 + q (fields 0/4, 2/6) or 1024 + 16 q (fields 1/5, 3/7) of each 4-bit field q
    w = words.numpy().view(np.uint32).astype(np.int64)
    for i, j in enumerate((0, 4, 1, 5, 2, 6, 3, 7)):
        q = (w >> (4 * j)) & 0xF
        assert np.array_equal(want[i].view(np.float16).astype(np.float64), 1024 + q * (16 if j % 2 else 1))


def test_byte_fields_ptx_gives_the_triton_op_values():
    """Two words per PTX instance ($2, $3: elements 2i and 2i + 1) with their zeros packed in one register each
    (1024 + z: $4, 64 + z: $5), each output register holding field 2b (low nibble of byte b) or 2b + 1 of both
    elements in its halves (low: element 2i)."""
    words, zf = _words(), _zeros_f16()
    want = _probe_bytes(words, zf, False)
    w = words.numpy().view(np.uint32)
    zbits = zf.numpy().view(np.uint16).astype(np.uint32)
    obits = (zf - 960).numpy().view(np.uint16).astype(np.uint32)
    for b in range(4):
        got = run_ptx(gptq_kernels.BYTE_FIELDS_PTX.value[b], gptq_kernels.BYTE_FIELDS_CONSTRAINTS.value,
                      [w[0::2], w[1::2], zbits[0::2] | (zbits[1::2] << 16), obits[0::2] | (obits[1::2] << 16)])
        for half, j in enumerate((2 * b, 2 * b + 1)):
            pairs = np.stack([got[half] & 0xFFFF, got[half] >> 16], axis=1).reshape(-1).astype(np.uint16)
            assert np.array_equal(pairs, want[j]), f"field {j}: the PTX differs from the Triton-op path"
    # and what both mean: q - z of each 4-bit field q, exactly, in fp16
    z = zf.numpy().astype(np.int64) - 1024
    for j in range(8):
        q = (w.astype(np.int64) >> (4 * j)) & 0xF
        assert np.array_equal(want[j].view(np.float16).astype(np.float64), q - z), f"field {j}"


def test_emulator_knows_prmt_and_f16x2():
    a, b = np.array([0x44332211], dtype=np.uint32), np.array([0x88776655], dtype=np.uint32)
    assert run_ptx("{ prmt.b32 $0, $1, $2, 0x5140; }", "=r,r,r", [a, b])[0][0] == 0x66225511
    one, three = np.float16(1).view(np.uint16), np.float16(3).view(np.uint16)
    x = np.array([int(three) | int(one) << 16], dtype=np.uint32)
    y = np.array([int(one) | int(three) << 16], dtype=np.uint32)
    r = run_ptx("{ sub.f16x2 $0, $1, $2; }", "=r,r,r", [x, y])[0][0]
    assert np.uint16(r & 0xFFFF).view(np.float16) == 2 and np.uint16(r >> 16).view(np.float16) == -2


@pytest.mark.parametrize("j", range(5))
def test_mantissa_ptx_gives_the_triton_op_values(j):
    words, mask = _words(), 0xF << (4 * j)
    want = _probe_mantissa(words, mask, False)
    got = run_ptx(gptq_gemv.MANTISSA_PTX.value, gptq_gemv.MANTISSA_CONSTRAINTS.value,
                  [words.numpy().view(np.uint32), np.full(words.numel(), mask, dtype=np.uint32)])[0]
    assert np.array_equal(got, want)
    q = (words.numpy().view(np.uint32).astype(np.int64) >> (4 * j)) & 0xF
    assert np.array_equal(want.view(np.float32).astype(np.float64), 2.0 ** 23 + q * 2.0 ** (4 * j))


@pytest.mark.gpu
def test_compiled_ptx_gives_the_emulated_values_on_a_gpu():
    words = _words()
    assert np.array_equal(_probe_pairs(words, True), _probe_pairs(words, False))
    zf = _zeros_f16()
    assert np.array_equal(_probe_bytes(words, zf, True), _probe_bytes(words, zf, False))
    for j in range(5):
        mask = 0xF << (4 * j)
        assert np.array_equal(_probe_mantissa(words, mask, True), _probe_mantissa(words, mask, False))
