"""Session 63 review of the Gated DeltaNet Triton kernels (kernels.delta_triton) for what the interpreter does not
show: compiled for sm_90 (H100) and sm_89 (Ada: 99 KiB of shared memory a block) through the real launchers at
Qwen3.5-9B's / Qwen3-Next's shapes (Hk 16, Hv 32, Dk 128, Dv 128, conv kernel 4), every kernel fits the GPU's
shared memory (the chunked rule's state recurrence took 160 KiB with Triton's default pipeline); the prefill conv
addresses token rows past 2^31 elements of its input (int32 offsets wrapped, a read 4 GiB before the tensor); the
slots, kept flags and query_start_loc may be strided views (the kernels indexed them as contiguous)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from infer.kernels import delta_rule
from infer.kernels.moe import SM90_SMEM

from helpers import COMPILE_ONLY_SHARED, interpreted_module, run_compile_only

SM89_SMEM = 101376  # the shared memory one program may take on sm_86 / sm_89 (99 KiB)

COMPILED = COMPILE_ONLY_SHARED + textwrap.dedent('''
    from infer.kernels import delta_triton as D
    hk, hv, dk, dv, taps, t = 16, 32, 128, 128, 4, 70
    conv_dim, bf16 = 2 * hk * dk + hv * dv, torch.bfloat16
    x = torch.zeros(t, conv_dim + hv * dv, dtype=bf16)[:, :conv_dim]  # (in_proj_qkv's columns of in_proj_qkvz)
    q, k = x[:, :hk * dk].view(t, hk, dk), x[:, hk * dk:2 * hk * dk].view(t, hk, dk)
    v = x[:, 2 * hk * dk:].view(t, hv, dv)
    g, beta = torch.zeros(t, hv), torch.zeros(t, hv, dtype=bf16)
    w, conv, rec = torch.zeros(conv_dim, 1, taps, dtype=bf16), torch.zeros(3, conv_dim, taps - 1, dtype=bf16), \\
        torch.zeros(3, hv, dk, dv)
    slots, kept, starts = torch.tensor([0, 1]), torch.tensor([True, False]), torch.tensor([0, 64, t], dtype=torch.int32)
    for arch[0] in (90, 89):
        triton.runtime.driver.set_active(Driver(arch[0]))
        D.causal_conv1d_update(x[:2], w, conv, slots, kept)
        D.recurrent_gated_delta_rule_slots(q[:2], k[:2], v[:2], g[:2], beta[:2], rec, slots, kept)
        D.causal_conv1d_varlen(x, w, conv, starts, slots, kept, 64)
        D.chunk_gated_delta_rule_varlen(q, k, v, g, beta, rec, starts, slots, kept)
    print(json.dumps(shared))
''')


def test_delta_kernels_fit_the_shared_memory_of_sm90_and_sm89():
    """Each of the five kernels, compiled for sm_90 and sm_89 at the real models' shapes as the launchers launch
    them, takes no more shared memory than a program may have there (else the launch fails on that GPU)."""
    check_compiled_shared_memory(COMPILED, ["_conv_update_kernel", "_recurrent_kernel", "_conv_varlen_kernel",
                                            "_chunk_terms_kernel", "_chunk_h_kernel", "_chunk_o_kernel"])


def check_compiled_shared_memory(script: str, names: list[str]) -> None:
    """`script` (a COMPILE_ONLY_SHARED script) run: the kernels `names`, each compiled for sm_90 and sm_89 (and no
    other), each taking no more shared memory than a program may have there."""
    shared = run_compile_only(script, 600)
    assert sorted(shared) == sorted(f"{n} sm_{a}" for n in names for a in (90, 89)), shared
    for key, used in shared.items():
        assert used <= (SM90_SMEM if key.endswith("sm_90") else SM89_SMEM), (key, used)


FAR_ROWS = textwrap.dedent('''
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import json, torch
    from infer.kernels import delta_rule, delta_triton
    c, taps, stride, t = 64, 4, 2 ** 30, 3
    gen = torch.Generator().manual_seed(0)
    big = torch.empty((t - 1) * stride + c, dtype=torch.bfloat16)  # (virtual memory: only the rows' pages touched)
    x = big.as_strided((t, c), (stride, 1))  # row 2 starts at element 2^31
    x.copy_(torch.randn(t, c, generator=gen))
    w = torch.randn(c, 1, taps, generator=gen).to(torch.bfloat16)
    starts, slots, kept = torch.tensor([0, t], dtype=torch.int32), torch.tensor([1]), torch.tensor([True])
    mine = torch.randn(2, c, taps - 1, generator=gen).to(torch.bfloat16)
    ref = mine.clone()
    want = delta_rule.causal_conv1d_varlen(x.clone(), w, ref, starts, slots, kept, t)
    got = delta_triton.causal_conv1d_varlen(x, w, mine, starts, slots, kept, t)
    print(json.dumps({"out": torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2),
                      "state": torch.equal(mine, ref)}))
''')


def test_conv_varlen_reads_token_rows_past_2_31_elements():
    """A prefill's conv over a strided input whose third row starts at element 2^31 (as Qwen3.5-9B's in_proj_qkv
    view, row stride 12288, does at 174,763 tokens), interpreted in a process of its own (the int32 offset wrapped:
    a read 4 GiB before the tensor, a segfault): its outputs and state equal the reference's."""
    assert run_compile_only(FAR_ROWS, 300) == {"out": True, "state": True}


