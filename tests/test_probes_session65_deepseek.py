"""Session 65: DeepSeek-V3 (DeepseekV3ForCausalLM: V3/V3.1/R1, Moonlight, Kimi-K2) and DeepSeek-V2
(DeepseekV2ForCausalLM: V2-Lite, V2, V2.5), multi-head latent attention served over a latent KV cache of one row
a token (kv_lora_rank + qk_rope_head_dim, one "KV head", no V copy) with kv_b_proj absorbed (models.deepseek), end to
end on tiny random models (float32) against transformers: q_lora_rank set and null, rope_interleave, yarn's mscale in
the softmax scale, attention biases, V3's sigmoid router of groups (GLM-4.5's), V2's softmax router (greedy and
group-limited), shared experts, first_k_dense_replace dense layers; chunked prefill, prefix caching, preemption, the
GPU code path (Triton, interpreted) with emulated CUDA graphs; the cache's one copy and the memory plan's count of
it; the hub's multi-token-prediction layer skipped; what infer does not run of the family refused."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app

from helpers import (check_builtin_runs_and_warmup_sizes_it, check_chunked_prefill_and_prefix_caching,
                     check_equal_transformers, correction_bias_drawn, estimate_refusal, greedy_each, greedy_tokens,
                     hub_shaped_folder, norms_shifted_biases_drawn, random_prompts, save_random_model)
from quant_helpers import check_gpu_path_equals_transformers, needs_gptqmodel

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
# DeepSeek-V3's shape, shrunk: 61 layers there (3 dense), 128 heads of 128 + 64 (values 128) over a latent of 512,
# q through a rank of 1536, 256 experts of 2048 in 8 groups (4 kept, top 8) beside a shared expert; here 3 layers
# (the first dense), 4 heads of 16 + 16 (values 16) over a latent of 32 (cache rows of 48), q through 48, 8 experts
# of 32 in 4 groups of 2 (2 kept, top 2), renormalised and scaled by 2.5, a shared expert
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
             v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
             topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
             norm_topk_prob=True, max_position_embeddings=256, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}
ARCH = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}


def build(folder, family: str = "deepseek_v3", seed: int = 0, **config):
    """A random DeepSeek folder (float32) with the tiny-llama tokenizer, norms shifted and biases drawn, each V3
    router's e_score_correction_bias drawn from N(0, 0.3); returns transformers' model (eager)."""
    cfg = {**SMALL, **config}
    if family == "deepseek_v2":
        cfg = {k: v for k, v in cfg.items() if k != "norm_topk_prob"}
    hf = save_random_model(folder, family, ARCH[family], cfg, seed, norms_shifted_biases_drawn)
    return correction_bias_drawn(hf, folder, seed, 0.3, buffers=True) if family == "deepseek_v3" else hf


CONFIGS = {  # name -> (family, config)
    "v3-qlora-groups-yarn": ("deepseek_v3", dict(rope_parameters=YARN)),
    # q_proj (no q_lora_rank), NeoX pairs (rope_interleave false), q_a/kv_a/o biases, every layer sparse, one group,
    # no shared expert, the weights neither renormalised nor scaled
    "v3-qproj-neox-bias": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, attention_bias=True,
                                               first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=False,
                                               routed_scaling_factor=1.0, n_shared_experts=0)),
    # V2-Lite's: q_proj, the softmax's greedy top k, two shared experts, a scale of 1
    "v2-lite-greedy": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None,
                                           n_shared_experts=2, routed_scaling_factor=1.0)),
    # V2 / V2.5's: q through q_lora_rank, group-limited greedy (4 groups, 2 kept), scaled, MLP biases, yarn
    "v2-qlora-group-limited": ("deepseek_v2", dict(topk_method="group_limited_greedy", mlp_bias=True,
                                                   routed_scaling_factor=1.5, rope_parameters=YARN)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4; the
    latent cache one copy of rows kv_lora_rank + qk_rope_head_dim wide (k_cache is v_cache), the dense layers and the
    sparse ones where first_k_dense_replace says, the routers float32."""
    from infer.models.deepseek import MLAttention
    from infer.models.moe import SparseMoeBlock
    family, config = CONFIGS[name]
    hf = build(tmp_path, family, **config)
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        runner = llm.engine.runner
        model = runner.model
        k = hf.config.first_k_dense_replace
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == \
            [i >= k for i in range(hf.config.num_hidden_layers)]
        assert runner.kv_cache.shape[:2] == (3, 1) and runner.kv_cache.shape[-2:] == (1, 48)
        for layer in model.layers:
            assert isinstance(layer.self_attn, MLAttention)
            assert layer.self_attn.k_cache.data_ptr() == layer.self_attn.v_cache.data_ptr()
        assert model.layers[-1].mlp.gate.weight.dtype == torch.float32
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, name)


