"""Session 62: mixture-of-experts families. GLM-4.5 and GLM-4.6 (Glm4MoeForCausalLM, model_type glm4_moe), end to
end on tiny random models built from its config (float32) against transformers: the sigmoid router whose
e_score_correction_bias steers the choice (not the weights), group-limited top k (n_group, topk_group),
norm_topk_prob, routed_scaling_factor, shared experts, the first_k_dense_replace dense layers, half of each head
rotated (NeoX pairs), q/k/v biases, q/k norms per head;
chunked prefill, prefix caching, the GPU code path (interpreted), peft adapters (attention, dense MLP, shared
experts, stacked experts) mixed in a batch, GPTQ, warmup --estimate, run, bench, the built-in tiny-glm4-moe, the
multi-token-prediction layer of the hub's checkpoints skipped; what infer cannot run of it refused. OLMoE
(OlmoeForCausalLM): q and k normed over their whole projections, experts on every layer; the same paths, `infer
quantize` through GPTQModel's olmoe definition against GPTQModel's own load. Granite MoE (GraniteMoeForCausalLM):
Granite's four scalars, the hub's input_linear / output_linear / router.layer names, the softmax over the top k
logits; the same paths."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.models.tiny import ensure_builtin

from helpers import (check_builtin_runs_and_warmup_sizes_it, check_chunked_prefill_and_prefix_caching,
                     check_equal_transformers, check_greedy_and_logprobs_equal_transformers,
                     check_run_and_bench_builtin, correction_bias_drawn, estimate_refusal, greedy_each, measured_warmup,
                     norms_shifted_biases_drawn, random_prompts, save_random_model)
from lora_helpers import (base_and_adapters, check_all8_qv4_equal_peft, check_granite_adapters_equal_peft,
                          check_mixed_adapters_gpu_path_equal_peft, hf_float)
from quant_helpers import (check_gpu_path_equals_transformers, check_gptq_moe_equals_dequantized, gptqmodel_greedy,
                           infer_quantize, needs_gptqmodel, rtn_gptq_pair)

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
# GLM-4.5-Air's shape, shrunk: 46 layers there (the first dense), 128 experts of 1408 (top 8) beside one shared
# expert; here 3 layers (the first dense), 8 experts of 32 in 4 groups of 2 (2 groups kept, top-2), one shared
# expert, the routing weights renormalised and scaled by 2.5; 96 query heads of 128 over 8 KV heads there (4 of 16
# over 2 here), q/k/v biases, half of each head rotated
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
             n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
             attention_bias=True, use_qk_norm=True, max_position_embeddings=256, eos_token_id=2, pad_token_id=0)


def build(folder, seed: int = 0, **config):
    """A random GLM-4.5 folder (float32) with the tiny-llama tokenizer, each router's e_score_correction_bias (a
    buffer, zeros at init) drawn from N(0, 0.3); returns transformers' model (eager)."""
    hf = save_random_model(folder, "glm4_moe", "Glm4MoeForCausalLM", {**SMALL, **config}, seed,
                           norms_shifted_biases_drawn)
    return correction_bias_drawn(hf, folder, seed, 0.3, buffers=True)


