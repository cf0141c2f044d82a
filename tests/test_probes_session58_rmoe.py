"""Session 58 review of the fused MoE's BLOCK_M per call: the warm-up (LLMEngine.warm_kernels ->
SparseMoeBlock.warm_block_sizes) launches every kernel variant a long prefill can, the experts' adapters' variants
too (their pairs choose BLOCK_M over the slots' virtual experts, and the down matmul of a step with adapters is the
unweighted variant)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams

from helpers import random_prompts
from lora_helpers import hf_float
from test_probes_session55_moe import build
from test_probes_session56_moeq import gptq_moe  # noqa: F401 (a fixture)
from test_probes_session57_moelora import EXPERTS, _adapters

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")


def record_launches(monkeypatch) -> list:
    """Each fused MoE matmul launched from now on as its compiled variant's key: (its weight's [N, K], BLOCK_M, the
    ROW_DIV and WEIGHTED constexprs, x's dtype, a tuned entry's tiles, warps and stages)."""
    from infer.kernels import moe
    launched = []
    real = moe._gemm

    def gemm(a, w, out, weights, aligned, top_k, row_div, weighted, cfg=None, **epilogue):  # (bias, act: gpt-oss)
        launched.append((tuple(w.shape[1:]), aligned.block_m, row_div, weighted, a.dtype,
                         tuple(sorted((k, v) for k, v in (cfg or {}).items() if k != "BLOCK_M"))))
        return real(a, w, out, weights, aligned, top_k, row_div, weighted, cfg, **epilogue)
    monkeypatch.setattr(moe, "_gemm", gemm)
    return launched


@interpreted
def test_the_warm_up_launches_what_a_long_prefill_with_an_expert_adapter_launches(tmp_path, monkeypatch):
    """An engine with adapter slots on the experts alone (--lora-target-modules experts; the GPU code path,
    interpreted, eager): a prefill of 130 tokens with an expert adapter (top-2 of 8 experts, one slot: 32 rows an
    expert and a virtual expert, blocks of 32 for both) and a decode step (16) give the CPU path's tokens and
    logprobs, and launch only variants the engine's warm-up of the fused MoE launched first: the adapters' shrinks
    and expands and the experts' unweighted down matmul (a step with adapters weights after the delta). The warm-up
    ran the experts without their adapters: those variants were compiled on the user's first request with one."""
    from quant_helpers import int4_kernel_path
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1, norm_topk_prob=True)
    paths = _adapters(tmp_path, hf_float(tmp_path / "base"), {"a": dict(r=4, lora_alpha=8, target_parameters=EXPERTS)})
    prompt = random_prompts(512, (130, 131), seed=3)[0]
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, logprobs=1)
    opts = dict(block_size=8, max_num_batched_tokens=136, max_num_seqs=2, max_model_len=160, max_loras=1,
                max_lora_rank=4, loras={"a": str(paths["a"])}, lora_target_modules=["experts"])
    with LLM(str(tmp_path / "base"), **opts) as llm:
        cpu = llm.generate([prompt], params, lora="a")[0]
    int4_kernel_path(monkeypatch)
    launched = record_launches(monkeypatch)
    with LLM(str(tmp_path / "base"), **opts) as llm:
        launched.clear()
        llm.engine._warm_moe_blocks()
        warmed = set(launched)
        launched.clear()
        gpu = llm.generate([prompt], params, lora="a")[0]
        steps = set(launched)
    assert gpu.token_ids == cpu.token_ids
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-4 for a, b in zip(gpu.logprobs, cpu.logprobs))
    lora_shapes = {(4, 64), (64, 4), (4, 32)}  # the shrinks [r, H] and [r, I], the expands [2I, r] and [H, r]
    assert {bm for shape, bm, *_ in steps} == {16, 32} and {s for s, *_ in steps} >= lora_shapes, steps
    assert steps <= warmed, sorted(steps - warmed)


