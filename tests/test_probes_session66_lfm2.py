"""Liquid AI's LFM2 (Lfm2ForCausalLM, models.lfm2) equals transformers (float32): short-conv layers (in_proj to B, C
and x, B * x through a causal depthwise conv of conv_L_cache taps whose last inputs are kept per sequence in the
state cache, C times its output, out_proj) beside attention layers with q and k normed per head, operator_norm and
ffn_norm, the SwiGLU feed_forward of transformers' adjusted width, the final embedding_norm, a tied head: greedy
tokens and logprobs of concurrent prompts, chunked prefill, preemption, prefix caching through state snapshots; the
memory estimate's state bytes; the short conv's Triton kernels without silu; LFM2's neighbours refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import (check_batched_chunks_equal_transformers, check_chunked_prefill_carries_the_states,
                     check_greedy_and_logprobs_equal_transformers, check_preemption_restarts_from_zero_state,
                     check_prefix_snapshot_restored, check_sleep_frees_the_states_with_the_kv_cache,
                     check_warmup_counts_the_states, estimated_plan, greedy_each, greedy_tokens, hf_model,
                     interpreted_module, norms_and_biases_shifted, random_prompts, save_random_model)
from quant_helpers import needs_gptqmodel

NAME = "tiny-lfm2"


@pytest.fixture(scope="module")
def hf():
    return hf_model(str(ensure_builtin(NAME)))


def _layers_as_the_config(model) -> None:
    """conv, conv, attention, conv: three short convs with a conv state [64, 2] each and no other state, one
    attention layer (the only KV); the feed_forward 160 wide (2/3 of 200, rounded up to 32); the head tied."""
    assert [layer.linear for layer in model.layers] == [True, True, False, True]
    convs = model.linear_layers()
    assert len(convs) == 3 and all(c.conv_state.shape[1:] == (64, 2) and c.rec_state is None for c in convs)
    assert [hasattr(layer, "self_attn") for layer in model.layers] == [False, False, True, False]
    assert model.layers[0].feed_forward.gate_up_proj.out_sizes == [160, 160]
    assert model.tie_word_embeddings


def test_lfm2_equals_transformers(hf):
    """Prompts of 5, 13 and 30 tokens batched: transformers' greedy tokens and logprobs."""
    check_greedy_and_logprobs_equal_transformers(ensure_builtin(NAME), hf, NAME, _layers_as_the_config)


def test_conv_bias_and_drawn_norms_equal_transformers(tmp_path):
    """An LFM2 with conv_bias (in_proj, out_proj and the conv with biases), every norm weight and bias moved off its
    init (operator_norm, ffn_norm, q_layernorm, k_layernorm, embedding_norm), 4 taps, block_ffn_dim_multiplier 1.5
    (the width 2/3 of intermediate_size 100, 66, times 1.5, 99, rounded up to 112) and an untied head: transformers'
    tokens and logprobs."""
    config = dict(hidden_size=64, intermediate_size=100, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, conv_L_cache=4, conv_bias=True, block_multiple_of=16,
                  block_ffn_dim_multiplier=1.5, layer_types=["full_attention", "conv", "conv"],
                  tie_word_embeddings=False, max_position_embeddings=256)
    hf = save_random_model(tmp_path, "lfm2", "Lfm2ForCausalLM", config, seed=3, perturb=norms_and_biases_shifted)

    def check(model):
        assert model.layers[0].feed_forward.gate_up_proj.out_sizes == [112, 112]
        assert model.linear_layers()[0].conv.bias is not None and not model.tie_word_embeddings
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, "lfm2-bias", check)


def test_chunked_prefill_carries_the_conv_state_across_steps(hf):
    """Steps of 8 tokens: prompts of 30 and 41 tokens run in chunks whose conv states carry over, mixed with the
    others' decodes; a prompt of one token too; every state slot given back."""
    check_chunked_prefill_carries_the_states(NAME, hf)


def test_preemption_restarts_the_conv_state_from_zero(hf):
    """A KV budget of 16 blocks of 4 for 4 prompts: some are preempted and recomputed from zero state."""
    check_preemption_restarts_from_zero_state(NAME, hf)


