"""Classification and scoring on the pooling runner (vLLM's classify and score tasks): a *ForSequenceClassification
model's pooled last hidden state through its `score` head (models.classifier) gives num_labels logits, then the
activation transformers' loss implies (vLLM's): softmax for several labels, sigmoid for one (a cross-encoder's
relevance) or for problem_type multi_label_classification, none for regression (or use_activation false).

A score of two texts: a classifier of one label (a cross-encoder) reads the pair as its tokenizer joins two texts
(transformers' tokenizer(text_1, text_2), as sentence-transformers' CrossEncoder and vLLM); an embedding model
embeds each text apart and scores their cosine similarity."""

from __future__ import annotations

import torch

from ..errors import RequestError
from .pooling import EmbeddingOutput, EmbeddingRequestOutput, Pooler, PoolingOutput, PoolingParams, \
    PoolingRequestOutput

NOT_CLASSIFIER = ("this model makes embeddings, not classes: classification (LLM.classify, POST /classify) needs a "
                  "*ForSequenceClassification model")
NOT_EMBEDDER = ("this model is a classifier (a *ForSequenceClassification model): it gives class probabilities "
                "(LLM.classify, POST /classify) and scores (LLM.score, POST /score, /rerank), not embeddings")
# a classifier's refusals of generation (a server's generation routes; LLM.generate), as pooling's for embedders
CLASSIFIER_NOT_GENERATING = ("this server runs the model as a classifier (a *ForSequenceClassification model, on the "
                             "pooling runner): it answers /classify, /score and /rerank, not text generation")
GENERATE_NOT_CLASSIFIER = ("LLM.generate() is only supported for generative models: this engine runs the model as a "
                           "classifier (a *ForSequenceClassification model), which gives class probabilities and "
                           "scores, not text")
TOKEN_CLASSIFIER_ONLY = ("this model is a token classifier (a *ForTokenClassification model): it classifies each "
                         "token of a prompt (LLM.encode with pooling_task \"token_classify\", POST /pooling), and "
                         "makes no embeddings, sequence classes nor scores")
CLASSIFY_INSTEAD = "classify or score instead (LLM.classify, LLM.score, POST /classify, /score, /rerank)"
# a token classifier's (*ForTokenClassification) refusals of generation: it answers none of the sequence routes
TOKEN_CLASSIFIER_NOT_GENERATING = ("this server runs the model as a token classifier (a *ForTokenClassification "
                                   "model, on the pooling runner): it answers /pooling (every token's class "
                                   "probabilities), not text generation")
GENERATE_NOT_TOKEN_CLASSIFIER = ("LLM.generate() is only supported for generative models: this engine runs the model "
                                 "as a token classifier (a *ForTokenClassification model), which gives every "
                                 "token's class probabilities, not text")
TOKEN_CLASSIFY_INSTEAD = 'classify each token instead (LLM.encode(..., pooling_task="token_classify"), POST /pooling)'


def not_generating(pooler, server: bool) -> tuple[str, str]:
    """(message, hint) of a classifier's refusal of generation, naming its kind: a server's route (`server`) or
    LLM.generate."""
    if pooler.task == "token_classify":
        return (TOKEN_CLASSIFIER_NOT_GENERATING if server else GENERATE_NOT_TOKEN_CLASSIFIER), TOKEN_CLASSIFY_INSTEAD
    return (CLASSIFIER_NOT_GENERATING if server else GENERATE_NOT_CLASSIFIER), CLASSIFY_INSTEAD


def score_rows(model, pooled: dict, pooler: Pooler) -> dict:
    """A classifier's logits (float32) for each pooled hidden state of the step (pooling.pool_rows's), through the
    model's score head in the model's dtype (as transformers'); an embedding model's pooled states as they are."""
    if not pooler.classifies or not pooled:
        return pooled
    keys = list(pooled)
    head = model.score  # (a token classifier's has a bias)
    rows = [pooled[k].reshape(-1, pooled[k].shape[-1]) for k in keys]  # (a per-token task's: a row per token)
    logits = torch.nn.functional.linear(torch.cat(rows).to(head.weight.dtype), head.weight, head.bias).float()
    parts = logits.split([len(r) for r in rows])
    return {k: part if pooled[k].dim() > 1 else part[0] for k, part in zip(keys, parts)}


