"""Sequence classification models (transformers' *ForSequenceClassification of a family infer runs): the decoder
of the family's ForCausalLM and, instead of its lm_head, the `score` head (num_labels x hidden, no bias) that
transformers applies to the last token's final hidden state. vLLM runs them on its pooling runner (the classify
task): so does infer (engine.pooling)."""

from __future__ import annotations

import torch
from torch import nn

SEQ_CLS = "ForSequenceClassification"
# token classification (transformers' *ForTokenClassification): the same decoder, a `score` head (num_labels x hidden,
# with a bias) over every token's final hidden state; vLLM's token_classify task (engine.pooling: pooling type ALL)
TOKEN_CLS = "ForTokenClassification"
# what vLLM's convert="classify" (--convert classify) is in infer: config.json edited (cli.vllm_flags, engine.llm)
CONVERT_CLASSIFY = ("infer reads a classifier from MODEL's config.json (runner auto pools it): in a copy of the folder "
                    "set \"architectures\" to the family's *ForSequenceClassification; an LLM reranker (a score head "
                    "from lm_head's rows of tokens) also \"method\" (from_2_way_softmax or no_post_processing) and "
                    "\"classifier_from_token\", the fields vLLM's --hf-overrides sets")


_CAUSAL = {"Gemma3TextForSequenceClassification": "Gemma3ForCausalLM"}  # (Gemma 3's text model: model_type gemma3_text)


def causal_name(arch: str) -> str:
    """The ForCausalLM architecture whose decoder a ForSequenceClassification architecture has."""
    if arch in _CAUSAL:
        return _CAUSAL[arch]
    suffix = next((s for s in (SEQ_CLS, TOKEN_CLS) if arch.endswith(s)), None)
    return arch[:-len(suffix)] + "ForCausalLM" if suffix else arch


def _archs_end(cfg, suffixes: tuple[str, ...]) -> bool:
    archs = cfg.get("architectures") if isinstance(cfg, dict) else getattr(cfg, "architectures", None)
    return bool(archs) and all(isinstance(a, str) and a.endswith(suffixes) for a in archs)


def is_classifier(cfg) -> bool:
    """Whether a config (transformers' or config.json's dict) is a classifier's: a ForSequenceClassification or a
    ForTokenClassification model (a score head instead of lm_head, run on the pooling runner)."""
    return _archs_end(cfg, (SEQ_CLS, TOKEN_CLS))


def is_token_classifier(cfg) -> bool:
    """Whether a config is a ForTokenClassification model's (a class distribution for every token)."""
    return _archs_end(cfg, (TOKEN_CLS,))


def labels(cfg) -> list[str]:
    """The label of each class, in order: config.json's id2label (transformers' LABEL_i where it has none)."""
    names = getattr(cfg, "id2label", None) or {}
    return [str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(cfg.num_labels)]


def add_score_head(model: nn.Module, cfg, dtype: torch.dtype, weight: torch.Tensor | None = None) -> None:
    """Give a ForCausalLM model a classifier's head: `score` (loaded from score.weight, or `weight`) and no lm_head
    (the checkpoint has none; a pooling engine never computes logits over the vocabulary)."""
    if hasattr(model, "lm_head"):
        del model.lm_head
    model.tie_word_embeddings = True  # (no lm_head.weight is looked for)
    model.quantized_head = False
    if weight is None:  # (transformers' token classifier's score head has a bias; the sequence classifier's none)
        model.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=is_token_classifier(cfg), dtype=dtype)
    else:
        model.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False, dtype=dtype, device="meta")
        model.score.weight = nn.Parameter(weight)
    model.score.requires_grad_(False)


# vLLM's online conversion of a causal LM into a classifier (its model_executor/models/adapters.py): config.json's
# `method` and `classifier_from_token` (what vLLM's --hf-overrides sets) build the score head from the output head's
# rows of those tokens. from_2_way_softmax (Qwen3-Reranker, mxbai-rerank-v2): one label, the "true" token's row less
# the "false" one's (sigmoid of the difference = softmax over [false, true] of the true token's logit);
# no_post_processing (bge-reranker-v2-gemma): one label a token, each token's row.
TOKEN_METHODS = ("from_2_way_softmax", "no_post_processing")
_TOKEN_HINT = ("give config.json both \"method\" (from_2_way_softmax: [false token, true token]; or "
               "no_post_processing) and \"classifier_from_token\", as vLLM's --hf-overrides would")


