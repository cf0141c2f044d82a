"""Sequence classification models (transformers' *ForSequenceClassification of a family infer runs): the decoder
of the family's ForCausalLM and, instead of its lm_head, the `score` head (num_labels x hidden, no bias) that
transformers applies to the last token's final hidden state. vLLM runs them on its pooling runner (the classify
task): so does infer (engine.pooling)."""

from __future__ import annotations

import torch
from torch import nn

SEQ_CLS = "ForSequenceClassification"


_CAUSAL = {"Gemma3TextForSequenceClassification": "Gemma3ForCausalLM"}  # (Gemma 3's text model: model_type gemma3_text)


def causal_name(arch: str) -> str:
    """The ForCausalLM architecture whose decoder a ForSequenceClassification architecture has."""
    if arch in _CAUSAL:
        return _CAUSAL[arch]
    return arch[:-len(SEQ_CLS)] + "ForCausalLM" if arch.endswith(SEQ_CLS) else arch


def is_classifier(cfg) -> bool:
    """Whether a config (transformers' or config.json's dict) is a ForSequenceClassification model's."""
    archs = cfg.get("architectures") if isinstance(cfg, dict) else getattr(cfg, "architectures", None)
    return bool(archs) and all(isinstance(a, str) and a.endswith(SEQ_CLS) for a in archs)


def labels(cfg) -> list[str]:
    """The label of each class, in order: config.json's id2label (transformers' LABEL_i where it has none)."""
    names = getattr(cfg, "id2label", None) or {}
    return [str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(cfg.num_labels)]


def add_score_head(model: nn.Module, cfg, dtype: torch.dtype) -> None:
    """Give a ForCausalLM model a classifier's head: `score` (loaded from score.weight) and no lm_head (the
    checkpoint has none; a pooling engine never computes logits over the vocabulary)."""
    if hasattr(model, "lm_head"):
        del model.lm_head
    model.tie_word_embeddings = True  # (no lm_head.weight is looked for)
    model.quantized_head = False
    model.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False, dtype=dtype)
    model.score.weight.requires_grad_(False)
