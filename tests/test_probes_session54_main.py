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


def test_a_soft_capped_prefill_keeps_a_later_nan_from_earlier_queries_and_stays_capped():
    """The CPU prefill attends the queries before a key that is not finite without it (a token the model overflowed
    on): those rows, of a soft-capped model (Gemma 2), equal the capped attention of the prompt cut before it."""
    torch.manual_seed(1)
    bs, heads, kv_heads, dim, n, bad = 4, 4, 2, 8, 10, 7
    k_cache, v_cache = torch.randn(6, bs, kv_heads, dim) * 3, torch.randn(6, bs, kv_heads, dim)
    table = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    q = torch.randn(n, heads, dim) * 3
    v_cache[2, bad - bs] = float("nan")  # position 7: block 2 (the table's second), slot 3
    got = ref.paged_attention(q, k_cache, v_cache, table, torch.tensor([n], dtype=torch.int32),
                              torch.tensor([0, n], dtype=torch.int32), 0.5, n, softcap=2.0)
    cut = ref.paged_attention(q[:bad], k_cache, v_cache, table[:, :2], torch.tensor([bad], dtype=torch.int32),
                              torch.tensor([0, bad], dtype=torch.int32), 0.5, bad, softcap=2.0)
    torch.testing.assert_close(got[:bad], cut)
    assert torch.isnan(got[bad:]).all()


def test_verify_rows_keep_a_later_drafts_nan_value_from_the_rows_before_it():
    """Speculative verify rows (a few queries after a context) are attended as decode rows of one padded batch: the
    later drafts' keys sit in an earlier row's masked padding, so a draft the model overflowed on (NaN K/V, rejected
    later) must not reach the rows before it."""
    torch.manual_seed(2)
    bs, heads, kv_heads, dim = 4, 4, 2, 8
    k_cache, v_cache = torch.randn(8, bs, kv_heads, dim), torch.randn(8, bs, kv_heads, dim)
    table = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    lens, n = 14, 4  # 10 tokens of context, the last token and 3 drafts: positions 10..13
    v_cache[4, 13 - 3 * bs] = float("nan")  # the last draft's value (position 13)
    q = torch.randn(n, heads, dim)
    got = ref.paged_attention(q, k_cache, v_cache, table, torch.tensor([lens], dtype=torch.int32),
                              torch.tensor([0, n], dtype=torch.int32), 0.3, n)
    for i in range(n - 1):  # row i (position 10 + i) over the keys up to its position, alone
        m = 11 + i
        alone = ref.paged_attention(q[i:i + 1], k_cache, v_cache, table[:, :(m + bs - 1) // bs],
                                    torch.tensor([m], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                                    0.3, 1)
        torch.testing.assert_close(got[i], alone[0])
    assert torch.isnan(got[n - 1]).all()


def test_a_sliding_layers_decode_batch_gathers_no_block_before_every_rows_window():
    """A sliding layer's padded decode batch gathers its rows' blocks from the shortest row's window on, as the
    Triton decode kernel skips them: the blocks wholly before every row's window are not read (the masked keys
    are zeroed, so reading them would not change the outputs, only the time and memory of every decode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(3)
    bs, heads, kv_heads, dim, window = 4, 4, 2, 8, 8
    lens = [40, 33, 37]
    tables = torch.arange(1, 1 + 3 * 10, dtype=torch.int32).view(3, 10)
    k_cache, v_cache = torch.randn(32, bs, kv_heads, dim), torch.randn(32, bs, kv_heads, dim)
    q = torch.randn(3, heads, dim)

    class Gathers(TorchDispatchMode):
        rows: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.index_select.default and args[0].dim() == 4:  # the caches' blocks
                self.rows.append(int(args[2].numel()))
            return out

    with Gathers() as seen:
        ref.paged_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32),
                            torch.tensor([0, 1, 2, 3], dtype=torch.int32), 0.3, 1, window=window)
    first, last = (min(lens) - window) // bs, (max(lens) + bs - 1) // bs  # blocks 6..9 of each row
    assert seen.rows and max(seen.rows) <= 3 * (last - first), seen.rows