CONFIGS = {
    "groups-shared-bias-qknorm": dict(),
    # every layer sparse, one group (no group limit), the weights neither renormalised nor scaled, no shared expert,
    # no biases, no q/k norms, a whole-head rotary
    "one-group-plain": dict(first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=False,
                            routed_scaling_factor=1.0, n_shared_experts=0, attention_bias=False, use_qk_norm=False,
                            partial_rotary_factor=1.0, num_key_value_heads=4),
    # two dense layers first, 2 groups of 4 (1 kept: top-3 of its 4), two shared experts
    "one-group-of-two-kept-top3": dict(num_hidden_layers=4, first_k_dense_replace=2, n_group=2, topk_group=1,
                                       num_experts_per_tok=3, n_shared_experts=2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4; the
    dense layers and the sparse ones where first_k_dense_replace says, the routers float32."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path, **CONFIGS[name])
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        model = llm.engine.runner.model
        k = hf.config.first_k_dense_replace
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == \
            [i >= k for i in range(hf.config.num_hidden_layers)]
        sparse = model.layers[-1].mlp
        assert sparse.gate.weight.dtype == torch.float32 and torch.equal(
            sparse.gate.e_score_correction_bias, hf.model.layers[-1].mlp.gate.e_score_correction_bias)
        assert sparse.shared_width == hf.config.n_shared_experts * 32
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, name)


def test_the_router_equals_transformers_where_groups_and_the_bias_decide(tmp_path):
    """SparseMoeBlock.route of 64 tokens against transformers' Glm4MoeTopkRouter of the same weights: the same experts
    (as sets) and weights, with a bias large enough that it, and the groups' limit, change the choice from the
    plain top k of the scores."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path)
    router = hf.model.layers[1].mlp.gate
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8)[torch.randperm(8, generator=torch.Generator()
                                                                                     .manual_seed(1))])
    block = SparseMoeBlock(hf.config, "model.layers.1.mlp", lambda names: None, torch.float32)
    block.gate.weight.data.copy_(router.weight)
    block.gate.e_score_correction_bias.data.copy_(router.e_score_correction_bias)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, want_w, want_ids = router(x)
    weights, ids = block.route(x)
    assert weights.dtype == torch.float32
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_w.gather(1, want_order.indices))
    plain = torch.sigmoid(x @ router.weight.T).topk(2, dim=-1).indices.sort(dim=-1).values
    assert not torch.equal(plain, order.values)  # (the bias and the groups decided some tokens' experts)
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))  # (renormalised, then scaled)


FAMILIES = ("glm4_moe", "olmoe", "granitemoe")  # (their builders: BUILDERS, below)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path, family):
    hf = BUILDERS[family](tmp_path, seed=1)
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


@interpreted
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch, family):
    """Every op through its Triton kernel (interpreted on CPU): GLM-4.5's partial rotary with the q/k norms, OLMoE's
    whole-projection q/k norms, Granite's scalars, the fused MoE with the router's float32 weights, GLM-4.5's shared
    expert; decodes through emulated CUDA graphs, the other steps through emulated piecewise graphs: transformers'
    tokens."""
    check_gpu_path_equals_transformers(tmp_path, monkeypatch, BUILDERS[family](tmp_path))


# ------------------------------------------------------------------------------------------------------- LoRA
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# the attention (all of it, some of it) and the stacked experts (target_parameters: peft on transformers 5 also turns
# target_modules gate_proj, up_proj, down_proj into those parameters, and keeps them on the dense layer's and the
# shared experts' MLPs: test_an_adapter_of_the_dense_mlp_shared_and_routed_experts_equals_peft)
ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=ATTENTION, target_parameters=EXPERTS),
            "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"], target_parameters=EXPERTS)}


@pytest.fixture(scope="module")
def glm_lora(tmp_path_factory):
    """(base folder, transformers' model, {name: adapter}) of ADAPTERS (peft's) on a GLM-4.5."""
    return base_and_adapters(tmp_path_factory.mktemp("glm4moe_lora"), ADAPTERS, build)


def test_peft_adapters_equal_peft_alone_and_mixed(glm_lora):
    check_all8_qv4_equal_peft(*glm_lora)


def test_an_adapter_of_the_dense_mlp_shared_and_routed_experts_equals_peft(glm_lora, tmp_path):
    """target_modules gate_proj, up_proj, down_proj: peft (>= 0.22) adapts the dense layer's MLP and the shared
    experts' Linear layers by them and turns them into the routed experts' parameters too (peft 0.21 turned them into
    the experts' alone, which infer followed by refusing the others' weights); all of them served, mixed with the
    base: peft's tokens."""
    from lora_helpers import check_mlp_names_adapter_equals_peft
    base, hf, _ = glm_lora
    check_mlp_names_adapter_equals_peft(base, hf, tmp_path, "q_proj", {
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.gate_proj",
        "model.layers.1.mlp.shared_experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"})


@interpreted
def test_gpu_code_path_with_mixed_adapters_interpreted_equals_peft(glm_lora, monkeypatch):
    """Adapters beside a base-only row through the Triton kernels (interpreted: the fused MoE adding the experts'
    deltas per token) and emulated decode graphs: peft's tokens."""
    base, hf, paths = glm_lora

    def check_model(model):
        assert all(layer.mlp.lora is not None for layer in model.layers[1:])
    check_mixed_adapters_gpu_path_equal_peft(base, hf, paths, monkeypatch, check_model)


def test_convert_merges_an_adapter_and_a_bfloat16_copy_keeps_the_routers_float32(glm_lora, tmp_path):
    """`infer convert --merge-lora`: the merged folder gives peft's tokens of the adapter (its experts' delta
    merged); `--dtype bfloat16` keeps the routers float32 (transformers' _keep_in_fp32_modules_strict), and infer
    loads their stored float32 values, not bfloat16 roundings of them (the choice of experts hangs on the bias)."""
    from safetensors.torch import load_file

    from lora_helpers import PeftOracle
    base, hf, paths = glm_lora
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(tmp_path / "m"), "--merge-lora", str(paths["all8"])])
    assert res.exit_code == 0, res.output
    prompts = random_prompts(512, (6, 11), seed=8)
    oracle = PeftOracle(hf, {"all8": paths["all8"]})
    try:
        want = [oracle.greedy("all8", p, 6) for p in prompts]
    finally:
        oracle.close()
    with LLM(str(tmp_path / "m"), block_size=4) as llm:
        assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))] == want
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(tmp_path / "b"), "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    stored = {}
    for f in (tmp_path / "b").glob("*.safetensors"):
        stored.update(load_file(f))
    bias = stored["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and not torch.equal(bias, bias.bfloat16().float())
    with LLM(str(tmp_path / "b"), block_size=4, dtype="bfloat16") as llm:
        gate = llm.engine.runner.model.layers[1].mlp.gate
        assert torch.equal(gate.e_score_correction_bias, bias)
        assert torch.equal(gate.weight, stored["model.layers.1.mlp.gate.weight"].float())


# ------------------------------------------------------------------------------------------------------- GPTQ
@pytest.fixture(scope="module")
def gptq_glm(tmp_path_factory):
    """(float folder, a GPTQ checkpoint of it in GPTQModel's layout: every attention, dense MLP, shared expert and
    expert projection 4-bit by round to nearest, group 32, each expert's projections apart; the routers float)."""
    return rtn_gptq_pair(tmp_path_factory.mktemp("glm4moe_gptq"), build)


def test_a_gptq_checkpoint_equals_transformers_of_its_dequantized_weights(gptq_glm):
    """infer's CPU path (each GPTQ expert dequantized at load into the stacks, in the scales' float16 as GPTQ runtimes
    do) gives transformers' greedy tokens of the same weights dequantized in float32
    (quant_helpers.dequantized_float_model); `warmup --estimate` counts the weights as loaded."""
    check_gptq_moe_equals_dequantized(*gptq_glm)


@interpreted
def test_int4_experts_through_the_kernels_equal_the_cpu_path(gptq_glm, monkeypatch):
    """The GPTQ checkpoint on the GPU code path (the experts stacked int4, the int4 fused MoE with the float32
    routing weights, interpreted): the CPU path's tokens."""
    from quant_helpers import check_kernel_path_equals_cpu
    check_kernel_path_equals_cpu(gptq_glm[1], monkeypatch)


# ------------------------------------------------------------------------ checkpoints, refusals, neighbours
def test_the_hubs_multi_token_prediction_layer_is_skipped(tmp_path):
    """GLM-4.5's checkpoints store num_nextn_predict_layers layers after the model's (model.layers.N: the MTP layer,
    which transformers drops too): infer skips them and equals transformers; a layer past those is still named as
    one config.json has no place for."""
    from safetensors.torch import load_file, save_file

    from infer.errors import ModelLoadError
    hf = build(tmp_path, num_hidden_layers=2)
    tensors = load_file(tmp_path / "model.safetensors")
    extra = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    extra["model.layers.2.eh_proj.weight"] = torch.randn(64, 128)
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prompts = random_prompts(512, (7, 12), seed=5)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json", "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    with LLM(str(tmp_path), block_size=4, dtype="bfloat16") as llm:
        from infer.memory.sizes import weights_bytes
        assert plan["weights_bytes"] == weights_bytes(llm.engine.runner.model)  # (the MTP layer not counted)
    with LLM(str(tmp_path), block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert got == greedy_each(hf, prompts, 6)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ModelLoadError, match="config.json has no place for: model.layers.2."):
        LLM(str(tmp_path), block_size=4)


REFUSED = {  # config -> words of the refusal
    "n_group-not-dividing": (dict(n_group=3), "n_group 3 with n_routed_experts 8"),
    "groups-of-one": (dict(n_group=8, topk_group=2), "n_group 8 with n_routed_experts 8"),
    "topk_group-over-n_group": (dict(topk_group=5), "topk_group 5 with n_group 4"),
    "top-k-past-the-kept-groups": (dict(num_experts_per_tok=3, topk_group=1), "num_experts_per_tok 3, more than the "
                                                                              "2 experts of its topk_group 1 groups"),
    "top-k-past-the-experts": (dict(num_experts_per_tok=9), "num_experts_per_tok 9 with n_routed_experts 8"),
    "gelu": (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_the_router_cannot_compute_is_refused_up_front(tmp_path, name):
    """A config.json transformers' router would fail on (or route otherwise than infer): `infer warmup --estimate`
    refuses it naming the fields and what GLM-4.5 takes."""
    from transformers import AutoConfig
    config, words = REFUSED[name]
    cfg = AutoConfig.for_model("glm4_moe", **{**SMALL, **config})
    cfg.architectures = ["Glm4MoeForCausalLM"]
    cfg.save_pretrained(tmp_path)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"], env={"COLUMNS": "250"})
    assert res.exit_code != 0, res.output
    text = " ".join(res.output.split())
    assert words in text, text
    if "group" in name:
        assert "GLM-4.5's router splits n_routed_experts into n_group equal groups" in text, text


# ------------------------------------------------------------------------------ warmup, run, bench, tiny
def test_builtin_tiny_model_runs_and_warmup_sizes_it():
    """tiny-glm4-moe equals transformers and writes varied tokens; `infer warmup --estimate` counts its weights as
    the loaded engine holds them (the float32 routers too)."""
    path = ensure_builtin("tiny-glm4-moe")
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Glm4MoeForCausalLM"]
    res = CliRunner().invoke(app, ["warmup", "tiny-glm4-moe", "--estimate", "--json", "--max-length", "256",
                                   "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    with LLM("tiny-glm4-moe", max_model_len=256, dtype="bfloat16") as llm:
        from infer.memory.sizes import weights_bytes
        assert plan["weights_bytes"] == weights_bytes(llm.engine.runner.model)
        assert llm.engine.runner.model.layers[1].mlp.gate.weight.dtype == torch.float32
    with LLM("tiny-glm4-moe", max_model_len=256) as llm:
        prompts = random_prompts(512, (6, 90), seed=1)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert got == greedy_each(hf_float(path), prompts, 6)
    assert all(len(set(tokens)) > 2 for tokens in got)


def test_infer_serve_completes_as_transformers(glm_lora):
    from helpers import check_served_completion_equals_transformers
    base, hf, _ = glm_lora
    check_served_completion_equals_transformers(base, "glm", hf)


def test_infer_run_and_bench_on_the_builtin_model(tmp_path):
    """`infer run` writes transformers' greedy tokens of a token prompt; `infer bench` completes its requests."""
    check_run_and_bench_builtin(tmp_path, "tiny-glm4-moe")


def test_the_measured_cpu_peak_is_under_the_estimate(tmp_path):
    """A step of 1,020 tokens (4 x 256) and decodes at 256: the measured peak (the float32 router's scores and
    group masks, the shared expert after the experts) is under `warmup --estimate`'s activations, by less than 1.3x."""
    build(tmp_path, intermediate_size=200, num_hidden_layers=4)
    measured = measured_warmup([str(tmp_path), "--max-length", "256", "--concurrency", "4",
                                "--max-num-batched-tokens", "1024"])
    peak, formula = measured["activation_peak_bytes"], measured["activation_estimate_bytes"]
    assert peak <= formula <= 1.3 * peak, (formula, peak)


# ================================================================================================== OLMoE
# OLMoE-1B-7B's shape, shrunk: 64 experts of 1024 (top 8) there, 8 of 32 (top 2) here, on every layer; q and k normed
# over their whole projections (OLMo 2's), in Llama's layer of two norms
OLMOE = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=2,
             pad_token_id=0)


def build_olmoe(folder, seed: int = 0, **config):
    """A random OLMoE folder (float32) with the tiny-llama tokenizer; returns transformers' model (eager)."""
    return save_random_model(folder, "olmoe", "OlmoeForCausalLM", {**OLMOE, **config}, seed, norms_shifted_biases_drawn)


OLMOE_CONFIGS = {
    "gqa-top2": dict(),
    "renormalised-biases-top1-mha": dict(norm_topk_prob=True, attention_bias=True, num_experts_per_tok=1,
                                         num_key_value_heads=4),
}


@pytest.mark.parametrize("name", OLMOE_CONFIGS)
def test_olmoe_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4; q and
    k normed over their whole projections."""
    hf = build_olmoe(tmp_path, **OLMOE_CONFIGS[name])
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        attn = llm.engine.runner.model.layers[0].self_attn
        kv = hf.config.num_key_value_heads * 16
        assert attn.qk_norm_whole and attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (kv,)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, name)


def test_olmoe_peft_adapters_equal_peft_alone_and_mixed(tmp_path):
    """Adapters of the attention and the stacked experts (target_parameters), each alone and mixed with the base in
    one batch: peft's tokens."""
    check_all8_qv4_equal_peft(*base_and_adapters(tmp_path, ADAPTERS, build_olmoe))


@pytest.fixture(scope="module")
def gptq_olmoe(tmp_path_factory):
    """(float folder, `infer quantize`'s GPTQ checkpoint of it: GPTQModel's olmoe definition, every expert's
    projections apart, the router float)."""
    root = tmp_path_factory.mktemp("olmoe_gptq")
    build_olmoe(root / "f")
    return root / "f", infer_quantize(root / "f", root / "q")


@needs_gptqmodel
def test_olmoe_infer_quantize_writes_a_gptq_checkpoint_equal_to_gptqmodels_load(gptq_olmoe):
    """GPTQModel's olmoe definition through `infer quantize`: infer's tokens of the checkpoint equal GPTQModel's own
    load; the note says transformers leaves its experts float."""
    from safetensors.torch import load_file
    _, out = gptq_olmoe
    assert {"model.layers.0.mlp.experts.3.gate_proj.qweight", "model.layers.1.self_attn.o_proj.qweight",
            "model.layers.0.mlp.gate.weight"} <= set(load_file(out / "model.safetensors"))
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4, dtype="float32") as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))]
    assert got == gptqmodel_greedy(out, prompts, 8)
    assert len({t for tokens in got for t in tokens}) > 6  # (varied tokens: the comparison means something)


