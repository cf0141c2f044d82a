"""A model's context limit: its max_position_embeddings, or less where a sliding window or longrope's short factors
cap it (the engine's max_model_len, a draft model's context, the memory plan's draft share read it)."""

from __future__ import annotations

from .rope import rope_max_positions


def sliding_window(model_config) -> int | None:
    """The attention window of the layers that slide, if any does: infer's attention is full, which equals sliding
    attention up to the window, so the context is capped there. Mistral and Phi-3 slide on every layer; Qwen2 and
    Qwen3 on the layers from max_window_layers on when use_sliding_window is set, Gemma 2 on alternate layers
    (transformers lists them in layer_types). transformers' Mistral and Phi-3 slide whenever sliding_window is set,
    whatever a use_sliding_window in config.json says; its Llama ignores the window in attention but its generate()
    cache keeps only the last sliding_window keys, so the context is capped there too (where both ways of
    transformers agree)."""
    window = getattr(model_config, "sliding_window", None)
    if not window:
        return None
    if getattr(model_config, "model_type", None) in ("mistral", "llama", "phi3"):
        return int(window)
    types = getattr(model_config, "layer_types", None)
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    return int(window) if getattr(model_config, "use_sliding_window", True) else None


def context_limit(model_config) -> tuple[int, str]:
    """(the model's context limit, why it is below max_position_embeddings, or "" where it is not): attention is
    full, which equals sliding attention up to the window; longrope's short factors hold up to
    original_max_position_embeddings (models.rope.rope_max_positions)."""
    positions = int(getattr(model_config, "max_position_embeddings", 0) or 2048)
    window, rope_limit = sliding_window(model_config), rope_max_positions(model_config)
    if window and window < positions and not (rope_limit and rope_limit < window):
        # the window named: "the model's limit of 4096" of a model whose max_position_embeddings is 32768 read as
        # a wrong number
        return window, (f"its sliding_window: infer's attention is full, which equals sliding attention only up to "
                        f"the window; max_position_embeddings is {positions}")
    if rope_limit and rope_limit < positions:
        return rope_limit, (f"its longrope rope_parameters' original_max_position_embeddings: past it transformers "
                            f"rotates the whole sequence with the long factors, which infer's KV cache cannot; "
                            f"max_position_embeddings is {positions}")
    return positions, ""