def test_the_softmax_scale_takes_yarns_mscale_squared(tmp_path):
    """The attention's scale is qk_head_dim ** -0.5 times (0.1 mscale_all_dim ln(factor) + 1)² with yarn, as
    transformers' attention's `scaling`; qk_head_dim ** -0.5 with the default rope."""
    import math
    hf = build(tmp_path, rope_parameters={**YARN, "mscale_all_dim": 0.707, "mscale": 0.707, "factor": 40.0})
    with LLM(str(tmp_path), block_size=4) as llm:
        scale = llm.engine.runner.model.layers[0].self_attn.scale
    want = 32 ** -0.5 * (0.1 * 0.707 * math.log(40.0) + 1) ** 2
    assert scale == pytest.approx(want, rel=1e-6) and scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
    hf = build(tmp_path / "plain")
    with LLM(str(tmp_path / "plain"), block_size=4) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.scale == pytest.approx(32 ** -0.5)


def test_the_v2_router_equals_transformers_where_the_groups_decide(tmp_path):
    """SparseMoeBlock.route of 64 tokens against transformers' DeepseekV2TopkRouter (group_limited_greedy, 4 groups
    of 2, 1 kept): the same experts and weights, which the groups' limit changed from the plain top k."""
    from infer.models.moe import SparseMoeBlock
    hf = build(tmp_path, "deepseek_v2", topk_method="group_limited_greedy", topk_group=1, routed_scaling_factor=1.5)
    router = hf.model.layers[1].mlp.gate
    block = SparseMoeBlock(hf.config, "model.layers.1.mlp", lambda names: None, torch.float32)
    block.gate.weight.data.copy_(router.weight)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, want_w, want_ids = router(x)
    weights, ids = block.route(x)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_w.gather(1, want_order.indices))
    plain = torch.softmax(x @ router.weight.T, dim=-1).topk(2, dim=-1).indices.sort(dim=-1).values
    assert not torch.equal(plain, order.values)


@pytest.mark.parametrize("family", ARCH)
def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path, family):
    hf = build(tmp_path, family, seed=1)
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


def test_preemption_under_a_tiny_kv_budget_equals_transformers(tmp_path):
    """Five prompts over 20 blocks of 4 tokens: some sequences preempted (their latent rows recomputed), every
    output transformers' greedy tokens, no block left held."""
    hf = build(tmp_path, seed=2)
    prompts = random_prompts(512, (9, 17, 12, 21, 6), seed=6)
    with LLM(str(tmp_path), block_size=4, num_kv_blocks=20, max_model_len=64) as llm:
        got = greedy_tokens(llm, prompts, 12)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.block_manager.num_used_blocks == 0
    assert got == greedy_each(hf, prompts, 12)


@interpreted
@pytest.mark.parametrize("family", ARCH)
def test_gpu_code_path_interpreted_equals_transformers(tmp_path, monkeypatch, family):
    """Every op through its Triton kernel (interpreted on CPU): MLA's paged attention (kernels.mla) over latent rows
    of 48 (32 + 16: no power of two), the rotary of q_pe and k_pe, the fused MoE with float32 routing weights;
    decodes through emulated CUDA graphs, the other steps through emulated piecewise graphs: transformers' tokens."""
    check_gpu_path_equals_transformers(tmp_path, monkeypatch, build(tmp_path, family, rope_parameters=YARN))