def pooled_prompt(ids: list[int], pooler: Pooler, task: str | None = None) -> list[int]:
    """The tokens a classifier runs of a prompt (LAST pooling): transformers' *ForSequenceClassification scores the
    last token that is not config.json's pad_token_id (the first token when every one is), so the prompt runs
    without its trailing pad tokens (a causal decoder's state at a token does not depend on those after it); the
    prompt as it is for an embedding model, another pooling type, a per-token `task` or a model without a pad
    token."""
    pad, end = pooler.pad_token_id, len(ids)
    if pooler.task != "classify" or task not in (None, "classify") or pooler.pooling_type != "LAST" or pad is None:
        return ids
    while end > 1 and ids[end - 1] == pad:
        end -= 1
    return ids[:end]


def activated(logits: torch.Tensor, pooler: Pooler, params: PoolingParams) -> torch.Tensor:
    """The request's probabilities (vLLM's classify activation) or its raw logits (use_activation false, or a
    regression model's)."""
    use = pooler.use_activation if params.use_activation is None else params.use_activation
    if not use or pooler.problem_type == "regression":
        return logits
    if logits.shape[-1] < 2 or pooler.problem_type == "multi_label_classification":  # (token tasks: each row's)
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


class ClassificationOutput:
    """vLLM's ClassificationOutput: `probs` (one per class, a list of floats), `num_classes` (`data`: the tensor)."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def num_classes(self) -> int:
        return len(self.data)


class ClassificationRequestOutput(EmbeddingRequestOutput):
    """vLLM's ClassificationRequestOutput (a finished classify request): `.outputs.probs`, `.prompt_token_ids`."""

    def __repr__(self) -> str:
        return (f"ClassificationRequestOutput(request_id={self.request_id!r}, num_classes="
                f"{self.outputs.num_classes}, prompt_tokens={len(self.prompt_token_ids)})")


def pooled_output(seq, vec: torch.Tensor, task: str):
    """A finished pooling request's output (vLLM's): an embedding's, a classification's, or a per-token task's
    PoolingRequestOutput (`.outputs.data`: a row per prompt token)."""
    if task == "classify":
        return ClassificationRequestOutput(seq, ClassificationOutput(vec))
    if task == "embed":
        return EmbeddingRequestOutput(seq, EmbeddingOutput(vec))
    return PoolingRequestOutput(seq, PoolingOutput(vec))


class ScoringOutput:
    """vLLM's ScoringOutput: the pair's `score` (a float)."""

    def __init__(self, score: float):
        self.score = score

    def __repr__(self) -> str:
        return f"ScoringOutput(score={self.score})"


class ScoringRequestOutput:
    """vLLM's ScoringRequestOutput: `.outputs.score`, the tokens the pair ran as (`prompt_token_ids`: a
    cross-encoder's joined pair; an embedding model's two texts, one after the other)."""

    finished = True

    def __init__(self, request_id: str, score: float, prompt_token_ids: list[int]):
        self.request_id, self.outputs, self.prompt_token_ids = request_id, ScoringOutput(score), prompt_token_ids

    def __repr__(self) -> str:
        return f"ScoringRequestOutput(request_id={self.request_id!r}, score={self.outputs.score})"


def check_cross_encoder(pooler: Pooler) -> None:
    """A classifier scores pairs only with one label (vLLM's: a cross-encoder's relevance)."""
    if pooler.classifies and len(pooler.labels) != 1:
        raise RequestError(f"this classifier has {len(pooler.labels)} labels: scoring a pair needs a cross-encoder, "
                           "a *ForSequenceClassification model of num_labels 1",
                           "classify the texts instead (LLM.classify, POST /classify)")


def check_activation(params: PoolingParams, pooler: Pooler, field: str = "use_activation") -> None:
    """use_activation is a classifier's (vLLM's embed task refuses it): an embedding model's score is a cosine.
    `field`: the name the request gave it (a body's deprecated softmax or activation)."""
    if params.use_activation is not None and pooler.task == "embed":
        raise RequestError(f"{field} is a classifier's field: this model makes embeddings, and scores a pair by "
                           "the cosine similarity of its two embeddings (vLLM's embed task refuses it too)",
                           f"leave {field} out")


