"""Session 61 (mm): the text model of multimodal checkpoints, as vLLM serves them with images disabled: Gemma 3's
(Gemma3ForConditionalGeneration: Gemma-3-4B/12B/27B, MedGemma) and Mistral 3's (Mistral3ForConditionalGeneration:
Mistral Small 3.1/3.2). config.json's text_config is the model's; the weights are read under the language model's
prefix (the hub's language_model.model.*, which transformers 5.25's save_pretrained writes, and transformers 5's
model.language_model.*), the vision tower's and the projector's skipped; tiny random models (a tiny vision tower)
saved by transformers, against the real thing: greedy tokens and logprobs equal its ...ForConditionalGeneration's
(float32); peft adapters trained on the multimodal model equal peft's mixed in one batch (those of the vision tower
refused naming it); warmup --estimate counts the language model's bytes; chat with text parts, an image part refused
naming it (a 400 from serve); the built-in tiny-gemma3-mm and tiny-mistral3."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app
from infer.errors import ModelLoadError, UnsupportedModelError

from helpers import (check_builtin_runs_and_warmup_sizes_it, check_greedy_and_logprobs_equal_transformers,
                     norms_drawn, random_prompts, save_random_model)
from quant_helpers import needs_gptqmodel

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
PIXTRAL = dict(SIGLIP, head_dim=16)
SL, FULL = "sliding_attention", "full_attention"


def build_gemma3(folder, tie: bool = False, **text):
    """A random Gemma3ForConditionalGeneration (norm weights drawn off their init), a sliding layer (a window of 8:
    prompts pass it) and a full one; transformers' model of it."""
    text = {**TEXT, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8, "layer_types": [SL, FULL],
            "tie_word_embeddings": tie, **text}
    return save_random_model(folder, "gemma3", "Gemma3ForConditionalGeneration",
                             dict(text_config=text, vision_config=SIGLIP, mm_tokens_per_image=4,
                                  tie_word_embeddings=tie), perturb=norms_drawn(0.0))


def build_mistral3(folder, **text):
    """A random Mistral3ForConditionalGeneration (a Mistral language model, a Pixtral vision tower)."""
    return save_random_model(folder, "mistral3", "Mistral3ForConditionalGeneration",
                             dict(text_config={**TEXT, "model_type": "mistral", "head_dim": 16, **text},
                                  vision_config=PIXTRAL, image_token_index=511, tie_word_embeddings=False),
                             perturb=norms_drawn(1.0))


def relayout(folder, rename) -> None:
    """The folder's weights renamed by rename(name) (None: dropped)."""
    tensors = load_file(folder / "model.safetensors")
    save_file({rename(k): v for k, v in tensors.items() if rename(k) is not None}, folder / "model.safetensors",
              metadata={"format": "pt"})


def to_transformers5_layout(name: str) -> str:
    """The hub's layout (language_model.model.*, vision_tower.*) as transformers 5's modules name it
    (model.language_model.*, model.vision_tower.*; lm_head.weight at the top)."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return name if name.startswith("lm_head.") else "model." + name


def is_text_model(model) -> bool:
    """infer's model holds no vision tower or projector parameter."""
    return not any("vision" in n or "projector" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_gemma3_multimodal_text_model_equals_transformers(tmp_path, tie):
    """A Gemma3ForConditionalGeneration as transformers 5.25 saves it (language_model.model.*, vision_tower.*,
    multi_modal_projector.*): greedy tokens and logprobs of text prompts equal its generate's (float32), its tied
    head (as the hub's Gemma 3) and an untied one."""
    hf = build_gemma3(tmp_path, tie=tie)
    names = load_file(tmp_path / "model.safetensors").keys()
    assert any(n.startswith("language_model.model.") for n in names) and any(n.startswith("vision_tower.")
                                                                             for n in names)
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, f"gemma3-mm-{tie}", lambda m: is_text_model(m))


def test_gemma3_multimodal_transformers5_layout_equals_transformers(tmp_path):
    """The same weights in transformers 5's own names (model.language_model.*, model.vision_tower.*, lm_head at the
    top), which its conversion reads too: infer's tokens equal transformers' load of that folder."""
    from helpers import hf_model
    build_gemma3(tmp_path, num_hidden_layers=3, layer_types=[SL, SL, FULL])
    relayout(tmp_path, to_transformers5_layout)
    assert "model.language_model.embed_tokens.weight" in load_file(tmp_path / "model.safetensors")
    hf = hf_model(str(tmp_path))
    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, "gemma3-mm-t5", is_text_model)


