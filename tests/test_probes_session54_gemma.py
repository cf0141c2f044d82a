"""Session 54: the Gemma family (GemmaForCausalLM: Gemma 2B/7B, CodeGemma; Gemma2ForCausalLM), end to end on tiny
random models built from GemmaConfig / Gemma2Config (float32), each against the real thing: greedy tokens and
logprobs equal transformers' (GQA and MHA, tied and untied head, head_dim 256 and head_dim apart from hidden / heads),
Gemma 2's soft-capped attention and logits and its sliding window (the context capped there), the GPU code path
(Triton interpreted) equal to the CPU path, the kernels' Gemma variants (norm by 1 + w, GeGLU, soft-capped attention
in the paged prefill/mixed and decode kernels), GPTQ checkpoints from `infer quantize` and GPTQModel equal to
GPTQModel's own load, peft adapters equal to peft (alone and mixed), lora-validate, serve, warmup, the built-in
tiny-gemma and tiny-gemma2; what infer cannot run refused up front."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import UnsupportedModelError
from infer.models.tiny import BUILTIN_MODELS, ensure_builtin

from helpers import (check_equal_transformers, greedy_each, norms_drawn, random_prompts, save_random_model,
                     served_completion_text)
from lora_helpers import (base_and_adapters, check_lora_validate_ok, check_mixed_adapters_equal_peft,
                          hf_float)
from quant_helpers import (check_int4_kernels_with_mixed_adapters, check_kernel_path_equals_cpu, gptqmodel_greedy,
                           make_gptqmodel_checkpoint, needs_gptqmodel)

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
ARCH = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"}
# Gemma 2 with soft-capping strong enough to change the tokens of these random models (50 and 30 would not)
GEMMA2 = dict(head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
              sliding_window=256)


def build(folder, model_type: str = "gemma", seed: int = 0, **config):
    """A random Gemma / Gemma 2 model folder (float32; norm weights random, not zero) with the tiny-llama tokenizer;
    returns transformers' model (its eager attention: Gemma 2's soft-capping)."""
    return save_random_model(folder, model_type, ARCH[model_type], {**SMALL, **config}, seed, norms_drawn(0.0))


hf_greedy = greedy_each


CONFIGS = {  # model type, config, the context infer caps it at
    "gemma-gqa-head256": ("gemma", dict(), 256),  # GemmaConfig's head_dim 256 with hidden 64 and 4 heads
    "gemma-mha-tied": ("gemma", dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=True), 256),
    "gemma2-gqa": ("gemma2", dict(GEMMA2), 256),
    "gemma2-mha-tied-window": ("gemma2", dict(GEMMA2, num_key_value_heads=4, tie_word_embeddings=True,
                                              sliding_window=16, head_dim=16), 256),  # (prompts past the window)
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    model_type, config, limit = CONFIGS[name]
    hf = build(tmp_path, model_type, **config)
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert llm.engine.max_model_len == limit
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 8, name)


def test_gemma2_softcapping_and_its_scale_change_the_outputs(tmp_path):
    """The checks above mean something: without its attention soft-capping, or with Llama's scale, the same Gemma 2
    model gives other tokens in transformers; without its final soft-capping (monotonic: the same tokens), other
    logprobs."""
    prompts = random_prompts(512, (9, 21), seed=7)
    hf = build(tmp_path / "a", "gemma2", **GEMMA2)
    want = hf_greedy(hf, prompts, 8)
    for i, change in enumerate((dict(attn_logit_softcapping=None), dict(query_pre_attn_scalar=32))):
        assert hf_greedy(build(tmp_path / str(i), "gemma2", **{**GEMMA2, **change}), prompts, 8) != want, change
    uncapped = build(tmp_path / "f", "gemma2", **{**GEMMA2, "final_logit_softcapping": None})
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        assert (hf(ids).logits.log_softmax(-1) - uncapped(ids).logits.log_softmax(-1)).abs().max() > 0.1


@pytest.mark.parametrize("model_type", ["gemma", "gemma2"])
def test_gpu_code_path_interpreted_equals_the_cpu_path(tmp_path, monkeypatch, model_type):
    """Every op through its Triton kernel (interpreted on CPU): the norm by 1 + w, the GeGLU, and for Gemma 2 the
    soft-capped scores in the prefill and decode attention kernels, give the CPU path's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    build(tmp_path, model_type, num_hidden_layers=1, **(GEMMA2 if model_type == "gemma2" else dict(head_dim=32)))
    check_kernel_path_equals_cpu(tmp_path, monkeypatch)


