"""Session 62 (gaps): EAGLE-3 targets of the families vLLM taps (Ministral 3, InternLM3, Hunyuan dense), their
drafts equal to an independent reference over transformers' hidden states and greedy output equal to the target's
alone; the families no EAGLE head is trained for refused by name. `infer quantize` of a Mistral 3 (GPTQModel 7.6's
definition given the hub's tensor names), equal to GPTQModel's own load."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM
from infer.errors import InferError

from helpers import greedy_tokens, random_prompts
from quant_helpers import gptqmodel_greedy, infer_quantize, needs_gptqmodel
from test_probes_session56_eagle import VOCAB, check_eagle_heads_drive, greedy, save_eagle3, spec
from test_probes_session61_famb import ALPHA, DYNAMIC
from test_probes_session61_mm import MINISTRAL3_ROPE

# (model_type, the checkpoints' architecture, its settings): the EAGLE-3 targets added in session 62, in their
# checkpoints' rope (Ministral 3's yarn and query scaling by position, InternLM3's dynamic NTK, Hunyuan's alpha)
EAGLE_TARGETS = {
    "ministral3": ("Ministral3ForCausalLM", dict(rope_parameters=MINISTRAL3_ROPE)),
    "internlm3": ("InternLM3ForCausalLM", dict(rope_parameters=DYNAMIC, qkv_bias=True, bias=True)),
    "hunyuan_v1_dense": ("HunYuanDenseV1ForCausalLM", dict(rope_parameters=ALPHA, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("model_type", sorted(EAGLE_TARGETS))
def test_eagle_drafts_equal_the_reference_and_greedy_equals_the_target_alone(tmp_path, monkeypatch, model_type):
    """An EAGLE-3 head reading the residual stream entering layers (5, 1, 6), and an EAGLE-1 head: every draft
    equals the reference's over transformers' hidden states, greedy tokens equal the target's without a head."""
    arch, config = EAGLE_TARGETS[model_type]
    check_eagle_heads_drive(tmp_path, monkeypatch, model_type, arch, config, aux_ids=(5, 1, 6))