def test_vision_tensors_are_never_read(tmp_path):
    """The vision tower's and the projector's tensors are skipped unread: NaN there (which a load refuses in any
    tensor it reads) or one dropped changes nothing; the same tensor names in a text model's checkpoint are still
    refused as tensors config.json has no place for."""
    build_gemma3(tmp_path / "mm")
    dropped = []

    def spoil(name):
        if name.startswith("multi_modal_projector."):
            dropped.append(name)
            return None
        return name
    tensors = {k: (torch.full_like(v, float("nan")) if k.startswith("vision_tower.") else v)
               for k, v in load_file(tmp_path / "mm" / "model.safetensors").items()}
    save_file(tensors, tmp_path / "mm" / "model.safetensors", metadata={"format": "pt"})
    relayout(tmp_path / "mm", spoil)
    assert dropped
    prompts = random_prompts(512, (7,), seed=2)
    with LLM(str(tmp_path / "mm")) as llm:
        assert len(llm.generate(prompts)[0].token_ids) > 0
    save_random_model(tmp_path / "llama", "llama", "LlamaForCausalLM", TEXT)
    tensors = load_file(tmp_path / "llama" / "model.safetensors")
    tensors["vision_tower.embeddings.patch_embedding.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "llama" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="vision_tower.embeddings.patch_embedding.weight"):
        LLM(str(tmp_path / "llama"))


def test_text_config_of_another_language_model_is_refused(tmp_path):
    """A Mistral3ForConditionalGeneration whose text_config is a language model infer does not run (here a Qwen2)
    is refused naming text_config's model_type and what infer serves."""
    from transformers import Mistral3Config
    cfg = Mistral3Config(text_config=dict(model_type="qwen2", **TEXT), vision_config=dict(PIXTRAL,
                                                                                        model_type="pixtral"))
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="text_config has model_type 'qwen2'") as e:
        LLM(str(tmp_path))
    assert "MistralForCausalLM" in e.value.hint


# peft's target_modules for a multimodal model's language model alone (the vision tower has q_proj ... too)
LM_ALL = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
MM_ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=LM_ALL),
               "qv4": dict(r=4, lora_alpha=4, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)")}


@pytest.fixture(scope="module")
def gemma3_adapters(tmp_path_factory):
    """A Gemma3ForConditionalGeneration (transformers' model of it) and MM_ADAPTERS trained on it by peft: (base
    folder, transformers' model, {name: adapter})."""
    from lora_helpers import save_adapters
    root = tmp_path_factory.mktemp("g3lora")
    hf = build_gemma3(root / "base").eval()
    return root / "base", hf, save_adapters(hf, root, MM_ADAPTERS)


def test_adapters_of_the_multimodal_model_equal_peft_mixed(gemma3_adapters):
    """peft adapters trained on the multimodal model (their modules under model.language_model) served mixed in one
    batch (and each alone) give peft's tokens; `infer lora-validate` says they fit."""
    from lora_helpers import check_lora_validate_ok, check_mixed_adapters_equal_peft
    base, hf, paths = gemma3_adapters
    names = load_file(paths["all8"] / "adapter_model.safetensors")
    assert all(".language_model.layers." in n for n in names)
    prompts = random_prompts(512, (6, 11, 17), seed=7)
    check_mixed_adapters_equal_peft(base, hf, paths, prompts, ["all8", None, "qv4"])
    check_lora_validate_ok(base, paths["qv4"])


