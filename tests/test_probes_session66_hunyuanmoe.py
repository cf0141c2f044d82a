"""Session 66: Tencent's Hunyuan MoE (HunYuanMoEV1ForCausalLM, model_type hunyuan_v1_moe: Hunyuan-A13B-Instruct),
end to end on tiny random models (float32) against transformers: the dense Hunyuan's attention (q and k normed after
the rotary, the rope's NTK alpha), on every layer a float32 softmax router (mlp.gate.wg) whose top k are renormalised,
experts of intermediate_size and the shared MLP beside them; moe_topk as one k or a list of one k a layer; chunked
prefill and prefix caching; peft adapters of the attention, the experts and the shared MLP mixed in one batch; `infer
quantize`'s GPTQ checkpoint (GPTQModel's hunyuan_v1_moe definition) against transformers on its dequantized weights,
and through the int4 kernels (Triton interpreted); the memory plan of A13B's shapes; the remote code's fields
transformers ignores refused where they ask another layer."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app

from helpers import (check_builtin_runs_and_warmup_sizes_it, check_chunked_prefill_and_prefix_caching,
                     check_equal_transformers, estimate_refusal, greedy_each, greedy_tokens, hub_shaped_folder,
                     norms_shifted_biases_drawn, random_prompts, save_random_model)
from quant_helpers import needs_gptqmodel

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
ARCH = "HunYuanMoEV1ForCausalLM"
ALPHA = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}
# Hunyuan-A13B's shape, shrunk: 32 layers there, 32 heads of 128 (8 KV heads), 64 experts of 3072 (top 8) beside a
# shared MLP of 3072, the NTK alpha rope; here 2 layers, 4 heads of 16 (2 KV heads), 8 experts of 32 (top 2) beside a
# shared MLP of 32
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=8, moe_topk=2, max_position_embeddings=256,
             eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, rope_parameters=ALPHA)


def build(folder, seed: int = 0, **config):
    """A random Hunyuan MoE folder (float32) with the tiny-llama tokenizer, norms shifted and biases drawn; returns
    transformers' model (eager)."""
    return save_random_model(folder, "hunyuan_v1_moe", ARCH, {**SMALL, **config}, seed, norms_shifted_biases_drawn)


CONFIGS = {
    "alpha-untied": dict(),
    # moe_topk given a layer (the hub's form), 3 of 8, q/k/v/o biases, a tied head, the default rope
    "topk-list-biases-tied": dict(moe_topk=[3, 3], attention_bias=True, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4; every
    layer sparse, its router float32, its shared MLP loaded from mlp.shared_mlp."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path, **CONFIGS[name])
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        model = llm.engine.runner.model
        for layer in model.layers:
            block = layer.mlp
            assert isinstance(block, SparseMoeBlock) and block.gate.weight.dtype == torch.float32
            assert block.top_k == hf.model.layers[0].mlp.gate.top_k and block.shared_experts is block.shared_mlp
        assert model.layers[1].mlp.shared_mlp.down_proj.names == ["model.layers.1.mlp.shared_mlp.down_proj"]
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, name)


def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path):
    check_chunked_prefill_and_prefix_caching(tmp_path, build(tmp_path, seed=1))


