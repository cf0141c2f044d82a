"""Session 55: partial rotary embeddings (Phi-3's partial_rotary_factor < 1: Phi-4-mini's 0.75, tied embeddings).
transformers' Phi3 rotates the first int(head_dim * factor) dims of each q and k head (rotate_half pairs i with
i + rotary_dim / 2 within them) and passes the rest; infer's rope table is that wide and every rotary path (the CPU
reference, the Triton rotary_store_kv and decode_attention, CUDA graphs and pieces) rotates the table's width. On
tiny random Phi-3 models (float32), each against the real thing: greedy tokens and logprobs equal transformers'
(batched prompts; factors 0.75, 0.5 with head_dim 32, an odd rotary dim; longrope with short factors of rotary_dim / 2
values), the GPU code path (Triton interpreted), speculative decoding and beam search, `infer quantize` equal to
GPTQModel's load, a peft adapter equal to peft, warmup's count of the rope table, the built-in tiny-phi4. Llama-family
models ignore the field as transformers does (their default rope rotates the whole head)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.models.rope import build_cos_sin_cache, rope_table_bytes

from helpers import random_prompts
from lora_helpers import PeftOracle, hf_float, save_adapter
from quant_helpers import int4_kernel_path, needs_gptqmodel, split_gate_up
from test_probes_session53_phi3 import _check_gptq, build, hf_greedy
from test_triton_kernels import check_decode_attention, ops  # noqa: F401
from test_triton_kernels import \
    test_rotary_store_kv_writes_the_rotated_k_and_v_into_their_slots as rotary_store_kv_check


def longrope(half: int) -> dict:
    """Phi-4-mini's rope: longrope whose factors have rotary_dim / 2 values (not head_dim / 2)."""
    return dict(original_max_position_embeddings=64, rope_scaling={
        "type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.5 * i for i in range(half)]})


CONFIGS = {  # config, the rope table's width (rotary dims), the context infer caps it at
    "phi4-mini-0.75-tied": (dict(partial_rotary_factor=0.75, tie_word_embeddings=True), 12, 256),
    "0.5-head32-mha": (dict(partial_rotary_factor=0.5, hidden_size=128, num_key_value_heads=4), 16, 256),
    "0.7-odd-dims": (dict(partial_rotary_factor=0.7), 12, 256),  # int(16 * 0.7) = 11: 6 frequencies over 11
    "0.75-longrope-tied": (dict(partial_rotary_factor=0.75, tie_word_embeddings=True, **longrope(6)), 12, 64),
}


def hf_logprobs(hf, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    return [float(logits[i, t]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
    config, width, limit = CONFIGS[name]
    hf = build(tmp_path, **config)
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert llm.engine.max_model_len == limit
        model = llm.engine.runner.model
        assert model.cos_sin.shape[-1] == width and model.layers[0].self_attn.rot_dim == width
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=1))
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, 8), name
    for p, o in zip(prompts, outs):
        want = hf_logprobs(hf, p, o.token_ids)
        assert max(abs(lp["logprob"] - w) for lp, w in zip(o.logprobs, want)) < 1e-4, name


@pytest.mark.parametrize("config", [dict(partial_rotary_factor=0.625), dict(partial_rotary_factor=0.75, **longrope(6))])
def test_the_gpu_path_interpreted_equals_transformers(tmp_path, monkeypatch, config):
    """Every op through its Triton kernel (interpreted on CPU): prefill chunks through rotary_store_kv (pieces), decode
    steps through decode_attention in emulated CUDA graphs; 0.625: 5 frequencies (a rotary half that is no power of
    2) and 6 dims passed."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    hf = build(tmp_path, num_hidden_layers=1, **config)
    prompts = random_prompts(512, (5, 14), seed=4)
    want = hf_greedy(hf, prompts, 6)
    int4_kernel_path(monkeypatch)
    with LLM(str(tmp_path), block_size=4, max_model_len=32, max_num_batched_tokens=8, max_num_seqs=2,
             cuda_graph_max_tokens=4) as llm:
        llm.engine.runner.capture_graphs(32, emulate=True)
        assert llm.engine.runner.pieces is not None  # prefill chunks of up to 4 tokens: piecewise graphs
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert [o.token_ids for o in outs] == want
        assert sum(llm.engine.runner.graphs.replays.values()) > 0


def test_speculative_decoding_and_beam_search_rotate_part_of_each_head(tmp_path):
    """n-gram speculative decoding (its verify rows: several queries of a sequence in one step) gives transformers'
    greedy tokens; beam search's best beam starts with the greedy token."""
    from infer import BeamSearchParams
    hf = build(tmp_path, partial_rotary_factor=0.75, tie_word_embeddings=True)
    p = random_prompts(512, (12, 20), seed=5)
    prompts = [p[0] + p[0], p[1] + p[1][:10]]  # repeats for the n-gram drafter
    want = hf_greedy(hf, prompts, 12)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    with LLM(str(tmp_path), block_size=4, speculative_config=spec) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert [o.token_ids for o in outs] == want
        beams = llm.beam_search([prompts[1]], BeamSearchParams(beam_width=2, max_tokens=6))
        assert len(beams[0].sequences[0].tokens) == len(prompts[1]) + 6


@pytest.mark.parametrize("config", [CONFIGS["phi4-mini-0.75-tied"][0], CONFIGS["0.75-longrope-tied"][0],
                                    CONFIGS["0.5-head32-mha"][0]])
def test_warmup_counts_the_rope_table_of_the_rotary_dims(tmp_path, config):
    """The rope table is [positions, rotary dims], not [positions, head_dim]: warmup's weights count it as the
    engine builds it."""
    build(tmp_path, **config)
    with LLM(str(tmp_path), block_size=4) as llm:
        cfg, table = llm.engine.model_config, llm.engine.runner.model.cos_sin
        assert rope_table_bytes(cfg, table.shape[0]) == table.numel() * table.element_size()
    assert rope_table_bytes(cfg, 100) == build_cos_sin_cache(cfg, 100).nbytes
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json", "--max-length", "64"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["weights_bytes"] > 0


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_a_llama_family_default_rope_ignores_the_factor_as_transformers_does(tmp_path, model_type):
    """transformers' Llama and Qwen2 compute their default rope over the whole head whatever partial_rotary_factor
    says (compute_default_rope_parameters reads head_dim alone), and rotate whole heads: so does infer (a scaled
    rope with the factor is refused: test_model_variants). The factor is written into config.json afterwards, and
    the oracle is the model without it (transformers' own init of the buffers of such a model can fail)."""
    from test_model_variants import build as build_family
    hf = build_family(tmp_path, model_type)
    hf.generation_config.eos_token_id = None
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = random_prompts(512, (6, 11), seed=2)
    with LLM(str(tmp_path), block_size=4) as llm:
        model = llm.engine.runner.model
        assert model.cos_sin.shape[-1] == model.layers[0].self_attn.head_dim
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, 6)


def test_peft_adapter_on_a_partial_rotary_model_equals_peft(tmp_path):
    build(tmp_path / "base", partial_rotary_factor=0.75, tie_word_embeddings=True)
    hf = hf_float(tmp_path / "base")
    path = save_adapter(hf, tmp_path / "a", seed=1, lora_dropout=0.0, r=8, lora_alpha=16,
                        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    oracle = PeftOracle(hf, {"a": path})
    try:
        prompts = random_prompts(512, (5, 12), seed=6)
        with LLM(str(tmp_path / "base"), loras={"a": str(path)}, max_loras=1, max_lora_rank=8, block_size=4) as llm:
            got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True),
                                                     lora=["a", None])]
        assert got == [oracle.greedy("a", prompts[0], 6), oracle.greedy(None, prompts[1], 6)]
    finally:
        oracle.close()