@interpreted
@pytest.mark.parametrize("queries", [(1, 1, 1), (5, 1, 3)])
def test_triton_paged_attention_of_latent_rows_of_48_equals_the_reference(monkeypatch, queries):
    """kernels.attention.paged_attention (interpreted) of 4 query heads of 48 over one KV head of 48 whose K and V
    are the same cache: the reference's output (random inputs); decodes alone and prefills beside decodes, sequences
    of 3 to 14 tokens over blocks of 4 in a random order; `mla_attention` on a GPU (kernels.mla's kernels) its
    latent part."""
    from infer.kernels import attention, reference
    from infer.models.deepseek import mla_attention
    g = torch.Generator().manual_seed(len(queries) + sum(queries))
    lens = [7, 14, 3][:len(queries)]
    blocks = 12
    cache = torch.randn(blocks, 4, 1, 48, generator=g)
    tables = torch.randperm(blocks, generator=g)[:len(lens) * 4].view(len(lens), 4).to(torch.int32)
    qsl = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), 4, 48, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = reference.paged_attention(q, cache, cache, tables, seq_lens, qsl, 0.2, max(queries))
    got = attention.paged_attention(q, cache, cache, tables, seq_lens, qsl, 0.2, max(queries))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr("infer.kernels.use_triton", lambda t: True)
    latent = mla_attention(q, cache, tables, seq_lens, qsl, 0.2, max(queries), 32)
    assert latent.shape == (q.shape[0], 4, 32)
    torch.testing.assert_close(latent, want[..., :32], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- memory
def test_the_plan_counts_one_latent_row_a_token_and_layer(tmp_path):
    """kv_bytes_per_token: layers x (kv_lora_rank + qk_rope_head_dim) x the dtype's bytes (one copy, not K and V);
    the engine's cache is that many bytes a token."""
    from infer.memory.sizes import kv_bytes_per_token
    hf = build(tmp_path)
    assert kv_bytes_per_token(hf.config, torch.bfloat16) == 3 * 48 * 2
    assert kv_bytes_per_token(hf.config, torch.float32) == 3 * 48 * 4
    with LLM(str(tmp_path), block_size=4, num_kv_blocks=10, max_model_len=40) as llm:
        cache = llm.engine.runner.kv_cache
        assert cache.numel() * cache.element_size() == 10 * 4 * kv_bytes_per_token(hf.config, torch.float32)


MOONLIGHT = dict(vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
                 num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                 n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=2.446, kv_lora_rank=512,
                 q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_group=1,
                 topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=8192,
                 rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, tie_word_embeddings=False)
V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
               num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
               n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.0, kv_lora_rank=512,
               q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, topk_method="greedy",
               first_k_dense_replace=1, max_position_embeddings=163840, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                                "original_max_position_embeddings": 4096})
HUB = {"moonlight": ("deepseek_v3", MOONLIGHT), "v2-lite": ("deepseek_v2", V2_LITE)}


@pytest.mark.parametrize("name", HUB)
def test_warmup_plans_the_hubs_shapes(tmp_path, monkeypatch, name):
    """`infer warmup --estimate` of a checkpoint of Moonlight-16B-A3B's and DeepSeek-V2-Lite's shapes (no values):
    a KV cache of 27 x (512 + 64) x 2 bytes a token (one latent row a layer), bfloat16 weights of their 15.7 to 16
    billion parameters (the CPU's prepacked copies of the dense layers on top, under 15% more), a context of
    4,096 tokens planned for on a host of 128 GiB given 96 GB."""
    family, config = HUB[name]
    params = hub_shaped_folder(tmp_path, family, ARCH[family], config)
    assert 15.5e9 < params < 16.1e9, params
    monkeypatch.setattr("infer.memory.plan.device_total", lambda device: 128 << 30)  # (a host of 128 GiB)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json", "--dtype", "bfloat16",
                                   "--max-length", "4096", "--device", "cpu", "--memory-limit", "96GB"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    assert plan["kv_bytes_per_token"] == 27 * (512 + 64) * 2
    assert 2 * params <= plan["weights_bytes"] < 2 * params * 1.15, (plan["weights_bytes"], params)
    assert plan["max_concurrency_at_max_length"] >= 1, plan


