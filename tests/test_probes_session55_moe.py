"""Session 55: mixtures of experts (models.moe): Qwen3-MoE (Qwen3MoeForCausalLM), Mixtral (MixtralForCausalLM) and
Qwen2-MoE (Qwen2MoeForCausalLM, its shared expert and sigmoid gate), end to end on tiny random models built from
transformers' configs (float32), each against transformers: greedy tokens and logprobs over batched prompts, chunked
prefill and prefix caching; top-k renormalised or not (norm_topk_prob), dense layers (mlp_only_layers,
decoder_sparse_step); the checkpoint's per-expert names and transformers' stacked ones; the built-ins; the fused-MoE
op's GPU form equal to its reference; what infer cannot run (quantized experts, adapters on the router) refused up
front."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from infer import LLM, SamplingParams
from infer.errors import ModelLoadError
from infer.models.tiny import ensure_builtin

from helpers import check_equal_transformers, greedy_each, norms_drawn, random_prompts, save_random_model

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
MOE = {  # the experts' fields of each family: 8 experts, top-2
    "qwen3_moe": dict(head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2),
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=48),
}


def build(folder, model_type: str, seed: int = 0, **config):
    """A random MoE model folder (float32; norms random, not ones) with the tiny-llama tokenizer; returns
    transformers' model."""
    return save_random_model(folder, model_type, ARCH[model_type], {**SMALL, **MOE[model_type], **config}, seed,
                             norms_drawn(1.0))


hf_greedy = greedy_each


def check_equal(hf, llm, prompts, name, n: int = 8):
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, n, name)
    return outs