@interpreted
def test_the_warm_up_launches_what_a_long_prefill_of_a_moe_draft_model_launches(tmp_path, monkeypatch):
    """Draft-model speculation with a mixture of experts of other shapes than the target's (experts 16 wide, not
    32): a prefill of 130 tokens runs the draft model's sparse layer at blocks of 32 rows too, a variant the warm-up
    launched first (it warmed the target's sparse layers alone)."""
    from quant_helpers import int4_kernel_path
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1, norm_topk_prob=True)
    build(tmp_path / "draft", "qwen3_moe", num_hidden_layers=1, norm_topk_prob=True, moe_intermediate_size=16)
    int4_kernel_path(monkeypatch)
    launched = record_launches(monkeypatch)
    prompt = random_prompts(512, (130, 131), seed=4)[0]
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 2}
    with LLM(str(tmp_path / "base"), block_size=8, max_num_batched_tokens=136, max_num_seqs=2, max_model_len=160,
             speculative_config=spec) as llm:
        launched.clear()
        llm.engine._warm_moe_blocks()
        warmed = set(launched)
        launched.clear()
        llm.generate([prompt], SamplingParams(max_new_tokens=1))
        prefill = {key for key in launched if key[1] > 16}
    assert {(shape, bm) for shape, bm, *_ in prefill} >= {((32, 64), 32), ((64, 16), 32)}, prefill  # the draft's
    assert prefill <= warmed, sorted(prefill - warmed)


@interpreted
def test_piecewise_graphs_of_32_row_blocks_with_expert_adapters_over_act_order_experts_equal_the_cpu_path(
        gptq_moe, monkeypatch):
    """The GPTQModel act-order checkpoint (experts sorted by group at load) with two expert adapters on the GPU code
    path (interpreted), its steps through emulated CUDA graphs: decode graphs and piecewise graphs of up to 136
    tokens, whose bucket of 136 tokens (a step of the mixed batch's prefills) chooses blocks of 32 rows for the
    experts (272 pairs over 8: 34 rows each) and of 16 for the adapters' pairs (over two slots' 16 virtual experts).
    The mixed batch (a 130-token prompt with an adapter, a short one without, a short one with the other) gives the
    CPU path's tokens, logprobs close."""
    from infer.kernels import moe
    from quant_helpers import dequantized_float_model, int4_kernel_path
    path = gptq_moe["asym-act"]
    hf = dequantized_float_model(path.parent / "base", path)
    paths = _adapters(path.parent / "rmoe-adapters", hf, {
        "a": dict(r=4, lora_alpha=8, target_parameters=EXPERTS),
        "b": dict(r=4, lora_alpha=16, target_parameters=["mlp.experts.down_proj"])})
    prompts = random_prompts(512, (130, 131), seed=5)[:1] + random_prompts(512, (5, 9), seed=6)[:2]
    names = ["a", None, "b"]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=1)
    opts = dict(block_size=8, max_num_batched_tokens=136, max_num_seqs=3, max_model_len=160, max_loras=2,
                max_lora_rank=4, loras={k: str(p) for k, p in paths.items()})
    with LLM(str(path), **opts) as llm:
        cpu = llm.generate(prompts, params, lora=names)
    int4_kernel_path(monkeypatch)
    chosen = []
    real = moe.align
    monkeypatch.setattr(moe, "align", lambda ids, e, block_m: chosen.append((e, block_m)) or real(ids, e, block_m))
    with LLM(str(path), cuda_graph_max_tokens=136, **opts) as llm:
        assert llm.engine.runner.model.layers[0].mlp.experts.w13_int4.perm is not None
        llm.engine.runner.capture_graphs(opts["max_model_len"], emulate=True)
        assert llm.engine.runner.pieces is not None  # (the pieces' check passed)
        llm.engine.runner.pieces.replays.clear()
        chosen.clear()
        gpu = llm.generate(prompts, params, lora=names)
        pieces = llm.engine.runner.pieces.replays
        assert max(pieces) >= 128 and sum(llm.engine.runner.graphs.replays.values()) > 0, pieces
    assert (8, 32) in chosen and (16, 16) in chosen, chosen  # the experts' blocks of 32, the pairs' of 16
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    for a, b in zip(gpu, cpu):
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert abs(ra["logprob"] - rb["logprob"]) < 1e-3


