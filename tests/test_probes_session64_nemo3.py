"""Nemotron 3 (NVIDIA-Nemotron-3-Nano-30B-A3B: NemotronHForCausalLM with "moe" layers, hybrid_override_pattern "E")
equals transformers: models.nemotron_h's mixer of an "E" layer a models.moe.SparseMoeBlock with GLM-4.5's float32
router (sigmoid scores, e_score_correction_bias steering the choice, n_group / topk_group, norm_topk_prob,
routed_scaling_factor), relu² experts without gate (w13 their up rows alone: the fused MoE's relu(up)²) and the
shared relu² expert; the built-in tiny-nemotron-h-moe in float32 and bfloat16, chunked prefill, preemption, n > 1,
emulated CUDA graphs (the Triton kernels interpreted too), the checkpoint's per-expert names and transformers 5's
stacked ones, the memory plan counting the experts, adapters on the attention equal to peft (the experts' and
shared experts': test_probes_session71_nemo3lora), and the hub's config.json shapes through the registry checks and
the memory plan."""

from __future__ import annotations

import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import (builtin_model_tests, check_emulated_decode_graphs, check_greedy_and_logprobs_equal_transformers,
                     check_one_step_and_split_prompts, check_preemption_restarts_from_zero_state,
                     check_state_slots_all_free, check_warmup_counts_the_states, correction_bias_drawn,
                     estimated_plan, greedy_each, greedy_tokens, hf_model, measured_warmup, random_prompts)

NAME = "tiny-nemotron-h-moe"
# NVIDIA-Nemotron-3-Nano-30B-A3B's config.json (the hub's values): 52 layers of 23 Mamba-2 (M), 23 experts (E) and 6
# attention (*); 128 experts of 1856 (top 6) and a shared expert of 3712, one group, scaled by 2.5
NANO_30B = dict(
    vocab_size=131072, hidden_size=2688, intermediate_size=1856, num_attention_heads=32, num_key_value_heads=2,
    head_dim=128, max_position_embeddings=262144, mamba_num_heads=64, mamba_head_dim=64, n_groups=8,
    ssm_state_size=128, conv_kernel=4, chunk_size=128, n_routed_experts=128, num_experts_per_tok=6,
    moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5,
    tie_word_embeddings=False, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME")


@pytest.fixture(scope="module")
def hf():
    return hf_model(str(ensure_builtin(NAME)))


def _layers_as_the_pattern(model) -> None:
    """ME*M-E: the "E" layers' mixers SparseMoeBlocks of 8 relu² experts without gate (w13 [8, 32, 64]: up rows
    alone), a float32 router, the shared relu² expert of 48."""
    from infer.models.llama import UngatedMLP
    from infer.models.moe import SparseMoeBlock
    kinds = [type(layer.mixer).__name__ for layer in model.layers]
    assert kinds == ["Mamba2Mixer", "SparseMoeBlock", "Attention", "Mamba2Mixer", "UngatedMLP", "SparseMoeBlock"]
    block = model.layers[1].mixer
    assert isinstance(block, SparseMoeBlock) and block.glm and block.scaling == 2.5 and block.renormalize
    assert tuple(block.experts.w13.shape) == (8, 32, 64) and tuple(block.experts.w2.shape) == (8, 64, 32)
    assert block.gate.weight.dtype == torch.float32 and block.gate.e_score_correction_bias.dtype == torch.float32
    assert isinstance(block.shared_experts, UngatedMLP) and block.shared_experts.up.out_features == 48
    assert [hasattr(layer.mixer, "k_cache") for layer in model.layers].count(True) == 1


def test_nemotron3_equals_transformers(hf):
    """Prompts of 5, 13 and 30 tokens batched: transformers' greedy tokens and logprobs."""
    check_greedy_and_logprobs_equal_transformers(ensure_builtin(NAME), hf, NAME, _layers_as_the_pattern)


def _copy_with(tmp_path, hf, seed: int):
    """The built-in folder copied to tmp_path (its tokenizer), with each router's e_score_correction_bias drawn from
    N(0, 0.3) and saved again; returns transformers' model of it."""
    import copy
    folder = tmp_path / "m"
    shutil.copytree(ensure_builtin(NAME), folder)
    return folder, correction_bias_drawn(copy.deepcopy(hf), folder, seed, 0.3, buffers=True)


def test_the_router_equals_transformers_where_the_bias_and_the_groups_decide(tmp_path, hf):
    """Each router's e_score_correction_bias drawn (zeros in the built-in): infer's routing of 64 random hidden
    states equals transformers' NemotronHTopkRouter (the experts, the scaled float32 weights), the bias changes some
    choices, and the model's greedy tokens are transformers'."""
    folder, drawn = _copy_with(tmp_path, hf, 4)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    prompts = random_prompts(512, (5, 13, 30), seed=6)
    with LLM(str(folder), block_size=4) as llm:
        block = llm.engine.runner.model.layers[1].mixer
        weights, ids = block.route(x)
        _, want_w, want_ids = drawn.model.layers[1].mixer.gate(x)
        order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
        assert torch.equal(order.values, want_order.values)
        assert torch.equal(weights.gather(1, order.indices), want_w.gather(1, want_order.indices))
        bias = block.gate.e_score_correction_bias.data.clone()
        block.gate.e_score_correction_bias.data.zero_()
        assert not torch.equal(block.route(x)[1].sort(dim=-1).values, order.values)
        block.gate.e_score_correction_bias.data.copy_(bias)
        assert greedy_tokens(llm, prompts, 8) == greedy_each(drawn, prompts, 8)


def test_transformers_5_stacked_expert_names_load_as_the_per_expert_ones(tmp_path, hf):
    """A checkpoint saved as transformers 5 holds the model (model.layers.N.mixer.experts.up_proj [E, I, H] and
    down_proj [E, H, I] stacked, model.embeddings, model.norm_f) gives the built-in's tokens."""
    from safetensors.torch import save_file
    folder = tmp_path / "m"
    shutil.copytree(ensure_builtin(NAME), folder)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert tuple(state["model.layers.1.mixer.experts.up_proj"].shape) == (8, 32, 64)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts(512, (7, 19), seed=9)
    with LLM(str(folder), block_size=4) as llm:
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)


