"""Multimodal checkpoints served as their text model, as vLLM serves them with images disabled: Gemma 3's
(Gemma3ForConditionalGeneration: Gemma-3-4B/12B/27B, MedGemma) and Mistral 3's (Mistral3ForConditionalGeneration:
Mistral Small 3.1/3.2, Ministral 3). config.json's text_config is the model's config; the weights are read under the
language model's prefix (transformers 5's `model.language_model.*` and the hub's older `language_model.model.*`,
which transformers 5.25's save_pretrained still writes), and the vision tower's and projector's tensors are skipped,
never loaded. The folder's tokenizer and chat template are the model's; a message with an image or audio part is
refused (engine.inputs.chat_messages)."""

from __future__ import annotations

import json

from ..errors import UnsupportedModelError
from ..quant.convert import CONFIG_HINT

# the multimodal architecture -> its config's model_type
WRAPPERS = {"Gemma3ForConditionalGeneration": "gemma3", "Mistral3ForConditionalGeneration": "mistral3",
            "Qwen3_5ForConditionalGeneration": "qwen3_5",  # (Qwen3.5's: a hybrid text model, models.qwen3_5)
            "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",  # (Qwen3.5 MoE's: its experts, models.moe)
            "Llama4ForConditionalGeneration": "llama4"}  # (Llama 4 Scout's and Maverick's: models.llama4)
# the text model's architecture, by text_config's model_type
TEXT_ARCHS = {"gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM",
              "ministral3": "Ministral3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
              "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "llama4_text": "Llama4ForCausalLM"}
# the tensors (and peft modules) of the vision tower and the projector: skipped, never loaded
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                   "model.visual.", "mtp.",  # (Qwen3.5's vision tower, and its multi-token prediction layers)
                   "vision_model.", "model.vision_model.")  # (Llama 4's vision tower)
# the language model's prefixes, as checkpoints store them -> what a text model's checkpoint stores there
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def quant_config(gcfg, cfg):
    """A checkpoint's GPTQConfig (None: float) with its `dynamic` rules matched against the language model's names
    as the multimodal checkpoint stores them (model.language_model.layers.N..., as GPTQModel writes its rules) as
    well as the text model's, where `cfg` is a multimodal checkpoint's text config; else `gcfg` as it is."""
    if gcfg is None or not is_multimodal(cfg):
        return gcfg
    from dataclasses import replace
    return replace(gcfg, aliases=tuple((plain.rstrip("."), prefix.rstrip(".")) for prefix, plain in _TEXT_PREFIXES))


def wrapper_of(cfg) -> str | None:
    """The multimodal architecture `cfg` (a config read by transformers) is one of, else None."""
    archs = list(getattr(cfg, "architectures", None) or [])
    found = next((a for a in archs if a in WRAPPERS), None)
    if found is None and not archs:
        found = next((a for a, t in WRAPPERS.items() if t == getattr(cfg, "model_type", None)), None)
    return found


def text_config(cfg, raw: dict):
    """The text model's config of a multimodal config (`raw`: config.json's object): its text_config, named as the
    text architecture, with the top level's quantization_config, dtype, eos_token_id and tie_word_embeddings
    (transformers ties the head by the top level's where config.json sets it), and `multimodal_architecture` set to
    the wrapper's name.
    Another config is returned as it is."""
    wrapper = wrapper_of(cfg)
    if wrapper is None:
        return cfg
    text = getattr(cfg, "text_config", None)
    kind = getattr(text, "model_type", None)
    if kind not in TEXT_ARCHS:
        raise UnsupportedModelError(
            f"{wrapper}'s text_config has model_type {kind!r}, a language model infer does not run",
            f"infer serves the text model of {' and '.join(WRAPPERS)} checkpoints whose text_config is one of "
            f"{', '.join(f'{t} ({a})' for t, a in TEXT_ARCHS.items())}")
    text.architectures = [TEXT_ARCHS[kind]]
    text.multimodal_architecture = wrapper
    # (the top level's dtype as transformers 4 wrote it, torch_dtype: the hub's Gemma 3 and Mistral 3 configs; its
    # eos_token_id, the hub's Gemma 3's [1, 106], which transformers' generation config reads over text_config's)
    for field, value in (("quantization_config", raw.get("quantization_config")),
                         ("dtype", raw.get("dtype") or raw.get("torch_dtype")),
                         ("eos_token_id", raw.get("eos_token_id"))):
        if value is not None:
            try:
                setattr(text, field, value)
            except Exception as e:  # (a typed field: eos_token_id "2", true, [2, "x"])
                raise UnsupportedModelError(
                    f"config.json's {field} {json.dumps(value)[:80]} is not a value {wrapper}'s text model takes: "
                    f"{str(e).splitlines()[-1].strip()[:200]}", CONFIG_HINT) from e
    if "tie_word_embeddings" in raw:
        text.tie_word_embeddings = bool(raw["tie_word_embeddings"])
    return text


def is_multimodal(cfg) -> bool:
    """Whether `cfg` is the text config of a multimodal checkpoint (text_config's result)."""
    return bool(getattr(cfg, "multimodal_architecture", None))


def text_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor (or module) name as a text model's checkpoint names it (`model.layers.0...`,
    `lm_head.weight`); None for the vision tower's and the projector's. Another name is returned as it is."""
    if name.startswith(VISION_PREFIXES):
        return None
    for prefix, plain in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return plain + name[len(prefix):]
    return name


def text_tensors(cfg, tensors):
    """(name, tensor) of a checkpoint's tensors as the text model names them, the vision tower's and the
    projector's left out, where `cfg` is a multimodal checkpoint's text config; else the tensors as they are."""
    if getattr(cfg, "model_type", None) == "nemotron_h":  # (backbone.*: models.nemotron_h.checkpoint_name)
        from .nemotron_h import checkpoint_name
        yield from ((checkpoint_name(name), t) for name, t in tensors)
        return
    if not is_multimodal(cfg):
        yield from tensors
        return
    for name, t in tensors:
        plain = text_name(name)
        if plain is not None:
            yield plain, t
