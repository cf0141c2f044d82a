"""Nemotron 3 Super (NVIDIA-Nemotron-3-Super-120B-A12B: NemotronHForCausalLM with moe_latent_size) equals
transformers: its "E" layers' experts run in a latent of moe_latent_size dims (models.moe.SparseMoeBlock's
fc1_latent_proj before them, fc2_latent_proj after, biases where mlp_bias says), the router and the shared experts on
the hidden state itself. Random models of tiny-nemotron-h-moe's shape with a latent: greedy tokens and logprobs,
chunked prefill and preemption, emulated CUDA graphs (the Triton kernels interpreted too), no adapter slots on the
latent projections and adapters of them refused, the memory plan of the hub's config.json."""

from __future__ import annotations

import pytest
import torch

from infer import LLM

from helpers import (check_emulated_decode_graphs, check_equal_transformers, check_state_slots_all_free,
                     estimated_plan, greedy_each, greedy_tokens, norms_and_biases_shifted, random_prompts,
                     save_random_model)

BUILT_ON = "tiny-nemotron-h-moe"
# NVIDIA-Nemotron-3-Super-120B-A12B's config.json (the hub's values): 88 layers of 40 Mamba-2 (M), 40 experts (E)
# and 8 attention (*) (the counts the hub's; the order here ours: the plan does not depend on it); 512 experts of 2688
# in a latent of 1024 (top 22) and a shared expert of 5376, one group, scaled by 5
SUPER_PATTERN = ("ME" * 5 + "*") * 8
SUPER_120B = dict(
    vocab_size=131072, hidden_size=4096, intermediate_size=2688, num_attention_heads=32, num_key_value_heads=2,
    head_dim=128, max_position_embeddings=262144, mamba_num_heads=128, mamba_head_dim=64, n_groups=8,
    ssm_state_size=128, conv_kernel=4, chunk_size=128, n_routed_experts=512, num_experts_per_tok=22,
    moe_intermediate_size=2688, moe_latent_size=1024, moe_shared_expert_intermediate_size=5376, n_group=1,
    topk_group=1, routed_scaling_factor=5.0, norm_topk_prob=True, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5,
    tie_word_embeddings=False, num_nextn_predict_layers=1, hybrid_override_pattern=SUPER_PATTERN)


def _build(folder, seed: int = 3, **change):
    """A random Nemotron 3 of tiny-nemotron-h-moe's shape with a latent of 24 (`change` set on it), its norms moved
    off their init and its biases drawn, saved to `folder`; transformers' model of it."""
    from infer.models.tiny import BUILTIN_MODELS
    config = {**BUILTIN_MODELS[BUILT_ON].config, "vocab_size": 512, "max_position_embeddings": 256,
              "moe_latent_size": 24, **change}
    return save_random_model(folder, "nemotron_h", "NemotronHForCausalLM", config, seed=seed,
                             perturb=norms_and_biases_shifted)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("super") / "m"
    return folder, _build(folder)


@pytest.mark.parametrize("bias", [False, True])
def test_latent_experts_equal_transformers(tmp_path, bias):
    """Prompts of 5, 13 and 30 tokens batched (and, with mlp_bias, the latent projections' biases, the MLP's and the
    shared experts'): transformers' greedy tokens and every logprob within 1e-4; the experts' stacks [8, 32, 24] and
    [8, 24, 32] and the projections [24, 64] and [64, 24]."""
    from infer import SamplingParams
    hf = _build(tmp_path, mlp_bias=bias)
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        block = llm.engine.runner.model.layers[1].mixer
        assert block.latent == 24 and tuple(block.experts.w13.shape) == (8, 32, 24)
        assert tuple(block.experts.w2.shape) == (8, 24, 32)
        assert block.fc1_latent_proj.weight.shape == (24, 64) and block.fc2_latent_proj.weight.shape == (64, 24)
        assert (block.fc1_latent_proj.bias is not None) == bias
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, "latent")


def test_a_missing_projection_is_named(tmp_path):
    """A checkpoint without a layer's fc2_latent_proj: refused at load naming the tensor."""
    from safetensors.torch import load_file, save_file

    from infer.errors import ModelLoadError
    _build(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    gone = [k for k in state if k.endswith("layers.5.mixer.fc2_latent_proj.weight")]
    assert len(gone) == 1
    del state[gone[0]]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"fc2_latent_proj"):
        LLM(str(tmp_path))


