"""Session 58: the fused MoE kernels' BLOCK_M chosen per call from the step's static shape (kernels.moe.choose_block_m:
16 at decode, up to 128 rows for a prefill's many rows per expert) through the alignment, both kernels and the
experts' LoRA pairs; act-order int4 experts sorted by group at load (reference.Int4Experts.sorted_by_group,
models.moe.Int4Stack.perm), the kernel gathering x's columns through the permutation so that each K step lies in one
group. Interpreted kernels against the torch reference (outputs poisoned first), tiles compiled for an H100, and the
engine's tokens on the GPU code path equal to the CPU path's."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import reference

from helpers import nan_filled_empty
from test_probes_session56_moeq import gptq_moe, int4_experts, routing  # noqa: F401 (gptq_moe: a fixture)

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")


def check_alignment(ids: torch.Tensor, e: int, block_m: int) -> None:
    """moe.aligned(ids, e, block_m): each expert's pairs padded to whole blocks of block_m rows, every block's rows
    of its one expert, every pair once, the padded end where the counts say."""
    from infer.kernels import moe
    al = moe.aligned(ids, e, block_m)
    pairs, experts, post = al.sorted_pairs, al.block_expert, al.post
    assert al.block_m == block_m and len(pairs) % block_m == 0 and len(experts) == len(pairs) // block_m
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert int(post) == int(((counts + block_m - 1) // block_m * block_m).sum())
    flat, p = ids.flatten(), ids.numel()
    for b in range(int(post) // block_m):
        rows = pairs[b * block_m:(b + 1) * block_m]
        real = rows[rows < p].long()
        assert len(real) and bool((flat[real] == experts[b]).all())
    assert sorted(pairs[pairs < p].tolist()) == list(range(p))


def test_block_m_is_chosen_by_the_steps_shape_and_keeps_the_k_steps():
    """choose_block_m: 16 at decode, the largest power of two at most an expert's rows on average up to 128, never
    less for more tokens; the tiles of a bigger block keep the layer's K steps (each row's sums over K alike) and a
    64-wide N tile; 8 warps for 128-row tiles. A block_m that is no power of two from 16 is refused."""
    from infer.kernels import moe
    # Qwen3-30B-A3B (top-8 of 128), Mixtral (top-2 of 8)
    assert [moe.choose_block_m(t, 8, 128) for t in (1, 64, 255, 256, 512, 1024, 2048, 8192)] == \
        [16, 16, 16, 16, 32, 64, 128, 128]
    assert [moe.choose_block_m(t, 2, 8) for t in (1, 63, 64, 128, 256, 512, 4096)] == [16, 16, 16, 32, 64, 128, 128]
    for e, k in ((128, 8), (8, 2), (3, 1)):
        chosen = [moe.choose_block_m(t, k, e) for t in range(1, 3000, 7)]
        assert chosen == sorted(chosen) and set(chosen) <= {16, 32, 64, 128}
        assert all(m == 16 or m <= t * k / e for m, t in zip(chosen, range(1, 3000, 7)))
    for n, k, top_k in ((1536, 2048, 8), (2048, 768, 8), (4096, 14336, 2), (96, 64, 2)):
        bn16, bk16 = moe.tiles(n, k, top_k)
        for m in (32, 64, 128):
            bn, bk = moe.tiles(n, k, top_k, m)
            assert bk == bk16 and bn == min(64, max(16, 1 << (n - 1).bit_length())) and bn >= bn16
            assert moe.int4_tiles(n, k, 128, top_k, m)[1:] == moe.int4_tiles(n, k, 128, top_k)[1:]
    # the variants of an engine's steps (warm_kernels compiles each at its fewest tokens)
    assert moe.block_m_steps(160, 2, 8) == {16: 1, 32: 128} and moe.block_m_steps(8, 2, 8) == {16: 1}
    assert moe.block_m_steps(8192, 8, 128) == {16: 1, 32: 512, 64: 1024, 128: 2048}
    assert moe.launch_options(128, True) == {"num_warps": 8, "num_stages": 3}
    assert moe.launch_options(16, True) == {"num_warps": 4, "num_stages": moe.INT4_STAGES}
    for bad in (8, 48):
        with pytest.raises(ValueError, match="no power of two from 16"):
            moe.aligned(torch.zeros(3, 2, dtype=torch.int64), 4, bad)


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_alignment_pads_each_expert_to_the_chosen_block(block_m):
    """Uneven segments and an expert no token chose, aligned to blocks of 16, 32 and 64 rows."""
    _, ids = routing(37, 6, 3, seed=block_m)
    check_alignment(ids, 6, block_m)


def sorted_experts(e: int, k: int, n: int, group_size: int, seed: int) -> tuple:
    """(act-order int4 experts as a checkpoint stores them (g_idx read per row), the same sorted by group)."""
    raw = int4_experts(e, k, n, group_size, True, False, True, seed)
    done = raw.sorted_by_group(group_size)
    assert done.perm is not None and done.group_size == group_size and raw.group_size == 0
    assert torch.equal(done.g_idx, (torch.arange(k) // group_size).int().expand(e, k))
    return raw, done


CASES = [  # tokens, experts, top-k, hidden, expert width, group size, block_m
    (9, 4, 2, 64, 32, 16, 16),  # groups of 16: K steps of one group (ONE_GROUP)
    (23, 5, 3, 64, 32, 32, 32),  # uneven segments, an expert with no tokens, k = 3, blocks of 32
    (40, 3, 2, 128, 48, 64, 64),  # 64-row blocks, the down's K 48 in steps of its groups of 16
]


@interpreted
@pytest.mark.parametrize("case", CASES)
def test_sorted_act_order_experts_equal_the_reference(case):
    """Act-order int4 experts sorted by group (the kernel's ONE_GROUP path, x's columns gathered through perm) equal
    the float reference over the checkpoint's experts dequantized, at the case's block_m and at the chosen one; so
    do the unsorted experts (g_idx read per row), the float kernel at that block_m, and the CPU reference over the
    sorted experts (the same function); outputs poisoned first."""
    from infer.kernels import moe
    t, e, k, h, i, gs, bm = case
    raw13, w13 = sorted_experts(e, h, 2 * i, gs, seed=t)
    raw2, w2 = sorted_experts(e, i, h, 16, seed=t + 1)  # (groups of 16: two or more in the down's K)
    assert all(moe.int4_tiles(q.out_features, q.in_features, q.group_size, k, bm)[2] for q in (w13, w2))
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t + 2))
    w, ids = routing(t, e, k, seed=t + 3)
    f13, f2 = raw13.dequantize(x.dtype), raw2.dequantize(x.dtype)
    assert torch.equal(w13.dequantize(x.dtype), f13) and torch.equal(w2.dequantize(x.dtype), f2)
    want = reference.fused_moe(x, f13, f2, w, ids)
    with nan_filled_empty(moe):
        for got in (moe.fused_moe_int4(x, w13, w2, w, ids, block_m=bm), moe.fused_moe_int4(x, w13, w2, w, ids),
                    moe.fused_moe_int4(x, raw13, raw2, w, ids, block_m=bm), moe.fused_moe(x, f13, f2, w, ids,
                                                                                           block_m=bm)):
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.allclose(reference.fused_moe_int4(x, w13, w2, w, ids), want, atol=1e-6)


@interpreted
def test_the_chosen_block_reaches_the_kernels(monkeypatch):
    """A step of 64 tokens over 4 experts (top-2: 32 rows an expert) aligns its pairs to blocks of 32 and the
    kernels compute every row at that block_m (poisoned outputs), its experts' adapters of 2 slots (8 virtual
    experts: 16 rows each) to blocks of 16; a decode-sized step keeps 16."""
    from infer.kernels import moe
    raw13, w13 = sorted_experts(4, 64, 64, 32, seed=1)
    raw2, w2 = sorted_experts(4, 32, 64, 16, seed=2)
    seen = []
    real = moe.align
    monkeypatch.setattr(moe, "align", lambda ids, e, block_m: seen.append(block_m) or real(ids, e, block_m))
    for t, want_m in ((64, [32, 16]), (3, [16])):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, 64, generator=g)
        w, ids = routing(t, 4, 2, seed=t, empty=None)
        lora = reference.MoELoRA(*(torch.randn(*shape, generator=g) * 0.3 for shape in (
            (2, 4, 4, 64), (2, 4, 64, 4), (2, 4, 4, 32), (2, 4, 64, 4))), torch.arange(t) % 2) if t > 3 else None
        want = reference.fused_moe(x, raw13.dequantize(x.dtype), raw2.dequantize(x.dtype), w, ids, lora)
        seen.clear()
        with nan_filled_empty(moe):
            got = moe.fused_moe_int4(x, w13, w2, w, ids, lora)
        assert seen == want_m and torch.allclose(got, want, atol=1e-4, rtol=1e-4), (seen, (got - want).abs().max())


@interpreted
@pytest.mark.parametrize("block_m", [16, 32])
def test_expert_adapters_at_either_block_equal_the_reference(block_m):
    """The experts' LoRA pairs (aligned by slot and expert at the call's block_m) over sorted act-order int4 experts
    and over float ones equal the reference, tokens without adapter among them."""
    from infer.kernels import moe
    t, e, k, h, i, s, r = 21, 4, 2, 32, 32, 2, 4
    g = torch.Generator().manual_seed(block_m)
    raw13, w13 = sorted_experts(e, h, 2 * i, 16, seed=3)
    raw2, w2 = sorted_experts(e, i, h, 16, seed=4)
    f13, f2 = raw13.dequantize(torch.float32), raw2.dequantize(torch.float32)
    x = torch.randn(t, h, generator=g)
    w, ids = routing(t, e, k, seed=5)
    slots = torch.randint(-1, s, (t,), generator=g)
    slots[0] = -1
    lora = reference.MoELoRA(*(torch.randn(*shape, generator=g) * 0.3 for shape in
                               ((s, e, r, h), (s, e, 2 * i, r), (s, e, r, i), (s, e, h, r))), slots)
    want = reference.fused_moe(x, f13, f2, w, ids, lora)
    assert (want - reference.fused_moe(x, f13, f2, w, ids)).abs().max() > 1e-2
    seen = []
    real = moe.align
    with nan_filled_empty(moe), pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "align", lambda ids, e, block_m: seen.append(block_m) or real(ids, e, block_m))
        for got in (moe.fused_moe(x, f13, f2, w, ids, lora, block_m=block_m),
                    moe.fused_moe_int4(x, w13, w2, w, ids, lora, block_m=block_m)):
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert seen == [block_m] * 4  # the experts' and the pairs' alignments, each call


def test_an_irregular_grouping_stays_read_per_row():
    """Experts whose g_idx is no permutation of plain groups stay as they are (the kernel reads g_idx per row), and
    plain ones need no sorting."""
    raw = int4_experts(3, 64, 16, 16, True, True, False, seed=0)
    odd = raw._replace(g_idx=raw.g_idx.clone().index_fill_(1, torch.tensor([0]), 3))
    assert odd.sorted_by_group(16) is odd
    plain = int4_experts(3, 64, 16, 16, False, True, False, seed=0)
    assert plain.sorted_by_group(16) is plain
    from infer.models.moe import Int4Stack
    from infer.quant.config import GPTQConfig
    stack = Int4Stack(3, 64, 16, GPTQConfig(group_size=16, desc_act=True))  # (the load's: left unsorted, read per row)
    for buf, t in zip((stack.words, stack.zeros, stack.scales, stack.g_idx), odd[:4]):
        buf.copy_(t)
    stack.sort_by_group(16)
    assert stack.perm is None and stack.group_size == 0 and torch.equal(stack.g_idx, odd.g_idx)


def test_the_bigger_tiles_compiled_for_an_h100_fit_its_shared_memory():
    """Compiled for sm_90 (bfloat16, H 256, groups of 128 and 64, act-order sorted: the gathered A tile): the int4
    and the float kernels' 64- and 128-row tiles compile, their shared memory within an H100's 227 KiB a block, 8
    warps at 128 rows."""
    import inspect
    import textwrap

    from helpers import COMPILE_ONLY_LAUNCHES, run_compile_only
    pytest.importorskip("triton")
    script = COMPILE_ONLY_LAUNCHES + "from infer.kernels import packing, reference\n" + inspect.getsource(
        int4_experts) + textwrap.dedent('''
        from infer.kernels import moe
        got = []
        def keep(self, *args, grid, warmup, **kwargs):
            kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
            if self.fn.__name__.startswith("_moe_gemm"):  # (its shared memory: what a launch checks)
                got.append([self.fn.__name__, kwargs["BLOCK_M"], kwargs.get("PERM", False), kernel.metadata.shared,
                            kernel.metadata.num_warps])
            return kernel
        jit.JITFunction.run = keep
        w13 = int4_experts(4, 256, 256, 128, True, False, True, 0).sorted_by_group(128)
        w2 = int4_experts(4, 128, 256, 64, True, False, True, 1).sorted_by_group(64)
        f13, f2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
        x = torch.randn(5, 256, dtype=torch.bfloat16)
        w, ids = torch.topk(torch.randn(5, 4).softmax(-1), 2, -1)
        for bm in (64, 128):
            moe.fused_moe_int4(x, w13, w2, w.to(torch.bfloat16), ids, block_m=bm)
            moe.fused_moe(x, f13, f2, w.to(torch.bfloat16), ids, block_m=bm)
        print(json.dumps({"got": got}))
    ''')
    got = run_compile_only(script, 900)["got"]
    kernels = [("_moe_gemm_int4", True)] * 2 + [("_moe_gemm", False)] * 2  # (gate_up, down) of each op
    assert [(name, bm, perm) for name, bm, perm, _, _ in got] == [(name, bm, perm) for bm in (64, 128)
                                                                  for name, perm in kernels]
    for name, bm, perm, shared, warps in got:
        assert 0 < shared <= 227 * 1024, (name, bm, shared)
        assert warps == (8 if bm == 128 else 4), (name, bm, warps)


@interpreted
def test_a_long_prefill_of_act_order_experts_on_the_gpu_path_equals_the_cpu_path(gptq_moe, monkeypatch):
    """The GPTQModel act-order checkpoint (asym, groups of 16) on the GPU code path (interpreted kernels, decode
    through emulated CUDA graphs): its experts sorted by group at load, the 32-row variant warmed (as a GPU engine's
    start does), a prefill of 160 tokens in one step (40 rows an expert: blocks of 32) and decode steps (16): the
    CPU path's tokens, logprobs close."""
    from infer import LLM, SamplingParams
    from infer.kernels import moe as moe_kernels
    from quant_helpers import int4_kernel_path
    from helpers import random_prompts
    path = gptq_moe["asym-act"]
    prompts = random_prompts(512, (150, 151), seed=7)[:1] + random_prompts(512, (9, 10), seed=8)[:1]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=1)
    opts = dict(block_size=8, max_num_batched_tokens=160, max_num_seqs=2, max_model_len=176)
    with LLM(str(path), **opts) as llm:
        cpu = llm.generate(prompts, params)
        assert llm.engine.runner.model.layers[0].mlp.warm_block_sizes(160) == []  # (no Triton: nothing to compile)
    int4_kernel_path(monkeypatch)
    chosen = []
    real = moe_kernels.align
    monkeypatch.setattr(moe_kernels, "align", lambda ids, e, block_m: chosen.append(block_m) or real(ids, e, block_m))
    with LLM(str(path), cuda_graph_max_tokens=4, **opts) as llm:
        experts = llm.engine.runner.model.layers[0].mlp.experts
        for stack in (experts.w13_int4, experts.w2_int4):
            assert stack.perm is not None and stack.group_size == 16
            assert torch.equal(stack.g_idx, (torch.arange(stack.g_idx.shape[1]) // 16).int().expand_as(stack.g_idx))
        # warm_kernels' (a GPU engine's start): the 32-row variant a step of 128 to 160 tokens takes, on zeros
        chosen.clear()
        llm.engine._warm_moe_blocks()
        assert chosen == [32] and llm.engine.runner.model.layers[0].mlp.warm_block_sizes(160) == [128]
        chosen.clear()
        llm.engine.runner.capture_graphs(opts["max_model_len"], emulate=True)
        gpu = llm.generate(prompts, params)
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert 32 in chosen and 16 in chosen, chosen
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    for a, b in zip(gpu, cpu):
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert abs(ra["logprob"] - rb["logprob"]) < 1e-3


def test_the_moe_bench_searches_block_m_and_refuses_other_sizes(capsys):
    """`python -m infer.bench.moe --block-m ...` times these BLOCK_M candidates too; a size the kernels do not take
    is refused by name before anything runs."""
    from infer.bench import moe as bench
    with pytest.raises(SystemExit) as exc:
        bench.main(["--block-m", "16", "48"])
    assert exc.value.code == 2 and "--block-m: invalid choice: 48" in capsys.readouterr().err


@interpreted
def test_reload_from_act_order_to_plain_experts_drops_the_permutation(tmp_path, monkeypatch):
    """reload_weights of plain-group experts over act-order ones (the GPU code path, interpreted): the fresh load's
    absent permutation is taken with its tensors (Int4Stack.perm a buffer, None), not the old one kept over rows no
    longer sorted: the fresh engine's tokens and logprobs."""
    import shutil

    from infer import LLM, SamplingParams
    from helpers import random_prompts
    from quant_helpers import int4_kernel_path
    from test_probes_session55_moe import build
    from test_probes_session56_review_moeq import rtn_gptq
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1)
    rtn_gptq(tmp_path / "base", tmp_path / "plain")
    rtn_gptq(tmp_path / "base", tmp_path / "act", act_order=True)
    shutil.copytree(tmp_path / "act", tmp_path / "m")
    int4_kernel_path(monkeypatch)
    prompts = random_prompts(512, (5, 14), seed=4)[:2]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=1)
    opts = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=32)
    with LLM(str(tmp_path / "plain"), **opts) as llm:
        want = llm.generate(prompts, params)
    with LLM(str(tmp_path / "m"), **opts) as llm:
        stack = llm.engine.runner.model.layers[0].mlp.experts.w13_int4
        assert stack.perm is not None and stack.group_size == 32
        for f in ("model.safetensors", "config.json"):
            shutil.copy(tmp_path / "plain" / f, tmp_path / "m" / f)
        llm.engine.reload_weights()
        stack = llm.engine.runner.model.layers[0].mlp.experts.w13_int4
        assert stack.perm is None and stack.group_size == 32
        got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert abs(ra["logprob"] - rb["logprob"]) < 1e-5