@needs_gptqmodel
@interpreted
def test_olmoe_int4_experts_through_the_kernels_equal_the_cpu_path(gptq_olmoe, monkeypatch):
    from quant_helpers import check_kernel_path_equals_cpu
    check_kernel_path_equals_cpu(gptq_olmoe[1], monkeypatch)


def test_olmoe_clip_qkv_is_refused(tmp_path):
    """OLMoE's clip_qkv (OLMo's clamping of q, k and v): refused up front, naming the field."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("olmoe", **OLMOE, clip_qkv=8.0)
    cfg.architectures = ["OlmoeForCausalLM"]
    cfg.save_pretrained(tmp_path)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"], env={"COLUMNS": "250"})
    assert res.exit_code != 0, res.output
    assert "config.json has clip_qkv 8.0: infer does not clip OLMoE's queries" in " ".join(res.output.split())


def test_olmoe_builtin_tiny_model_runs_and_warmup_sizes_it():
    check_builtin_runs_and_warmup_sizes_it("tiny-olmoe", "OlmoeForCausalLM", False, lengths=(6, 90))


# ============================================================================================= Granite MoE
# granite-3.1-1b-a400m's shape, shrunk: 32 experts of 512 (top 8) there, 8 of 32 (top 2) here, on every layer;
# Granite's scalars (embeddings x 12, the residual adds x 0.22, the attention's scale 1/16, the logits / 4)
GRANITE = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
               embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0,
               eos_token_id=2, pad_token_id=0)


def build_granite(folder, seed: int = 0, **config):
    """A random Granite MoE folder (float32, the hub's names: block_sparse_moe.input_linear, output_linear,
    router.layer) with the tiny-llama tokenizer; returns transformers' model (eager)."""
    return save_random_model(folder, "granitemoe", "GraniteMoeForCausalLM", {**GRANITE, **config}, seed,
                             norms_shifted_biases_drawn)


