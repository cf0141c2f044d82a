"""Session 54 probes (main): the CPU attention's padded decode batch never reads the padding's values."""
import pytest
import torch

from infer.kernels import reference as ref


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_an_uneven_decode_batch_reads_nothing_of_the_padding_block(poison):
    """A batch of decode rows of uneven lengths is gathered padded to the longest; the block tables' padding is block
    0, which may hold another request's K/V: a request that went non-finite left NaN there (it ends as 'not finite',
    its blocks go back to the pool). The shorter rows must not read those values (0 x NaN is NaN): each row's output
    equals its own sequence attended alone."""
    torch.manual_seed(0)
    bs, heads, kv_heads, dim = 4, 4, 2, 8
    k_cache = torch.randn(8, bs, kv_heads, dim)
    v_cache = torch.randn(8, bs, kv_heads, dim)
    k_cache[0], v_cache[0] = poison, poison  # block 0: nobody's here, the padding's target
    tables = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]], dtype=torch.int32)  # padded with block 0
    lens = torch.tensor([11, 3, 6], dtype=torch.int32)
    q = torch.randn(3, heads, dim)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    got = ref.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.3, 1)
    assert torch.isfinite(got).all()
    for b in range(3):
        alone = ref.paged_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1, :(int(lens[b]) + bs - 1) // bs],
                                    lens[b:b + 1], torch.tensor([0, 1], dtype=torch.int32), 0.3, 1)
        torch.testing.assert_close(got[b], alone[0])