def test_kernels_gemma_variants_equal_the_reference():
    """The Triton kernels (interpreted) of Gemma's ops equal their references, which equal transformers' math:
    rms_norm by 1 + w (with and without a residual), gelu_tanh_and_mul, and paged attention (a prefill, a chunk
    after a context, decodes: the unified and decode kernels) and decode_attention with soft-capped scores."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer.kernels import attention, fused, reference
    g = torch.Generator().manual_seed(0)
    x, w, r = torch.randn(5, 64, generator=g), torch.randn(64, generator=g), torch.randn(5, 64, generator=g)
    h = (x + r).float()
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)
    assert torch.allclose(reference.rms_norm(x, w, 1e-6, r, unit_offset=True)[0], want, atol=1e-6)
    assert torch.allclose(fused.rms_norm(x, w, 1e-6, r, unit_offset=True)[0], want, atol=1e-5)
    assert torch.allclose(fused.rms_norm(x + r, w, 1e-6, unit_offset=True), want, atol=1e-5)
    gu = torch.randn(7, 96, generator=g) * 3
    act = torch.nn.functional.gelu(gu[:, :48], approximate="tanh") * gu[:, 48:]
    assert torch.allclose(reference.gelu_tanh_and_mul(gu), act)
    assert torch.allclose(fused.gelu_tanh_and_mul(gu), act, atol=1e-5)
    hq, hk, d, bs = 4, 2, 32, 4
    kc, vc = torch.randn(32, bs, hk, d, generator=g), torch.randn(32, bs, hk, d, generator=g)
    tables = torch.randperm(32, generator=g)[:24].view(3, 8).int()
    lens, qsl = torch.tensor([13, 7, 20], dtype=torch.int32), torch.tensor([0, 13, 14, 19], dtype=torch.int32)
    q = torch.randn(19, hq, d, generator=g) * 2

    def naive(b, rows, cap):  # transformers' eager attention with softcap, of sequence b's last `rows` queries
        n = int(lens[b])
        k = kc[tables[b].long()].flatten(0, 1)[:n].repeat_interleave(2, 1)
        v = vc[tables[b].long()].flatten(0, 1)[:n].repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", rows, k) * 0.3
        s = torch.tanh(s / cap) * cap
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril()[n - rows.shape[0]:], float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    for kernel in (reference.paged_attention, attention.paged_attention):
        out = kernel(q, kc, vc, tables, lens, qsl, 0.3, 13, softcap=5.0)
        for b in range(3):
            rows = slice(int(qsl[b]), int(qsl[b + 1]))
            assert torch.allclose(out[rows], naive(b, q[rows], 5.0), atol=1e-5), (kernel.__module__, b)
        dec = kernel(q[:3].contiguous(), kc, vc, tables, lens, torch.arange(4, dtype=torch.int32), 0.3, 1,
                     softcap=5.0)
        for b in range(3):
            assert torch.allclose(dec[b:b + 1], naive(b, q[b:b + 1], 5.0), atol=1e-5), (kernel.__module__, b)
    pos = lens.long() - 1
    qq, kk, vv = (torch.randn(3, n * d, generator=g) for n in (hq, hk, hk))
    cos_sin = torch.randn(64, d, generator=g)
    slots = tables[torch.arange(3), pos // bs].long() * bs + pos % bs
    want = reference.decode_attention(pos, qq, kk, vv, cos_sin, d, kc.clone(), vc.clone(), slots, tables, lens,
                                      torch.arange(4, dtype=torch.int32), 0.3, softcap=5.0)
    plain = reference.decode_attention(pos, qq, kk, vv, cos_sin, d, kc.clone(), vc.clone(), slots, tables, lens,
                                       torch.arange(4, dtype=torch.int32), 0.3)
    assert not torch.allclose(want, plain, atol=1e-2)
    for parts in (1, 2):
        got = attention.decode_attention(pos, qq, kk, vv, cos_sin, d, kc.clone(), vc.clone(), slots, tables, lens,
                                         torch.arange(4, dtype=torch.int32), 0.3, softcap=5.0, parts=parts)
        assert torch.allclose(got, want, atol=1e-5), parts


def test_what_infer_cannot_run_is_refused_up_front(tmp_path):
    """Another activation, or bidirectional attention (EmbeddingGemma's), is refused when the config is read,
    naming the field: `infer warmup --estimate` (which never builds the model) too."""
    build(tmp_path / "a", "gemma2", **GEMMA2, hidden_activation="silu")
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'silu' is not supported for gemma2"):
        LLM(str(tmp_path / "a"))
    build(tmp_path / "b", "gemma", head_dim=16, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        LLM(str(tmp_path / "b"))
    res = CliRunner().invoke(app, ["warmup", str(tmp_path / "b"), "--estimate"])
    assert res.exit_code != 0 and "use_bidirectional_attention" in res.output


# ------------------------------------------------------------------------------------------------------- GPTQ
@needs_gptqmodel
def test_infer_quantize_writes_a_gemma_gptq_checkpoint_equal_to_gptqmodels_load(tmp_path):
    build(tmp_path / "f", "gemma", head_dim=32)
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(out), "--group-size", "32",
                                   "--num-samples", "8", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    assert "model.layers.0.mlp.gate_proj.qweight" in load_file(out / "model.safetensors")
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.qweight is not None
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == gptqmodel_greedy(out, prompts, 8)


@needs_gptqmodel
def test_gptqmodel_act_order_asymmetric_gemma2_checkpoint_equals_gptqmodels_load(tmp_path):
    build(tmp_path / "f", "gemma2", seed=1, **GEMMA2)
    path = make_gptqmodel_checkpoint(tmp_path / "f", tmp_path / "q", bits=4, group_size=32, desc_act=True, sym=False,
                                     seq_len=32)
    prompts = random_prompts(512, (4, 11, 23), seed=12)
    with LLM(str(path), block_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == gptqmodel_greedy(path, prompts, 8)


# ------------------------------------------------------------------------------------------------------- LoRA
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=ALL),
            "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module", params=["gemma", "gemma2"])
def gemma_lora(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    build(root / "base", request.param, **(GEMMA2 if request.param == "gemma2" else dict(head_dim=32)))
    return base_and_adapters(root, ADAPTERS)


def test_peft_adapters_equal_peft_alone_and_mixed(gemma_lora):
    base, hf, paths = gemma_lora
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (5, 12, 8), seed=6), ["all8", None, "qv4"])


def test_lora_validate_accepts_a_gemma_adapter(gemma_lora):
    base, _, paths = gemma_lora
    check_lora_validate_ok(base, paths["all8"])


def test_int4_kernel_path_with_mixed_adapters_interpreted_equals_the_cpu_path(gemma_lora, tmp_path, monkeypatch):
    """GPTQ Gemma / Gemma 2 with adapters beside a base-only row, through the Triton kernels (interpreted) and
    emulated decode graphs: the GeGLU applied in the int4 gate_up kernel's epilogue in steps without adapters
    (session 61: GATED 2), the adapters' deltas going to gelu_tanh_and_mul, decode_attention (soft-capped) and the
    norms by 1 + w: the CPU path's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    pytest.importorskip("gptqmodel")
    base, hf, paths = gemma_lora
    if hf.config.model_type != "gemma2":  # (Gemma 2's run covers Gemma's GeGLU and norms, and adds soft-capping)
        pytest.skip("the Gemma 2 run covers it")
    check_int4_kernels_with_mixed_adapters(base, paths, tmp_path, monkeypatch, ["all8", None, "qv4"],
                                           act_in_gate_up=True)


# ---------------------------------------------------------------------------------------------- serve, warmup
def test_serve_completions_on_gemma(gemma_lora):
    from transformers import AutoTokenizer

    base, hf, _ = gemma_lora
    prompt = random_prompts(512, (7,), seed=8)[0]
    assert served_completion_text(base, "gemma", prompt, 5) == \
        AutoTokenizer.from_pretrained(base).decode(hf_greedy(hf, [prompt], 5)[0])


@pytest.mark.parametrize("name", ["tiny-gemma", "tiny-gemma2"])
def test_builtin_tiny_gemma_runs_and_warmup_sizes_it(name):
    """The built-in models equal transformers and write varied tokens; `infer warmup --estimate` counts their
    weights (the norms too) as the loaded engine holds them, and the KV cache at head_dim (not hidden / heads)."""
    path = ensure_builtin(name)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [ARCH[BUILTIN_MODELS[name].arch]] and config["head_dim"] == 32
    res = CliRunner().invoke(app, ["warmup", name, "--estimate", "--json", "--max-length", "256"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    with LLM(name, max_model_len=256) as llm:
        from infer.memory.sizes import kv_bytes_per_token, weights_bytes
        model = llm.engine.runner.model
        assert plan["weights_bytes"] == weights_bytes(model)  # (the rope table included)
        assert kv_bytes_per_token(llm.engine.runner.model.config, torch.float32) == 2 * 2 * 2 * 32 * 4
        hf = hf_float(path)
        prompts = random_prompts(512, (6, 11), seed=1)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))]
    assert got == hf_greedy(hf, prompts, 5)
    assert all(len(set(tokens)) > 2 for tokens in got)  # (tied, its random weights repeated the last token)