def as_gptq_v2(src, out) -> None:
    """`src` (a v1 GPTQ checkpoint) rewritten as gptq_v2: every qzeros as the zeros themselves (checkpoint_format
    gptq_v2), the same weights once dequantized."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from infer.kernels import packing
    shutil.copytree(src, out)
    tensors = {name: packing.zeros_v1_to_v2(packing.v1_words_to_fields(t, 4), 4) if name.endswith(".qzeros") else t
               for name, t in load_file(out / "model.safetensors").items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (out / "config.json").write_text(json.dumps(cfg))


@interpreted
def test_reload_from_gptq_v1_to_v2_experts_takes_their_zero_points_format(tmp_path, monkeypatch):
    """reload_weights of a gptq_v2 checkpoint over the same weights as v1 (act-order, so the experts sorted too; the
    GPU code path, interpreted): the int4 stacks hold the new load's zero points as they are (v2), and so must their
    config (Int4Stack.config, the kernel's ZEROS_V1): the old v1 config kept added one to every expert's zero point.
    The fresh engine's tokens and logprobs on either checkpoint."""
    import shutil

    from quant_helpers import int4_kernel_path
    from test_probes_session56_review_moeq import rtn_gptq
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1)
    rtn_gptq(tmp_path / "base", tmp_path / "v1", act_order=True)
    as_gptq_v2(tmp_path / "v1", tmp_path / "v2")
    shutil.copytree(tmp_path / "v1", tmp_path / "m")
    int4_kernel_path(monkeypatch)
    prompts = random_prompts(512, (5, 14), seed=4)[:2]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=1)
    opts = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=32)
    with LLM(str(tmp_path / "v2"), **opts) as llm:
        assert not llm.engine.runner.model.layers[0].mlp.experts.w13_int4.config.zeros_v1
        want = llm.generate(prompts, params)
    with LLM(str(tmp_path / "m"), **opts) as llm:
        experts = llm.engine.runner.model.layers[0].mlp.experts
        assert experts.w13_int4.config.zeros_v1 and experts.w13_int4.perm is not None
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in want]  # (v1: the same)
        for f in ("model.safetensors", "config.json"):
            shutil.copy(tmp_path / "v2" / f, tmp_path / "m" / f)
        llm.engine.reload_weights()
        assert not experts.w13_int4.config.zeros_v1 and not experts.w2_int4.config.zeros_v1
        got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert abs(ra["logprob"] - rb["logprob"]) < 1e-5


@pytest.mark.parametrize("experts, top_k", [(128, 8), (8, 2), (60, 4)])
def test_the_padding_of_the_chosen_block_stays_within_the_pairs(experts, top_k):
    """The alignment pads each expert's segment to whole blocks: at most E * (BLOCK_M - 1) rows more than the pairs,
    which grows with BLOCK_M (Qwen3's 128 experts x 127 rows at 128). choose_block_m takes a block only where an
    expert gets as many rows on average, so beyond decode's 16 the padded length stays within twice the pairs and a
    block: its int32 sorted pairs within the alignment's bytes a pair that memory.sizes.moe_token_bytes counts (the
    matmuls' float outputs are [T * k, N], never padded)."""
    from infer.kernels import moe
    for t in sorted({1, 2, 3, 15, 16, 17, 63, 64, 127, 128, 255, 256, 511, 512, 1023, 1024, 2047, 2048, 4095, 8192}
                    | set(moe.block_m_steps(8192, top_k, experts).values())):
        ids = torch.arange(t * top_k).view(t, top_k) % experts
        al = moe.aligned(ids, experts)
        m, pairs, padded = al.block_m, ids.numel(), len(al.sorted_pairs)
        assert m == moe.choose_block_m(t, top_k, experts)
        assert padded <= (pairs + experts * (m - 1) + m if m == moe.BLOCK_M else 2 * pairs + m), (t, m, padded)
