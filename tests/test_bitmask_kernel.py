"""The grammar mask on the device (kernels.bitmask, interpreted on CPU without a GPU) against the torch reference
(kernels.reference.apply_bitmask, which tests/test_structured_outputs.py checks against xgrammar's own
apply_token_bitmask_inplace): -inf wherever a row's bit is 0 and past the bitmask's end, the other logits untouched,
the input never modified."""

from __future__ import annotations

import pytest
import torch

from infer import kernels
from infer.kernels import reference

from helpers import interpreted_module


@pytest.fixture(scope="module")
def bitmask():
    yield from interpreted_module("infer.kernels.bitmask")


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _masks(g, rows: int, words: int) -> torch.Tensor:
    """Random words, bit 31 set in about half of them (negative int32), some all-zero and all-one words."""
    m = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    m[:, ::5] = 0
    m[:, 1::7] = -1
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab,words", [(77, 3), (2077, 65), (2077, 40), (1024, 32)])
def test_kernel_equals_the_reference(bitmask, dtype, vocab, words):
    """Ragged and whole blocks of 1024 tokens; words = 40 leaves 797 tokens past the bitmask's end (banned)."""
    g = torch.Generator().manual_seed(vocab + words)
    n = 6
    logits = torch.randn(n, vocab, generator=g).to(dtype).to(DEV)
    before = logits.clone()
    every = _masks(g, n, words).to(DEV)
    got = bitmask.apply_bitmask(logits, None, every)
    assert torch.equal(got, reference.apply_bitmask(logits, None, every))
    assert torch.equal(logits, before) and got.dtype == dtype
    # some rows, in any order, their indices a view at an odd offset (as a slice of the step's packed copy is)
    packed = torch.tensor([9, 4, 0, 2, 5], dtype=torch.long, device=DEV)
    rows = packed[1:4]
    some = _masks(g, 3, words).to(DEV)
    got = bitmask.apply_bitmask(logits, rows, some)
    assert torch.equal(got, reference.apply_bitmask(logits, rows, some))
    assert torch.equal(got[[1, 3, 5]], before[[1, 3, 5]])  # rows without a grammar are untouched
    banned = (got == float("-inf")).sum().item()
    assert 0 < banned < 3 * vocab


def test_no_rows_and_the_dispatch(bitmask):
    logits = torch.randn(2, 50, device=DEV)
    empty = bitmask.apply_bitmask(logits, torch.zeros(0, dtype=torch.long, device=DEV),
                                  torch.zeros(0, 2, dtype=torch.int32, device=DEV))
    assert torch.equal(empty, logits) and empty.data_ptr() != logits.data_ptr()
    ones = torch.full((2, 2), -1, dtype=torch.int32, device=DEV)
    assert torch.equal(kernels.apply_bitmask(logits, None, ones), logits)  # every bit set: nothing banned


def test_the_engine_warm_up_launches_both_variants(monkeypatch):
    """A GPU engine's start reaches the mask kernel with and without row indices (nothing compiles on a user's
    first constrained request); here the dispatch is recorded."""
    from infer import LLM
    from infer.models.tiny import ensure_builtin
    llm = LLM(str(ensure_builtin("tiny-llama")), max_num_seqs=2, block_size=4, num_kv_blocks=64, max_model_len=64)
    calls = []
    real = kernels.apply_bitmask
    monkeypatch.setattr(kernels, "apply_bitmask",
                        lambda x, rows, m: (calls.append((x.dtype, rows is None, tuple(m.shape))), real(x, rows, m))[1])
    llm.engine.warm_kernels()
    vocab = llm.engine.model_config.vocab_size
    assert sorted(calls) == [(torch.float32, False, (2, -(-vocab // 32))), (torch.float32, True, (2, -(-vocab // 32)))]


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_kernel_at_real_sizes_on_gpu(vocab):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from infer.kernels import bitmask
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g).cuda()
    masks = _masks(g, 64, -(-vocab // 32)).cuda()
    assert torch.equal(bitmask.apply_bitmask(logits, None, masks), reference.apply_bitmask(logits, None, masks))
    rows = torch.arange(1, 64, 2, device="cuda")
    assert torch.equal(bitmask.apply_bitmask(logits, rows, masks[:32]),
                       reference.apply_bitmask(logits, rows, masks[:32]))