def token_head(cfg) -> tuple[str, list[str]] | None:
    """(method, tokens) of a classifier whose score head is read from its output head's rows of tokens (vLLM's
    `method` and `classifier_from_token` in config.json; Qwen3's `is_original_qwen3_reranker` true means
    from_2_way_softmax); None for a classifier with a stored score head. UnsupportedModelError for a bad one."""
    from ..errors import UnsupportedModelError
    get = cfg.get if isinstance(cfg, dict) else (lambda key: getattr(cfg, key, None))
    method, tokens = get("method"), get("classifier_from_token")
    if method is None and get("is_original_qwen3_reranker") is True:
        method = "from_2_way_softmax"
    if method is None and tokens is None or tokens is None and not is_classifier(cfg):
        return None  # (a causal LM's config of a field named method: not vLLM's, which reads it of classifiers)
    if not is_classifier(cfg):
        raise UnsupportedModelError("config.json gives method/classifier_from_token (a score head from the output "
                                    "head's rows of tokens) but its architectures are not a *ForSequenceClassification",
                                    "set \"architectures\" to the family's, e.g. [\"Qwen3ForSequenceClassification\"]"
                                    ", as vLLM's --hf-overrides does")
    if method not in TOKEN_METHODS:
        raise UnsupportedModelError(f"config.json's method {json_text(method)} is not one infer runs: "
                                    f"{' or '.join(TOKEN_METHODS)}", _TOKEN_HINT)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise UnsupportedModelError(f"config.json's classifier_from_token must be a non-empty list of tokens "
                                    f"(strings), got {json_text(tokens)}", _TOKEN_HINT)
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise UnsupportedModelError(f"method from_2_way_softmax takes two tokens in classifier_from_token, [false, "
                                    f"true], got {len(tokens)}: {json_text(tokens)}", _TOKEN_HINT)
    return method, list(tokens)


def json_text(value) -> str:
    import json
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def token_ids(path, tokens: list[str]) -> list[int]:
    """Each token's id in the model folder's tokenizer (vLLM's convert_tokens_to_ids: a token of the vocabulary, not a
    text to encode); ModelLoadError naming a token that is not one."""
    from transformers import AutoTokenizer
    from ..errors import ModelLoadError
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    vocab = tok.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        pieces = {t: tok.convert_ids_to_tokens(tok(t, add_special_tokens=False)["input_ids"]) for t in missing}
        raise ModelLoadError(f"config.json's classifier_from_token has {', '.join(map(json_text, missing))}, not one "
                             f"token of {path}'s tokenizer (it splits "
                             f"{'; '.join(f'{json_text(t)} into {json_text(p)}' for t, p in pieces.items())})",
                             "name tokens of its vocabulary (tokenizer.json's), e.g. \"yes\" and \"no\" as "
                             "Qwen3-Reranker's")
    return [vocab[t] for t in tokens]


def token_score_weight(model, method: str, ids: list[int]) -> torch.Tensor:
    """The score head's weight [labels, hidden] in float32 from the loaded output head's rows (a GPTQ head's
    dequantized; a tied one's: the embeddings')."""
    if getattr(model, "quantized_head", False):
        head = model.lm_head.dequantized_weight()
    else:
        head = model.embed_tokens.weight if model.tie_word_embeddings else model.lm_head.weight
    rows = head[ids].float()
    return rows[1:] - rows[:1] if method == "from_2_way_softmax" else rows.clone()


def set_token_head(model, cfg, path) -> None:
    """Replace a loaded causal LM's output head with the score head of config.json's tokens (token_head's)."""
    method, tokens = token_head(cfg)
    ids = token_ids(path, tokens)
    if model.embed_tokens.weight.device.type == "meta":  # (check_weights': the shapes only)
        weight = torch.empty(cfg.num_labels, cfg.hidden_size, device="meta")
    else:
        weight = token_score_weight(model, method, ids)
    add_score_head(model, cfg, weight.dtype, weight)