def test_adapters_of_the_vision_tower_or_another_base_are_refused(gemma3_adapters, tmp_path):
    """An adapter whose target_modules reach the vision tower (q_proj, v_proj: the tower has them too) is refused
    naming the tower; one of the multimodal model's language model on its text model's checkpoint, and one of a text
    model on the multimodal checkpoint, are refused (peft would load neither)."""
    from lora_helpers import save_adapter
    from infer.errors import LoRAError
    base, hf, paths = gemma3_adapters
    both = save_adapter(hf, tmp_path / "both", seed=5, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    assert any("vision_tower" in n for n in load_file(both / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match=r"vision_tower\..*vision tower or projector, which infer never loads"):
        LLM(str(base), loras={"both": str(both)})
    res = CliRunner().invoke(app, ["lora-validate", str(base), str(both)])
    assert res.exit_code != 0 and "vision tower" in res.output
    text = save_random_model(tmp_path / "text", "gemma3_text", "Gemma3ForCausalLM",
                             {**TEXT, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8,
                              "layer_types": [SL, FULL]})
    with pytest.raises(LoRAError, match="a multimodal model's language model, but the base is a text model"):
        LLM(str(tmp_path / "text"), loras={"all8": str(paths["all8"])})
    plain = save_adapter(text, tmp_path / "plain", seed=6, r=4, lora_alpha=4, target_modules=["q_proj"])
    with pytest.raises(LoRAError, match="a text model's module, but the base is a multimodal "
                                        "Gemma3ForConditionalGeneration"):
        LLM(str(base), loras={"plain": str(plain)})


GEMMA_PARTS_TEMPLATE = (  # Gemma 3's chat template's shape: content parts looped over, an image part a marker
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
    "{% endif %}")


def test_chat_with_text_parts_and_an_image_part_refused(tmp_path):
    """The multimodal folder's chat template (one that renders image parts; its processor's chat_template.json, which
    the tokenizer does not read, as the hub's Gemma 3 and Mistral 3 folders have it) renders text parts; a message
    with an image part (image_url, or input_audio) is refused naming it: by LLM.chat, and by serve's
    /v1/chat/completions with a 400."""
    import shutil

    import httpx

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.errors import RequestError
    from infer.models.tiny import ensure_builtin
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    folder = tmp_path / "mm"
    shutil.copytree(ensure_builtin("tiny-gemma3-mm"), folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": GEMMA_PARTS_TEMPLATE}))
    text = [{"role": "user", "content": [{"type": "text", "text": "the cat"}]}]
    image = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]
    with LLM(str(folder), max_num_seqs=2) as llm:
        from infer import SamplingParams
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        [out] = llm.chat(text, params)
        assert out.prompt_token_ids == llm.get_tokenizer()("<start_of_turn>user\nthe cat<end_of_turn>\n"
                                                           "<start_of_turn>model\n")["input_ids"]
        for msgs, kind in ((image, "image_url"), (audio, "input_audio")):
            with pytest.raises(RequestError, match=f"messages\\[0\\].content has {kind} parts"):
                llm.chat(msgs, params)
    engine = LLMEngine(EngineConfig(str(folder), block_size=4, max_num_seqs=2))
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=4), "mm")) as url:
        ok = httpx.post(f"{url}/v1/chat/completions", json={"model": "mm", "messages": text, "max_tokens": 3},
                        timeout=120)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        bad = httpx.post(f"{url}/v1/chat/completions", json={"model": "mm", "messages": image, "max_tokens": 3},
                         timeout=120)
        assert bad.status_code == 400 and "image_url" in bad.json()["error"]["message"]


@pytest.mark.parametrize("name,arch", [("tiny-gemma3-mm", "Gemma3ForConditionalGeneration"),
                                       ("tiny-mistral3", "Mistral3ForConditionalGeneration"),
                                       ("tiny-ministral3", "Mistral3ForConditionalGeneration")])
def test_builtin_multimodal_models_and_warmup_counts_the_language_model(name, arch):
    """The built-in tiny-gemma3-mm, tiny-mistral3 and tiny-ministral3 (a tiny vision tower in the folder) equal
    transformers' ...ForConditionalGeneration and write varied tokens; `infer warmup --estimate` counts the language
    model's weights alone, as the loaded engine holds them (not the vision tower's or the projector's)."""
    check_builtin_runs_and_warmup_sizes_it(name, arch, False)


def test_mistral3_text_model_equals_transformers(tmp_path):
    """A Mistral3ForConditionalGeneration (Mistral Small 3.1/3.2's: a Mistral language model, a Pixtral vision
    tower), in the layout transformers saves and in transformers 5's own: greedy tokens and logprobs equal its
    generate's (float32)."""
    from helpers import hf_model
    hf = build_mistral3(tmp_path / "a")
    check_greedy_and_logprobs_equal_transformers(tmp_path / "a", hf, "mistral3", is_text_model)
    import shutil
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    relayout(tmp_path / "b", to_transformers5_layout)
    check_greedy_and_logprobs_equal_transformers(tmp_path / "b", hf_model(str(tmp_path / "b")), "mistral3-t5",
                                                 is_text_model)


