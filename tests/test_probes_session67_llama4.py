"""Session 67: Meta's Llama 4 text model (Llama4ForCausalLM, model_type llama4_text; the language model of
Llama4ForConditionalGeneration: Llama-4-Scout-17B-16E, Maverick-17B-128E), end to end on tiny random models (float32)
against transformers: NoPE layers (no_rope_layers) and the others' rotary of interleaved pairs, q and k L2-normed
after it (use_qk_norm), the NoPE layers' attention temperature (attn_temperature_tuning, floor_scale, attn_scale),
the rope layers' chunked attention (attention_chunk_size 8: prompts cross chunks) in the CPU reference and the Triton
kernels (interpreted), with chunked prefill and prefix caching; experts on the layers moe_layers lists whose sigmoid
router scales their input, the shared expert, dense layers of intermediate_size_mlp; the built-in tiny-llama4 and
tiny-llama4-mm (the multimodal checkpoint's text model); peft adapters; the memory plan of Scout's shapes;
refusals (`infer quantize`, refused here then: test_probes_session71_llama4_gptq)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer.cli.main import app
from infer.kernels import reference

from helpers import (builtin_model_tests, check_chunked_prefill_and_prefix_caching, estimate_refusal,
                     greedy_and_logprobs_test, hub_shaped_folder, interpreted_module, norms_shifted_biases_drawn,
                     save_random_model)
from quant_helpers import check_gpu_path_equals_transformers
from test_probes_session54_window import _batch, decode_batch

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
ARCH = "Llama4ForCausalLM"
# Scout's layout, shrunk: 4 layers, the 4th NoPE (no_rope_layer_interval 4), the others chunked (chunks of 8 here,
# 8,192 there) with q and k L2-normed; experts on the odd layers (interleave_moe_layer_step 2; Scout's on every
# layer, Maverick's on alternate ones), 4 experts of 32 (top 1) beside a shared expert of 32, dense MLPs of 48;
# floor_scale 4 and attn_scale 0.5 (8,192 and 0.1 there) so that the temperature moves within the prompts
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
             interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
             max_position_embeddings=256, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32})


def build(folder, family: str = "llama4_text", seed: int = 0, **config):
    """A random Llama 4 text folder (float32) with the tiny-llama tokenizer, norms shifted (and biases drawn);
    returns transformers' model (eager)."""
    return save_random_model(folder, family, ARCH, {**SMALL, **config}, seed, norms_shifted_biases_drawn)