GRANITE_CONFIGS = {"gqa-top2": dict(), "mha-top1-biases": dict(num_key_value_heads=4, num_experts_per_tok=1,
                                                                attention_bias=True)}


@pytest.mark.parametrize("name", GRANITE_CONFIGS)
def test_granitemoe_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4; the
    checkpoint in the hub's names (input_linear, output_linear, router.layer)."""
    from safetensors.torch import load_file
    hf = build_granite(tmp_path, **GRANITE_CONFIGS[name])
    assert "model.layers.0.block_sparse_moe.router.layer.weight" in load_file(tmp_path / "model.safetensors")
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, name, lambda model: None)


BUILDERS = {"glm4_moe": build, "olmoe": build_olmoe, "granitemoe": build_granite}


def test_granitemoe_peft_adapters_equal_peft_alone_and_mixed(tmp_path):
    """Adapters of the attention and the stacked experts (target_parameters block_sparse_moe.experts.*), each alone
    and mixed with the base in one batch: peft's tokens (their weights at 0.5's scale: Granite's residual_multiplier
    of 0.22 leaves 0.15's deltas too small to change a token)."""
    check_granite_adapters_equal_peft(tmp_path, build_granite)


@needs_gptqmodel
def test_granitemoe_infer_quantize_equals_gptqmodels_load(tmp_path):
    """GPTQModel's granitemoe definition through `infer quantize` given infer's tree (quant.quantize._granite_view:
    the attention and, since session 70, each expert's gate_proj, up_proj and down_proj quantized; GPTQModel 7.6's
    own tree looked for input_linear.N and left them float): infer's tokens equal GPTQModel's own load given that
    view."""
    from infer.quant.quantize import _granite_view
    build_granite(tmp_path / "f")
    infer_quantize(tmp_path / "f", tmp_path / "q")
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(tmp_path / "q"), block_size=4, dtype="float32") as llm:
        assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.qweight is not None
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))]
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.down_proj.qweight" in f.keys()
    with _granite_view(tmp_path / "q"):
        assert got == gptqmodel_greedy(tmp_path / "q", prompts, 8)
    assert len({t for tokens in got for t in tokens}) > 6


def test_granitemoe_builtin_tiny_model_runs_and_warmup_sizes_it():
    check_builtin_runs_and_warmup_sizes_it("tiny-granitemoe", "GraniteMoeForCausalLM", False, lengths=(6, 90))


def test_granitemoe_multipliers_are_checked_as_granites(tmp_path):
    """A logits_scaling of 0 (every logit inf) is refused as Granite's is."""
    text = estimate_refusal(tmp_path, "granitemoe", "GraniteMoeForCausalLM", **{**GRANITE, "logits_scaling": 0.0})
    assert "config.json has logits_scaling 0.0: Granite's logits_scaling must be a finite number" in text
