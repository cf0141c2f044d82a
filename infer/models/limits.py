"""A model's context limit: its max_position_embeddings, or less where longrope's short factors (or a Llama's
sliding_window) cap it (the engine's max_model_len, a draft model's context, the memory plan's draft share read it);
which layers attend over a sliding window (`layer_window`)."""

from __future__ import annotations

from .registry import HUNYUAN
from .rope import rope_max_positions

# the families whose transformers attention ignores a sliding_window (no layer of theirs slides) while generate()'s
# cache keeps only the last sliding_window keys (cache_utils.get_layer_types_and_kwargs: a config with the key and no
# layer_types): a stray sliding_window in their config.json (a fine-tune's tooling) caps the context, never slides
WINDOW_IGNORED = ("llama", "granite", "olmo2", "glm", "glm4", "gemma", "seed_oss", "ernie4_5", "ernie4_5_moe", "arcee",
                  "nemotron", "apertus", "internlm3", "helium", *HUNYUAN, "minimax_m2", "flex_olmo")


def sliding_window(model_config) -> int | None:
    """The attention window of the layers that slide, if any does. Mistral and Phi-3 slide on every layer; Qwen2 and
    Qwen3 on the layers from max_window_layers on when use_sliding_window is set, Gemma 2 on alternate layers
    (transformers lists them in layer_types). transformers' Mistral and Phi-3 slide whenever sliding_window is set,
    whatever a use_sliding_window in config.json says; its Llama ignores the window in attention but its generate()
    cache keeps only the last sliding_window keys (infer's Llama attends fully: its context is capped at the window,
    where both ways of transformers agree; `context_limit`)."""
    window = getattr(model_config, "sliding_window", None)
    if not window:
        return None
    if getattr(model_config, "model_type", None) in ("mistral", *WINDOW_IGNORED, "phi3", "mixtral", "qwen3_moe",
                                                     "phimoe"):
        return int(window)
    types = getattr(model_config, "layer_types", None)
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    return int(window) if getattr(model_config, "use_sliding_window", True) else None


def layer_window(model_config, layer: int) -> int:
    """The attention window of decoder layer `layer` as transformers runs it (its key at position k seen by the
    query at p where p - window < k <= p: masking_utils' sliding_window_overlay), 0 where the layer attends to
    every key: Mistral and Phi-3 slide on every layer whenever sliding_window is set; Qwen2, Qwen3 and Gemma 2 on
    the layers their layer_types names "sliding_attention" (Qwen's from max_window_layers on when
    use_sliding_window is set, Gemma 2's even layers); Llama's attention ignores the window (0: its context stays
    capped at the window, `context_limit`). Where every layer slides over the same window (`uniform_window`) the
    blocks of a running sequence behind it are freed (engine.block_manager); where layers mix full attention and one
    window, the sliding layers' groups free theirs (`layer_groups`, engine.hybrid_blocks). The kernels skip the
    blocks wholly before a query's window and mask the rest."""
    if layer_chunked(model_config, layer):  # (Llama 4's chunked layers: the chunk, Attention.chunked)
        return int(model_config.attention_chunk_size)
    window = getattr(model_config, "sliding_window", None)
    model_type = getattr(model_config, "model_type", None)
    if not window or model_type in WINDOW_IGNORED:
        return 0
    if model_type in ("mistral", "ministral3", "phi3", "mixtral", "qwen3_moe", "phimoe"):  # (Qwen3-MoE: sliding_window
        return int(window)  # set only where use_sliding_window is, then on every layer, as transformers runs it)
    types = getattr(model_config, "layer_types", None)
    if types is not None:
        return int(window) if layer < len(types) and types[layer] == "sliding_attention" else 0
    if not getattr(model_config, "use_sliding_window", True):
        return 0
    if model_type == "gemma2":
        return int(window) if layer % 2 == 0 else 0
    return int(window) if layer >= int(getattr(model_config, "max_window_layers", 0) or 0) else 0


def layer_chunked(model_config, layer: int) -> bool:
    """Whether decoder layer `layer` attends over chunks (Llama 4's rope layers where attention_chunk_size is set:
    transformers' layer_types "chunked_attention"), its `layer_window` the chunk: a query at p reads the keys of its
    own chunk, p - p % chunk..p, which are among the last `chunk` keys (what the block manager keeps of a sliding
    window that size: the blocks behind it freed as a sliding window's are)."""
    if getattr(model_config, "model_type", None) != "llama4_text":
        return False
    types = getattr(model_config, "layer_types", None) or []
    return layer < len(types) and types[layer] == "chunked_attention" \
        and bool(getattr(model_config, "attention_chunk_size", None))


def uniform_window(model_config) -> int:
    """The window every decoder layer slides over when all of them slide over the same one (Mistral, Phi-3, a
    Qwen2/Qwen3 whose layers all slide), else 0: only then can a sequence's KV blocks behind the window be freed
    (one block table serves every layer; models of mixed layers, Gemma 2 or a Qwen2 with max_window_layers, get a
    table per layer group instead: `layer_groups`)."""
    layers = int(getattr(model_config, "num_hidden_layers", 0) or 0)
    windows = {layer_window(model_config, i) for i in range(layers)}
    return windows.pop() if len(windows) == 1 else 0


def layer_groups(model_config) -> tuple[int, list[tuple[int, list[int]]]] | None:
    """A model of mixed layers (full attention and one sliding window: Gemma 2, Gemma 3, a Qwen2/Qwen3 with
    max_window_layers) split into KV groups of the same number of layers (vLLM's KVCacheGroups): (layers per group,
    [(the group's window, its layers)]), the full groups first; each kind's layers in order, its last group padded
    where its count is not a multiple. None where every layer attends alike (`uniform_window`) or the sliding
    layers' windows differ."""
    layers = int(getattr(model_config, "num_hidden_layers", 0) or 0)
    windows = [layer_window(model_config, i) for i in range(layers)]
    kinds = sorted(set(windows))
    if len(kinds) != 2 or kinds[0] != 0:
        return None
    by_kind = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    size = min(len(v) for v in by_kind.values())
    return size, [(w, ls[i:i + size]) for w, ls in by_kind.items() for i in range(0, len(ls), size)]


def context_limit(model_config) -> tuple[int, str]:
    """(the model's context limit, why it is below max_position_embeddings, or "" where it is not): the sliding
    layers attend over their window in every attention path (`layer_window`), so a window caps nothing, but a
    Llama's: its attention is full (transformers' too) where its generate() cache keeps the last sliding_window
    keys, the two equal only up to the window; longrope's short factors hold up to original_max_position_embeddings
    (models.rope.rope_max_positions)."""
    positions = int(getattr(model_config, "max_position_embeddings", 0) or 2048)
    rope_limit = rope_max_positions(model_config)
    window = sliding_window(model_config) if getattr(model_config, "model_type", None) in WINDOW_IGNORED else None
    if window and window < positions and not (rope_limit and rope_limit < window):
        # the window named: "the model's limit of 4096" of a model whose max_position_embeddings is 32768 read as
        # a wrong number
        return window, (f"its sliding_window: a {model_config.model_type} model's attention is full, which equals "
                        f"transformers' generate() (its cache of the last sliding_window keys) only up to the window; "
                        f"max_position_embeddings is {positions}")
    if rope_limit and rope_limit < positions:
        return rope_limit, (f"its longrope rope_parameters' original_max_position_embeddings: past it transformers "
                            f"rotates the whole sequence with the long factors, which infer's KV cache cannot; "
                            f"max_position_embeddings is {positions}")
    return positions, ""
