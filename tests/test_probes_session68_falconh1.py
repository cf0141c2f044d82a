"""TII's Falcon-H1 (FalconH1ForCausalLM, models.falcon_h1) equals transformers (float32): every layer's attention
(rope, k times key_multiplier) and Mamba-2 mixer (the mup vector on in_proj's output, ssm_in/out multipliers; its conv
and SSM states in the per-sequence state cache) on the same normed input, the MLP's gate and down multipliers, the
embedding and lm_head multipliers: greedy tokens and logprobs, the gated norm (before and after the gate) and every
bias, chunked prefill, prefix caching through state snapshots, preemption, the Triton kernels interpreted under
emulated graphs; the memory plan's KV (every layer) and Mamba-2 states, on the tiny model and on the 7B's shapes;
adapters (attention, MLP, the mixers' in_proj) equal to peft's; `infer quantize` equal to GPTQModel's own load;
configs it cannot run refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM
from infer.models.tiny import ensure_builtin

from helpers import (builtin_model_tests, check_batched_chunks_equal_transformers, check_emulated_decode_graphs,
                     check_greedy_and_logprobs_equal_transformers, check_preemption_restarts_from_zero_state,
                     check_prefix_snapshot_restored, estimated_plan, greedy_each, greedy_tokens, hf_model,
                     hub_shaped_folder, norms_shifted_biases_drawn, random_prompts, save_random_model)
from quant_helpers import needs_gptqmodel

NAME = "tiny-falcon-h1"
ARCH = "FalconH1ForCausalLM"


@pytest.fixture(scope="module")
def hf():
    return hf_model(str(ensure_builtin(NAME)))


def _layers_as_the_config(model) -> None:
    """3 layers, each an attention (the KV) beside a Mamba-2 mixer of 128 channels with a conv state [128 + 2 * 2 *
    16, 3] and an SSM state [8, 16, 16]; no gated norm weight (mamba_rms_norm false); the scalars read."""
    assert len(model.layers) == 3 and all(hasattr(layer.self_attn, "k_cache") for layer in model.layers)
    mixers = model.linear_layers()
    assert len(mixers) == 3 and mixers[0].rec_state.shape[1:] == (8, 16, 16)
    assert mixers[0].conv_state.shape[1:] == (128 + 2 * 2 * 16, 3) and mixers[0].norm.weight is None
    assert model.layers[0].self_attn.scale == pytest.approx(16 ** -0.5 * 0.390625)
    assert (model.embedding_multiplier, model.lm_head_multiplier, model.ssm_out) == (5.656, 0.0390625, 0.2357)


def test_falcon_h1_equals_transformers(hf):
    """Prompts of 5, 13 and 30 tokens batched (the 30-token one spans two scan chunks of 16): transformers' greedy
    tokens and logprobs."""
    check_greedy_and_logprobs_equal_transformers(ensure_builtin(NAME), hf, NAME, _layers_as_the_config)


SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=2, pad_token_id=0,
             mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3,
             mamba_chunk_size=8, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
             embedding_multiplier=2.5, lm_head_multiplier=0.5, key_multiplier=0.7, attention_in_multiplier=1.3,
             attention_out_multiplier=0.8, ssm_in_multiplier=0.6, ssm_out_multiplier=1.7,
             ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 2.0], mlp_multipliers=[1.4, 0.6])


@pytest.mark.parametrize("before_gate", [True, False])
def test_gated_norm_biases_and_a_tied_head_equal_transformers(tmp_path, before_gate):
    """mamba_rms_norm (its weight drawn; the gate after the norm or before it), every bias (mamba_proj_bias on
    in_proj, projectors_bias on out_proj, the conv's, attention_bias, mlp_bias; drawn), mamba_d_ssm 96 (not
    mamba_expand * hidden_size), every multiplier off 1 (attention_in_multiplier too), a tied head, chunks of 8:
    transformers' tokens and logprobs."""
    config = dict(SMALL, mamba_rms_norm=True, mamba_norm_before_gate=before_gate, mamba_proj_bias=True,
                  projectors_bias=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    hf = save_random_model(tmp_path, "falcon_h1", ARCH, config, seed=4, perturb=norms_shifted_biases_drawn)

    def check(model):
        mixer = model.linear_layers()[0]
        assert mixer.norm.weight is not None and mixer.norm.before_gate == before_gate
        assert mixer.in_proj.bias is not None and mixer.out_proj.bias is not None and model.tie_word_embeddings
        assert mixer.inter == 96 and model.attention_in == 1.3
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, f"falcon-h1-{before_gate}", check)


def test_bfloat16_equals_transformers_in_bfloat16(hf):
    """--dtype bfloat16 (the mup vector in bfloat16, as transformers holds it; the SSM state float32): transformers'
    greedy tokens in bfloat16, batched, a one-token prompt included."""
    import copy
    hf = copy.deepcopy(hf).to(torch.bfloat16)  # (the module's hf: float32)
    prompts = random_prompts(512, (5, 13, 30, 1), seed=3)
    with LLM(NAME, block_size=4, dtype="bfloat16", max_num_seqs=2) as llm:
        assert llm.engine.runner.model.linear_layers()[0].mup.dtype == torch.bfloat16
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)