# ------------------------------------------------------------------------ checkpoints, refusals, neighbours
def test_the_hubs_multi_token_prediction_layer_is_skipped(tmp_path):
    """DeepSeek-V3's checkpoints store num_nextn_predict_layers layers after the model's (model.layers.61 there,
    with embed_tokens, enorm, hnorm, eh_proj, shared_head): infer skips them and equals transformers; with
    num_nextn_predict_layers 0 such a layer is named as one config.json has no place for."""
    from safetensors.torch import load_file, save_file

    from infer.errors import ModelLoadError
    hf = build(tmp_path, num_hidden_layers=2)
    tensors = load_file(tmp_path / "model.safetensors")
    extra = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    extra["model.layers.2.eh_proj.weight"] = torch.randn(64, 128)
    extra["model.layers.2.enorm.weight"] = torch.randn(64)
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    prompts = random_prompts(512, (7, 12), seed=5)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert greedy_tokens(llm, prompts, 6) == greedy_each(hf, prompts, 6)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0, "num_mtp_layers": 0}))
    with pytest.raises(ModelLoadError, match="config.json has no place for: model.layers.2."):
        LLM(str(tmp_path), block_size=4)


def test_deepseek_v32_and_v4_are_refused_naming_what_infer_runs(tmp_path):
    """DeepSeek-V3.2's config (model_type deepseek_v32: sparse attention) and V4's are refused before transformers
    reads them, naming DeepSeek-V3's and V2's layouts."""
    for model_type, arch in (("deepseek_v32", "DeepseekV32ForCausalLM"), ("deepseek_v4", "DeepseekV4ForCausalLM")):
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**SMALL, "model_type": model_type, "architectures": [arch]}))
        res = CliRunner().invoke(app, ["warmup", str(folder), "--estimate"], env={"COLUMNS": "250"})
        assert res.exit_code != 0, res.output
        text = " ".join(res.output.split())
        assert f"(model_type '{model_type}')" in text and "which infer does not run" in text, text
        assert "DeepseekV3ForCausalLM, model_type deepseek_v3" in text, text


REFUSED = {  # family, config -> words of the refusal
    "v2-noaux": ("deepseek_v2", dict(topk_method="noaux_tc"), "deepseek_v2 with topk_method 'noaux_tc'"),
    "v2-groups-not-dividing": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=3),
                               "n_group 3 with n_routed_experts 8"),
    "v3-groups-not-dividing": ("deepseek_v3", dict(n_group=3), "n_group 3 with n_routed_experts 8"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_the_router_cannot_compute_is_refused_up_front(tmp_path, name):
    family, config, words = REFUSED[name]
    if family == "deepseek_v2":
        config = {**{k: v for k, v in SMALL.items() if k != "norm_topk_prob"}, **config}
    else:
        config = {**SMALL, **config}
    text = estimate_refusal(tmp_path, family, ARCH[family], **config)
    assert words in text, text


@pytest.mark.parametrize("name, arch", [("tiny-deepseek-v3", "DeepseekV3ForCausalLM"),
                                        ("tiny-deepseek-v2", "DeepseekV2ForCausalLM")])
def test_builtin_tiny_model_runs_and_warmup_sizes_it(name, arch):
    check_builtin_runs_and_warmup_sizes_it(name, arch, False)


# ------------------------------------------------------------------------------------------------------- LoRA
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# the attention's projections (q_lora_rank set: q_a_proj and q_b_proj; kv_b_proj is absorbed) and the stacked experts
# (target_parameters)
ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
                         target_parameters=EXPERTS),
            "qv4": dict(r=4, lora_alpha=4, target_modules=["q_b_proj", "o_proj"], target_parameters=EXPERTS)}
# (q_lora_rank null: q_proj)
V2_ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "kv_a_proj_with_mqa", "o_proj"]),
               "qv4": dict(r=4, lora_alpha=4, target_modules=["kv_a_proj_with_mqa"], target_parameters=EXPERTS)}


@pytest.fixture(scope="module")
def ds_lora(tmp_path_factory):
    """(base folder, transformers' model, {name: adapter}) of ADAPTERS (peft's) on a DeepSeek-V3."""
    from lora_helpers import base_and_adapters
    return base_and_adapters(tmp_path_factory.mktemp("dsv3_lora"), ADAPTERS, build)


