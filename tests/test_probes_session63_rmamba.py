"""Review of Granite 4.0 (models.granite4, kernels.mamba2): random models of the shapes of the real checkpoints'
configs (granite-4.0-h-tiny / -h-small: one Mamba-2 group, conv bias, no projection bias, experts, no rope, tied
embeddings; granite-4.0-h-micro: a hybrid without experts; the other bias settings, rope in a hybrid, a
time_step_limit, Mamba-2 layers alone), saved by transformers' save_pretrained, equal transformers; n > 1, beam
search and sleep / wake with the Mamba-2 states."""

from __future__ import annotations

import pytest
import torch

from helpers import (family_builder, family_small_config, greedy_and_logprobs_test, norms_and_biases_shifted)


def _perturb(name, p):
    """Norms and biases moved, and the Mamba-2 layers' D, dt_bias and A_log too (their init is constant)."""
    norms_and_biases_shifted(name, p)
    if name.rsplit(".", 1)[-1] in ("D", "dt_bias", "A_log"):
        p.add_(torch.randn_like(p) * 0.3)


# granite-4.0-h-*: Mamba-2 heads of 16 (8), 16 state dims, conv kernel 4, chunks of 16, Granite's scalars
_H = dict(shared_intermediate_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
          embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0,
          position_embedding_type="nope", tie_word_embeddings=True, layer_types=["mamba", "mamba", "attention", "mamba"],
          mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
          mamba_chunk_size=16, mamba_conv_bias=True, mamba_proj_bias=False)
build = family_builder(family_small_config(4), {"granite4": ("granitemoehybrid", "GraniteMoeHybridForCausalLM", _H)},
                       _perturb)

CONFIGS = {
    "h-tiny": ("granite4", {}),
    "h-micro": ("granite4", dict(num_local_experts=0)),
    "biases-rope": ("granite4", dict(mamba_conv_bias=False, mamba_proj_bias=True, mamba_n_groups=2,
                                     position_embedding_type="rope")),
}


def _check(model, hf, family, config):
    layers = model.linear_layers()
    assert len(layers) == sum(t == "mamba" for t in {**_H, **config}["layer_types"])
    assert all(layer.rec_state.dtype == torch.float32 for layer in layers)


test_real_config_shapes_equal_transformers = greedy_and_logprobs_test(CONFIGS, build, _check)


def test_time_step_limit_clamps_the_prefill_as_transformers(tmp_path):
    """A time_step_limit (transformers clamps dt in its chunked scan, not in its one-token step, as mamba_ssm's
    selective_state_update): transformers' greedy tokens, and every prompt token's logprob its full forward's, prompts
    cut in steps of 8 mixed with decodes."""
    from infer import LLM, SamplingParams

    from helpers import greedy_each, random_prompts
    hf = build(tmp_path, "granite4", time_step_limit=[0.05, 0.5], mamba_n_groups=4)
    prompts = random_prompts(512, (30, 19, 1), seed=6)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=8, max_num_seqs=3) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True, prompt_logprobs=0))
    assert [o.token_ids for o in outs] == greedy_each(hf, prompts, 6)
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            lp = hf(torch.tensor([p])).logits[0].log_softmax(-1)
            want = torch.tensor([lp[i, p[i + 1]].item() for i in range(len(p) - 1)])
            got = torch.tensor([d["logprob"] for d in o.prompt_logprobs[1:]])
            assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_mamba_layers_alone_are_refused(tmp_path):
    """A config whose every layer is Mamba-2 (transformers' default layer_types): refused naming it, before any
    work (it failed dividing by the KV bytes of no attention layer)."""
    from infer import LLM
    from infer.errors import UnsupportedModelError
    build(tmp_path, "granite4", layer_types=["mamba"] * 4, num_local_experts=0)
    with pytest.raises(UnsupportedModelError, match=r"granitemoehybrid with no attention layer \(every layer_types "
                                                    r"entry \"mamba\"\) is not supported"):
        LLM(str(tmp_path))
