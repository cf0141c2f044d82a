"""Session 65: the Triton paged attention of MLA's absorbed latent cache (kernels.mla.mla_paged_attention: one cache
row of L + R a token shared by every head, the values its first L dims) under TRITON_INTERPRET=1 (compiled on a GPU)
against its definition, reference.paged_attention(q, cache, cache, ...)[..., :L]: decode batches (contexts across
blocks, uneven, of one key, splits of one tile and many, splits past a context's keys, heads a program below 16 and
past the head count) and prefill / mixed batches (cached prefixes, whole prompts, decodes beside them), float32 and
bfloat16 (a bound from bf16's epsilon against a float64 computation), outputs and partials poisoned with NaN; a
non-finite key past a query's position kept from it; bad inputs refused; the CPU path; the launch plan filling an
H100's SMs at V2-Lite's and V3's heads; compiled for sm_90 / sm_89 at V3's widths within their shared memory,
without spills; on a GPU the real sizes and a CUDA graph replayed over new lengths; the bench's rows and refusals."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

from infer import kernels
from infer.kernels import reference
from infer.kernels.intmath import cdiv
from infer.kernels.moe import SM90_SMEM

from helpers import COMPILE_ONLY_SHARED, interpreted_module, nan_filled_empty, run_compile_only
from test_probes_session63_rdelta import SM89_SMEM

DEV = "cuda" if torch.cuda.is_available() else "cpu"
USE_TRITON = kernels.use_triton  # (the dispatch as shipped, before the fixture forces it)
PAGE = 16
TOL = 2e-5  # float32: the kernels' sums in another order than torch's


@pytest.fixture(scope="module")
def mla():
    """kernels.mla, its op through the Triton kernels on every tensor (interpreted on CPU tensors)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "use_triton", lambda t: True)
        yield from interpreted_module("infer.kernels.mla")


def _batch(gen, lens, queries, heads, latent, rope, dtype=torch.float32, past=30.0):
    """q [T, H, L+R] of sequences whose last queries[b] tokens are new out of lens[b], a cache whose blocks are
    handed out in a random order, every slot past a sequence's keys `past` (30: a key read there would outweigh the
    rest) and every spare block NaN (the block tables' spare entries point at one), seq_lens and query_start_loc."""
    blocks = [cdiv(n, PAGE) for n in lens]
    total = sum(blocks) + 2
    cache = torch.randn(total, PAGE, 1, latent + rope, generator=gen).to(dtype)
    order = torch.randperm(total - 1, generator=gen).tolist()
    tables = torch.full((len(lens), max(blocks) + 1), total - 1, dtype=torch.int32)
    cache[total - 1] = float("nan")
    used = set()
    for b, n in enumerate(lens):
        for j in range(blocks[b]):
            tables[b, j] = order.pop()
            used.add(int(tables[b, j]))
        last = int(tables[b, blocks[b] - 1])
        cache[last, n - (blocks[b] - 1) * PAGE:] = past
    for blk in set(range(total)) - used:
        cache[blk] = float("nan")
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, latent + rope, generator=gen).to(dtype)
    return [x.to(DEV) for x in (q, cache, tables, torch.tensor(lens, dtype=torch.int32), starts)]


def _definition(q, cache, tables, lens, starts, scale, latent):
    return reference.paged_attention(q.cpu(), cache.cpu(), cache.cpu(), tables.cpu(), lens.cpu(), starts.cpu(),
                                     scale)[..., :latent]