def test_the_router_in_bfloat16_equals_transformers(tmp_path):
    """SparseMoeBlock.route of 64 bfloat16 tokens against transformers' HunYuanMoEV1Gate (its wg float32, the hidden
    state cast to float32): the same experts and float32 weights, renormalised (each token's sum 1), where a router in
    bfloat16 weighs them otherwise."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path)
    router = hf.model.layers[0].mlp.gate
    block = SparseMoeBlock(hf.config, "model.layers.0.mlp", lambda names: None, torch.bfloat16)
    block.gate.weight.data.copy_(router.wg.weight)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        _, want_w, want_ids = router(x)
    weights, ids = block.route(x)
    assert weights.dtype == torch.float32 and torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    torch.testing.assert_close(weights.sum(-1), torch.ones(64))
    rounded = torch.softmax(x @ router.wg.weight.bfloat16().T, dim=-1, dtype=torch.float32).topk(2, dim=-1).values
    assert not torch.equal(rounded / rounded.sum(-1, keepdim=True), want_w)


def test_builtin_tiny_model_runs_and_warmup_sizes_it():
    check_builtin_runs_and_warmup_sizes_it("tiny-hunyuan-moe", ARCH, True)


# ------------------------------------------------------------------------------------------------------- memory
A13B = dict(vocab_size=128167, hidden_size=4096, intermediate_size=3072, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, num_experts=64, moe_topk=[8] * 32, max_position_embeddings=32768,
            tie_word_embeddings=True, rope_parameters={**ALPHA, "rope_theta": 10000.0})


def test_warmup_plans_a13bs_shapes(tmp_path, monkeypatch):
    """`infer warmup --estimate` of a checkpoint of Hunyuan-A13B's shapes (no values, the hub's config fields: moe_topk
    a layer, moe_intermediate_size, num_shared_expert): its 80 billion parameters' bfloat16 bytes (the routers float32,
    the CPU's prepacked copies of the dense layers on top, under 15% more), a KV cache of 32 x 2 x 8 x 128 x 2 bytes a
    token, 4,096 tokens planned for on a host of 256 GiB given 200 GB."""
    params = hub_shaped_folder(tmp_path, "hunyuan_v1_moe", ARCH, A13B)
    assert 79.5e9 < params < 80.6e9, params
    config = json.loads((tmp_path / "config.json").read_text())
    hub = dict(moe_intermediate_size=[3072] * 32, num_shared_expert=[1] * 32, moe_layer_num_skipped=0,
               use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=False, capacity_factor=1.0)
    (tmp_path / "config.json").write_text(json.dumps({**config, **hub}))
    monkeypatch.setattr("infer.memory.plan.device_total", lambda device: 256 << 30)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json", "--dtype", "bfloat16",
                                   "--max-length", "4096", "--device", "cpu", "--memory-limit", "200GB"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    assert plan["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    assert 2 * params <= plan["weights_bytes"] < 2 * params * 1.15, (plan["weights_bytes"], params)
    assert plan["max_concurrency_at_max_length"] >= 1, plan


def test_a13b_in_int4_fits_one_80_gb_gpu_with_its_whole_context(tmp_path):
    """A 4-bit GPTQ checkpoint of Hunyuan-A13B's shapes (groups of 128, GPTQModel's layout: each expert's projections
    apart; no values): the weights a GPU holds (memory.checkpoint: the experts int4, about 0.53 bytes a parameter,
    42 GB) with the KV cache of its whole context (32,768 tokens of 32 x 2 x 8 x 128 bfloat16 values) fit one 80 GB
    GPU with a tenth to spare."""
    from infer.memory.checkpoint import checkpoint_load_bytes
    from infer.memory.sizes import kv_bytes_per_token
    from infer.models.loader import load_config
    params = hub_shaped_folder(tmp_path, "hunyuan_v1_moe", ARCH, A13B, gptq_group=128)
    cfg = load_config(tmp_path)
    weights = checkpoint_load_bytes(tmp_path, cfg, torch.bfloat16, torch.device("cuda"))
    assert 0.5 * params < weights < 0.56 * params, (weights, params)
    assert weights + 32768 * kv_bytes_per_token(cfg, torch.bfloat16) < 0.9 * 80e9


# ------------------------------------------------------------------------------------------------------ refusals
REFUSED = {  # config -> words of the refusal
    "cla": (dict(use_cla=True), "hunyuan_v1_moe with use_cla true (cross-layer attention"),
    "mla": (dict(use_mla=True), "hunyuan_v1_moe with use_mla true (multi-head latent attention)"),
    "no-qk-norm": (dict(use_qk_norm=False), "hunyuan_v1_moe with use_qk_norm false"),
    "no-shared-mlp": (dict(use_mixed_mlp_moe=False), "hunyuan_v1_moe with use_mixed_mlp_moe false (no shared MLP"),
    "topk-by-layer": (dict(moe_topk=[2, 3]), "hunyuan_v1_moe with moe_topk [2, 3] for 2 layers is not supported"),
    "topk-short": (dict(moe_topk=[2]), "hunyuan_v1_moe with moe_topk [2] for 2 layers is not supported"),
    "expert-width": (dict(moe_intermediate_size=[32, 64]), "hunyuan_v1_moe with moe_intermediate_size 64 (experts"),
    "shared-experts": (dict(num_shared_expert=2), "hunyuan_v1_moe with num_shared_expert 2 (a shared MLP"),
    "dense-first": (dict(moe_layer_num_skipped=1), "hunyuan_v1_moe with moe_layer_num_skipped 1 (its first layers"),
    "topk-over-experts": (dict(moe_topk=9), "config.json has moe_topk 9 with num_experts 8"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_infer_cannot_run_is_refused_up_front_naming_the_field(tmp_path, name):
    config, words = REFUSED[name]
    text = estimate_refusal(tmp_path, "hunyuan_v1_moe", ARCH, **{**SMALL, **config})
    assert words in text, text


def test_the_hubs_fields_transformers_ignores_load_as_transformers(tmp_path):
    """The hub's config.json fields of A13B that transformers ignores (their values the layers it builds): the model
    loads and gives transformers' tokens; capacity_factor and moe_drop_tokens (training's) are ignored as transformers
    ignores them."""
    hf = build(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        **config, "moe_topk": [2, 2], "moe_intermediate_size": [32, 32], "num_shared_expert": [1, 1],
        "moe_layer_num_skipped": 0, "use_mixed_mlp_moe": True, "use_qk_norm": True, "use_rotary_pos_emb": True,
        "use_cla": False, "use_mla": False, "capacity_factor": 1.0, "moe_drop_tokens": True}))
    prompts = random_prompts(512, (7, 12), seed=5)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert greedy_tokens(llm, prompts, 6) == greedy_each(hf, prompts, 6)


# ------------------------------------------------------------------------------------------------------- LoRA
# the attention's projections and the experts: through target_modules gate_proj, up_proj, down_proj, which peft (on
# transformers 5) turns into the experts' parameters (Hunyuan MoE: qwen2_moe's conversion; gate and up one
# gate_up_proj of rank 2r; the shared MLP's projections of those names not adapted), or peft's target_parameters of
# the names that conversion gives (peft mixes adapters of one set of parameters only)
ADAPTERS = {"all8": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]),
            "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                        target_parameters=["gate_up_proj", "down_proj"])}


@pytest.fixture(scope="module")
def hy_lora(tmp_path_factory):
    """(base folder, transformers' model, {name: adapter}) of ADAPTERS (peft's) on a Hunyuan MoE."""
    from lora_helpers import base_and_adapters
    return base_and_adapters(tmp_path_factory.mktemp("hunyuan_moe_lora"), ADAPTERS, build)


def test_peft_adapters_equal_peft_alone_and_mixed(hy_lora):
    """Adapters of the attention and the stacked experts, each alone and mixed with the base in one batch: peft's
    tokens."""
    from lora_helpers import check_mixed_adapters_equal_peft
    check_mixed_adapters_equal_peft(*hy_lora, random_prompts(512, (5, 9, 7), seed=6), ["all8", None, "qv4"], n=4)


@interpreted
def test_gpu_code_path_with_adapters_interpreted_equals_the_cpu_path(hy_lora, monkeypatch):
    """"all8" (the attention's, the shared MLP's and the experts' adapters), the base and "qv4" in one batch, every op
    through its Triton kernel (interpreted), the fused MoE given the experts' adapters, decodes through emulated CUDA
    graphs: the CPU path's tokens (which are peft's: test_peft_adapters_equal_peft_alone_and_mixed), the shared
    MLP's deltas added on both paths."""
    from test_probes_session57_moelora import _cpu_and_gpu_path
    base, _, paths = hy_lora
    cpu, gpu = _cpu_and_gpu_path(base, paths, random_prompts(512, (6, 3, 5), seed=7), ["all8", None, "qv4"],
                                 monkeypatch, n=4)
    assert gpu == cpu