def test_chunked_prefill_preemption_and_n_samples(hf):
    """Steps of 8 tokens (prompts of 30 and 41 in chunks beside the others' decodes, a one-token prompt), a long
    prompt in one step and one split, a KV budget that preempts, n=3 greedy samples: transformers' tokens."""
    prompts = random_prompts(512, (30, 41, 1, 9), seed=5)
    with LLM(NAME, block_size=4, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
        outs = llm.generate(prompts[2:], SamplingParams(n=3, max_new_tokens=6, ignore_eos=True, temperature=0.0))
        check_state_slots_all_free(llm)
    assert [[s.token_ids for s in o.outputs] for o in outs] == [[w] * 3 for w in greedy_each(hf, prompts[2:], 6)]
    check_one_step_and_split_prompts(NAME, hf, random_prompts(512, (70, 45), seed=7), 20)
    check_preemption_restarts_from_zero_state(NAME, hf)


@pytest.mark.parametrize("triton", [False, True])
def test_emulated_cuda_graphs_equal_transformers(hf, monkeypatch, triton):
    """Decode steps through emulated CUDA graphs of buckets 1, 2, 4, 8 (the fused MoE over every expert: no
    data-dependent shapes), and with every op through its Triton kernel (interpreted: the fused MoE's relu(up)² of
    the up rows alone): transformers' tokens."""
    check_emulated_decode_graphs(NAME, hf, monkeypatch, triton)


def test_bfloat16_equals_transformers_in_bfloat16():
    """--dtype bfloat16 (the routers float32, as transformers keeps them: _keep_in_fp32_modules_strict): transformers'
    greedy tokens of its bfloat16 load, batched."""
    from transformers import AutoModelForCausalLM

    from infer.memory.sizes import weights_bytes
    hf16 = AutoModelForCausalLM.from_pretrained(ensure_builtin(NAME), dtype=torch.bfloat16).eval()
    hf16.generation_config.eos_token_id = None
    assert hf16.model.layers[1].mixer.gate.weight.dtype == torch.float32
    prompts = random_prompts(512, (5, 13, 30, 2), seed=3)
    plan = estimated_plan(NAME, "--dtype", "bfloat16", "--max-length", "256")
    with LLM(NAME, block_size=4, dtype="bfloat16", max_num_seqs=2, max_model_len=256) as llm:
        model = llm.engine.runner.model
        assert model.layers[1].mixer.gate.weight.dtype == torch.float32
        assert plan["weights_bytes"] == weights_bytes(model)  # (`warmup --estimate`: the routers float32 too)
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf16, prompts, 8)


test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = \
    builtin_model_tests({NAME: "NemotronHForCausalLM"}, nope=(NAME,))