def _float64(q, cache, tables, lens, starts, scale, latent):
    """The same attention in float64 from the same (rounded) inputs, written out per query."""
    out = torch.empty(q.shape[0], q.shape[1], latent, dtype=torch.float64)
    q, cache, tables, lens, starts = (x.cpu() for x in (q, cache, tables, lens, starts))
    for b in range(lens.shape[0]):
        n, s0 = int(starts[b + 1] - starts[b]), int(starts[b])
        keys = int(lens[b])
        rows = torch.stack([cache[int(tables[b, i // PAGE]), i % PAGE, 0] for i in range(keys)]).double()
        for i in range(n):
            pos = keys - n + i
            s = q[s0 + i].double() @ rows[:pos + 1].T * scale
            out[s0 + i] = torch.softmax(s, -1) @ rows[:pos + 1, :latent]
    return out


LENS = [40, 1, 17, 33, 16]  # across blocks (3 of 16), one key, one block and a key, 3 blocks less 15, one whole block


@pytest.mark.parametrize("heads, latent, rope", [(4, 32, 16), (16, 64, 16), (20, 48, 8)])
@pytest.mark.parametrize("parts, per_program", [(None, None), (1, None), (2, None), (8, None), (3, 4), (2, 32)])
def test_decode_equals_the_definition(mla, monkeypatch, heads, latent, rope, parts, per_program):
    """Decode rows of contexts across blocks, uneven, of one key: every split count (one; two; 8, most of them past
    a context's 3 tiles of 16 keys: they write nothing and the merge reads the used ones only), heads a program
    below 16 (4 in rows of 16) and past the head count (32); widths that are not powers of two (48 + 8): the output
    (NaN first, as the partials) equals reference.paged_attention(q, cache, cache)[..., :L]."""
    monkeypatch.setattr(mla, "BLOCK_N", 16)
    q, cache, tables, lens, starts = _batch(torch.Generator().manual_seed(heads + parts if parts else heads), LENS,
                                            [1] * len(LENS), heads, latent, rope)
    want = _definition(q, cache, tables, lens, starts, 0.3, latent)
    out = torch.full((q.shape[0], heads, latent), float("nan"), device=DEV)
    with nan_filled_empty(mla):
        if parts is None and per_program is None:
            assert mla.mla_paged_attention(q, cache, tables, lens, starts, 0.3, latent, 1, out=out) is out
        else:
            mla._decode(q, cache, tables, lens, starts, 0.3 * mla.LOG2E, out, mla._widths(q, cache, latent),
                        parts=parts, heads=per_program)
    assert torch.allclose(out.cpu(), want, atol=TOL, rtol=TOL), float((out.cpu() - want).abs().max())


def test_merge_of_many_splits_over_a_long_context(mla, monkeypatch):
    """40 splits of one tile each (more than the merge's chunk of 16 partials: three chunks) over 620 keys, beside a
    context of 2 keys (39 of its splits empty)."""
    monkeypatch.setattr(mla, "BLOCK_N", 16)
    q, cache, tables, lens, starts = _batch(torch.Generator().manual_seed(5), [620, 2], [1, 1], 4, 32, 16)
    want = _definition(q, cache, tables, lens, starts, 0.2, 32)
    out = torch.full((2, 4, 32), float("nan"), device=DEV)
    with nan_filled_empty(mla):
        mla._decode(q, cache, tables, lens, starts, 0.2 * mla.LOG2E, out, mla._widths(q, cache, 32), parts=40)
    assert torch.allclose(out.cpu(), want, atol=TOL, rtol=TOL), float((out.cpu() - want).abs().max())


MIXED = ([40, 30, 1, 50, 33, 9], [1, 7, 1, 20, 33, 9])  # decodes, a chunk after a prefix, whole prompts


@pytest.mark.parametrize("heads, latent, rope", [(4, 32, 16), (16, 64, 16), (20, 48, 8)])
def test_prefill_and_mixed_batches_equal_the_definition(mla, heads, latent, rope):
    """A step mixing decodes, a prefill chunk after 10 cached tokens (7 new of 30), 20 new of 50, whole prompts of
    33 and of 9 tokens: causal within each sequence's new tokens, every row equal to the definition's."""
    q, cache, tables, lens, starts = _batch(torch.Generator().manual_seed(heads), *MIXED, heads, latent, rope)
    want = _definition(q, cache, tables, lens, starts, 0.25, latent)
    out = torch.full((q.shape[0], heads, latent), float("nan"), device=DEV)
    mla.mla_paged_attention(q, cache, tables, lens, starts, 0.25, latent, out=out)
    assert torch.allclose(out.cpu(), want, atol=TOL, rtol=TOL), float((out.cpu() - want).abs().max())


def _half_bound(cache, tables, lens, latent):
    """The kernels' error against float64 on the same inputs in cache's half precision (bf16, fp16): the softmax
    weights rounded to it before the value product (eps / 2 relative each: eps / 2 x max |v| at most) and the
    output rounded to it (eps / 2 x |out| <= eps / 2 x max |v|), max |v| over the values the sequences attend to;
    the float32 sums' errors are far below (1e-5 relative)."""
    cache, tables = cache.cpu(), tables.cpu()
    top = max(float(cache[int(tables[b, i // PAGE]), i % PAGE, 0, :latent].float().abs().max())
              for b in range(lens.shape[0]) for i in range(int(lens[b])))
    return torch.finfo(cache.dtype).eps * top * (1 + 1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lens, queries", [(LENS, [1] * len(LENS)), MIXED], ids=["decode", "mixed"])
def test_half_precision_within_its_rounding_of_float64(mla, lens, queries, dtype):
    """bfloat16 and float16 q and cache, decode (two splits a sequence at most, as decode_plan gives a small batch
    here: splits of 32 keys) and mixed: within `_half_bound` of the float64 attention of the same inputs. (float16
    takes the kernels' half-precision tl.dot, as a GPU's bf16 does: the interpreter's bf16 tl.dot is wrong, so
    interpreted bf16 takes the float32 one.)"""
    q, cache, tables, lens_t, starts = _batch(torch.Generator().manual_seed(1), lens, queries, 16, 64, 16, dtype)
    want = _float64(q, cache, tables, lens_t, starts, 0.2, 64)
    with nan_filled_empty(mla):
        got = mla.mla_paged_attention(q, cache, tables, lens_t, starts, 0.2, 64)
    assert got.dtype == dtype
    err, bound = float((got.cpu().double() - want).abs().max()), _half_bound(cache, tables, lens_t, 64)
    assert err <= bound, (err, bound)


def test_a_key_that_is_not_finite_reaches_only_the_queries_that_attend_to_it(mla):
    """A prefill of 20 new tokens after 30 cached whose 15th new token's row is NaN (a token the model overflowed
    on): the 14 queries before it equal the definition's (finite: its masked weight kept from them), those from it
    on are NaN, as the definition's."""
    q, cache, tables, lens, starts = _batch(torch.Generator().manual_seed(2), [50, 9], [20, 1], 4, 32, 16)
    cache[int(tables[0, 44 // PAGE]), 44 % PAGE] = float("nan")
    want = _definition(q, cache, tables, lens, starts, 0.3, 32)
    got = mla.mla_paged_attention(q, cache, tables, lens, starts, 0.3, 32).cpu()
    assert torch.isfinite(got[:14]).all() and torch.isnan(got[14:20]).all() and torch.isfinite(got[20]).all()
    assert torch.allclose(got, want, atol=TOL, rtol=TOL, equal_nan=True)


@pytest.mark.parametrize("lens, queries", [(LENS, [1] * len(LENS)), MIXED], ids=["decode", "mixed"])
def test_nan_past_a_sequences_keys_is_never_read(mla, lens, queries):
    """NaN in every slot past a sequence's keys in its last block (a block's stale rows: a request that overflowed
    before) and in the spare blocks: decode and mixed outputs finite, equal to the float64 attention of the
    sequences' own keys. (reference.paged_attention's decode rows read such slots: NaN there, 0 x NaN.)"""
    q, cache, tables, lens_t, starts = _batch(torch.Generator().manual_seed(6), lens, queries, 4, 32, 16,
                                              past=float("nan"))
    got = mla.mla_paged_attention(q, cache, tables, lens_t, starts, 0.3, 32).cpu()
    want = _float64(q, cache, tables, lens_t, starts, 0.3, 32)
    assert torch.isfinite(got).all() and torch.allclose(got.double(), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("change, message", [
    (lambda a: dict(a, cache=a["cache"].expand(-1, -1, 2, -1)), "one row of q's width 48 a token"),
    (lambda a: dict(a, q=a["q"][..., :40]), "one row of q's width 40"),
    (lambda a: dict(a, latent_dim=48), "latent_dim 48: give kv_lora_rank"),
    (lambda a: dict(a, latent_dim=0), "latent_dim 0"),
    (lambda a: dict(a, q=a["q"][0]), "takes q [T, H, L+R]"),
    (lambda a: dict(a, cache=a["cache"].double()), "store the cache in q's dtype"),
    (lambda a: dict(a, out=torch.empty(5, 4, 48, device=DEV)),
     "out must be a torch.float32 tensor of shape (5, 4, 32)"),
], ids=["two_kv_heads", "cache_width", "latent_all", "latent_zero", "q_2d", "cache_dtype", "out_shape"])
def test_bad_inputs_are_refused(mla, change, message):
    q, cache, tables, lens, starts = _batch(torch.Generator().manual_seed(0), LENS, [1] * len(LENS), 4, 32, 16)
    args = change(dict(q=q, cache=cache, block_tables=tables, seq_lens=lens, query_start_loc=starts, scale=1.0,
                       latent_dim=32))
    with pytest.raises(ValueError, match=re.escape(message)):
        mla.mla_paged_attention(**args)


def test_an_empty_batch_returns_an_empty_output(mla):
    q, cache, tables, lens, starts = _batch(torch.Generator().manual_seed(0), [3], [1], 4, 32, 16)
    out = mla.mla_paged_attention(q[:0], cache, tables[:0], lens[:0], starts[:1], 1.0, 32)
    assert out.shape == (0, 4, 32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_cpu_path_equals_float64(mla, monkeypatch):
    """On CPU tensors (kernels.use_triton as shipped) the op computes with torch (reference.paged_attention, no kernel
    launched): equal to the float64 attention written out per query (float32 tolerance), mixed batch, out written
    in place."""
    monkeypatch.setattr(kernels, "use_triton", USE_TRITON)
    for name in ("_decode", "_prefill"):
        monkeypatch.setattr(mla, name, lambda *a, **k: pytest.fail("a Triton kernel launched on CPU tensors"))
    mod = mla
    q, cache, tables, lens, starts = _batch(torch.Generator().manual_seed(4), *MIXED, 4, 32, 16)
    out = torch.full((q.shape[0], 4, 32), float("nan"))
    assert mod.mla_paged_attention(q, cache, tables, lens, starts, 0.2, 32, out=out) is out
    want = _float64(q, cache, tables, lens, starts, 0.2, 32)
    assert torch.allclose(out.double(), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("heads", [16, 128])
def test_decode_plan_fills_an_h100_at_batch_1_to_64(heads):
    """V2-Lite's 16 heads and V3's 128 at batch 1, 16, 64 and contexts 1k, 8k, 32k: every plan launches at least
    128 programs (an H100 has 132 SMs: batch 1 at 1k context has 32 tiles of 32 keys, 4 heads a program), at most
    2 x 132 + a batch's worth (decode_parts' floor of one split), with 4-32 heads a program."""
    from infer.kernels import mla
    for batch in (1, 16, 64):
        for context in (1024, 8192, 32768):
            per, parts = mla.decode_plan(batch, heads, context, torch.device("cpu"))
            programs = batch * cdiv(heads, per) * parts
            assert 128 <= programs <= 264 + batch * cdiv(heads, per), (batch, context, per, parts)
            assert per in (4, 8, 16, 32) and parts <= cdiv(context, mla.BLOCK_N)
    assert mla.decode_plan(64, heads, 8192, torch.device("cpu")) == (mla.head_block(heads), 4 if heads == 16 else 1)


# a compile-only script's start: `seen` maps "KERNEL LABEL sm_ARCH" to the kernel's shared memory and its main loop's
# local traffic, each launch (label[0] set by the script) compiled for arch[0]
MLA_COMPILE_HOOK = COMPILE_ONLY_SHARED + textwrap.dedent('''
    from infer.kernels import mla
    seen, bf16, label = {}, torch.bfloat16, [""]
    def kept(self, *args, **kwargs):
        kern = record(self, *args, **kwargs)
        res, local = kernel_sass.main_loop_spills(kern)
        seen[f"{self.fn.__name__} {label[0]} sm_{arch[0]}"] = [kern.metadata.shared, local]
        return kern
    jit.JITFunction.run = kept
''')
COMPILED = MLA_COMPILE_HOOK + textwrap.dedent('''
    for arch[0] in (90, 89):
        triton.runtime.driver.set_active(Driver(arch[0]))
        for h in (16, 128):
            label[0] = f"h{h}"
            q, cache = torch.zeros(4, h, 576, dtype=bf16), torch.zeros(8, 16, 1, 576, dtype=bf16)
            tables, lens = torch.zeros(4, 2, dtype=torch.int32), torch.full((4,), 20, dtype=torch.int32)
            out, meta = torch.zeros(4, h, 512, dtype=bf16), mla._widths(q, cache, 512)
            mla._decode(q, cache, tables, lens, torch.arange(5, dtype=torch.int32), 1.0, out, meta, parts=2)
            mla._prefill(q, cache, tables, lens, torch.tensor([0, 4, 4, 4, 4], dtype=torch.int32), 1.0, out, meta)
    print(json.dumps(seen))
''')


def test_kernels_fit_the_shared_memory_of_sm90_and_sm89_without_spills():
    """The decode, merge and prefill kernels compiled for sm_90 and sm_89 at V3's widths (L 512, R 64, bf16) with
    16 and 128 heads as the launchers launch them: each takes no more shared memory than a program may have there,
    and none loads or stores spilled registers in its main loop."""
    seen = run_compile_only(COMPILED, 600)
    names = ("_decode_kernel", "_merge_kernel", "_prefill_kernel")
    assert sorted(seen) == sorted(f"{n} h{h} sm_{a}" for n in names for h in (16, 128) for a in (90, 89)), seen
    for key, (used, local) in seen.items():
        assert used <= (SM90_SMEM if key.endswith("sm_90") else SM89_SMEM) and local == 0, (key, used, local)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("lens, queries", [([1000, 1, 37, 515, 4096], [1] * 5), ([700, 300, 1, 64], [1, 100, 1, 20])])
def test_gpu_real_widths_within_bf16_rounding(mla, heads, lens, queries):
    """V2-Lite's and V3's heads at L 512, R 64 in bf16 on the GPU (compiled kernels, the plan's heads and splits):
    decode and mixed steps within `_half_bound` of the float64 attention."""
    q, cache, tables, lens_t, starts = _batch(torch.Generator().manual_seed(heads), lens, queries, heads, 512, 64,
                                              torch.bfloat16)
    got = mla.mla_paged_attention(q, cache, tables, lens_t, starts, 576 ** -0.5, 512)
    want = _float64(q, cache, tables, lens_t, starts, 576 ** -0.5, 512)
    assert float((got.cpu().double() - want).abs().max()) <= _half_bound(cache, tables, lens_t, 512)


@pytest.mark.gpu
def test_gpu_decode_replays_in_a_cuda_graph_over_new_lengths(mla):
    """A V3 decode step (max_query_len 1, out given) recorded in a CUDA graph, then replayed after the lengths and
    block tables changed in place (a sequence grown across a block, one shrunk to one key): the replay's output
    equals the definition at the new lengths (nothing read on the host, the grid fixed by the sizes)."""
    gen = torch.Generator().manual_seed(9)
    q, cache, tables, lens, starts = _batch(gen, [300, 40, 1000], [1, 1, 1], 128, 512, 64, torch.bfloat16)
    out = torch.empty(3, 128, 512, dtype=torch.bfloat16, device=DEV)
    mla.mla_paged_attention(q, cache, tables, lens, starts, 0.05, 512, 1, out=out)  # (compiled before recording)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.mla_paged_attention(q, cache, tables, lens, starts, 0.05, 512, 1, out=out)
    _, cache2, tables2, _, _ = _batch(gen, [333, 1, 999], [1, 1, 1], 128, 512, 64, torch.bfloat16)
    assert cache2.shape == cache.shape and tables2.shape == tables.shape  # (87 blocks, 64 a table: as recorded)
    cache.copy_(cache2)
    tables.copy_(tables2)
    lens.copy_(torch.tensor([333, 1, 999], dtype=torch.int32))
    q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = _float64(q, cache, tables, lens, starts, 0.05, 512)
    assert float((out.cpu().double() - want).abs().max()) <= _half_bound(cache, tables, lens, 512)


def test_bench_refuses_without_cuda_and_names_the_interpreted_check(monkeypatch, capsys):
    from infer.bench import mla as bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--interpret" in err


@pytest.mark.parametrize("argv, message", [(["--out", "{tmp}/missing/m.csv"], "missing does not exist"),
                                           (["--out", "{tmp}/m.csv", "--batch", "0"], "--batch 0: give batch sizes"),
                                           (["--out", "{tmp}/m.csv", "--context", "0"], "--context 0: give")])
def test_bench_refuses_bad_arguments_before_timing(tmp_path, monkeypatch, capsys, argv, message):
    from test_probes_session62_probe import _on_a_gpu_that_never_times
    from infer.bench import mla as bench
    _on_a_gpu_that_never_times(monkeypatch)
    assert bench.main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_bench_row_on_interpreted_kernels(mla, monkeypatch):
    """A row at a tiny shape with a stand-in timer of 1 ms a call: the MLA output within bf16 rounding of the
    generic kernel's (v = k, first L dims), gain 1, the bytes those of the cache rows, q, output and tables, GBps
    and of_copy from them, the plan decode_plan's."""
    from infer.bench import mla as bench
    monkeypatch.setitem(bench.MODELS, "tiny", (4, 32, 16))
    row = bench.measure("tiny", 3, 40, 1e12, lambda fn: (fn(), 1.0)[1], torch.Generator(device=DEV).manual_seed(0),
                        DEV)
    moved = 3 * (40 * 48 * 2 + 4 * (64 + 16) * 2 + 3 * 4)
    assert bench.bytes_moved("tiny", 3, 40) == moved
    assert row["gain"] == 1.0 and row["mla_us"] == row["generic_us"] == 1000.0 and row["max_abs_err"] <= 2 ** -6
    assert row["GBps"] == round(moved / 1e6, 1) and row["of_copy"] == round(moved / 1e-3 / 1e12, 2)
    assert (row["heads"], row["splits"]) == mla.decode_plan(3, 4, 48, torch.device(DEV))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU check")
def test_bench_interpreted_check_against_the_definition(mla, monkeypatch, capsys):
    """--interpret on CPU: its rows (tiny V3 and V2-Lite heads, batch 1 and 3) within bf16 rounding of the
    definition and of the generic kernel (2 x bf16's eps: outputs below 2 in magnitude, each rounded to bf16); the
    dispatch and the models restored after."""
    from infer.bench import mla as bench
    forced = kernels.use_triton
    rows, real = [], bench.interpreted_check
    monkeypatch.setattr(bench, "interpreted_check", lambda: rows.extend(real()) or rows)
    assert bench.main(["--interpret", "--out", "unused.csv"]) == 0
    table = capsys.readouterr().out
    assert "v2-lite-tiny" in table and "definition_err" in table
    assert len(rows) == 4 and all(r["definition_err"] <= 2 ** -6 and r["max_abs_err"] <= 2 ** -6 for r in rows)
    assert sorted(bench.MODELS) == ["v2-lite", "v3"] and kernels.use_triton is forced


def test_bench_row_without_the_generic_kernel_or_where_it_fails(mla, monkeypatch, capsys):
    """--no-generic: no generic time, gain nor error; a generic kernel that raises: its error on stderr, the MLA
    kernel's row still there."""
    from infer.bench import mla as bench
    from infer.kernels import attention
    monkeypatch.setitem(bench.MODELS, "tiny", (4, 32, 16))
    timer, gen = (lambda fn: (fn(), 1.0)[1]), torch.Generator(device=DEV).manual_seed(0)
    row = bench.measure("tiny", 2, 20, 1e12, timer, gen, DEV, generic_too=False)
    assert "generic_us" not in row and "gain" not in row and row["max_abs_err"] != row["max_abs_err"]

    def broken(*a, **k):
        raise RuntimeError("out of resources: shared memory")
    monkeypatch.setattr(attention, "paged_attention", broken)
    row = bench.measure("tiny", 2, 20, 1e12, timer, gen, DEV)
    assert "gain" not in row and row["mla_us"] == 1000.0
    assert "tiny batch 2 context 20: the generic kernel failed: out of resources" in capsys.readouterr().err
