"""Session 61 (fam): the dense families whose MLP has no gate, as vLLM runs them: Arcee's AFM (ArceeForCausalLM:
Llama with down(relu(up(x))²)), NVIDIA's Nemotron-4 / Minitron (NemotronForCausalLM: LayerNorm1P with biases, weighting
by 1 + w, the relu² MLP without gate, a partial rotary) and Swiss AI's Apertus (ApertusForCausalLM: the xIELU
activation of learned per-layer parameters, q and k RMSNorms per head, Llama's norms under its own names), one
UngatedMLP with StarCoder2's, end to end on tiny random models built from their configs (float32), each against the
real thing: greedy tokens and logprobs equal transformers' (GQA and MHA, biases, tied and untied heads), the GPU code
path (Triton interpreted, emulated CUDA graphs and piecewise graphs), chunked prefill and prefix caching; GPTQ
checkpoints from `infer quantize`; peft adapters on up_proj/down_proj equal to peft (alone and mixed);
--lora-target-modules up_proj,down_proj; serve, warmup --estimate, run, bench, the built-in tiny-arcee,
tiny-nemotron and tiny-apertus; what their configs ask that infer cannot do refused up front, and their near
neighbours (Nemotron-H, Llama-Nemotron's NAS, Arcee's Trinity, Apertus 1.5) refused naming what they are."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app
from infer.errors import UnsupportedModelError

from helpers import (check_builtin_runs_and_warmup_sizes_it, check_chunked_prefill_and_prefix_caching,
                     check_greedy_and_logprobs_equal_transformers, check_run_and_bench_builtin,
                     check_served_completion_equals_transformers, greedy_each, norms_and_biases_shifted,
                     random_prompts, save_random_model)
from lora_helpers import (check_lora_validate_ok, check_mixed_adapters_equal_peft,
                          check_mixed_adapters_gpu_path_equal_peft, check_no_target_modules_refused_as_peft,
                          family_base_and_adapters)
from quant_helpers import (check_gpu_path_interpreted, check_infer_quantize_and_convert,
                           check_int4_kernels_with_mixed_adapters, needs_gptqmodel)

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
FAMILIES = {"arcee": ("arcee", "ArceeForCausalLM", dict()),
            "nemotron": ("nemotron", "NemotronForCausalLM", dict()),
            "apertus": ("apertus", "ApertusForCausalLM", dict())}


def _perturbed(name, p):
    """norms_and_biases_shifted, and Apertus's xIELU parameters (alpha_p, alpha_n: the same in every layer at their
    init) drawn apart per layer, so that a layer read with another's changes the tokens."""
    norms_and_biases_shifted(name, p)
    if name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):
        p.add_(torch.randn_like(p) * 0.5)


def build(folder, family: str, seed: int = 0, **config):
    """A random model folder of `family` (float32) over SMALL; returns transformers' model (eager attention)."""
    model_type, arch, extra = FAMILIES[family]
    return save_random_model(folder, model_type, arch, {**SMALL, **extra, **config}, seed, _perturbed)


CONFIGS = {
    "arcee-gqa": ("arcee", dict()),
    "arcee-mha-tied-biases": ("arcee", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                            mlp_bias=True)),
    # a quarter of each head rotated (Nemotron's default: half)
    "nemotron-gqa-partial-quarter": ("nemotron", dict(partial_rotary_factor=0.25)),
    "nemotron-mha-tied-biases": ("nemotron", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                  attention_bias=True, mlp_bias=True)),
    "apertus-gqa": ("apertus", dict()),
    # (mlp_bias set: Apertus's MLP has no biases whatever its config says)
    "apertus-mha-tied-bias": ("apertus", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                              mlp_bias=True)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4."""
    family, config = CONFIGS[name]
    hf = build(tmp_path, family, **config)

    def check_model(model):
        mlp, attn = model.layers[0].mlp, model.layers[0].self_attn
        assert mlp.proj_names == ("up_proj", "down_proj") and not hasattr(mlp, "gate_up_proj")
        assert (mlp.up_proj.bias is not None) == (family != "apertus" and bool(config.get("mlp_bias")))
        assert attn.qk_norm == (family == "apertus")
        if family == "nemotron":  # the rotary over a part of each head
            assert attn.rot_dim == int(attn.head_dim * config.get("partial_rotary_factor", 0.5))
        if family == "apertus":  # each layer's own xIELU parameters
            assert model.layers[0].mlp.act_fn.alpha_p != model.layers[1].mlp.act_fn.alpha_p
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, name, check_model)