@needs_gptqmodel
def test_infer_quantize_of_a_partial_rotary_model_equals_gptqmodels_load(tmp_path):
    build(tmp_path / "f", partial_rotary_factor=0.75, tie_word_embeddings=True)
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "f"), "-o", str(out), "--group-size", "32",
                                   "--num-samples", "8", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    _check_gptq(out, split_gate_up(out, tmp_path / "split"))


def test_builtin_tiny_phi4_rotates_three_quarters_of_each_head_as_transformers():
    """tiny-phi4: Phi-4-mini's rope (partial_rotary_factor 0.75, longrope's short factors) and tied head; its
    tokens transformers', warmup's count of it the engine's rope table."""
    from infer.models.tiny import ensure_builtin
    path = ensure_builtin("tiny-phi4")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Phi3ForCausalLM"] and cfg["tie_word_embeddings"]
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.75
    hf = hf_float(path)
    prompts = random_prompts(512, (6, 17), seed=1)
    with LLM("tiny-phi4", block_size=4) as llm:
        assert llm.engine.max_model_len == 4096 and llm.engine.runner.model.cos_sin.shape == (4096, 12)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, 6)
    res = CliRunner().invoke(app, ["warmup", "tiny-phi4", "--estimate", "--json", "--max-length", "256"])
    assert res.exit_code == 0, res.output