def test_chunked_prefill_preemption_and_graphs(built, monkeypatch):
    """Steps of 8 tokens (prompts cut into chunks beside the others' decodes, a one-token prompt), a KV budget that
    preempts, emulated decode graphs with every op through its Triton kernel (interpreted): transformers' tokens."""
    folder, hf = built
    prompts = random_prompts(512, (30, 41, 1, 9), seed=5)
    with LLM(str(folder), block_size=4, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
        check_state_slots_all_free(llm)
    with LLM(str(folder), block_size=4, num_kv_blocks=16, max_model_len=64) as llm:
        prompts = random_prompts(512, (20, 25, 17, 30), seed=4)
        assert greedy_tokens(llm, prompts, 12) == greedy_each(hf, prompts, 12)
        assert llm.engine.scheduler.num_preemptions > 0
        check_state_slots_all_free(llm)
    check_emulated_decode_graphs(str(folder), hf, monkeypatch, triton=True)


def test_no_slots_on_the_latent_projections_and_their_adapters_refused(built, tmp_path):
    """--enable-lora gives the latent projections no slots, as the memory plan counts; an adapter of
    fc1_latent_proj is refused at registration naming it."""
    from lora_helpers import hf_float, save_adapters

    from infer.errors import LoRAError
    folder, _ = built
    with LLM(str(folder), enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4) as llm:
        manager = llm.engine.lora_manager
        assert not any("_latent_proj" in n for m in manager.linears for n in m.names)
        assert llm.engine.memory_plan.lora_bytes == manager.device_bytes()
    paths = save_adapters(hf_float(folder), tmp_path, {"a": dict(r=4, lora_alpha=8,
                                                                 target_modules=["q_proj", "fc1_latent_proj"])})
    with pytest.raises(LoRAError, match=r"adapts model\.layers\.1\.mixer\.fc1_latent_proj: infer does not adapt "
                                        r"Nemotron 3's latent projections"):
        LLM(str(folder), loras={"a": str(paths["a"])}, max_lora_rank=8)


def test_warmup_estimate_counts_the_latent_weights(built):
    """`infer warmup --estimate`'s weights are the loaded model's (the latent projections and the narrower experts)."""
    from infer.memory.sizes import weights_bytes
    folder, _ = built
    plan = estimated_plan(str(folder), "--max-length", "256")
    with LLM(str(folder), max_model_len=256) as llm:
        assert plan["weights_bytes"] == weights_bytes(llm.engine.runner.model)


def test_the_hubs_super_120b_config_passes_the_checks_and_the_memory_plan():
    """NVIDIA-Nemotron-3-Super-120B-A12B's config.json: the registry accepts it; its model built on the meta device
    holds 40 sparse layers of 512 relu² experts in the latent (w13 [512, 2688, 1024]) with their projections, about
    120.8B parameters (the hub's 120B); the KV is the 8 attention layers' alone; in bfloat16 the weights alone
    (about 225 GiB) do not fit an H100's 80 GiB, which the plan says."""
    from transformers import AutoConfig

    from helpers import meta_hub_model
    from infer.memory.sizes import kv_bytes_per_token, moe_token_bytes, weights_bytes
    assert len(SUPER_PATTERN) == 88 and [SUPER_PATTERN.count(c) for c in "ME*"] == [40, 40, 8]
    cfg, model, blocks = meta_hub_model("nemotron_h", "NemotronHForCausalLM", SUPER_120B)
    assert len(blocks) == 40 and tuple(blocks[0].experts.w13.shape) == (512, 2688, 1024)
    assert blocks[0].fc1_latent_proj.weight.shape == (1024, 4096)
    weights = weights_bytes(model)
    assert 119e9 < weights / 2 < 122e9, weights / 2
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 8 * 2 * 2 * 128 * 2
    # (a token's 22 experts' down rows in the latent, not the hidden size, beside the projections' input and output)
    full = AutoConfig.for_model("nemotron_h", **{**SUPER_120B, "moe_latent_size": None})
    saved = moe_token_bytes(full, torch.bfloat16) - moe_token_bytes(cfg, torch.bfloat16)
    assert saved == (22 * (4096 - 1024) - 1024 - 4096) * 2
    assert weights > 80 * 2 ** 30


def test_the_hubs_tensor_names_load(built, tmp_path):
    """The checkpoint as the hub names it (backbone.*, each expert's up_proj [I, L] and down_proj [L, I] apart, the
    latent projections under the mixer): transformers' tokens."""
    from safetensors.torch import save_file
    folder, hf = built
    state = {}
    for key, value in hf.state_dict().items():
        key = key.replace("model.", "backbone.", 1)
        if key.endswith(("experts.up_proj", "experts.down_proj")):
            stack, proj = key.rsplit(".", 1)
            for i, w in enumerate(value):
                state[f"{stack}.{i}.{proj}.weight"] = w.contiguous()
            continue
        state[key] = value.contiguous()
    assert tuple(state["backbone.layers.1.mixer.experts.7.up_proj.weight"].shape) == (32, 24)
    assert "backbone.layers.1.mixer.fc1_latent_proj.weight" in state
    import shutil
    shutil.copytree(folder, tmp_path / "hub")
    save_file(state, str(tmp_path / "hub" / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts(512, (7, 19), seed=9)
    with LLM(str(tmp_path / "hub"), block_size=4) as llm:
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