CONFIGS = {
    "qwen3_moe-renormalised": ("qwen3_moe", dict(norm_topk_prob=True)),
    "qwen3_moe-raw-dense-layer": ("qwen3_moe", dict(norm_topk_prob=False, num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen3_moe-sparse-step": ("qwen3_moe", dict(norm_topk_prob=True, decoder_sparse_step=2)),
    "mixtral": ("mixtral", dict()),
    "qwen2_moe-shared": ("qwen2_moe", dict()),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    model_type, config = CONFIGS[name]
    hf = build(tmp_path, model_type, **config)
    prompts = random_prompts(512, (5, 23), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        check_equal(hf, llm, prompts, name, n=6)


def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path):
    """Long prompts cut into chunks of 8 tokens, and a second round whose prompts share cached blocks."""
    hf = build(tmp_path, "qwen3_moe", norm_topk_prob=True)
    prompts = random_prompts(512, (21, 30, 17), seed=5)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=8, max_num_seqs=8,
             enable_prefix_caching=True) as llm:
        check_equal(hf, llm, prompts, "chunked")
        again = [p[:16] + p[-3:] for p in prompts]
        check_equal(hf, llm, again, "prefix-cached")


def test_the_experts_are_used_and_routed(tmp_path):
    """The checks above mean something: the same model with the top-k left raw (norm_topk_prob false) or with two
    experts' weights swapped gives transformers other logits."""
    hf = build(tmp_path, "qwen3_moe", norm_topk_prob=True)
    ids = torch.tensor([random_prompts(512, (12,), seed=1)[0]])
    raw = build(tmp_path / "raw", "qwen3_moe", norm_topk_prob=False)
    with torch.no_grad():
        assert (hf(ids).logits - raw(ids).logits).abs().max() > 1e-2
        experts = hf.model.layers[0].mlp.experts
        base = hf(ids).logits
        experts.down_proj.data[[0, 1]] = experts.down_proj.data[[1, 0]]
        assert (hf(ids).logits - base).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_builtins_equal_transformers_and_the_estimate_counts_every_expert(name):
    """The built-in tiny-qwen3-moe and tiny-mixtral: transformers' tokens; `warmup --estimate`'s count of the
    checkpoint's weights is what the engine loads (every expert, none prepacked)."""
    from infer.kernels import cpu_gemm
    from infer.memory.checkpoint import checkpoint_weights_bytes
    from infer.memory.sizes import weights_bytes
    from infer.models.loader import load_model, weight_files
    path = ensure_builtin(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with LLM(name, block_size=4) as llm:
        check_equal(hf, llm, random_prompts(512, (6, 11), seed=2), name, n=6)
    if cpu_gemm.available(torch.empty(0)):
        model, cfg = load_model(path, torch.float32, torch.device("cpu"))
        rope = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("cos_sin"))
        cpu = torch.device("cpu")
        assert checkpoint_weights_bytes(weight_files(path), cfg, torch.float32, cpu) == weights_bytes(model) - rope


def test_stacked_experts_load_and_a_missing_expert_is_named(tmp_path):
    """A checkpoint of transformers' own parameter names (mlp.experts.gate_up_proj [E, 2I, H], down_proj) loads as
    the per-expert one; a checkpoint missing one expert's projection is refused naming it."""
    hf = build(tmp_path / "a", "qwen3_moe", norm_topk_prob=True)
    prompts = random_prompts(512, (7, 12), seed=8)
    with LLM(str(tmp_path / "a"), block_size=4) as llm:
        want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert want == hf_greedy(hf, prompts, 6)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "b" / "model.safetensors"))
    with LLM(str(tmp_path / "b"), block_size=4) as llm:
        assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))] == want
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"no tensor model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        LLM(str(tmp_path / "c"))
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    up = tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    tensors["model.layers.0.mlp.experts.2.down_proj.weight"] = up.clone()
    save_file(tensors, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts\.2\.down_proj\.weight has shape \(32, 64\)"):
        LLM(str(tmp_path / "c"))


def test_quantized_experts_are_refused_up_front(tmp_path):
    """GPTQ experts built on a GPU stay int4 (session 56, which runs AWQ experts too, no longer refused); `infer
    quantize` of a mixture of experts: session 56's moequant tests."""
    import json

    from infer.models.loader import linear_method_factory, load_config
    from infer.models import moe
    from infer.models.moe import moe_model_class
    build(tmp_path / "m", "mixtral")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    hf_cfg = load_config(tmp_path / "m")
    with pytest.MonkeyPatch.context() as mp, torch.device("meta"):  # a model built on a GPU: int4 experts (session 56)
        mp.setattr(moe, "on_gpu", lambda t: True)
        model = moe_model_class()(hf_cfg, torch.float32, linear_method_factory(tmp_path / "m", hf_cfg), 8)
        assert model.layers[0].mlp.experts.w13.numel() == 0


@pytest.fixture(scope="module")
def moe_lora(tmp_path_factory):
    """tiny Qwen3-MoE and a peft adapter on its attention projections (r 8, all four)."""
    from lora_helpers import hf_float, save_adapter
    root = tmp_path_factory.mktemp("moe-lora")
    build(root / "base", "qwen3_moe", norm_topk_prob=True)
    hf = hf_float(root / "base")
    path = save_adapter(hf, root / "attn", seed=1, r=8, lora_alpha=16, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return root / "base", hf, path


def test_attention_adapters_equal_peft(moe_lora):
    from lora_helpers import PeftOracle
    base, hf, path = moe_lora
    oracle = PeftOracle(hf, {"attn": path})
    try:
        prompts = random_prompts(512, (5, 12, 8), seed=6)
        names = ["attn", None, "attn"]
        with LLM(str(base), loras={"attn": str(path)}, max_loras=1, max_lora_rank=8, block_size=4) as llm:
            got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True),
                                                     lora=names)]
        want = [oracle.greedy(n, p, 6) for p, n in zip(prompts, names)]
        assert got == want
        assert want[0] != oracle.greedy(None, prompts[0], 6)  # the adapter changes the tokens
    finally:
        oracle.close()


ROUTER = ("infer adapts a mixture of experts' attention, dense layers' MLPs, shared expert and stacked experts, "
          "not its router")
UNLISTED = "which its adapter_config.json does not adapt"


@pytest.mark.parametrize("module,said", [("mlp.experts.3.gate_proj", UNLISTED), ("mlp.gate", ROUTER),
                                         ("mlp.down_proj", UNLISTED)], ids=["expert", "router", "mlp"])