def test_peft_adapters_equal_peft_alone_and_mixed(ds_lora):
    """Adapters of q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj and the stacked experts, each alone and mixed with
    the base in one batch: peft's tokens; kv_b_proj (absorbed) has no adapter slots."""
    from lora_helpers import check_all8_qv4_equal_peft
    check_all8_qv4_equal_peft(*ds_lora)


def test_v2_peft_adapters_of_q_proj_equal_peft(tmp_path):
    from lora_helpers import base_and_adapters, check_all8_qv4_equal_peft
    check_all8_qv4_equal_peft(*base_and_adapters(
        tmp_path, V2_ADAPTERS, lambda folder: build(folder, "deepseek_v2", q_lora_rank=None)))


def test_an_adapter_of_kv_b_proj_is_refused_naming_it_and_merging(ds_lora, tmp_path):
    """Weights on self_attn.kv_b_proj (absorbed into the query and the output): refused, naming the module and the
    merge that serves it (a problem `infer convert --merge-lora` folds in)."""
    from transformers import AutoConfig

    from infer.errors import LoRAError
    from infer.lora.adapter import adapter_problems
    from lora_helpers import adapter_with_module
    base, _, paths = ds_lora
    module = "layers.1.self_attn.kv_b_proj"
    folder = adapter_with_module(paths["qv4"], tmp_path / module, module, 4, 32, 128)
    [p] = adapter_problems("x", folder, AutoConfig.from_pretrained(base))
    assert "which infer's multi-head latent attention absorbs" in p.message and f"model.{module}" in p.message, p
    assert p.merges and "infer convert --merge-lora" in p.hint, p
    with pytest.raises(LoRAError, match="kv_b_proj"):
        LLM(str(base), loras={"x": str(folder)})


def test_an_adapter_of_the_dense_mlp_shared_and_routed_experts_equals_peft(ds_lora, tmp_path):
    """target_modules gate_proj, up_proj, down_proj: peft (>= 0.22) adapts the dense layer's MLP and the shared
    experts' Linear layers by them and turns them into the routed experts' parameters too; all of them served, mixed
    with the base: peft's tokens."""
    from lora_helpers import check_mlp_names_adapter_equals_peft
    base, hf, _ = ds_lora
    check_mlp_names_adapter_equals_peft(base, hf, tmp_path, "q_b_proj", {
        "model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.up_proj",
        "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"})


def test_lora_target_modules_names_the_latent_attentions_layers(ds_lora):
    """--lora-target-modules takes q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj (q_proj alone is no fused qkv);
    kv_b_proj is refused as a module without slots."""
    from infer.errors import ConfigError
    from lora_helpers import check_mixed_adapters_equal_peft
    base, hf, paths = ds_lora
    check_mixed_adapters_equal_peft(base, hf, {"qv4": paths["qv4"]}, random_prompts(512, (6, 9), seed=2),
                                    ["qv4", None], lora_target_modules=["q_b_proj", "o_proj", "experts"])
    with pytest.raises(ConfigError, match="kv_b_proj"):
        LLM(str(base), loras={"qv4": str(paths["qv4"])}, lora_target_modules=["kv_b_proj"])


@interpreted
def test_gpu_code_path_with_mixed_adapters_interpreted_equals_peft(ds_lora, monkeypatch):
    """Adapters beside a base-only row through the Triton kernels (interpreted) and emulated decode graphs: peft's
    tokens."""
    from lora_helpers import check_mixed_adapters_gpu_path_equal_peft
    base, hf, paths = ds_lora

    def check_model(model):
        assert all(layer.mlp.lora is not None for layer in model.layers[1:])
        assert all(layer.self_attn.kv_b_proj.lora is None for layer in model.layers)
    check_mixed_adapters_gpu_path_equal_peft(base, hf, paths, monkeypatch, check_model)


# ------------------------------------------------------------------------------------------- GLM-4.7-Flash
# GLM-4.7-Flash's shape, shrunk: 47 layers there (the first dense), 20 heads of 192 + 64 (values 256) over a latent
# of 512, q through 768, 64 experts of 1536 (top 4) beside a shared expert; here its mlp_layer_types of 3 layers
# (dense, sparse, sparse), SMALL's attention and experts
GLM_LITE = dict(SMALL, mlp_layer_types=["dense", "sparse", "sparse"])