def score_pairs(text_1, text_2, name_1: str = "text_1", name_2: str = "text_2", empty: bool = False) -> list[tuple]:
    """vLLM's pairing of LLM.score's / POST /score's texts: one and one, one and N (the first against each), or N
    and N (pairwise); RequestError naming the field otherwise. `empty` (a cross-encoder's): an empty text is scored
    as vLLM scores it (its pair still holds the other text and the tokenizer's separators), not refused."""
    left, right = _texts(text_1, name_1, empty), _texts(text_2, name_2, empty)
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise RequestError(f"{name_1} has {len(left)} texts and {name_2} {len(right)}: give one {name_1} or as "
                           f"many as {name_2}", f"one {name_1} is scored against each {name_2}")
    return list(zip(left, right))


def pair_labels(text_1, text_2, name_1: str = "text_1", name_2: str = "text_2") -> list[tuple[str, str]]:
    """The body's name of each text of score_pairs' pairs: (text_1, text_2[3]) for one text against a list,
    (text_1[3], text_2[3]) pairwise, what a refusal of one names."""
    count = max(len(_texts(text_1, name_1, True)), len(_texts(text_2, name_2, True)))
    return [(name_1 if one_text(text_1) else f"{name_1}[{i}]", name_2 if one_text(text_2) else f"{name_2}[{i}]")
            for i in range(count)]


def one_text(value) -> bool:
    """Whether `value` is one text (a string or a list of token ids), not a list of them."""
    return isinstance(value, str) or (isinstance(value, list) and bool(value) and all(_is_id(t) for t in value))


def _texts(value, name: str, empty: bool = False) -> list:
    one = one_text(value)  # (a refusal of one text names the field, not field[0])
    if one:
        value = [value]
    if not isinstance(value, list) or not value:
        raise RequestError(f"{name} must be a text or a non-empty list of texts, got "
                           f"{'an empty list' if value == [] else type(value).__name__}")
    for i, item in enumerate(value):
        if isinstance(item, str) and not item and not empty:
            raise RequestError(f"{name if one else f'{name}[{i}]'} is an empty string: there is nothing to embed and "
                               "score", "give a text" if one else "remove it")
        if not isinstance(item, str) and not (isinstance(item, list) and item and all(_is_id(t) for t in item)):
            raise RequestError(f"{name}[{i}] is neither a text nor a list of token ids (integers)",
                               'give the text itself, not an object such as {"text": ...} (as vLLM reads them)'
                               if isinstance(item, dict) else None)
    return value


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def pair_ids(tokenizer, first, second, max_model_len: int, truncate: int | None = None,
             joined: bool = False) -> list[int]:
    """A cross-encoder's prompt of a pair: its tokenizer's pair encoding (special tokens, separators and, where the
    tokenizer has them, token type ids left out as vLLM's decoder cross-encoders do); RequestError when longer than
    `max_model_len`. `truncate` (truncate_prompt_tokens; -1: max_model_len) cuts the pair to that many tokens as
    vLLM's tokenizer call does (transformers' truncation, longest first: the texts' ends, never the special tokens
    nor the first text's start), not the prompt's last tokens kept (which would drop the query). `joined` (an LLM
    reranker's, Pooler.joins_pair_text): the pair is one text, text_1 + text_2, as vLLM runs it (a pair of token
    ids: the two lists one after the other), cut as the tokenizer cuts one text."""
    keep = None if truncate is None else max_model_len if truncate == -1 else truncate
    texts = isinstance(first, str) and isinstance(second, str)
    if joined:
        cut = {} if keep is None else {"truncation": True, "max_length": keep}
        if texts:
            ids = list(tokenizer(first + second, **cut)["input_ids"])
        else:
            ids = [t for x in (first, second) for t in (x if isinstance(x, list) else
                                                       tokenizer(x, add_special_tokens=False)["input_ids"])]
            if keep is not None and len(ids) > keep:
                ids = ids[-keep:] if tokenizer.truncation_side == "left" else ids[:keep]
        return _fits(ids, keep, max_model_len)
    before, between, after = _pair_frame(tokenizer) if keep is not None or not texts else ((), (), ())
    if keep is not None and keep < len(before) + len(between) + len(after):
        raise RequestError(f"truncate_prompt_tokens {truncate} leaves no room for the pair's texts beside its "
                           f"{len(before) + len(between) + len(after)} special tokens", "give a larger value")
    if texts:
        cut = {} if keep is None else {"truncation": True, "max_length": keep}
        ids = tokenizer(first, second, **cut)["input_ids"]
    else:  # token ids: framed by the special tokens the tokenizer puts around and between a pair of texts
        one = first if isinstance(first, list) else tokenizer(first, add_special_tokens=False)["input_ids"]
        two = second if isinstance(second, list) else tokenizer(second, add_special_tokens=False)["input_ids"]
        if keep is not None:
            one, two = _longest_first(list(one), list(two), keep - len(before) - len(between) - len(after))
        ids = [*before, *one, *between, *two, *after]
    return _fits(list(ids), keep, max_model_len)