def test_chunked_prefill_and_preemption_carry_and_restart_the_states(hf):
    """Prompts of 30, 17 and 1 tokens in steps of 8 (states carried across steps beside the others' decodes); a KV
    budget that preempts (recomputed from zero state): transformers' tokens, every state slot given back."""
    check_batched_chunks_equal_transformers(ensure_builtin(NAME), hf)
    check_preemption_restarts_from_zero_state(NAME, hf)


def test_a_second_request_sharing_a_prefix_starts_after_its_snapshot(hf):
    """A 37-token prompt, then it with 7 more tokens (blocks of 4): the second finds the first's 9 full blocks (the KV
    of every layer) and the Mamba-2 states snapshotted at their end, computes its last tokens alone; the tokens and
    logprobs are those of caching off, the tokens transformers'."""
    check_prefix_snapshot_restored(NAME, hf)


def test_interpreted_triton_kernels_under_emulated_graphs_equal_transformers(hf, monkeypatch):
    """Every op through its Triton kernel (interpreted: the Mamba-2 scan and state update, the convs, the attention,
    the norms), decodes through emulated CUDA graphs of every bucket: transformers' tokens."""
    check_emulated_decode_graphs(NAME, hf, monkeypatch, triton=True)


test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = \
    builtin_model_tests({NAME: ARCH})


def test_warmup_counts_the_kv_of_every_layer_and_the_mamba_states():
    """`infer warmup --estimate` (8 sequences) counts the KV of all 3 layers (2 KV heads of 16, K and V, float32) and
    the 3 mixers' state slots (8 and a padding slot: a conv state [192, 3] and a float32 SSM state [8, 16, 16]), the
    engine's own."""
    plan = estimated_plan(NAME, "--max-length", "256", "--max-num-seqs", "8", "--memory-limit", "256MiB")
    assert plan["kv_bytes_per_token"] == 3 * 2 * 2 * 16 * 4
    assert plan["state_bytes"] == 3 * 9 * (192 * 3 * 4 + 8 * 16 * 16 * 4)
    with LLM(NAME, max_model_len=256, max_num_seqs=8) as llm:
        assert llm.engine.runner.state_bytes == plan["state_bytes"] and llm.engine.runner.kv_cache.shape[0] == 3


# the shapes of transformers' FalconH1 table for H1 7B (44 layers of 3072, 12 attention heads and 2 KV heads of 128,
# 24 Mamba-2 heads of 128, d_state 256); the MLP's width, the vocabulary and the one group are taken as the hub's
H1_7B = dict(vocab_size=130048, hidden_size=3072, intermediate_size=12288, num_hidden_layers=44,
             num_attention_heads=12, num_key_value_heads=2, head_dim=128, mamba_d_ssm=3072, mamba_n_heads=24,
             mamba_d_head=128, mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_chunk_size=256,
             max_position_embeddings=262144, tie_word_embeddings=False)


def test_the_7b_shaped_plan_counts_every_layers_kv_and_the_mamba_states(tmp_path, monkeypatch):
    """`infer warmup --estimate` of a checkpoint of Falcon-H1-7B's shapes (bfloat16, no values): the KV of all 44
    layers (2 KV heads of 128, K and V: 45,056 bytes a token), 4 sequences' and a padding slot's Mamba-2 states (a
    conv state [3072 + 2 * 256, 3] in bfloat16, an SSM state [24, 128, 256] in float32, a layer), the weights the
    checkpoint's in bfloat16."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    params = hub_shaped_folder(tmp_path, "falcon_h1", ARCH, H1_7B)
    assert 7.0e9 < params < 8.5e9, params
    monkeypatch.setattr("infer.memory.plan.device_total", lambda device: 80 << 30)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json", "--dtype", "bfloat16",
                                   "--max-length", "32768", "--max-num-seqs", "4", "--device", "cpu",
                                   "--memory-limit", "64GB"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    assert plan["kv_bytes_per_token"] == 44 * 2 * 2 * 128 * 2
    assert plan["state_bytes"] == 5 * 44 * (3584 * 3 * 2 + 24 * 128 * 256 * 4)
    # (on the CPU every float linear layer and the head prepacked beside their tensors: all but the embeddings twice;
    # on a CPU whose oneDNN packs no bfloat16, AMD EPYC's without AVX-512, none)
    from infer.kernels.cpu_gemm import _packs
    want = 4 * params - 2 * 130048 * 3072 if _packs(torch.bfloat16) else 2 * params
    assert abs(plan["weights_bytes"] - want) < 0.01 * params, (plan["weights_bytes"], params)


@pytest.mark.parametrize("change, match", [
    ({"mamba_n_groups": 3}, r"falcon_h1 with mamba_n_heads 8 in mamba_n_groups 3 is not supported"),
    ({"mlp_multipliers": [1.0]}, r"falcon_h1 mlp_multipliers \[1.0\] is not 2 numbers"),
    ({"ssm_multipliers": [1.0, 1.0, 1.0, 1.0, "x"]}, r"falcon_h1 ssm_multipliers .* is not 5 numbers"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported")])
def test_config_refusals(change, match):
    """A Falcon-H1 config of Mamba-2 heads its groups do not divide, multipliers of another count or kind, or another
    activation: refused naming the field."""
    from transformers import AutoConfig

    from infer.errors import UnsupportedModelError
    from infer.models.registry import check_supported
    cfg = AutoConfig.from_pretrained(str(ensure_builtin(NAME)))
    for key, value in change.items():
        object.__setattr__(cfg, key, value)
    with pytest.raises(UnsupportedModelError, match=match):
        check_supported(cfg)


def test_mup_vector_is_transformers():
    """models.falcon_h1.mup_vector is transformers' compute_mup_vector (z, x, B, C, dt columns), on SMALL's widths."""
    from transformers import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

    from infer.models.falcon_h1 import mup_vector
    cfg = FalconH1Config(**SMALL)
    assert torch.equal(mup_vector(cfg), compute_mup_vector(cfg).flatten())


def test_mixed_adapters_on_the_attention_the_mlp_and_in_proj_equal_peft(tmp_path):
    """Two adapters (every projection peft adapts on Falcon-H1: q, k, v, o, gate, up, down and the mixers' in_proj,
    whose delta the mup vector scales; in_proj alone) and the base model in one batch and each alone: peft's tokens."""
    from lora_helpers import check_mixed_adapters_equal_peft, hf_float, save_adapters
    base = ensure_builtin(NAME)
    hf = hf_float(base)
    paths = save_adapters(hf, tmp_path, {
        "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj", "in_proj"]),
        "mamba": dict(r=4, lora_alpha=4, target_modules=["in_proj"])}, scale=0.5)
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (7, 12, 5), seed=2), ["all", None, "mamba"],
                                    n=5)