@needs_gptqmodel
def test_infer_quantize_equals_gptqmodel_and_convert_keeps_the_layout(tmp_path):
    """`infer quantize` of tiny-gemma3-mm: GPTQModel 7.6 quantizes the language model's layers and writes the
    checkpoint in transformers 5's layout (model.language_model.*), the vision tower left in float; infer runs it
    with int4 weights and gives GPTQModel's own load's greedy tokens; `warmup --estimate` sizes it as loaded;
    `infer convert` keeps the multimodal layout (its architecture and vision tower: vLLM and transformers take it
    as they took the source) and gives the same tokens."""
    from helpers import greedy_tokens
    from infer.memory.sizes import weights_bytes
    from quant_helpers import check_greedy_equal_but_near_ties, gptqmodel_greedy, infer_quantize
    out = infer_quantize("tiny-gemma3-mm", tmp_path / "q")
    tensors = load_file(out / "model.safetensors")
    assert "model.language_model.layers.0.mlp.gate_proj.qweight" in tensors
    assert [k for k in tensors if k.startswith("model.vision_tower.")] and not [
        k for k in tensors if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))
        and k.endswith("qweight")]
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    res = CliRunner().invoke(app, ["warmup", str(out), "--estimate", "--json", "--max-length", "256"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    want = gptqmodel_greedy(out, prompts, 8)
    with LLM(str(out), block_size=4, max_model_len=256) as llm:
        model = llm.engine.runner.model
        assert model.layers[0].self_attn.qkv_proj.qweight is not None and is_text_model(model)
        assert plan["weights_bytes"] == weights_bytes(model)
        got = greedy_tokens(llm, prompts, 8)
        # (this machine's checkpoint has a near-tie, 7e-5 apart, at prompt 2's fifth token, which GPTQModel's float16
        # products break the other way: decided by the margin, not by which way the rounding falls)
        check_greedy_equal_but_near_ties(llm, prompts, got, want)
    res = CliRunner().invoke(app, ["convert", str(out), "-o", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "c" / "config.json").read_text())["architectures"] == \
        json.loads((out / "config.json").read_text())["architectures"]
    with LLM(str(tmp_path / "c"), block_size=4) as llm:
        assert greedy_tokens(llm, prompts, 8) == got


# Ministral 3's rope (yarn) and Llama 4's query scaling by position; its original context of 4 (Ministral 3's:
# 16384) so that prompts reach positions scaled by 1 + beta * log(1 + floor(p / 4)), up to log(9) at 32
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 64.0, "original_max_position_embeddings": 4,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.5}
MINISTRAL3 = {**TEXT, "head_dim": 16, "rope_parameters": MINISTRAL3_ROPE}


def scales_queries(model, beta: float = 0.5) -> bool:
    return all(layer.self_attn.q_scaling == (beta, 4) for layer in model.layers)


def test_ministral3_equals_transformers(tmp_path):
    """Ministral3ForCausalLM (Mistral's layers, yarn, the query scaled by position: Llama 4's llama_4_scaling_beta)
    and the text model of a Mistral3ForConditionalGeneration whose text_config is a ministral3 (Ministral 3's
    checkpoints): greedy tokens and logprobs of prompts past the scaling's original context equal transformers'."""
    hf = save_random_model(tmp_path / "text", "ministral3", "Ministral3ForCausalLM", MINISTRAL3,
                           perturb=norms_drawn(1.0))
    check_greedy_and_logprobs_equal_transformers(tmp_path / "text", hf, "ministral3", scales_queries)
    hf = build_mistral3(tmp_path / "mm", **{k: v for k, v in MINISTRAL3.items() if k not in TEXT},
                        model_type="ministral3")
    check_greedy_and_logprobs_equal_transformers(tmp_path / "mm", hf, "ministral3-mm",
                                                 lambda m: scales_queries(m) and is_text_model(m))


def test_ministral3_gpu_path_interpreted_and_adapters(tmp_path_factory, monkeypatch):
    """Ministral 3 through every op's Triton kernel (interpreted on CPU), emulated CUDA graphs and piecewise graphs:
    transformers' tokens (the query scaling runs before the rotary kernels: every path); peft adapters mixed with
    the base through the kernels (a decode's qkv delta added before the scaling) give peft's tokens. A beta of 4:
    queries scaled up to 5x, so that a delta left unscaled shows."""
    from helpers import greedy_each
    from lora_helpers import FAMILY_ADAPTERS, base_and_adapters, check_mixed_adapters_gpu_path_equal_peft
    from quant_helpers import check_gpu_path_interpreted
    root = tmp_path_factory.mktemp("ministral3")
    rope = {**MINISTRAL3_ROPE, "llama_4_scaling_beta": 4.0}
    save_random_model(root / "base", "ministral3", "Ministral3ForCausalLM", {**MINISTRAL3, "rope_parameters": rope},
                      perturb=norms_drawn(1.0))
    base, hf, paths = base_and_adapters(root, FAMILY_ADAPTERS)
    prompts = random_prompts(512, (5, 13), seed=4)
    check_gpu_path_interpreted(base, monkeypatch, prompts, greedy_each(hf, prompts, 6))
    for fused in (False, True):  # (lora_expand_fused: a decode's qkv expand left to decode_attention where it may)
        check_mixed_adapters_gpu_path_equal_peft(base, hf, paths, monkeypatch, lambda m: scales_queries(m, 4.0),
                                                 lora_expand_fused=fused)


def test_ministral3_without_its_scaling_parameters_is_refused(tmp_path):
    """A ministral3 config whose rope_parameters lack llama_4_scaling_beta (transformers' attention fails on it) is
    refused when the config is read, naming the field."""
    rope = {k: v for k, v in MINISTRAL3_ROPE.items() if k != "llama_4_scaling_beta"}
    save_random_model(tmp_path, "ministral3", "Ministral3ForCausalLM", {**MINISTRAL3, "rope_parameters": rope})
    with pytest.raises(UnsupportedModelError, match="llama_4_scaling_beta"):
        LLM(str(tmp_path))


def test_infer_convert_keeps_a_float_multimodal_folder(tmp_path):
    """`infer convert` of a float Mistral3ForConditionalGeneration (transformers' auto class of image-text models:
    the causal LM's has no mistral3) writes the multimodal folder again, its vision tower kept (decided: the layout
    is kept, not cut down to the text model) with its processor's config, and infer gives the source's tokens from
    it."""
    import shutil

    from helpers import greedy_tokens
    from infer.models.tiny import ensure_builtin
    shutil.copytree(ensure_builtin("tiny-mistral3"), tmp_path / "src")
    (tmp_path / "src" / "preprocessor_config.json").write_text('{"image_processor_type": "PixtralImageProcessor"}')
    res = CliRunner().invoke(app, ["convert", str(tmp_path / "src"), "-o", str(tmp_path / "c"), "--dtype",
                                   "bfloat16"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "c" / "config.json").read_text())["architectures"] == \
        ["Mistral3ForConditionalGeneration"]
    assert any(k.startswith("vision_tower.") for k in load_file(tmp_path / "c" / "model.safetensors"))
    assert (tmp_path / "c" / "preprocessor_config.json").read_text() == \
        (tmp_path / "src" / "preprocessor_config.json").read_text()
    prompts = random_prompts(512, (5, 9), seed=3)
    with LLM("tiny-mistral3", dtype="bfloat16") as llm:
        want = greedy_tokens(llm, prompts, 6)
    with LLM(str(tmp_path / "c"), dtype="bfloat16") as llm:
        assert greedy_tokens(llm, prompts, 6) == want


def test_infer_quantize_checks_the_text_model_widths(tmp_path, monkeypatch):
    """`infer quantize` checks a multimodal checkpoint's text model (text_config's widths: the default groups of 128
    do not split its hidden size of 64) before GPTQModel runs."""
    import infer.quant.quantize as quantize
    monkeypatch.setattr(quantize, "_run_gptqmodel", lambda *a, **k: pytest.fail("GPTQModel ran"))
    res = CliRunner().invoke(app, ["quantize", "tiny-gemma3-mm", "-o", str(tmp_path / "q")])
    assert res.exit_code == 2, res.output
    assert "hidden_size" in " ".join(res.output.split()) and "128" in res.output


def test_the_demo_refuses_a_multimodal_builtin(tmp_path, monkeypatch):
    """The demo's chain (its adapters target q_proj ... of every module: a vision tower's too) is not set up for a
    multimodal built-in: refused before any step, naming what it is and the built-ins it runs on."""
    from infer.cli import demo as demo_module
    monkeypatch.setattr(demo_module, "_model_steps", lambda *a, **k: pytest.fail("a step ran"))
    res = CliRunner().invoke(app, ["demo", "--model", "tiny-gemma3-mm", "--out", str(tmp_path / "d")])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert "--model tiny-gemma3-mm is a multimodal Gemma3ForConditionalGeneration" in out
    assert "tiny-llama" in out and "tiny-mistral3" not in out and not (tmp_path / "d").exists()