def test_gemma2_piecewise_graphs_and_speculative_steps_equal_transformers(tmp_path, monkeypatch):
    """Gemma 2's own piece() (its four norms a layer) through emulated piecewise graphs passes the start's check
    against the whole forward and replays; n-gram speculative steps verify their drafts through the decode batch's
    rows, soft-capped too: both give transformers' tokens."""
    from infer.kernels import reference
    hf = build(tmp_path, "gemma2", **GEMMA2)
    prompts = [random_prompts(512, (9,), seed=13)[0], [5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    want = hf_greedy(hf, prompts, 6)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(str(tmp_path), max_num_seqs=3, max_num_batched_tokens=16, cuda_graph_max_tokens=32, block_size=4,
             num_kv_blocks=64, max_model_len=64) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        assert llm.engine.runner.pieces is not None and llm.engine.runner.pieces_check < 1e-5
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.stats()["piecewise_graph_steps"] > 0
    rows, real = [], reference._rows_attention
    monkeypatch.setattr(reference, "_rows_attention",
                        lambda *a, **kw: rows.append((kw.get("batched"), kw.get("softcap"))) or real(*a, **kw))
    with LLM(str(tmp_path), block_size=4, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert (True, 2.0) in rows  # verify rows in the decode batch, soft-capped


def test_the_cpu_soft_capped_attention_holds_a_bounded_slice_of_scores(monkeypatch):
    """The CPU path's soft-capped attention computes its scores itself (SDPA cannot cap them): a prefill's n x L
    scores of every head whole (and K and V repeated for each query head of a group) outgrew the memory plan's
    per-token activations on a long prompt; the queries now go in row chunks of at most MASK_ELEMENTS scores a
    head, each KV head's group over its keys by broadcasting, with the same result."""
    from infer.kernels import reference
    monkeypatch.setattr(reference, "MASK_ELEMENTS", 4096)
    g = torch.Generator().manual_seed(1)
    n, hq, hk, d = 300, 4, 2, 16
    q, k, v = torch.randn(n, hq, d, generator=g), torch.randn(n, hk, d, generator=g), torch.randn(n, hk, d, generator=g)
    seen, tanh = [], torch.tanh
    monkeypatch.setattr(torch, "tanh", lambda x, *a, **kw: seen.append(x.numel()) or tanh(x, *a, **kw))
    got = reference._attend(q, k, v, 0.25, 0, softcap=3.0)
    monkeypatch.setattr(torch, "tanh", tanh)
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, 1)) * 0.25
    s = (torch.tanh(s / 3.0) * 3.0).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    assert torch.allclose(got, torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(2, 1)), atol=1e-5)
    assert len(seen) > 1 and max(seen) <= 4096 * hq