def test_a_second_request_sharing_a_prefix_starts_after_its_snapshot(hf):
    """A 37-token prompt, then it with 7 more tokens (blocks of 4): the second finds the first's 9 full blocks and
    the conv states snapshotted at their end, computes its last 8 tokens alone, and both give transformers' tokens
    and those of caching off; after sleep and wake_up it is computed in full, the same tokens."""

    def after_sleep(llm, prompts, want):
        # sleep frees the conv states and their snapshots with the KV cache (no recurrent state to free) and
        # forgets the snapshots: the extension after waking is computed in full, the same tokens
        check_sleep_frees_the_states_with_the_kv_cache(llm)
        again = llm.generate(prompts[1:], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
        assert again.num_cached_tokens == 0 and again.token_ids == want[1]
    check_prefix_snapshot_restored(NAME, hf, after_sleep, enable_sleep_mode=True)


def test_prefix_caching_without_snapshots_is_off_and_said(caplog, hf):
    """--state-snapshots 0: prefix caching is off for lfm2, said in the log; a repeated prompt is computed in full and
    gives transformers' tokens."""
    import logging
    prompt = random_prompts(512, (21,), seed=9)[0]
    with caplog.at_level(logging.INFO, logger="infer"):
        with LLM(NAME, block_size=4, state_snapshots=0) as llm:
            assert not llm.engine.block_manager.enable_prefix_caching and llm.engine.block_manager.snapshots is None
            outs = [llm.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))[0] for _ in range(2)]
    assert "prefix caching is off for lfm2" in caplog.text
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert [o.token_ids for o in outs] == greedy_each(hf, [prompt], 4) * 2


def test_warmup_counts_the_conv_states_and_the_attention_kv_alone():
    """`infer warmup --estimate` counts the 3 short convs' state slots (8 sequences and a padding slot: a conv state
    [64, 2] in float32, nothing else) and the KV of the one attention layer of 4: 2 KV heads of 16, K and V."""
    plan = check_warmup_counts_the_states(NAME, 2 * 2 * 16 * 4)
    assert plan["state_bytes"] == 3 * 9 * 64 * 2 * 4


def test_the_activation_estimate_covers_the_measured_peak():
    """`infer warmup` (measured, a fresh process) of a step of 4,092 tokens: the short convs' temporaries (in_proj's
    B | C | x, B * x, the conv's input with its state and its output, C times it) are within the formula, which is
    not loose by more than 30%. (At 1,020 tokens the peak RSS's growth, about 3 MB, moved by 0.5 MB from run to run
    beside another pytest worker: 1.14 to 1.35 of it.)"""
    from helpers import measured_warmup
    measured = measured_warmup([NAME, "--max-length", "1024", "--concurrency", "4", "--max-num-batched-tokens", "4096"])
    peak, formula = measured["activation_peak_bytes"], measured["activation_estimate_bytes"]
    assert peak <= formula <= 1.3 * peak, (formula, peak)


def test_mlp_width_is_transformers():
    """models.lfm2.ffn_width is the width transformers' Lfm2MLP builds, for LFM2's released settings and others."""
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    from infer.models.lfm2 import ffn_width
    for kw in (dict(intermediate_size=12288), dict(intermediate_size=4608, block_ffn_dim_multiplier=1.5),
               dict(intermediate_size=300, block_ffn_dim_multiplier=1.3, block_multiple_of=32),
               dict(intermediate_size=300, block_auto_adjust_ff_dim=False), dict(intermediate_size=6656)):
        cfg = Lfm2Config(hidden_size=8, num_hidden_layers=1, **kw)
        assert ffn_width(cfg) == Lfm2MLP(cfg).w1.out_features, kw


@pytest.fixture(scope="module")
def triton_conv():
    yield from interpreted_module("infer.kernels.delta_triton")


@pytest.mark.parametrize("silu", [False, True])
def test_the_triton_conv_kernels_with_and_without_silu_equal_the_reference(triton_conv, silu):
    """Interpreted: the decode update and the varlen prefill conv (a bias, a kept state and a fresh one) without
    silu (LFM2's) and with it equal kernels.delta_rule's, outputs and states."""
    from infer.kernels import delta_rule
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(16, 1, 3, generator=g), torch.randn(16, generator=g)
    states = torch.randn(3, 16, 2, generator=g)
    slots, kept = torch.tensor([2, 0]), torch.tensor([True, False])
    x = torch.randn(2, 16, generator=g)
    a, b = states.clone(), states.clone()
    want = delta_rule.causal_conv1d_update(x, w, a, slots, kept, bias, silu=silu)
    got = triton_conv.causal_conv1d_update(x, w, b, slots, kept, bias, silu=silu)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(a, b)
    x, starts = torch.randn(9, 16, generator=g), torch.tensor([0, 4, 9])
    want = delta_rule.causal_conv1d_varlen(x, w, a, starts, slots, kept, 5, bias, silu=silu)
    got = triton_conv.causal_conv1d_varlen(x, w, b, starts, slots, kept, 5, bias, silu=silu)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(a, b)


