"""IBM's Bamba (BambaForCausalLM, models.bamba) equals transformers (float32): Granite 4.0's Mamba-2 mixers (their
conv and SSM states in the per-sequence state cache) and attention layers rotating half of each head, in Llama's
layer of two norms (input_layernorm, pre_ff_layernorm) with a SwiGLU feed_forward, the final final_layernorm: greedy
tokens and logprobs of concurrent prompts, chunked prefill, prefix caching through state snapshots, the GPU code path
interpreted; peft adapters; the memory estimate on the hub's shapes; configs infer cannot honour refused by field."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM
from infer.models.tiny import ensure_builtin

from helpers import (check_batched_chunks_equal_transformers, check_chunked_prefill_carries_the_states,
                     check_greedy_and_logprobs_equal_transformers, check_prefix_snapshot_restored,
                     check_state_slots_all_free, estimated_plan, greedy_each, greedy_tokens, hf_model,
                     norms_and_biases_shifted, random_prompts, save_random_model)

NAME = "tiny-bamba"


@pytest.fixture(scope="module")
def hf():
    return hf_model(str(ensure_builtin(NAME)))


def _layers_as_the_config(model) -> None:
    """Mamba-2, Mamba-2, attention, Mamba-2: three mixers with a conv state [128 + 2 * 2 * 16, 3] and a float32 SSM
    state [8, 16, 16], one attention layer rotating 8 of its 16 dims; the feed_forward on every layer."""
    assert [layer.linear for layer in model.layers] == [True, True, False, True]
    mixers = model.linear_layers()
    assert len(mixers) == 3 and all(m.rec_state.dtype == torch.float32 for m in mixers)
    assert mixers[0].rec_state.shape[1:] == (8, 16, 16) and mixers[0].conv_state.shape[1:] == (192, 3)
    assert model.layers[2].self_attn.rot_dim == 8
    assert all(layer.feed_forward.gate_up_proj.out_sizes == [128, 128] for layer in model.layers)


def test_bamba_equals_transformers(hf):
    """Prompts of 5, 13 and 30 tokens batched (the 30-token one spans two scan chunks of 16): transformers' greedy
    tokens and logprobs."""
    check_greedy_and_logprobs_equal_transformers(ensure_builtin(NAME), hf, NAME, _layers_as_the_config)


def _build(folder, seed: int = 3, **change):
    """A random Bamba of tiny-bamba's shape (`change` set on it) saved to `folder`, its norms moved off their init and
    its biases drawn; returns transformers' model (eager)."""
    from infer.models.tiny import BUILTIN_MODELS
    config = {**BUILTIN_MODELS[NAME].config, "vocab_size": 512, "max_position_embeddings": 256, **change}
    return save_random_model(folder, "bamba", "BambaForCausalLM", config, seed=seed, perturb=norms_and_biases_shifted)


def test_biases_one_group_two_attention_layers_and_a_tied_head_equal_transformers(tmp_path):
    """Every bias Bamba's config can ask (attention_bias: q, k, v, o; mlp_bias; mamba_proj_bias: in_proj, out_proj;
    the conv's), one group of B and C, attention on the first and last layers with
    another rope base, a tied head, every norm moved off its init: transformers' tokens and logprobs, and its tokens
    in steps of 8 (prompts cut into chunks whose states carry over)."""
    hf = _build(tmp_path, attention_bias=True, mlp_bias=True, mamba_proj_bias=True, mamba_n_groups=1,
                attn_layer_indices=[0, 3], tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0})

    def check(model):
        assert [layer.linear for layer in model.layers] == [False, True, True, False]
        assert model.layers[0].self_attn.o_proj.bias is not None and model.layers[1].mamba.in_proj.bias is not None
        assert model.layers[1].feed_forward.down_proj.bias is not None and model.tie_word_embeddings
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, "bamba-biases", check)
    check_batched_chunks_equal_transformers(tmp_path, hf)