def test_a_ministral3_multimodal_checkpoint_is_an_eagle3_target(tmp_path):
    """Mistral3ForConditionalGeneration with a ministral3 language model (Ministral-3-3B/8B/14B): its text model
    drives the head; greedy tokens equal its own."""
    save_eagle3(tmp_path / "h", seed=4, aux_ids=(0, 1, 1))
    prompts = random_prompts(VOCAB, (7, 12), seed=5)
    with LLM("tiny-ministral3", block_size=4) as plain:
        want = [o.token_ids for o in plain.generate(prompts, greedy(8))]
    with LLM("tiny-ministral3", block_size=4, speculative_config=spec(tmp_path / "h")) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy(8))] == want
        assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("name, model_type", [("tiny-gemma3", "gemma3_text"), ("tiny-arcee", "arcee"),
                                              ("tiny-granite-swa", "granite_swa"), ("tiny-cohere", "cohere")])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_families_without_eagle_heads_are_refused_naming_the_targets(tmp_path, name, model_type, method):
    h = tmp_path / "h"
    save_eagle3(h, aux_ids=(0, 1, 1))
    if method == "eagle":  # (an EAGLE-1 head's config: a Llama of one layer)
        cfg = json.loads((h / "config.json").read_text())
        (h / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(InferError) as e:
        LLM(name, speculative_config={**spec(h), "method": method})
    msg = str(e.value)
    assert "needs a target of the Llama family" in msg and f"not model_type {model_type!r}" in msg
    assert all(t in msg for t in ("ministral3", "internlm3", "hunyuan_v1_dense")) and "n-gram" in e.value.hint


# ------------------------------------------------------------------------------------------ Mistral 3 quantized
@needs_gptqmodel
@pytest.mark.parametrize("name", ["tiny-ministral3", "tiny-mistral3"])
def test_infer_quantize_of_a_mistral3_equals_gptqmodels_load(tmp_path, name):
    """GPTQModel 7.6 failed on a Mistral3ForConditionalGeneration (its definition maps none of the hub's tensor names,
    language_model.model.*: the embedding stayed on the meta device, "Tensor.item() cannot be called on meta
    tensors"); `infer quantize` gives it the names: the language model's layers quantized, the Pixtral tower and the
    projector kept in float, and infer's greedy tokens equal GPTQModel's own load's."""
    from safetensors.torch import load_file

    from infer.models.tiny import ensure_builtin
    out = infer_quantize(name, tmp_path / "q")
    tensors, source = load_file(out / "model.safetensors"), load_file(ensure_builtin(name) / "model.safetensors")
    assert "model.language_model.layers.1.mlp.down_proj.qweight" in tensors
    kept = [k for k in source if k.startswith(("vision_tower.", "multi_modal_projector."))]
    # (rounded to the checkpoint's dtype: GPTQModel's bfloat16 on a CPU for a float32 source)
    assert kept and all(torch.equal(tensors["model." + k], source[k].to(tensors["model." + k].dtype)) for k in kept)
    prompts = random_prompts(VOCAB, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.qweight is not None
        got = greedy_tokens(llm, prompts, 8)
    assert got == gptqmodel_greedy(out, prompts, 8)


# ------------------------------------------------------------------------------------------ bf16 rotary rounding
def _transformers_rotated(model_type: str, q: torch.Tensor, positions: torch.Tensor, heads: int, d: int):
    """q [T, heads * d] rotated by transformers' own rotary module and apply_rotary_pos_emb of `model_type`, in q's
    dtype as its attention rotates it."""
    import importlib

    from transformers import AutoConfig
    cfg = AutoConfig.for_model(model_type, hidden_size=heads * d, num_attention_heads=heads, head_dim=d,
                               num_key_value_heads=heads, rope_theta=10000.0)
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding"))(cfg)
    cos, sin = rotary(q, positions[None])
    x = q.view(1, -1, heads, d).transpose(1, 2)
    return mod.apply_rotary_pos_emb(x, x, cos, sin)[0].transpose(1, 2).reshape(q.shape), cfg


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "hunyuan_v1_dense", "olmo2", "ernie4_5"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_cpu_rotary_rounds_as_transformers_in_bf16_and_is_unchanged_otherwise(model_type, dtype):
    """A bfloat16 model's rotary on a CPU equals transformers' bit for bit: cos and sin cast to bfloat16 and each
    product and sum rounded where the family rotates in bfloat16 (Llama's, Qwen3's, Hunyuan's), float32 rounded once
    where it rotates in float32 (OLMo 2's, ERNIE 4.5's: their rotary keeps float32). float16 and float32 models keep
    the float32 table and its one rounding (their greedy tokens as before)."""
    from infer.kernels import reference
    from infer.models.rope import build_cos_sin_cache
    heads, d, positions = 2, 32, torch.tensor([0, 1, 7, 100, 513, 2047, 4000])
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(len(positions), heads * d, generator=g) * 3).to(dtype)
    want, cfg = _transformers_rotated(model_type, q, positions, heads, d)
    table = build_cos_sin_cache(cfg, 4096, None, dtype)
    assert table.dtype == (torch.bfloat16 if dtype == torch.bfloat16 and model_type not in ("olmo2", "ernie4_5")
                           else torch.float32)
    got = reference.rotary_embedding(positions, q, q.clone(), table, d)[0]
    float32_once = reference.rotary_embedding(positions, q, q.clone(), build_cos_sin_cache(cfg, 4096), d)[0]
    if dtype == torch.bfloat16:
        if model_type != "ernie4_5":  # (ERNIE's pairs interleave: infer rotates its deinterleaved weights' halves)
            assert torch.equal(got, want)
        assert torch.equal(got, float32_once) == (table.dtype == torch.float32)  # (the rounding tells them apart)
    else:
        assert torch.equal(got, float32_once)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-phi4", "tiny-mixtral", "tiny-hunyuan", "tiny-ministral3"])
def test_bf16_greedy_tokens_equal_transformers_where_the_rotary_was_the_difference(name):
    """bfloat16 on a CPU, against transformers' bfloat16 model (its default sdpa attention): these tiny models
    differed (the rotary rounded once in float32) and now give transformers' greedy tokens."""
    from helpers import _auto_class, greedy_each

    from infer.models.tiny import ensure_builtin
    path = ensure_builtin(name)
    hf = _auto_class(json.loads((path / "config.json").read_text())).from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    hf.generation_config.eos_token_id = None
    prompts = random_prompts(VOCAB, (5, 17, 33, 50), seed=3)
    with LLM(str(path), dtype="bfloat16", block_size=16) as llm:
        assert greedy_tokens(llm, prompts, 24) == greedy_each(hf, prompts, 24)


# ------------------------------------------------------------------------- calibration with a processor's template
@pytest.mark.parametrize("processor_only", [True, False])
def test_quantize_calibrates_chats_with_the_processors_template(tmp_path, monkeypatch, processor_only):
    """A multimodal folder whose chat template sits only in its processor's chat_template.json (the tokenizer reads
    none): `infer quantize` renders the calibration chats with it, as the engine serves them (not as the plain
    'role: content' lines of a model without a template); a tokenizer's own template still wins over it."""
    import shutil

    from transformers import AutoTokenizer

    import infer.quant.quantize as quantize
    from infer.errors import InferError
    from infer.models.tiny import ensure_builtin
    src = tmp_path / "src"
    shutil.copytree(ensure_builtin("tiny-gemma3-mm"), src)
    own = (src / "chat_template.jinja").read_text()
    if processor_only:
        (src / "chat_template.jinja").unlink()
    (src / "chat_template.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"}))
    chat = [{"role": "user", "content": "how tall is the tower"}, {"role": "assistant", "content": "three metres"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"messages": chat}) for _ in range(20)) + "\n")
    seen = []

    def run(src_, out, opts, calib, *rest):
        seen.append(calib.samples)
        raise InferError("stopped after calibration", "(the test's)")
    monkeypatch.setattr(quantize, "_run_gptqmodel", run)
    with pytest.raises(InferError, match="stopped after calibration"):
        quantize.quantize_model(src, tmp_path / "q", quantize.QuantizeOptions(group_size=32, num_samples=2, seq_len=32),
                                calibration=tmp_path / "c.jsonl")
    tok = AutoTokenizer.from_pretrained(src)
    text = tok.decode(seen[0][0]["input_ids"])
    if processor_only:
        assert text.startswith("<<user>>how tall is the tower\n<<assistant>>three")
    else:
        tok.chat_template = own
        assert text.startswith(tok.apply_chat_template(chat, tokenize=False)) and "<<user>>" not in text