@pytest.mark.parametrize("model_type, arch, what", [
    ("lfm2_vl", "Lfm2VlForConditionalGeneration", "LFM2-VL, LFM2's vision-language model"),
    ("lfm3", "Lfm3ForCausalLM", "LFM3"),
])
def test_lfm2_neighbours_are_refused_by_name(tmp_path, model_type, arch, what):
    """LFM2-VL and LFM3 are refused naming what they are and what infer runs, before transformers reads their
    config."""
    from infer.errors import UnsupportedModelError
    from infer.models.loader import load_config
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch]}))
    with pytest.raises(UnsupportedModelError, match=rf"is {what}.*which infer does not run") as e:
        load_config(tmp_path)
    assert "Lfm2ForCausalLM" in e.value.hint


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["conv", "sliding_attention", "full_attention", "conv"]),
     r"lfm2 layer_types \['sliding_attention'\] are not supported"),
    (dict(layer_types=["conv", "full_attention"]), r"`num_hidden_layers` \(4\) must be equal to the number of "
                                                   r"`layer_types` \(2\)"),
    (dict(layer_types=["conv"] * 4), r"lfm2 with no attention layer"),
    (dict(conv_L_cache=1), r"lfm2 with conv_L_cache 1 is not supported"),
])
def test_configs_lfm2_cannot_run_are_refused_naming_the_field(tmp_path, change, match):
    """A config.json of another layer kind, a layer count other than num_hidden_layers (transformers' own words), no
    attention layer or a conv of one tap: refused naming the field."""
    import shutil

    from infer.errors import UnsupportedModelError
    from infer.models.loader import load_config
    src = ensure_builtin(NAME)
    shutil.copy(src / "config.json", tmp_path / "config.json")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match=match):
        load_config(tmp_path)


def test_speculative_decoding_is_refused():
    """A rejected draft token would leave the conv state advanced: --speculative-config is refused for lfm2."""
    from infer.errors import ConfigError
    with pytest.raises(ConfigError, match="--speculative-config cannot run lfm2"):
        LLM(NAME, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_mixed_adapters_on_every_projection_equal_peft(tmp_path):
    """Two adapters (every projection peft finds: q, k, v and out_proj of the attention and of the short convs,
    in_proj, w1, w3, w2; the short convs' in_proj and out_proj alone) and the base model in one batch and each alone:
    peft's tokens."""
    from lora_helpers import check_mixed_adapters_equal_peft, hf_float, save_adapters
    base = ensure_builtin(NAME)
    hf = hf_float(base)
    paths = save_adapters(hf, tmp_path, {
        "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1",
                                                        "w3", "w2"]),
        "conv": dict(r=4, lora_alpha=4, target_modules=r".*\.conv\.(in_proj|out_proj)")}, scale=0.5)
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (7, 12, 5), seed=2), ["all", None, "conv"],
                                    n=5)


@pytest.mark.parametrize("targets", [None, ["qkv_proj", "out_proj"], ["in_proj", "w1", "w3", "w2"]])
def test_adapter_slots_are_counted(targets):
    """The slots allocated (--lora-target-modules: every layer, the attention's with both kinds of out_proj, the short
    convs' in_proj with the MLP) are lora_slot_bytes' count, byte for byte: a short conv's in_proj [64 -> 192] and
    out_proj, the MLP's width 160."""
    from infer.memory.sizes import lora_slot_bytes
    with LLM(NAME, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, lora_target_modules=targets) as llm:
        got = llm.engine.lora_manager.device_bytes()
        assert got == lora_slot_bytes(llm.engine.runner.model.config, 2, 4, torch.float32, targets) > 0


def test_an_adapter_of_the_depthwise_conv_is_refused_by_name(tmp_path):
    """An adapter whose target_modules name the short convs' depthwise conv (conv) is refused at registration, naming
    it and the projections infer adapts; w1 without w3 in --lora-target-modules is refused naming the fused layer."""
    from lora_helpers import hf_float, save_adapters

    from infer.errors import ConfigError, LoRAError
    paths = save_adapters(hf_float(ensure_builtin(NAME)), tmp_path, {"a": dict(r=4, lora_alpha=8,
                                                                               target_modules=["q_proj"])})
    config = json.loads((paths["a"] / "adapter_config.json").read_text())
    (paths["a"] / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "conv"]}))
    with pytest.raises(LoRAError, match=r"targets \['conv'\]: infer's adapters of lfm2 \(LFM2\) adapt the attention's, "
                                        r"the short convs' and the MLP's projections, not the short convs' depthwise "
                                        r"conv.*retrain with target_modules among q_proj, k_proj, v_proj, out_proj"):
        LLM(NAME, loras={"a": str(paths["a"])}, max_lora_rank=8)
    with pytest.raises(ConfigError, match=r"names w1 but not w3: infer computes w1, w3 as one fused layer"):
        LLM(NAME, enable_lora=True, max_lora_rank=8, lora_target_modules=["w1"])