@pytest.mark.parametrize("config", [dict(), dict(q_lora_rank=None, mlp_layer_types=["sparse", "dense", "sparse"])])
def test_glm_47_flash_equals_transformers(tmp_path, config):
    """GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's latent attention, GLM-4.5's router and experts on the
    layers mlp_layer_types names sparse: transformers' greedy tokens and logprobs, and in chunks with prefix caching."""
    from infer.models.moe import SparseMoeBlock
    hf = save_random_model(tmp_path, "glm4_moe_lite", "Glm4MoeLiteForCausalLM", {**GLM_LITE, **config}, 0,
                           norms_shifted_biases_drawn)
    hf = correction_bias_drawn(hf, tmp_path, 0, 0.3, buffers=True)
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        model = llm.engine.runner.model
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == \
            [t == "sparse" for t in hf.config.mlp_layer_types]
        assert llm.engine.runner.kv_cache.shape[1] == 1
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, "glm4_moe_lite")
    check_chunked_prefill_and_prefix_caching(tmp_path, hf)


@pytest.mark.parametrize("config, words", [
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), "glm4_moe_lite mlp_layer_types ['moe'] are not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
     "glm4_moe_lite with a rotary of 8 dims (head_dim 16 times partial_rotary_factor 0.5) over qk_rope_head_dim 16 "
     "is not supported"),
])
def test_glm_47_flash_refusals_name_the_field(tmp_path, config, words):
    """mlp_layer_types of another kind than dense and sparse, a rotary (head_dim, its qk_rope_head_dim, times
    partial_rotary_factor) of another width than qk_rope_head_dim: `infer warmup --estimate` refuses them naming the
    field."""
    text = estimate_refusal(tmp_path, "glm4_moe_lite", "Glm4MoeLiteForCausalLM", **{**GLM_LITE, **config})
    assert words in text, text


# ------------------------------------------------------------------------------------------------------- GPTQ
@pytest.fixture(scope="module")
def gptq_ds(tmp_path_factory):
    """(tiny-deepseek-v3's folder, `infer quantize`'s GPTQ checkpoint of it: GPTQModel's deepseek_v3 definition)."""
    from infer.models.tiny import ensure_builtin
    from quant_helpers import infer_quantize
    return ensure_builtin("tiny-deepseek-v3"), infer_quantize("tiny-deepseek-v3", tmp_path_factory.mktemp("gq") / "q")


@needs_gptqmodel
def test_infer_quantize_writes_a_gptq_checkpoint_equal_to_its_dequantized_weights(gptq_ds):
    """`infer quantize` of tiny-deepseek-v3 through GPTQModel quantizes the latent attention's projections (kv_b_proj
    too: dequantized once for its absorption), the dense MLP, the shared experts and the experts; infer runs it with
    transformers' greedy tokens of the same weights dequantized, and warmup --estimate counts its weights."""
    from safetensors.torch import load_file

    from quant_helpers import check_gptq_moe_equals_dequantized
    src, out = gptq_ds
    tensors = load_file(out / "model.safetensors")
    for name in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                 "self_attn.o_proj", "mlp.experts.3.up_proj"):
        assert f"model.layers.1.{name}.qweight" in tensors, name
    check_gptq_moe_equals_dequantized(src, out)


@needs_gptqmodel
@interpreted
def test_gptq_checkpoint_through_the_kernels_equals_the_cpu_path(gptq_ds, monkeypatch):
    """The GPU code path (int4 kernels, interpreted; kv_b_proj's int4 weight dequantized once for W_UK and W_UV)
    gives the CPU path's greedy tokens."""
    from quant_helpers import int4_kernel_path
    _, out = gptq_ds
    prompts = random_prompts(512, (5, 12), seed=4)
    with LLM(str(out), block_size=4, dtype="float32") as llm:
        want = greedy_tokens(llm, prompts, 5)
    int4_kernel_path(monkeypatch)
    with LLM(str(out), block_size=4, dtype="float32", max_model_len=32) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.kv_b_proj.weight is None
        assert greedy_tokens(llm, prompts, 5) == want
