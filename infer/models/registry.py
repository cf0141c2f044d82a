"""Which Hugging Face architectures infer runs, and the model class for each."""

from __future__ import annotations

from ..errors import UnsupportedModelError

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}


def check_supported(cfg) -> str:
    archs = list(getattr(cfg, "architectures", None) or [])
    model_type = getattr(cfg, "model_type", None)
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None and model_type in SUPPORTED.values() and not archs:
        arch = next(a for a, t in SUPPORTED.items() if t == model_type)
    if model_type == "ministral" and "MistralForCausalLM" in archs:
        raise UnsupportedModelError(
            "config.json of a MistralForCausalLM has layer_types, which makes transformers run it as Ministral "
            "(sliding attention on some layers only), an architecture infer does not run",
            "if every layer slides over sliding_window (Mistral), remove layer_types from config.json")
    if arch is None or model_type not in SUPPORTED.values():
        raise UnsupportedModelError(
            f"unsupported architecture {archs or model_type!r} (model_type {model_type!r})",
            f"infer runs {', '.join(SUPPORTED)}")
    check_activation(cfg)
    return arch


def check_activation(cfg) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' ACT2FN maps both to SiLU
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported", "the Llama family uses silu")


def model_class(cfg):
    check_supported(cfg)
    from .llama import LlamaForCausalLM, Phi3ForCausalLM
    return Phi3ForCausalLM if cfg.model_type == "phi3" else LlamaForCausalLM