def test_chunked_prefill_carries_the_mamba_state_across_steps(hf):
    """Steps of 8 tokens: prompts of 30 and 41 tokens run in chunks whose conv and SSM states carry over, mixed with
    the others' decodes; a prompt of one token too; every state slot given back."""
    check_chunked_prefill_carries_the_states(NAME, hf)


def test_a_second_request_sharing_a_prefix_starts_after_its_snapshot(hf):
    """A 37-token prompt, then it with 7 more tokens (blocks of 4): the second finds the first's 9 full blocks and
    the Mamba-2 states snapshotted at their end, computes its last 8 tokens alone; its logprobs are those of caching
    off and its tokens transformers'."""
    check_prefix_snapshot_restored(NAME, hf)


def test_bfloat16_equals_transformers_in_bfloat16(hf):
    """--dtype bfloat16 (the conv state in bfloat16, the SSM state float32, the half-head rotary's table rounded as
    transformers rounds it): transformers' greedy tokens in bfloat16, batched, a one-token prompt included."""
    import copy
    hf = copy.deepcopy(hf).to(torch.bfloat16)  # (the module's hf: float32)
    prompts = random_prompts(512, (5, 13, 30, 1), seed=3)
    with LLM(NAME, block_size=4, dtype="bfloat16", max_num_seqs=2) as llm:
        assert llm.engine.runner.model.linear_layers()[0].conv_state.dtype == torch.bfloat16
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
        check_state_slots_all_free(llm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels and graphs")
def test_the_gpu_code_path_interpreted_equals_transformers(hf, monkeypatch):
    """Every op through its Triton kernel (interpreted: the Mamba-2 conv, SSD scan and state update, the partial
    rotary, the attention) and decode steps through emulated CUDA graphs (state slots a static buffer, padding rows
    writing the padding slot): 5 sequences of different output lengths replay every bucket and give transformers'
    tokens."""
    from helpers import check_emulated_decode_graphs
    check_emulated_decode_graphs(NAME, hf, monkeypatch, triton=True)


def test_the_builtin_model_runs_and_warmup_counts_its_states_and_weights(tmp_path):
    """`infer run` of tiny-bamba writes transformers' tokens; `infer warmup --estimate` counts its weights as loaded,
    the 3 Mamba-2 layers' state slots (8 sequences and a padding slot: a conv state [192, 3] in float32 and an SSM
    state [8, 16, 16]) and the KV of the one attention layer alone (2 KV heads of 16, K and V)."""
    from helpers import check_builtin_runs_and_warmup_sizes_it, check_run_and_bench_builtin, \
        check_warmup_counts_the_states
    check_run_and_bench_builtin(tmp_path, NAME)
    check_builtin_runs_and_warmup_sizes_it(NAME, "BambaForCausalLM", nope=False)
    plan = check_warmup_counts_the_states(NAME, 2 * 2 * 16 * 4)
    assert plan["state_bytes"] == 3 * 9 * (192 * 3 * 4 + 8 * 16 * 16 * 4)


# ------------------------------------------------------------------------------------------------------ refusals
ARCH = "BambaForCausalLM"
REFUSED = {  # what config.json changes -> words of the refusal
    "attention-past-the-layers": (dict(attn_layer_indices=[2, 5]), "bamba with attn_layer_indices [5] naming no "
                                                                   "layer of 4 is not supported"),
    "no-attention": (dict(attn_layer_indices=[]), "bamba with no attention layer (attn_layer_indices empty"),
    "rotary-width": (dict(attn_rotary_emb=16), "bamba with attn_rotary_emb 16 is not supported: transformers rotates "
                                               "8 dims of each head of 16"),
    "groups": (dict(mamba_n_groups=3), "bamba with mamba_n_heads 8 in mamba_n_groups 3 is not supported"),
    "activation": (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_infer_cannot_run_is_refused_naming_the_field(tmp_path, name):
    """attn_layer_indices naming no layer or none, an attn_rotary_emb other than the half head transformers rotates,
    Mamba-2 heads the groups do not divide, an activation other than silu (the MLP's
    and the conv's): `infer warmup --estimate` refuses them naming the field."""
    from helpers import estimate_refusal
    from infer.models.tiny import BUILTIN_MODELS
    change, words = REFUSED[name]
    assert words in estimate_refusal(tmp_path, "bamba", ARCH, **{**BUILTIN_MODELS[NAME].config, **change})


def test_a_gptq_checkpoint_made_elsewhere_equals_transformers_dequantized(tmp_path):
    """A GPTQ checkpoint in GPTQModel's layout (every projection 4-bit by round to nearest, group 32: the attention's,
    the feed_forward's and the Mamba-2 mixers' in_proj [64 -> 328] and out_proj) loads int4 and gives transformers'
    greedy tokens on the dequantized weights; `infer warmup --estimate` counts its weights as loaded."""
    from helpers import estimated_plan
    from infer.memory.sizes import weights_bytes
    from quant_helpers import dequantized_float_model
    from test_probes_session56_review_moeq import rtn_gptq
    out = tmp_path / "q"
    rtn_gptq(ensure_builtin(NAME), out)
    (out / "quantize_config.json").write_text(json.dumps(json.loads((out / "config.json").read_text())
                                                         ["quantization_config"]))
    plan = estimated_plan(str(out), "--max-length", "256")
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4, max_model_len=256) as llm:
        model = llm.engine.runner.model
        assert model.layers[0].mamba.in_proj.qweight is not None and model.layers[0].mamba.out_proj.qweight is not None
        assert model.layers[2].self_attn.qkv_proj.qweight is not None
        assert model.layers[1].feed_forward.gate_up_proj.qweight is not None
        assert plan["weights_bytes"] == weights_bytes(model)
        got = greedy_tokens(llm, prompts, 8)
    assert got == greedy_each(dequantized_float_model(ensure_builtin(NAME), out).eval(), prompts, 8)
    assert len({t for tokens in got for t in tokens}) > 6


# ------------------------------------------------------------------------------------------------------ adapters
def test_mixed_adapters_on_every_projection_equal_peft(tmp_path):
    """Two adapters ("all": every projection peft finds, the attention's, the feed_forward's and the Mamba-2 mixers'
    in_proj [64 -> 328] and out_proj; "mamba": the mixers' alone) and the base model in one batch and each alone:
    peft's tokens."""
    from lora_helpers import check_mixed_adapters_equal_peft, hf_float, save_adapters
    base = ensure_builtin(NAME)
    hf = hf_float(base)
    paths = save_adapters(hf, tmp_path, {
        "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                        "down_proj", "in_proj", "out_proj"]),
        "mamba": dict(r=4, lora_alpha=4, target_modules=r".*\.mamba\.(in_proj|out_proj)")}, scale=0.5)
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (7, 12, 5), seed=2), ["all", None, "mamba"],
                                    n=5)