def test_per_expert_adapters_of_transformers_4_equal_peft(tmp_path):
    """An adapter as peft saved it on transformers 4 (q_proj's and each expert's gate_proj, up_proj, down_proj, modules
    of their own), which peft converts on transformers 5's stacked experts (gate and up one gate_up_proj of rank 2r),
    beside a request without one: peft's tokens."""
    from lora_helpers import hf_float
    from test_probes_session57_moelora import _engine_tokens, _v4_adapter, peft_tokens
    build(tmp_path / "base", seed=4)
    hf = hf_float(tmp_path / "base")
    paths = {"v4": _v4_adapter(hf, tmp_path / "v4", ("gate_proj", "up_proj", "down_proj"), seed=3)}
    prompts, order = random_prompts(512, (6, 9), seed=8), ["v4", None]
    mixed, alone = _engine_tokens(tmp_path / "base", paths, prompts, order)
    want = peft_tokens(hf, paths, prompts, order)
    assert mixed == want and alone == want
    assert want[0] != greedy_each(hf, prompts[:1], 6)[0]


def test_the_shared_mlp_has_slots_the_plan_counts_and_peft_adapts_it(hy_lora):
    """peft (>= 0.22) keeps target_modules gate_proj, up_proj, down_proj on the shared MLP's Linear layers beside the
    experts' parameters it turns them into: "all8" holds every layer's mlp.shared_mlp projections (served equal to
    peft: test_peft_adapters_equal_peft_alone_and_mixed); they get adapter slots, which the memory plan counts; and
    --lora-target-modules without the MLP's names leaves them out, refusing "all8" naming them."""
    from infer.errors import LoRAError
    from infer.lora.adapter import read_adapter
    from infer.memory.sizes import lora_slot_bytes
    base, _, paths = hy_lora
    modules = set(read_adapter("all8", paths["all8"]).modules)
    assert {f"model.layers.{i}.mlp.shared_mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")} \
        <= modules, modules
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4) as llm:
        model, manager = llm.engine.runner.model, llm.engine.lora_manager
        assert all(layer.mlp.shared_mlp.gate_up_proj.lora is not None and layer.mlp.shared_mlp.down_proj.lora
                   is not None and layer.mlp.lora is not None for layer in model.layers)
        assert llm.engine.memory_plan.lora_bytes == manager.device_bytes() == \
            lora_slot_bytes(model.config, 2, 8, torch.float32)
    with pytest.raises(LoRAError, match=r"has weights on shared_expert\.gate_proj, shared_expert\.up_proj, "
                                        r"shared_expert\.down_proj .*e\.g\. model\.layers\.\d\.mlp\.shared_mlp\."):
        LLM(str(base), loras={"x": str(paths["all8"])}, lora_target_modules=["qkv_proj", "o_proj", "experts"])


