"""Session 59: reload_weights compiles the fused MoE's variants of a new experts' layout (act-order or not, gptq or
gptq_v2, group size) as the engine's start does (LLMEngine._warm_moe_blocks), not on the first long prefill;
transformers 4's per-expert adapters served as peft 0.21 computes them (or refused where peft's conversion breaks
them); `infer run --resume --retry-failed`."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams

from helpers import random_prompts

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")


def record_int4_launches(monkeypatch) -> list:
    """Each int4 fused MoE matmul launched from now on as its compiled variant's key: its weight's shape, group size,
    act-order (a permutation) and zero points' format, BLOCK_M, ROW_DIV, WEIGHTED, x's dtype."""
    from infer.kernels import moe
    launched = []
    real = moe._gemm_int4

    def gemm(a, w, out, weights, aligned, top_k, row_div, weighted):
        launched.append((w.out_features, w.in_features, w.group_size, w.perm is None, bool(w.zeros_v1),
                         aligned.block_m, row_div, weighted, a.dtype))
        return real(a, w, out, weights, aligned, top_k, row_div, weighted)
    monkeypatch.setattr(moe, "_gemm_int4", gemm)
    return launched


@interpreted
def test_reload_weights_compiles_the_new_experts_layouts_variants_before_a_long_prefill(tmp_path, monkeypatch):
    """An engine that warmed its fused MoE at start (a GPU's; the GPU code path, interpreted) on act-order experts,
    reloaded with plain-group ones: the reload launches the plain layout's variants of every BLOCK_M a step can
    choose, so that a 130-token prefill and its decode then launch none it has not; a second reload of the same
    layout launches nothing. The tokens are a fresh engine's on the plain checkpoint."""
    import shutil

    from quant_helpers import int4_kernel_path
    from test_probes_session55_moe import build
    from test_probes_session56_review_moeq import rtn_gptq
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1, norm_topk_prob=True)
    rtn_gptq(tmp_path / "base", tmp_path / "plain")
    rtn_gptq(tmp_path / "base", tmp_path / "act", act_order=True)
    shutil.copytree(tmp_path / "act", tmp_path / "m")
    int4_kernel_path(monkeypatch)
    launched = record_int4_launches(monkeypatch)
    prompt = random_prompts(512, (130, 131), seed=3)[0]
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    opts = dict(block_size=8, max_num_batched_tokens=136, max_num_seqs=2, max_model_len=160)
    with LLM(str(tmp_path / "plain"), **opts) as llm:
        want = llm.generate([prompt], params)[0].token_ids
    with LLM(str(tmp_path / "m"), **opts) as llm:
        launched.clear()
        llm.engine._warm_moe_blocks()  # (the start of an engine on a GPU: warm_kernels)
        warmed = set(launched)
        for f in ("model.safetensors", "config.json"):
            shutil.copy(tmp_path / "plain" / f, tmp_path / "m" / f)
        launched.clear()
        llm.engine.reload_weights()
        reloaded = set(launched)
        launched.clear()
        got = llm.generate([prompt], params)[0].token_ids
        steps = set(launched)
        launched.clear()
        llm.engine.reload_weights()
        again = list(launched)
    assert got == want
    assert {bm for *_, bm, _, _, _ in steps} == {16, 32}, steps  # (the prefill's blocks and the decode's)
    assert reloaded - warmed and steps <= warmed | reloaded, sorted(steps - warmed - reloaded)
    assert again == []