def test_an_adapter_of_the_depthwise_conv_is_refused_by_name(tmp_path):
    """An adapter whose target_modules name the Mamba-2 mixers' depthwise conv (conv1d) is refused at registration,
    naming it and the projections infer adapts; --lora-target-modules gate_proj without up_proj is refused naming
    the fused layer."""
    from lora_helpers import hf_float, save_adapters

    from infer.errors import ConfigError, LoRAError
    paths = save_adapters(hf_float(ensure_builtin(NAME)), tmp_path, {"a": dict(r=4, lora_alpha=8,
                                                                               target_modules=["q_proj"])})
    config = json.loads((paths["a"] / "adapter_config.json").read_text())
    (paths["a"] / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "conv1d"]}))
    with pytest.raises(LoRAError, match=r"targets \['conv1d'\]: infer's adapters of bamba \(Bamba\) adapt the "
                                        r"attention's, the MLP's and the Mamba-2 mixers' projections, not the mixers' "
                                        r"depthwise conv.*retrain with target_modules among q_proj, .*in_proj, "
                                        r"out_proj"):
        LLM(NAME, loras={"a": str(paths["a"])}, max_lora_rank=8)
    with pytest.raises(ConfigError, match=r"names gate_proj but not up_proj: infer computes gate_proj, up_proj as one "
                                          r"fused layer"):
        LLM(NAME, enable_lora=True, max_lora_rank=8, lora_target_modules=["gate_proj"])