def check_texts(labelled, vocab_size: int) -> None:
    """Each (label, text) of a request's pairs: a text of token ids with one outside the vocabulary is refused naming
    that text (text_2, documents[3]), not the pair's prompt."""
    for label, text in labelled:
        bad = next((t for t in text if not 0 <= t < vocab_size), None) if isinstance(text, list) else None
        if bad is not None:
            raise RequestError(f"{label}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                               "give ids the model's tokenizer makes")


def check_query_room(tokenizer, query, max_model_len: int, joined: bool, name: str = "query") -> None:
    """RequestError naming the query (text_1) when it alone leaves no room in the context for a one-token text
    beside it and the tokenizer's special tokens: every pair would be refused, named by its document."""
    ids = query if isinstance(query, list) else tokenizer(query, add_special_tokens=False)["input_ids"]
    if joined:
        special = len(tokenizer("x")["input_ids"]) - len(tokenizer("x", add_special_tokens=False)["input_ids"])
    else:
        try:
            special = sum(map(len, _pair_frame(tokenizer)))
        except RequestError:
            special = 0
    if len(ids) + special + 1 > max_model_len:
        raise RequestError(f"{name}: the text has {len(ids)} tokens, which with the pair's {special} special tokens "
                           f"leave no room for a text beside it in the model's context of {max_model_len} tokens",
                           "shorten it, or give truncate_prompt_tokens")


def _fits(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    if not ids:
        raise RequestError("the pair has no tokens: both texts are empty and the tokenizer adds none",
                           "give a text on either side")
    if keep is None and len(ids) > max_model_len:
        raise RequestError(f"the pair has {len(ids)} tokens, more than the model's context of {max_model_len} "
                           "tokens", "shorten the texts, or give truncate_prompt_tokens")
    return ids


def _longest_first(one: list, two: list, room: int) -> tuple[list, list]:
    """Two token lists cut to `room` tokens together as the tokenizers library's longest_first truncation: the
    shorter kept whole when the longer can take the rest, else each cut to about half (the longer gets the odd
    token); each keeps its start."""
    if len(one) + len(two) <= room:
        return one, two
    short, long = sorted((len(one), len(two)))
    long = short if short > room else max(short, room - short)
    if short + long > room:
        short, long = room // 2, room // 2 + room % 2
    n1, n2 = (long, short) if len(one) > len(two) else (short, long)
    return one[:n1], two[:n2]


def _pair_frame(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """The special tokens a tokenizer's pair encoding puts before, between and after the two texts' own tokens (read
    off the pair encoding of two one-letter texts)."""
    x, y = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("x", "y"))
    pair = list(tokenizer("x", "y")["input_ids"])
    for i in range(len(pair) - len(x) + 1):
        if pair[i:i + len(x)] == x:
            for j in range(i + len(x), len(pair) - len(y) + 1):
                if pair[j:j + len(y)] == y:
                    return pair[:i], pair[i + len(x):j], pair[j + len(y):]
    raise RequestError("this tokenizer's pair encoding does not keep each text's tokens: a pair of token ids "
                       "cannot be joined as it joins texts", "give the pair as texts")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """An embedding model's score of a pair (vLLM's): the cosine similarity of the two vectors."""
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))