def test_the_gpu_path_over_a_float8_cache_equals_the_cpu_path():
    """tiny-phi4 over an fp8 KV cache: rotary_store_kv and decode_attention write the passed dims (the last quarter
    of each key head) through the float8 rounding as the rotated ones; every op through its Triton kernel
    (interpreted) gives the CPU path's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels")
    from infer import kernels
    prompts = random_prompts(512, (5, 11), seed=3)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    kw = dict(block_size=4, max_num_seqs=2, max_model_len=32, kv_cache_dtype="fp8_e5m2")
    with LLM("tiny-phi4", **kw) as llm:
        cpu = [o.token_ids for o in llm.generate(prompts, params)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "use_triton", lambda t: True)
        with LLM("tiny-phi4", cuda_graph_max_tokens=8, **kw) as llm:
            llm.engine.runner.capture_graphs(32, emulate=True)
            assert [o.token_ids for o in llm.generate(prompts, params)] == cpu
            assert sum(llm.engine.runner.graphs.replays.values()) > 0


def test_a_factor_of_0_rotates_nothing_in_every_kernel_as_transformers(tmp_path, ops, gen):
    """partial_rotary_factor 0: transformers' Phi-3 rotates no dim (its cos and sin of width 0), and neither do the
    rope table ([positions, 0]), the reference, rotary_store_kv (its rotary block was arange(0, 0), which Triton
    refuses) and decode_attention: tokens transformers'."""
    rotary_store_kv_check(ops, gen, torch.float32, 16, 0, 4)
    check_decode_attention(ops, gen, [9, 1, 4, 5], 4, 4, 2, 16, 0)
    hf = build(tmp_path, partial_rotary_factor=0.0, num_hidden_layers=1)
    prompts = random_prompts(512, (5, 9), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert llm.engine.runner.model.cos_sin.shape == (256, 0)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, 4)


def test_phi4_minis_rope_table_equals_transformers_rotary_embedding():
    """Phi-4-mini's config (head_dim 128, 96 of them rotated: longrope with 48 short and long factors,
    original_max_position_embeddings 4096 of 131072, the factors' attention scale): infer's table is transformers'
    cos | sin (its first 48 columns each: rotate_half's two halves repeat them) at every position up to the context
    cap, 4096, where transformers rotates with the short factors."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from infer.models.limits import context_limit
    g = torch.Generator().manual_seed(0)
    cfg = AutoConfig.for_model(
        "phi3", hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192,
        num_hidden_layers=32, vocab_size=200064, max_position_embeddings=131072, partial_rotary_factor=0.75,
        original_max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": (1 + torch.rand(48, generator=g)).tolist(),
                      "long_factor": (1 + 40 * torch.rand(48, generator=g)).tolist()})
    assert context_limit(cfg)[0] == 4096
    table = build_cos_sin_cache(cfg, 4096)
    assert table.shape == (4096, 96) and rope_table_bytes(cfg, 4096) == table.nbytes
    positions = torch.arange(4096)[None]
    cos, sin = Phi3RotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions)
    assert cos.shape[-1] == 96 and torch.equal(cos[0, :, :48], cos[0, :, 48:])
    torch.testing.assert_close(table, torch.cat([cos[0, :, :48], sin[0, :, :48]], dim=-1), rtol=0, atol=1e-6)
    assert abs(float(table[0, 0]) - (1 + math.log(32) / math.log(4096)) ** 0.5) < 1e-6  # the attention scale