CONFIGS = {
    "scout-shaped": ("llama4_text", dict()),
    # top 2 (each token's two scaled copies), every layer sparse, q/k/v/o biases, no L2 norm, the first and last
    # layers NoPE, the default rope, no temperature, a tied head
    "top2-biases-no-qk-norm": ("llama4_text", dict(
        num_experts_per_tok=2, moe_layers=[0, 1, 2, 3], attention_bias=True, use_qk_norm=False,
        no_rope_layers=[0, 1, 1, 0], attn_temperature_tuning=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # no chunked attention (attention_chunk_size null: every layer full), dense on every layer
    "unchunked-dense": ("llama4_text", dict(attention_chunk_size=None, moe_layers=[])),
}


def check_model(model, hf, family, config):
    """Each layer as transformers builds it: the rope layers chunked over attention_chunk_size (where set) and
    L2-normed (use_qk_norm), the NoPE layers' temperature, the experts where moe_layers says (their router and shared
    expert loaded from feed_forward.router and feed_forward.shared_expert), the dense MLPs of intermediate_size_mlp."""
    from infer.models.moe import SparseMoeBlock
    cfg = hf.config
    for i, layer in enumerate(model.layers):
        attn, rope = layer.self_attn, bool(cfg.no_rope_layers[i])
        chunked = rope and cfg.attention_chunk_size is not None
        assert (attn.chunked, attn.window) == (chunked, cfg.attention_chunk_size if chunked else 0), i
        assert (attn.l2_eps is not None) == (rope and cfg.use_qk_norm), i
        assert (attn.temperature is not None) == (not rope and cfg.attn_temperature_tuning), i
        block = layer.feed_forward
        assert isinstance(block, SparseMoeBlock) == (i in cfg.moe_layers), i
        if i in cfg.moe_layers:
            assert block.top_k == cfg.num_experts_per_tok and block.shared_experts is block.shared_expert
            assert block.shared_expert.down_proj.names == [f"model.layers.{i}.feed_forward.shared_expert.down_proj"]
            torch.testing.assert_close(block.gate.weight, hf.model.layers[i].feed_forward.router.weight)
        else:
            assert block.down_proj.in_features == cfg.intermediate_size_mlp, i


test_greedy_tokens_and_logprobs_equal_transformers = greedy_and_logprobs_test(CONFIGS, build, check_model)


def test_chunked_prefill_and_prefix_caching_equal_transformers(tmp_path):
    """Prompts of 30 and 41 tokens (chunks of 8: four and five of them) in steps of 12 tokens, and with prefix caching
    a third sharing the second's first 32 (its cached blocks end on a chunk's boundary, its new tokens start one)."""
    check_chunked_prefill_and_prefix_caching(tmp_path, build(tmp_path, seed=1))


def test_blocks_behind_the_chunk_are_freed_and_tokens_stay_transformers():
    """tiny-llama4 (chunks of 32) on a prompt of 100 tokens and 30 generated, blocks of 4: the chunked layers' KV
    group frees the blocks behind each query's chunk (engine.hybrid_blocks, as a sliding window of the chunk's size)
    and the tokens are transformers'."""
    from helpers import greedy_each, hf_model, random_prompts
    from infer import LLM, SamplingParams
    from infer.models.tiny import ensure_builtin
    prompts = random_prompts(512, (100,), seed=1)
    with LLM("tiny-llama4", block_size=4, max_model_len=256) as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))]
        assert llm.engine.stats()["kv_blocks_freed_window"] > 0
    assert got == greedy_each(hf_model(str(ensure_builtin("tiny-llama4"))), prompts, 30)


def test_bfloat16_equals_transformers_in_bfloat16_token_by_token():
    """tiny-llama4 in bfloat16 (transformers' own dtype handling: the rotary's complex form in float32, the L2 norm in
    float32, the router's sigmoid in float32 rounded to bfloat16, the temperature's product rounded once): prompts of
    6, 40 and 70 tokens (past two chunks of 32) and 12 greedy tokens. Every prompt token's logprob is transformers'
    (bfloat16, its default SDPA, one forward) within 2e-2, and each generated token is the argmax of transformers'
    forward over the tokens before it (or within 2e-2 of it: a tie at bfloat16's rounding), its logprob within 2e-2
    of transformers' (2e-2: 2.5 bfloat16 steps at these logits; on an AMD EPYC the logprobs 0 to 1.7e-2 apart, every
    token the argmax). Not transformers' generate: its cached decode rounds apart from its own
    forward in bfloat16 (on that AMD EPYC its SDPA generate parts from its forward, its eager generate and infer at
    token 8 of the 6-token prompt, the top two logits 3.33 and 2.81 swapped; its eager attention moves the logprobs of
    the 70-token prompt up to 0.48 from float32's, infer's and SDPA's 0.12)."""
    from helpers import random_prompts
    from infer import LLM, SamplingParams
    from infer.models.tiny import ensure_builtin
    from transformers import AutoModelForCausalLM
    path = str(ensure_builtin("tiny-llama4"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = random_prompts(512, (6, 40, 70), seed=1)
    with LLM(path, dtype="bfloat16", max_model_len=256, block_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0))
    for p, out in zip(prompts, outs):
        seq = p + out.token_ids
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, :-1].float().log_softmax(-1)
        got = torch.tensor([d["logprob"] for d in out.prompt_logprobs[1:]] + [d["logprob"] for d in out.logprobs])
        picked = want.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        torch.testing.assert_close(got, picked, atol=2e-2, rtol=0)
        gap = want[len(p) - 1:].max(-1).values - picked[len(p) - 1:]  # (0: transformers' argmax)
        assert float(gap.max()) <= 2e-2, (len(p), out.token_ids, gap)


