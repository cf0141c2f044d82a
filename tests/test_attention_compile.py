"""The Triton paged attention compiles for an H100 (sm_90) on this machine without a GPU (the compile side of a
Triton driver, scripts/kernel-sass's CompileOnlyDriver, as in test_gptq_compile.py): the kernel variants a step
compiles depend on its tile height only, never on the batch's block-table width, so the steps that
`LLMEngine.warm_kernels()` runs at start leave nothing to compile on a user's request. Triton specializes an integer
argument that is 1 or a multiple of 16; the tables' row stride is the width of the batch's longest sequence in
blocks, so without `do_not_specialize` a prompt of 241-256 tokens (block size 16) compiled a variant of its own."""

import textwrap

import pytest

from helpers import COMPILE_ONLY_LAUNCHES, run_compile_only

pytest.importorskip("triton")

SCRIPT = COMPILE_ONLY_LAUNCHES + textwrap.dedent('''
    from infer.kernels import attention

    def step(widths, qlens, bs=16, hq=4, hk=2, d=32):
        """One step's attention: sequence i of widths[i] blocks with qlens[i] new tokens; the kernels it compiled."""
        q = torch.randn(sum(qlens), hq, d, dtype=torch.float16)
        cache = torch.randn(64, bs, hk, d, dtype=torch.float16)
        tables = torch.zeros(len(widths), max(widths), dtype=torch.int32)
        lens = torch.tensor([w * bs for w in widths], dtype=torch.int32)
        qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
        before = len(compiled)
        attention.paged_attention(q, cache, cache, tables, lens, qsl, 0.1, max(qlens))
        return compiled[before:]

    # warm_kernels (prefix caching off, no CUDA graphs): a long prompt (3 blocks), a short one alone (1 block),
    # decodes over 3 blocks (48 keys: one partition a sequence), over 33 (528 keys: 9 partitions of a key block)
    warm = [step([3], [41]), step([1], [9]), step([3, 1], [1, 1]), step([33], [1])]
    # a user's steps: long and short queries, decodes, over block tables 1, 2, 16 and 32 blocks wide; eager decodes
    # over 4, 10, 19 and 32 partitions (the reduce merges 16 at a time; Triton would specialize a count of 32)
    user = {"long w16": step([16], [41]), "long w2": step([2, 1], [20, 9]), "short w2": step([2, 1], [9, 1]),
            "short w16": step([16, 3], [5, 9]), "decode w16": step([16, 1], [1, 1]),
            "decode w32": step([32, 2, 5], [1, 1, 1]), "decode 4 parts": step([100, 2], [1, 1]),
            "decode 10 parts": step([300], [1]), "decode 19 parts": step([600, 3], [1, 1]),
            "decode 32 parts": step([1024], [1])}
    print(json.dumps({"warm": warm, "user": user}))
''')


def test_block_table_width_never_compiles_an_attention_variant():
    out = run_compile_only(SCRIPT, 600)
    assert out["warm"] == [["_unified_kernel"], ["_unified_kernel"], ["_decode_kernel"],  # two tile heights
                           ["_decode_kernel"]], out  # one partition, then several (merged in the same kernel)
    assert out["user"] == {name: [] for name in out["user"]}, out


class _Variants:
    """Stands in for a Triton kernel: records the constexpr arguments (the compiled variant) of every launch."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, set()

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.seen.add(tuple(sorted(meta.items())))
            return self.kernel[grid](*args, **meta)
        return launch


def test_warm_kernels_reach_every_attention_tile_a_request_can_launch(monkeypatch):
    """LLMEngine.warm_kernels() (run at a GPU engine's start, here on CPU with the kernels interpreted) launches
    every variant of the unified attention kernel that requests then launch: long prompts, short prompts arriving
    beside decodes, with prefix caching off (the warm-up's cached-prefix request is not there to reach the short
    tile)."""
    import torch

    from infer import LLM, SamplingParams, kernels
    from infer.kernels import attention
    from infer.models.tiny import ensure_builtin

    from helpers import random_prompts
    if torch.cuda.is_available():
        pytest.skip("a GPU engine warms itself at start")
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    spy = _Variants(attention._unified_kernel)
    monkeypatch.setattr(attention, "_unified_kernel", spy)
    llm = LLM(str(ensure_builtin("tiny-llama")), block_size=4, num_kv_blocks=64, max_model_len=64,
              enable_prefix_caching=False)
    llm.engine.warm_kernels()
    warm, spy.seen = spy.seen, set()
    eng, params = llm.engine, SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = random_prompts(512, (30, 12, 3, 20), seed=3)
    eng.add_request("a", prompts[0], params)
    eng.add_request("b", prompts[1], params)
    eng.step()
    for i, p in enumerate(prompts[2:]):  # arrive while a and b decode: short and long queries in mixed steps
        eng.add_request(str(i), p, params)
        eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    assert len(warm) == 2 and spy.seen and spy.seen <= warm, (warm, spy.seen)