def test_adapters_on_the_router_or_modules_their_config_leaves_out_are_refused(moe_lora, tmp_path, module, said):
    """An adapter with tensors for the router (mlp.gate) is refused by the engine's load and by `infer
    lora-validate` (session 57: the experts, dense layers' MLPs and the shared expert are adapted); tensors for an
    expert's or an MLP's projection its target_modules does not name are refused as peft would leave them out."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.errors import LoRAError
    base, _, path = moe_lora
    shutil.copytree(path, tmp_path / "a")
    tensors = load_file(path / "adapter_model.safetensors")
    rows, cols = (8, 64) if module != "mlp.down_proj" else (8, 32)
    prefix = f"base_model.model.model.layers.1.{module}"
    tensors[f"{prefix}.lora_A.weight"] = torch.randn(rows, cols)
    tensors[f"{prefix}.lora_B.weight"] = torch.randn(8 if module == "mlp.gate" else 64, 8)
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(LoRAError) as err:
        LLM(str(base), loras={"x": str(tmp_path / "a")}, max_loras=1, max_lora_rank=8, block_size=4)
    assert f"model.layers.1.{module}" in str(err.value) and said in str(err.value)
    res = CliRunner().invoke(app, ["lora-validate", str(base), str(tmp_path / "a")])
    assert res.exit_code != 0 and said in " ".join(res.output.split()), res.output
    assert "sit under" not in res.output  # (model.layers.N...: this base's layers, not another model's)


# ------------------------------------------------------------------------------------------------ the GPU path
CASES = [  # tokens, experts, top-k, hidden, expert width, float32 routing weights (Mixtral's)
    (5, 8, 2, 32, 16, False), (19, 6, 3, 48, 24, True), (1, 4, 1, 16, 16, False), (33, 8, 2, 64, 32, True)]


@pytest.mark.parametrize("case", CASES)
def test_triton_fused_moe_equals_the_reference(case):
    """The Triton fused MoE (interpreted) and the dense graph-safe form equal the reference over random routings
    with an expert no token chose, and the alignment pads each expert's pairs to whole blocks, blocks past the
    padded end left to return at once."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer.kernels import moe, reference
    t, e, k, h, i, fw = case
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    logits = torch.randn(t, e, generator=g)
    logits[:, 1] -= 100  # expert 1: no tokens
    w, ids = torch.topk(logits.softmax(-1), k, -1)
    want = reference.fused_moe(x, w13, w2, w if fw else w.half().float(), ids)
    assert torch.allclose(moe.fused_moe(x, w13, w2, w if fw else w.half().float(), ids), want, atol=1e-5)
    assert torch.allclose(reference.fused_moe_dense(x, w13, w2, w if fw else w.half().float(), ids), want, atol=1e-5)
    pairs, experts, post = moe.align(ids, e)
    counts = torch.bincount(ids.flatten(), minlength=e)
    padded = (counts + moe.BLOCK_M - 1) // moe.BLOCK_M * moe.BLOCK_M
    assert int(post) == int(padded.sum()) and len(pairs) >= int(post) and len(pairs) % moe.BLOCK_M == 0
    flat = ids.flatten()
    for b in range(int(post) // moe.BLOCK_M):
        rows = pairs[b * moe.BLOCK_M:(b + 1) * moe.BLOCK_M]
        real = rows[rows < t * k].long()
        assert len(real) and bool((flat[real] == experts[b]).all())
    assert sorted(pairs[pairs < t * k].tolist()) == list(range(t * k))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_gpu_code_path_interpreted_equals_the_cpu_path(tmp_path, monkeypatch, model_type):
    """Every op through its Triton kernel (interpreted on CPU), the experts through the fused MoE, decode steps
    through emulated CUDA graphs, prefills in chunks: the CPU path's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from quant_helpers import int4_kernel_path
    build(tmp_path, model_type, num_hidden_layers=1, norm_topk_prob=True)
    prompts = random_prompts(512, (5, 14), seed=4)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    opts = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=32)
    with LLM(str(tmp_path), **opts) as llm:
        cpu = [o.token_ids for o in llm.generate(prompts, params)]
    int4_kernel_path(monkeypatch)
    with LLM(str(tmp_path), cuda_graph_max_tokens=4, **opts) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        assert [o.token_ids for o in llm.generate(prompts, params)] == cpu
        assert sum(llm.engine.runner.graphs.replays.values()) > 0


def test_the_activation_plan_counts_a_tokens_experts():
    """Qwen3-30B-A3B's prefill: each token's 8 experts' gate|up, activation and down rows (kernels.moe) weigh more
    than a dense MLP of its intermediate_size (6144): the memory plan counts them."""
    from infer.memory.sizes import activation_bytes, moe_token_bytes
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, vocab_size=151936)
    per_token = moe_token_bytes(cfg, torch.bfloat16)
    assert per_token >= 8 * (3 * 768 + 2048) * 2 > 4 * 6144 * 2
    dense = AutoConfig.for_model("qwen3", **{k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                                 "vocab_size")})
    assert moe_token_bytes(dense, torch.bfloat16) == 0
    assert activation_bytes(cfg, torch.bfloat16, 8192, 1, 16, penalties=False) >= 8192 * per_token > \
        activation_bytes(dense, torch.bfloat16, 8192, 1, 16, penalties=False)


def test_fused_moe_compiles_for_an_h100_once_whatever_the_step():
    """The fused MoE compiled for sm_90 (the compile side of a driver, no GPU): half-precision tl.dot on the tensor
    cores for bfloat16, float32's in IEEE; its kernels compile on a model's first step, and no later step's count
    of tokens (1, a multiple of 16, any other) compiles a variant of its own (warm_kernels' steps cover them)."""
    import textwrap

    from helpers import COMPILE_ONLY_LAUNCHES, run_compile_only
    pytest.importorskip("triton")
    script = COMPILE_ONLY_LAUNCHES + textwrap.dedent('''
        from infer.kernels import moe
        out = {}
        for dtype in (torch.bfloat16, torch.float32):
            w13, w2 = torch.randn(8, 64, 64, dtype=dtype), torch.randn(8, 64, 32, dtype=dtype)
            steps = []
            for t in (9, 1, 16, 41):
                x = torch.randn(t, 64, dtype=dtype)
                w, ids = torch.topk(torch.randn(t, 8).softmax(-1), 2, -1)
                before = len(compiled)
                moe.fused_moe(x, w13, w2, w.to(dtype), ids)
                steps.append(compiled[before:])
            out[str(dtype)] = steps
        print(json.dumps(out))
    ''')
    out = run_compile_only(script, 600)
    for dtype, steps in out.items():
        assert sorted(steps[0]) == ["_moe_gemm", "_moe_gemm", "_silu_and_mul_kernel"], (dtype, steps)
        assert steps[1:] == [[]] * 3, (dtype, steps)


@pytest.mark.parametrize("targets,said", [(["w1", "w3"], "targets ['w1', 'w3']: infer adapts a mixture of experts'"),
                                          (["gate_proj"], "targets gate_proj without up_proj: peft cannot load it")])
def test_adapters_whose_config_targets_the_experts_are_refused(moe_lora, tmp_path, targets, said):
    """An adapter whose target_modules names Mixtral's w1/w3 on a Qwen3-MoE, or an expert's gate_proj without its
    up_proj (fused in transformers 5's gate_up_proj: peft refuses to convert it), is refused whatever tensors it
    has (session 57: gate_proj, up_proj and down_proj together adapt the experts, as peft converts them)."""
    import json

    from infer.lora.adapter import adapter_problems
    base, _, path = moe_lora
    shutil.copytree(path, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "k_proj", "v_proj", "o_proj", *targets]
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    problems = adapter_problems("a", tmp_path / "a", AutoConfig.from_pretrained(base))
    assert str(problems[0]).startswith(said), problems


def test_gptq_experts_equal_gptqmodels_own_load(tmp_path):
    """GPTQModel's qwen3_moe quantizes every expert's gate/up/down: on the CPU each is dequantized once at load into
    the stacked weights (the scales' float16 product, as GPTQModel's torch kernel): greedy tokens equal GPTQModel's
    own load of the checkpoint."""
    pytest.importorskip("gptqmodel")
    from quant_helpers import gptqmodel_greedy, make_gptqmodel_checkpoint
    build(tmp_path / "base", "qwen3_moe", norm_topk_prob=True, num_hidden_layers=1)
    q = make_gptqmodel_checkpoint(tmp_path / "base", tmp_path / "q", bits=4, group_size=32, seq_len=32)
    assert "model.layers.0.mlp.experts.7.down_proj.qweight" in load_file(q / "model.safetensors")
    prompts = random_prompts(512, (6, 15), seed=11)
    with LLM(str(q), block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert got == gptqmodel_greedy(q, prompts, 6)
    with LLM(str(tmp_path / "base"), block_size=4) as llm:  # the int4 weights change the tokens: the check means much
        assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))] != got