@interpreted
def test_gpu_path_interpreted_equals_transformers(tmp_path, monkeypatch):
    """Every op's Triton kernel (interpreted): the chunked prefill tiles and decodes (CHUNKED), the fused MoE of the
    scaled inputs, through emulated CUDA graphs and piecewise graphs: transformers' tokens."""
    check_gpu_path_equals_transformers(tmp_path, monkeypatch, build(tmp_path, seed=2))


test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model = builtin_model_tests(
    {"tiny-llama4": ARCH, "tiny-llama4-mm": "Llama4ForConditionalGeneration"}, nope=("tiny-llama4", "tiny-llama4-mm"))


# ------------------------------------------------------------------------------------------- chunked attention
@pytest.fixture(scope="module")
def attention():
    """infer.kernels.attention, its kernels interpreted on CPU when there is no GPU."""
    yield from interpreted_module("infer.kernels.attention")


def _chunked_oracle(q, k_cache, v_cache, tables, lens, qsl, scale, chunk):
    """Brute force: every query at p over its sequence's keys p - p % chunk..p (masking_utils' chunked_overlay)."""
    out = torch.empty_like(q, dtype=torch.float32)
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for b in range(len(lens)):
        n_keys, start, end = int(lens[b]), int(qsl[b]), int(qsl[b + 1])
        slots = [int(tables[b, i // bs]) * bs + i % bs for i in range(n_keys)]
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)
        for t in range(start, end):
            p = n_keys - (end - start) + (t - start)
            pos = torch.arange(n_keys)
            s = (torch.einsum("hd,lhd->hl", q[t].float(), k) * scale).masked_fill(
                ~((pos <= p) & (pos >= p - p % chunk))[None], float("-inf"))
            out[t] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
    return out


CHUNK_CASES = {  # lens, queries (chunks of 8): decodes at a chunk's first key and past it, prefills, verify rows
    "decodes": ([40, 9, 23, 16, 17, 8], [1] * 6),
    "prefill-and-chunks": ([50, 33, 7, 16], [50, 20, 7, 3]),
    "verify-rows-and-decodes": ([45, 30, 12, 9], [4, 1, 3, 2]),
}


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_reference_and_triton_attend_to_the_querys_chunk_only(attention, case, monkeypatch):
    """reference.paged_attention with chunked (a batch of decodes, whole prompts, chunks after a context, verify rows;
    again one sequence at a time with row chunks of the masked queries) and the Triton kernels (interpreted):
    each query over its own chunk's keys, the blocks of earlier chunks NaN where no query reads them."""
    lens, queries = CHUNK_CASES[case]
    q, kc, vc, tables, lens_t, qsl = _batch(lens, queries)
    want = _chunked_oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 8)
    for b, (n, m) in enumerate(zip(lens, queries)):  # the blocks wholly before the first query's chunk: never read
        first = n - m
        for i in range((first - first % 8) // 4):
            kc[tables[b, i]], vc[tables[b, i]] = float("nan"), float("nan")
    args = (q, kc, vc, tables, lens_t, qsl, 0.3, max(queries))
    torch.testing.assert_close(reference.paged_attention(*args, window=8, chunked=True).float(), want, atol=2e-5,
                               rtol=2e-5)
    window = reference.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, max(queries), window=8)
    assert not torch.allclose(window.float(), want, atol=1e-3, equal_nan=True)  # (chunks are not a sliding window)
    monkeypatch.setattr(reference, "PER_SEQUENCE_LEN", 8)
    monkeypatch.setattr(reference, "MASK_ELEMENTS", 64)
    torch.testing.assert_close(reference.paged_attention(*args, window=8, chunked=True).float(), want, atol=2e-5,
                               rtol=2e-5)
    torch.testing.assert_close(attention.paged_attention(*args, window=8, chunked=True).float(), want, atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("parts", [1, 3])
def test_triton_decode_attention_over_the_chunk_in_partitions(attention, parts):
    """decode_attention (rotary, KV write, attention in one launch) with chunked over 1 and 3 partitions a sequence:
    the reference's (the partitions share out the chunk's keys only)."""
    q, kc, vc, tables, lens_t, qsl, qf, k, v, positions, slots, cos_sin = decode_batch([70, 9, 33, 16])
    t, hq, d = q.shape
    kr, vr, kt, vt = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    want = reference.decode_attention(positions, qf, k, v, cos_sin, d, kr, vr, slots, tables, lens_t, qsl, 0.3,
                                      window=32, chunked=True)
    oracle = _chunked_oracle(reference.rotary_embedding(positions, qf, k, cos_sin, d)[0].view(t, hq, d), kr, vr,
                             tables, lens_t, qsl, 0.3, 32)
    torch.testing.assert_close(want.float(), oracle, atol=2e-5, rtol=2e-5)
    got = attention.decode_attention(positions, qf, k, v, cos_sin, d, kt, vt, slots, tables, lens_t, qsl, 0.3,
                                     parts=parts, window=32, chunked=True)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------- memory
SCOUT = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
             num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16,
             num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8192,
             max_position_embeddings=10485760, tie_word_embeddings=False,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def test_warmup_plans_scouts_shapes_with_chunk_sized_kv_on_the_chunked_layers(tmp_path, monkeypatch):
    """`infer warmup --estimate` of a checkpoint of Llama-4-Scout's text shapes (no values): its 108 billion
    parameters' bfloat16 bytes (the 16 experts of every layer counted; the CPU's prepacked dense copies under 15%
    more), a KV cache of 48 x 2 x 8 x 128 x 2 bytes a token in 4 groups of 12 layers, the NoPE layers' group full
    and the chunked layers' 3 holding a chunk (8,192 tokens) a sequence: at 131,072 tokens each sequence needs 8,192
    blocks of the full group and 769 of each chunked one, where the whole context in every layer would fit none."""
    params = hub_shaped_folder(tmp_path, "llama4_text", ARCH, SCOUT)
    assert 107.5e9 < params < 108e9, params
    monkeypatch.setattr("infer.memory.plan.device_total", lambda device: 256 << 30)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json", "--dtype", "bfloat16",
                                   "--max-length", "131072", "--concurrency", "2", "--device", "cpu", "--memory-limit",
                                   "240GB"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    assert plan["kv_bytes_per_token"] == 48 * 2 * 8 * 128 * 2
    assert (plan["window"], plan["kv_groups"], plan["full_groups"]) == (8192, 4, 1), plan
    assert 2 * params <= plan["weights_bytes"] < 2 * params * 1.15, (plan["weights_bytes"], params)
    per_sequence = 131072 // 16 + 3 * plan["window_blocks"]
    assert plan["max_concurrency_at_max_length"] == plan["kv_blocks"] // per_sequence >= 2, plan
    # (the whole context in every layer: not the two sequences asked; on a CPU whose oneDNN packs no bfloat16, AMD
    # EPYC's, the plan holds no prepacked copies and has room for one such sequence, elsewhere for none)
    assert plan["kv_blocks"] < 2 * (4 * 131072 // 16)


# ------------------------------------------------------------------------------------------------------ refusals
REFUSED = {  # config -> words of the refusal
    "no-rope-values": (dict(no_rope_layers=[1, 1, 2, 0]), "llama4_text with no_rope_layers [1, 1, 2, 0] for 4 layers"),
    "chunk-size": (dict(attention_chunk_size=0), "llama4_text with attention_chunk_size 0 is not supported"),
    "layer-types": (dict(layer_types=["full_attention", "sliding_attention", "full_attention", "full_attention"]),
                    "llama4_text layer_types ['sliding_attention'] are not supported"),
    "chunked-nope": (dict(layer_types=["chunked_attention"] * 4),
                     "llama4_text with layer_types chunked where the rope layers are not (layers [3])"),
    "moe-layers": (dict(moe_layers=[1, 7]), "llama4_text with moe_layers [7] naming no layer of 4"),
    "topk-over-experts": (dict(num_experts_per_tok=5), "config.json has num_experts_per_tok 5 with num_local_experts"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_infer_cannot_run_is_refused_naming_the_field(tmp_path, name):
    config, words = REFUSED[name]
    assert words in estimate_refusal(tmp_path, "llama4_text", ARCH, **{**SMALL, **config})


# ------------------------------------------------------------------------------------------------------ adapters
def test_adapters_of_the_attention_dense_mlps_and_shared_experts_equal_peft_mixed(tmp_path):
    """peft adapters on the scout-shaped model, "all8" (every projection peft's target_modules reach: the attention,
    the dense layers' feed_forward.gate_proj/up_proj/down_proj of intermediate_size_mlp, the sparse layers'
    feed_forward.shared_expert) and "qv4", with the base between them in one batch: peft's tokens."""
    from lora_helpers import ALL, base_and_adapters, check_mixed_adapters_equal_peft
    from helpers import random_prompts
    base, hf, paths = base_and_adapters(tmp_path, {"all8": dict(r=8, lora_alpha=16, target_modules=ALL),
                                                   "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"])},
                                        build=lambda f: build(f, seed=3), scale=0.3)
    from safetensors.torch import load_file
    names = set(load_file(paths["all8"] / "adapter_model.safetensors"))
    assert {"base_model.model.model.layers.0.feed_forward.down_proj.lora_A.weight",
            "base_model.model.model.layers.1.feed_forward.shared_expert.up_proj.lora_B.weight"} <= names
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (5, 20, 8), seed=6), ["all8", None, "qv4"])


def test_an_adapter_of_the_experts_is_refused_naming_them(tmp_path):
    """peft adapts Llama 4's stacked experts (target_parameters); infer's expert slots lay out Qwen's experts (the
    score on the output), not these: refused naming them, before anything loads."""
    from infer import LLM
    from infer.errors import LoRAError
    from lora_helpers import save_adapter
    hf = build(tmp_path / "base", seed=3)
    experts = save_adapter(hf, tmp_path / "ex", 1, r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0,
                           target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"])
    with pytest.raises(LoRAError, match=r'target_parameters \["feed_forward.experts.gate_up_proj", "feed_forward.'
                       r"experts.down_proj\"\]: infer does not adapt Llama 4's experts or router"):
        LLM(str(tmp_path / "base"), loras={"x": str(experts)}, max_lora_rank=8)


# ------------------------------------------------------------------------------------------------------------ GPTQ
def _gptq_checkpoint(src, out):
    """`src` (a float Llama 4 folder) as a GPTQ checkpoint made elsewhere in GPTQModel's layout: every attention,
    dense MLP, shared expert and expert projection 4-bit by round to nearest (group 32), each expert's gate_proj,
    up_proj and down_proj apart under feed_forward.experts.N (from transformers 5's stacked [E, H, 2I] and
    [E, I, H], x @ W), the router and head float."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from test_probes_session56_review_moeq import rtn_gptq
    apart = out.parent / "apart"
    shutil.copytree(src, apart)
    tensors = {}
    for name, t in load_file(apart / "model.safetensors").items():
        m = re.fullmatch(r"(.+\.experts)\.(gate_up_proj|down_proj)", name)
        if m is None:
            tensors[name] = t
            continue
        for e in range(t.shape[0]):
            if m[2] == "down_proj":
                tensors[f"{m[1]}.{e}.down_proj.weight"] = t[e].t().contiguous()
            else:
                half = t.shape[2] // 2
                tensors[f"{m[1]}.{e}.gate_proj.weight"] = t[e, :, :half].t().contiguous()
                tensors[f"{m[1]}.{e}.up_proj.weight"] = t[e, :, half:].t().contiguous()
    save_file(tensors, str(apart / "model.safetensors"), metadata={"format": "pt"})
    rtn_gptq(apart, out)
    return out


def _dequantized(src, out):
    """transformers' model of `src` with every GPTQ projection of `out` dequantized into it (the experts' into the
    stacked gate_up_proj and down_proj, transposed)."""
    import re

    from safetensors.torch import load_file

    from quant_helpers import dequantize_v1
    tensors = load_file(out / "model.safetensors")
    hf = build_hf(src)
    state = hf.state_dict()
    with torch.no_grad():
        for name in tensors:
            if not name.endswith(".qweight"):
                continue
            prefix = name.removesuffix(".qweight")
            w = dequantize_v1(tensors, prefix, 4)
            m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)", prefix)
            if m is None:
                state[prefix + ".weight"].copy_(w)
            elif m[3] == "down_proj":
                state[f"{m[1]}.down_proj"][int(m[2])].copy_(w.t())
            else:
                half = w.shape[0]
                start = 0 if m[3] == "gate_proj" else half
                state[f"{m[1]}.gate_up_proj"][int(m[2]), :, start:start + half].copy_(w.t())
    return hf


def build_hf(folder):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def test_a_gptq_checkpoint_made_elsewhere_equals_transformers_dequantized(tmp_path):
    """A GPTQ Llama 4 in GPTQModel's layout (each expert's projections apart, 4-bit): infer's CPU path (its experts
    dequantized at load into the stacks, the attention and dense MLPs int4) gives transformers' greedy tokens of the
    same weights dequantized, varied; warmup --estimate counts the weights as loaded."""
    from helpers import estimated_plan, greedy_each, random_prompts
    from infer import LLM, SamplingParams
    from infer.memory.sizes import weights_bytes
    build(tmp_path / "f", seed=4, intermediate_size_mlp=64)  # (whole groups of 32)
    out = _gptq_checkpoint(tmp_path / "f", tmp_path / "q")
    hf = _dequantized(tmp_path / "f", out)
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    plan = estimated_plan(str(out), "--dtype", "float32")
    with LLM(str(out), block_size=4, dtype="float32") as llm:
        model = llm.engine.runner.model
        assert plan["weights_bytes"] == weights_bytes(model)
        assert model.layers[0].feed_forward.down_proj.qweight is not None and model.layers[1].mlp.method_for
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))]
    assert got == greedy_each(hf, prompts, 8)
    assert len({t for tokens in got for t in tokens}) > 6


def test_the_memory_plan_counts_the_adapter_slots_byte_for_byte(tmp_path):
    """Adapter slots (--max-loras 3 x --max-lora-rank 4) of the attention, the dense MLPs (intermediate_size_mlp wide)
    and the shared experts, none of the experts (refused): what the memory plan and `warmup --estimate`'s formula
    (memory.sizes.lora_slot_bytes) count, byte for byte."""
    from infer import LLM
    from infer.memory.sizes import lora_slot_bytes
    build(tmp_path)
    with LLM(str(tmp_path), enable_lora=True, max_loras=3, max_lora_rank=4, block_size=4) as llm:
        manager, cfg = llm.engine.lora_manager, llm.engine.runner.model.config
        assert not manager.expert_layers
        assert llm.engine.memory_plan.lora_bytes == manager.device_bytes() == lora_slot_bytes(cfg, 3, 4, torch.float32)