@needs_gptqmodel
def test_infer_quantize_and_the_gptq_checkpoint_equal_transformers_dequantized(tmp_path):
    """`infer quantize` (GPTQModel's lfm2 definition) writes the short convs' in_proj and out_proj, the attention's
    q, k, v and out_proj and the MLP's w1, w3, w2 int4; infer loads it (q|k|v and w1|w3 merged) and gives
    transformers' greedy tokens on the dequantized weights; `infer warmup --estimate` counts its weights as loaded."""
    from safetensors import safe_open

    from infer.memory.sizes import weights_bytes
    from quant_helpers import dequantized_float_model, infer_quantize
    out = infer_quantize(NAME, tmp_path / "q")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.0.conv.{p}.qweight" for p in ("in_proj", "out_proj")} <= names
    assert {f"model.layers.2.self_attn.{p}.qweight" for p in ("q_proj", "k_proj", "v_proj", "out_proj")} <= names
    assert {f"model.layers.1.feed_forward.{p}.qweight" for p in ("w1", "w3", "w2")} <= names
    plan = estimated_plan(str(out), "--max-length", "256")
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4, max_model_len=256) as llm:
        model = llm.engine.runner.model
        assert model.layers[0].conv.in_proj.qweight is not None and model.layers[2].self_attn.o_proj.qweight is not None
        assert plan["weights_bytes"] == weights_bytes(model)
        got = greedy_tokens(llm, prompts, 8)
    assert got == greedy_each(dequantized_float_model(ensure_builtin(NAME), out), prompts, 8)


def _moe_model(folder, seed: int, **change):
    """A random LFM2-MoE of tiny-lfm2-moe's shape (`change` set on it) saved to `folder`, its norms moved off their
    init and its expert_bias drawn (zero at init: a bug in it would go unseen); returns transformers' model."""
    from infer.models.tiny import BUILTIN_MODELS
    config = {**BUILTIN_MODELS["tiny-lfm2-moe"].config, "vocab_size": 512, **change}
    hf = save_random_model(folder, "lfm2_moe", "Lfm2MoeForCausalLM", config, seed=seed,
                           perturb=norms_and_biases_shifted)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in hf.model.layers:
            bias = getattr(layer.feed_forward, "expert_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.5)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


@pytest.mark.parametrize("change", [{}, dict(use_expert_bias=False, norm_topk_prob=False, tie_word_embeddings=False)])
def test_lfm2_moe_equals_transformers(tmp_path, change):
    """LFM2-MoE (the first MLP dense, then 8 experts of 32, 2 a token, by sigmoid scores, expert_bias steering the
    choice, renormalised, scaled by 1.5; and without the bias nor renormalising): transformers' greedy tokens and
    logprobs of prompts of 5, 13 and 30 batched, and its tokens in steps of 8 (chunked prefill)."""
    from infer.models.moe import SparseMoeBlock
    hf = _moe_model(tmp_path, 5, **change)

    def check(model):
        assert [isinstance(layer.feed_forward, SparseMoeBlock) for layer in model.layers] == [False, True, True, True]
        assert model.layers[0].feed_forward.gate_up_proj.out_sizes == [96, 96]
        bias = getattr(model.layers[1].feed_forward.gate, "e_score_correction_bias", None)
        want = getattr(hf.model.layers[1].feed_forward, "expert_bias", None)
        assert (bias is None) == (want is None) and (bias is None or torch.equal(bias, want))
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, "lfm2-moe", check)
    check_batched_chunks_equal_transformers(tmp_path, hf)


def test_lfm2_moe_warmup_counts_the_conv_states_and_the_built_in_model_runs():
    """`infer warmup --estimate` of tiny-lfm2-moe counts its 3 short convs' state slots and its one attention layer's
    KV as the engine allocates them; the built-in model gives transformers' tokens."""
    plan = check_warmup_counts_the_states("tiny-lfm2-moe", 2 * 2 * 16 * 4)
    assert plan["state_bytes"] == 3 * 9 * 64 * 2 * 4
    prompts = random_prompts(512, (6, 19), seed=1)
    with LLM("tiny-lfm2-moe", block_size=4) as llm:
        got = greedy_tokens(llm, prompts, 6)
    assert got == greedy_each(hf_model(str(ensure_builtin("tiny-lfm2-moe"))), prompts, 6)