def test_adapters_of_out_proj_and_conv1d_are_refused_by_name_and_the_slots_are_counted(tmp_path):
    """An adapter whose target_modules name the mixers' out_proj (peft refuses it on Falcon-H1; an adapter made
    elsewhere may have it) or conv1d is refused at registration naming them and what infer adapts; the slots
    allocated (every layer's attention, MLP and mixer) are lora_slot_bytes' count, byte for byte."""
    from lora_helpers import hf_float, save_adapters

    from infer.errors import LoRAError
    from infer.memory.sizes import lora_slot_bytes
    paths = save_adapters(hf_float(ensure_builtin(NAME)), tmp_path, {"a": dict(r=4, lora_alpha=8,
                                                                               target_modules=["q_proj"])})
    config = json.loads((paths["a"] / "adapter_config.json").read_text())
    for extra in ("out_proj", "conv1d"):
        (paths["a"] / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", extra]}))
        with pytest.raises(LoRAError, match=rf"targets \['{extra}'\]: infer's adapters of falcon_h1 \(Falcon-H1\) "
                                            r"adapt the attention's, the MLP's and the Mamba-2 mixers' in_proj, not "
                                            r"the mixers' out_proj or conv1d.*retrain with target_modules among "
                                            r"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, in_proj"):
            LLM(NAME, loras={"a": str(paths["a"])}, max_lora_rank=8)
    with LLM(NAME, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4) as llm:
        got = llm.engine.lora_manager.device_bytes()
        assert got == lora_slot_bytes(llm.engine.runner.model.config, 2, 4, torch.float32) > 0


@needs_gptqmodel
def test_infer_quantize_gives_gptqmodels_own_tokens(tmp_path):
    """`infer quantize` (GPTQModel's falcon_h1 definition, each mixer's mup_vector made after its lazy load) writes
    the attention's q, k, v, o, the mixers' in_proj and out_proj and the MLP's gate, up, down int4; infer loads it
    (q|k|v and gate|up merged) and gives GPTQModel's own load's greedy tokens and transformers' on the dequantized
    weights; `infer warmup --estimate` counts its weights as loaded."""
    from safetensors import safe_open

    from infer.memory.sizes import weights_bytes
    from infer.quant.quantize import _falcon_h1_view
    from quant_helpers import dequantized_float_model, gptqmodel_greedy, infer_quantize
    out = infer_quantize(NAME, tmp_path / "q")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.1.self_attn.{p}.qweight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")} <= names
    assert {f"model.layers.2.mamba.{p}.qweight" for p in ("in_proj", "out_proj")} <= names
    assert {f"model.layers.0.feed_forward.{p}.qweight" for p in ("gate_proj", "up_proj", "down_proj")} <= names
    plan = estimated_plan(str(out), "--max-length", "256")
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4, max_model_len=256) as llm:
        model = llm.engine.runner.model
        assert model.layers[0].mamba.in_proj.qweight is not None and model.layers[2].self_attn.qkv_proj.qweight \
            is not None and model.layers[1].feed_forward.gate_up_proj.qweight is not None
        assert plan["weights_bytes"] == weights_bytes(model)
        got = greedy_tokens(llm, prompts, 8)
    assert got == greedy_each(dequantized_float_model(ensure_builtin(NAME), out), prompts, 8)
    with _falcon_h1_view(out):
        assert got == gptqmodel_greedy(out, prompts, 8)