# ------------------------------------------------------------------------------------------------------- GPTQ
@pytest.fixture(scope="module")
def gptq_hy(tmp_path_factory):
    """(tiny-hunyuan-moe's folder, `infer quantize`'s GPTQ checkpoint of it: GPTQModel's hunyuan_v1_moe definition)."""
    from infer.models.tiny import ensure_builtin
    from quant_helpers import infer_quantize
    return ensure_builtin("tiny-hunyuan-moe"), infer_quantize("tiny-hunyuan-moe", tmp_path_factory.mktemp("gq") / "q")


@needs_gptqmodel
def test_infer_quantize_writes_a_gptq_checkpoint_equal_to_its_dequantized_weights(gptq_hy):
    """`infer quantize` of tiny-hunyuan-moe through GPTQModel quantizes the attention, the shared MLP and each expert's
    projections, the router (mlp.gate.wg) left float; infer runs it with transformers' greedy tokens of the same
    weights dequantized, and warmup --estimate counts its weights."""
    from safetensors.torch import load_file

    from quant_helpers import check_gptq_moe_equals_dequantized
    src, out = gptq_hy
    tensors = load_file(out / "model.safetensors")
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.shared_mlp.gate_proj", "mlp.shared_mlp.down_proj",
                 "mlp.experts.3.up_proj"):
        assert f"model.layers.1.{name}.qweight" in tensors, name
    assert tensors["model.layers.1.mlp.gate.wg.weight"].is_floating_point()
    check_gptq_moe_equals_dequantized(src, out)


@needs_gptqmodel
@interpreted
def test_gptq_checkpoint_through_the_int4_kernels_equals_the_cpu_path(gptq_hy, monkeypatch):
    """The GPU code path (the int4 fused MoE with float32 routing weights, the attention's and the shared MLP's int4
    kernels, q and k rotated and normed before the fused kernels' identity table; interpreted) gives the CPU path's
    greedy tokens."""
    from quant_helpers import check_kernel_path_equals_cpu
    check_kernel_path_equals_cpu(gptq_hy[1], monkeypatch)
