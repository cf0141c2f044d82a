"""Attention shapes derived from a Hugging Face config once: heads, KV heads, head_dim, q and kv projection widths.

`head_dim` is the config's own when it has one (Qwen3 sets it apart from hidden_size / heads), else
hidden_size // num_attention_heads; `num_key_value_heads` defaults to the head count (no GQA).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class ModelShapes:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, cfg) -> "ModelShapes":
        heads = cfg.num_attention_heads
        return cls(hidden_size=cfg.hidden_size, num_heads=heads,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)

    @property
    def q_size(self) -> int:
        """Width of the query projection's output: num_heads * head_dim (not always hidden_size)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim


def check_shapes(cfg) -> None:
    """Refuse head counts no attention can compute (an UnsupportedModelError naming the config fields): query heads
    shared by groups of KV heads need num_attention_heads to be a multiple of num_key_value_heads (transformers'
    repeat_kv fails at the first forward; infer's kernels would read the wrong KV head)."""
    shapes = ModelShapes.from_config(cfg)
    if shapes.num_heads % shapes.num_kv_heads:
        raise UnsupportedModelError(f"config.json has num_attention_heads {shapes.num_heads}, not a multiple of "
                                    f"num_key_value_heads {shapes.num_kv_heads}",
                                    "each KV head serves the same number of query heads: use the config.json that "
                                    "came with the weights")
