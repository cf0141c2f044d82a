"""Session 64, small gaps: memory.sizes.delta_rule_bytes counts the temporaries of a Gated DeltaNet prefill's chunked
gated delta rule (Qwen3.5, Qwen3-Next: the torch path's and the Triton path's [Hv, NC, C, ...] float32 terms and
per-chunk states), measured, and the activation estimate adds the device's path's; the adapter slots of Granite
4.0's and Nemotron-H's Mamba-2 layers (in_proj and out_proj, slots only with every layer's), of Granite 4.0's
shared_mlp and of Nemotron-H's one-mixer blocks are what memory.sizes.lora_slot_bytes counts (no attention's qkv and
o on a Mamba-2 layer, no MLP on a Nemotron-H mixer's block); ERNIE 4.5 MoE with use_bias (transformers' lm_head
then has a bias, beside the attention's and MLPs') runs, equal to transformers."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.kernels import delta_rule, delta_triton
from infer.memory import sizes
from infer.memory.sizes import DELTA_CHUNK, activation_bytes, delta_rule_bytes, lora_slot_bytes
from infer.models.loader import load_config
from infer.models.tiny import ensure_builtin

from helpers import check_equal_transformers, random_prompts
from test_probes_session63_gaps import _LiveBytes
from test_probes_session63_moe35 import build_ernie


class _NoLaunch:
    """A Triton kernel that launches nothing (its buffers allocated as on CUDA, on the CPU)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _rule_inputs(cfg, lens: list[int], dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    t, b = sum(lens), len(lens)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    bounds = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return (r(t, hk, dk), r(t, hk, dk), r(t, hv, dv), -torch.rand(t, hv, generator=g).to(dtype),
            torch.rand(t, hv, generator=g).to(dtype), torch.zeros(b, hv, dk, dv), bounds, torch.arange(b),
            torch.ones(b, dtype=torch.bool))


@pytest.mark.parametrize("lens", [[256], [1000], [130, 10, 70], [65, 1], [3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("triton", [False, True])
def test_delta_rule_temporaries_are_counted(monkeypatch, lens, dtype, triton):
    """The peak of the live tensors a prefill's chunked gated delta rule creates at tiny-qwen3-next's shapes (the
    torch path's; the Triton path's buffers, its kernels launching nothing) is what delta_rule_bytes counts for that
    path, within 15% (its chunks: at most tokens / C + seqs - 1, these layouts' own)."""
    assert DELTA_CHUNK == delta_triton.CHUNK
    for name in ("_chunk_terms_kernel", "_chunk_h_kernel", "_chunk_o_kernel"):
        monkeypatch.setattr(delta_triton, name, _NoLaunch())
    cfg = load_config(ensure_builtin("tiny-qwen3-next"))
    args = _rule_inputs(cfg, lens, dtype)
    with _LiveBytes() as meter:
        (delta_triton if triton else delta_rule).chunk_gated_delta_rule_varlen(*args)
    formula = delta_rule_bytes(cfg, dtype, sum(lens), len(lens), triton)
    assert meter.peak <= formula <= 1.15 * meter.peak, (meter.peak, formula)


@pytest.mark.parametrize("model", ["tiny-qwen3-next", "tiny-qwen3_5"])
def test_the_activation_estimate_adds_the_devices_delta_rule(monkeypatch, model):
    """A prefill step's estimate (memory.sizes.activation_bytes) is the same without the delta rule's temporaries
    less exactly delta_rule_bytes of its tokens and sequences, the torch path's on the CPU, the Triton path's on
    CUDA (`triton`); nothing for a model without Gated DeltaNet layers."""
    cfg = load_config(ensure_builtin(model))
    tokens, seqs = 2048, 3
    full = {tri: activation_bytes(cfg, torch.bfloat16, tokens, seqs, 1024, triton=tri) for tri in (False, True)}
    monkeypatch.setattr(sizes, "delta_rule_bytes", lambda *a, **k: 0)
    without = activation_bytes(cfg, torch.bfloat16, tokens, seqs, 1024)
    for tri in (False, True):
        assert full[tri] - without == delta_rule_bytes(cfg, torch.bfloat16, tokens, seqs, tri) > 0
    assert full[False] > full[True]
    assert delta_rule_bytes(load_config(ensure_builtin("tiny-granite4")), torch.bfloat16, tokens, seqs) == 0


@pytest.mark.parametrize("model", ["tiny-granite4", "tiny-granite4-dense", "tiny-nemotron-h", "tiny-arcee"])
@pytest.mark.parametrize("targets", [None, ["qkv_proj"], ["o_proj"]])
def test_mamba_hybrid_slots_are_counted(model, targets):
    """The slots allocated on Granite 4.0 (with and without experts) and Nemotron-H are lora_slot_bytes' count, byte
    for byte: a Mamba-2 layer's own in_proj and out_proj only with every layer's slots, never an attention's; an MLP
    without gate's (Nemotron-H's, Arcee's) up_proj one shard."""
    with LLM(model, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, device="cpu",
             lora_target_modules=targets) as llm:
        got = llm.engine.lora_manager.device_bytes()
        assert got == lora_slot_bytes(llm.engine.runner.model.config, 2, 4, torch.float32, targets)


@pytest.mark.parametrize("tied", [False, True])
def test_ernie_moe_with_use_bias_equals_transformers(tmp_path, tied):
    """use_bias: transformers' ERNIE 4.5 MoE biases q, k, v, o, the dense and shared MLPs and the output head
    (lm_head.bias, its own where the weight is tied to the embeddings); infer loads every bias (drawn) and gives
    transformers' greedy tokens and logprobs."""
    from safetensors.torch import load_file
    hf = build_ernie(tmp_path, use_bias=True, tie_word_embeddings=tied)
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["lm_head.bias"].abs().sum() > 0 and ("lm_head.weight" in stored) != tied
    prompts = random_prompts(512, (5, 13, 30), seed=4)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert torch.equal(llm.engine.runner.model.head_bias, stored["lm_head.bias"])
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, f"ernie-moe-use-bias-tied{tied}")