@pytest.mark.parametrize("targets", [None, ["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"], ["in_proj"],
                                     ["out_proj", "o_proj"]])
def test_adapter_slots_are_counted(targets):
    """The slots allocated (--lora-target-modules: every layer's; the attention's; the feed_forward's; the Mamba-2
    mixers' in_proj [64 -> 328]; their out_proj with the attention's o_proj) are lora_slot_bytes' count, byte for
    byte."""
    from infer.memory.sizes import lora_slot_bytes
    with LLM(NAME, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, lora_target_modules=targets) as llm:
        got = llm.engine.lora_manager.device_bytes()
        assert got == lora_slot_bytes(llm.engine.runner.model.config, 2, 4, torch.float32, targets) > 0


# ------------------------------------------------------------------------------------------------- hub's shapes
# Bamba-9B's config.json (ibm-ai-platform/Bamba-9B): 32 layers, attention on 9, 18 and 27 (GQA: 32 heads of 128,
# 8 KV heads, a rotary of 64 dims), Mamba-2 elsewhere (128 heads of 64, one group of 128 state dims, conv of 4, chunks
# of 256), an MLP of 14,336, 128,256 tokens, an untied head: 9.78B parameters
HUB = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
           num_key_value_heads=8, attn_layer_indices=[9, 18, 27], attn_rotary_emb=64, mamba_n_heads=128,
           mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
           mamba_chunk_size=256, max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5)


def test_warmup_estimate_on_bamba_9bs_shapes(tmp_path, monkeypatch):
    """`infer warmup --estimate` of a folder of Bamba-9B's shapes (bfloat16, no values) on an 80 GiB GPU: its 9.78B
    parameters' bytes, KV on the 3 attention layers alone (2 x 8 x 128 bfloat16 a token each), and per sequence the
    29 Mamba-2 layers' states: a conv state [8,192 + 2 x 128, 3] in bfloat16 and an SSM state [128, 64, 128] in
    float32; 4 sequences of 4,096 tokens fit."""
    from helpers import hub_shaped_folder
    params = hub_shaped_folder(tmp_path, "bamba", ARCH, HUB)
    assert 9.77e9 < params < 9.79e9, params
    from test_probes_session67_llama4b import on_an_80_gb_gpu
    on_an_80_gb_gpu(monkeypatch)
    plan = estimated_plan(str(tmp_path), "--dtype", "bfloat16", "--max-length", "4096", "--max-num-seqs", "4",
                          "--device", "cuda")
    assert plan["kv_bytes_per_token"] == 3 * 2 * 8 * 128 * 2
    assert plan["state_bytes"] == 5 * 29 * (8448 * 3 * 2 + 128 * 64 * 128 * 4)
    assert 2 * params <= plan["weights_bytes"] < 2 * params * 1.01, (plan["weights_bytes"], params)
    assert plan["fits"] and plan["max_concurrency_at_max_length"] >= 4, plan


def test_the_measured_cpu_peak_is_under_the_estimate():
    """`infer warmup` (measured, a fresh process) of a step of 4,092 tokens and decodes at 1,024: the measured peak
    (the SSD scan's temporaries over 256 chunks of 16, the feed_forward's) is under `warmup --estimate`'s
    activations, which are not loose by more than 1.5x (1.38 to 1.39 measured; at 1,020 tokens, 1.39 to 1.45)."""
    from helpers import measured_warmup
    measured = measured_warmup([NAME, "--max-length", "1024", "--concurrency", "4", "--max-num-batched-tokens", "4096"])
    peak, formula = measured["activation_peak_bytes"], measured["activation_estimate_bytes"]
    assert peak <= formula <= 1.5 * peak, (formula, peak)