def test_warmup_counts_the_states_and_the_kv_of_the_attention_alone():
    """`infer warmup --estimate` counts the 2 Mamba-2 layers' state slots and the one attention layer's KV (the
    experts' layers have none)."""
    plan = check_warmup_counts_the_states(NAME, 2 * 2 * 16 * 4)
    assert plan["state_bytes"] == 2 * 9 * (192 * 3 * 4 + 8 * 16 * 16 * 4)


def test_the_measured_cpu_peak_is_under_the_estimate():
    """A step of 1,020 tokens and decodes at 256: the measured peak is under `warmup --estimate`'s activations."""
    measured = measured_warmup([NAME, "--max-length", "256", "--concurrency", "4", "--max-num-batched-tokens",
                                "1024"])
    peak, formula = measured["activation_peak_bytes"], measured["activation_estimate_bytes"]
    assert peak <= formula, (formula, peak)


def test_adapters_on_the_attention_equal_peft_and_their_slots_are_planned(tmp_path):
    """Two adapters (every attention projection; q and v alone) and the base in one batch and each alone: peft's
    tokens; the slots (attention, MLP layers, shared experts and routed experts) are the memory plan's."""
    from lora_helpers import check_attention_adapters_equal_peft, hf_float

    from infer.memory.sizes import lora_slot_bytes
    base = ensure_builtin(NAME)
    check_attention_adapters_equal_peft(base, hf_float(base), tmp_path)
    with LLM(NAME, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4) as llm:
        manager = llm.engine.lora_manager
        assert manager.expert_layers and any(".mixer.shared_experts." in m.names[0] for m in manager.linears)
        assert llm.engine.memory_plan.lora_bytes == manager.device_bytes()
        # (`warmup --estimate`'s formula, without the model: at least the slots, the experts' layers' none)
        assert manager.device_bytes() <= lora_slot_bytes(llm.engine.runner.model.config, 2, 4, torch.float32)


def _config(**change):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(str(ensure_builtin(NAME)))
    for key, value in change.items():
        object.__setattr__(cfg, key, value)
    return cfg


@pytest.mark.parametrize("change, match", [
    ({"moe_latent_size": 0}, r"moe_latent_size 0: Nemotron 3's experts run in a latent of that many dims"),
    ({"n_group": 3}, r"n_group 3 with n_routed_experts 8.*Nemotron 3's router \(GLM-4.5's\) splits"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok 9 with n_routed_experts 8"),
    ({"topk_group": 1, "num_experts_per_tok": 3}, r"num_experts_per_tok 3, more than the 2 experts of its "
                                                   r"topk_group 1 groups of 2")])
def test_what_the_experts_cannot_compute_is_refused(change, match):
    """A Nemotron 3 config.json with a latent of no dims (moe_latent_size 0), groups that do not divide
    the experts, or more experts a token than there are (or than its kept groups hold): refused naming the field."""
    from infer.errors import UnsupportedModelError
    from infer.models.registry import check_supported
    with pytest.raises(UnsupportedModelError, match=match):
        check_supported(_config(**change))


def test_the_hubs_nano_30b_config_passes_the_checks_and_the_memory_plan():
    """NVIDIA-Nemotron-3-Nano-30B-A3B's config.json: the registry accepts it; its model built on the meta device
    holds 23 sparse layers of 128 relu² experts (w13 [128, 1856, 2688]), about 31.6B parameters (the hub's count);
    the plan's KV is the 6 attention layers' alone and a step's activations count the experts' rows
    (memory.sizes.moe_token_bytes) within a budget: 4096 tokens of 8 sequences fit an H100's 80 GiB in bfloat16."""
    from helpers import meta_hub_model
    from infer.memory.sizes import activation_bytes, kv_bytes_per_token, moe_token_bytes, weights_bytes
    cfg, model, blocks = meta_hub_model("nemotron_h", "NemotronHForCausalLM", NANO_30B)
    assert len(blocks) == 23 and tuple(blocks[0].experts.w13.shape) == (128, 1856, 2688)
    weights = weights_bytes(model)
    assert 31.0e9 < weights / 2 < 32.5e9, weights / 2
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 6 * 2 * 2 * 128 * 2
    per_token = moe_token_bytes(cfg, torch.bfloat16)
    assert per_token >= 6 * (2 * 1856 + 2688) * 2  # (each token's 6 experts' up rows, their relu², the down rows)
    act = activation_bytes(cfg, torch.bfloat16, 2048, 8, 4096)
    kv = 8 * 4096 * kv_bytes_per_token(cfg, torch.bfloat16)
    assert 2048 * per_token <= act and weights + act + kv < 80 * 2 ** 30