@pytest.fixture(scope="module")
def delta():
    yield from interpreted_module("infer.kernels.delta_triton")


def _every_other(values, other, dtype=None) -> torch.Tensor:
    """`values` as a strided view: every other entry of a tensor twice as long, `other` between them."""
    return torch.tensor([v for x in values for v in (x, other)], dtype=dtype)[::2]


def test_the_kernels_take_strided_slots_kept_and_starts(delta):
    """The four ops with slots, kept and query_start_loc each a view of every other entry: the states and outputs
    equal the reference's (which indexes them as tensors)."""
    gen = torch.Generator().manual_seed(5)
    hk, hv, dk, dv, c, taps, lens = 1, 2, 16, 16, 40, 4, [5, 3, 1]
    slots, kept = _every_other([3, 0, 1], 2), _every_other([True, False, True], False)
    starts = _every_other([0, 5, 8, 9], 0, torch.int32)
    conv = torch.randn(4, c, taps - 1, generator=gen)
    rec = torch.randn(4, hv, dk, dv, generator=gen)
    weight = torch.randn(c, 1, taps, generator=gen)
    q, k, v = torch.randn(9, hk, dk, generator=gen), torch.randn(9, hk, dk, generator=gen), \
        torch.randn(9, hv, dv, generator=gen)
    g, beta = -torch.rand(9, hv, generator=gen), torch.rand(9, hv, generator=gen)
    x = torch.randn(9, c, generator=gen)
    ops = [("causal_conv1d_update", (x[:3], weight), conv, ()),
           ("causal_conv1d_varlen", (x, weight), conv, (starts,)),
           ("recurrent_gated_delta_rule_slots", (q[:3], k[:3], v[:3], g[:3], beta[:3]), rec, ()),
           ("chunk_gated_delta_rule_varlen", (q, k, v, g, beta), rec, (starts,))]
    for name, args, pool, before in ops:
        mine, ref = pool.clone(), pool.clone()
        tail = (max(lens),) if name == "causal_conv1d_varlen" else ()
        want = getattr(delta_rule, name)(*args, ref, *before, slots, kept, *tail)
        got = getattr(delta, name)(*args, mine, *before, slots, kept, *tail)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), name
        assert torch.allclose(mine, ref, atol=1e-5, rtol=1e-5), name
