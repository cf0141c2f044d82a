"""vLLM's pooling routes beside /v1/embeddings: POST /classify (a *ForSequenceClassification model's class
probabilities), POST /score and /v1/score (text_1 against text_2), POST /rerank, /v1/rerank and /v2/rerank
(Jina's and Cohere's format: query, documents, top_n, return_documents). A pair is scored by a cross-encoder (a
classifier of one label, the pair joined by its tokenizer) or by an embedding model (cosine similarity); both run
as pooling requests through embeddings.pooled. Without --runner pooling every route is refused."""

from __future__ import annotations

import asyncio
import json
import numbers
import re
import uuid

from ..engine.classify import (NOT_CLASSIFIER, TOKEN_CLASSIFIER_ONLY, check_activation, check_cross_encoder,
                               check_query_room, check_texts, cosine, one_text, pair_ids, pair_labels, score_pairs)
from ..engine.inputs import CHAT_TEMPLATE_FIELDS, encode_prompt
from ..engine.pooling import PoolingParams, embedding_inputs, embedding_request_id
from ..errors import RequestError
from . import protocol as p
from .body import check_values, load_json
from .embeddings import EmbeddingRequest, pooled

NOT_POOLING_SERVER = ("this server runs the model for text generation: {api} needs the server started with --runner "
                      "pooling (a classifier, or an embedding model for scores)")
_FIELDS = ("input", "messages", "model", "text_1", "text_2", "data_1", "data_2", "queries", "items", "query",
           "documents", "top_n", "return_documents",
           "truncate_prompt_tokens", "use_activation", "activation", "softmax", "priority", "request_id")


def _body(raw: bytes, needs: tuple[str, ...], max_depth: int) -> dict:
    """The body read as the other routes read theirs (`max_depth`: --max-json-depth; a body nested past Python's
    recursion limit was a 500), every string valid Unicode (an unpaired surrogate was a 500 in the pair's tokenizer)
    and every number finite."""
    body = load_json(raw, max_depth)
    check_values(body)
    if not isinstance(body, dict):
        raise p.ApiError(400, f"the body must be a JSON object with {' and '.join(needs) or 'input (or messages)'}")
    for key in needs:
        if key not in body:
            raise p.ApiError(400, f"{key} is required", param=key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise p.ApiError(400, f"model must be a string, got {type(model).__name__}", param="model")
    return body


def _refused(e: RequestError) -> p.ApiError:
    """A 400 whose param is the body's field the error names."""
    word = re.match(r"[a-z_0-9]*", e.message).group(0)
    return p.bad_request(e, param=word if word in _FIELDS else None)


def _params(body: dict, task: str | None = None) -> PoolingParams:
    return PoolingParams(truncate_prompt_tokens=body.get("truncate_prompt_tokens"), task=task,
                         use_activation=_use_activation(body), priority=body.get("priority", 0)).checked()


def _use_activation(body: dict):
    """use_activation, or the spelling vLLM still reads for it (softmax, then activation: deprecated, read by its
    get_use_activation); they were ignored: `"activation": false` answered probabilities, not the logits asked for."""
    use, named = body.get("use_activation"), "use_activation"  # (named: the field that gave `use`)
    for old in ("softmax", "activation"):
        value = body.get(old)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise RequestError(f"{old} must be true or false, got {value!r}"[:200],
                               f"{old} is vLLM's deprecated spelling of use_activation; send use_activation")
        if use is not None and use != value:
            raise RequestError(f"{old} {json.dumps(value)} contradicts {named} {json.dumps(use)}",
                               f"send use_activation alone ({old} is its deprecated spelling)")
        if use is None:
            use, named = value, old
    return use


def _pooler(server, api: str):
    pooler = getattr(server.engine, "pooler", None)
    if pooler is None:
        raise p.ApiError(400, f"The model does not support {api} API: {NOT_POOLING_SERVER.format(api=api)}",
                         code="model_not_supported")
    if pooler.task not in ("embed", "classify"):  # (a token classifier: POST /pooling alone)
        raise p.ApiError(400, f"The model does not support {api} API: {TOKEN_CLASSIFIER_ONLY}",
                         code="model_not_supported")
    return pooler


async def _run(server, request, req: EmbeddingRequest, prefix: str, arrival: float):
    return await pooled(server, request, req, server.lora_for(req.model), prefix, arrival)


def _named(label: str | None, fn, *args, **kwargs):
    """fn(*args, **kwargs), its RequestError naming the body's text `label` (none: as it is)."""
    try:
        return fn(*args, **kwargs)
    except RequestError as e:
        if label is None:
            raise
        raise RequestError(f"{label}: {e.message}", e.hint) from None


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


async def classify(server, request, raw: bytes, arrival: float):
    """POST /classify: one entry per input (its label, probs, num_classes), as vLLM's ClassificationResponse."""
    pooler = _pooler(server, "Classification")
    if pooler.task != "classify":
        raise p.ApiError(400, f"The model does not support Classification API: {NOT_CLASSIFIER}",
                         code="model_not_supported")
    body = _body(raw, (), server.limits.max_json_depth)
    chat = body.get("messages") is not None  # vLLM's ClassificationChatRequest
    if chat and body.get("input") is not None:
        raise p.ApiError(400, "send either input or messages, not both", param="input")
    if not chat and "input" not in body:
        raise p.ApiError(400, "input is required: the text (or token ids) to classify (or messages, a chat rendered "
                              "with the chat template)", param="input")
    stray = [k for k in (*CHAT_TEMPLATE_FIELDS, "chat_template") if not chat and body.get(k) is not None]
    if stray:  # (ignored: an input classified as if the template had rendered it)
        raise p.ApiError(400, f"{stray[0]} applies to the chat form (messages) only: input is classified as it is",
                         param=stray[0])
    rid = _response_id(request, body, "classify-")

    def parse() -> EmbeddingRequest:
        try:
            params = _params(body, "classify")
            room = None if params.truncate_prompt_tokens is not None else server.engine.max_model_len
            if chat:  # rendered as /v1/embeddings' chat form: no generation prompt unless asked (vLLM's default)
                given = body if body.get("add_generation_prompt") is not None else \
                    {**body, "add_generation_prompt": False}
                ids = p.chat_prompt_ids(given, server.tokenizer, room, server.parser.trust_template)
                return EmbeddingRequest(body.get("model"), [ids], params, field="messages")
            prompts = [list(map(int, item)) if isinstance(item, list) else
                       encode_prompt(server.tokenizer, prompt=item, max_tokens=room)
                       for item in embedding_inputs(body["input"], verb="classify", empty=True)]
            blank = next((i for i, ids in enumerate(prompts) if not ids), None)
            if blank is not None:  # (vLLM's: an empty text is its special tokens alone, the BOS; here none)
                raise RequestError(f"input[{blank}] is an empty string: there is nothing to classify (this model's "
                                   "tokenizer adds no BOS to it, the token vLLM classifies alone)",
                                   "remove it, or give it text")
        except RequestError as e:
            raise _refused(e) from None
        return EmbeddingRequest(body.get("model"), prompts, params)

    req = await asyncio.to_thread(parse)
    got = await _run(server, request, req, "classify-", arrival)
    if got is None:
        return None
    data = [{"index": i, **class_entry(v, pooler.labels)} for i, v in enumerate(got[0])]
    return {"id": rid, "object": "list",
            "created": p.now(), "model": req.model or server.model_id, "data": data, "usage": _usage(got[1])}


def class_entry(probs, labels) -> dict:
    """One input's answer of /classify (vLLM's ClassificationData but its index): the label of its most probable
    class (config.json's id2label), its probabilities (or logits) and how many classes."""
    return {"label": labels[int(probs.argmax())], "probs": probs.tolist(), "num_classes": len(probs)}


async def _scores(server, request, body: dict, left, right, names: tuple[str, str], prefix: str,
                  arrival: float) -> tuple[list[float], int] | None:
    """The score of each pair of `left` and `right` (score_pairs' rule) and the prompt tokens; None: client gone."""
    pooler = server.engine.pooler

    def parse() -> tuple[EmbeddingRequest, int]:
        try:
            params = _params(body)
            check_activation(params, pooler, next((k for k in ("use_activation", "softmax", "activation")
                                                   if body.get(k) is not None), "use_activation"))
            pairs = score_pairs(left, right, *names, empty=pooler.task == "classify")
            check_texts(zip((n for pair in pair_labels(left, right, *names) for n in pair),
                            (t for pair in pairs for t in pair)), server.engine.model_config.vocab_size)
            room = None if params.truncate_prompt_tokens is not None else server.engine.max_model_len
            if pooler.task == "classify":  # a pair's prompt named by its text of a list (documents[3])
                check_cross_encoder(pooler)
                if one_text(left) and params.truncate_prompt_tokens is None:
                    check_query_room(server.tokenizer, left, server.engine.max_model_len, pooler.joins_pair_text,
                                     names[0])
                # (one pair too: the engine's refusal of it named `input`, a field the body does not have)
                labels = [b for _, b in pair_labels(left, right, *names)]
                prompts = [_named(labels[i], pair_ids, server.tokenizer, a, b, server.engine.max_model_len,
                                  params.truncate_prompt_tokens, pooler.joins_pair_text)
                           for i, (a, b) in enumerate(pairs)]
            else:  # each text embedded, named by its field (query, documents[3]: not the prompts' input[7])
                labels = [name for pair in pair_labels(left, right, *names) for name in pair]
                prompts = [t if isinstance(t, list) else _named(labels[i], encode_prompt, server.tokenizer, prompt=t,
                                                                max_tokens=room)
                           for i, t in enumerate(t for pair in pairs for t in pair)]
        except RequestError as e:
            raise _refused(e) from None
        return EmbeddingRequest(body.get("model"), prompts, params, labels=tuple(labels)), len(pairs)

    req, count = await asyncio.to_thread(parse)
    got = await _run(server, request, req, prefix, arrival)
    if got is None:
        return None
    vectors, tokens = got
    if pooler.task == "classify":
        return [float(v[0]) for v in vectors], tokens
    return [cosine(vectors[2 * i], vectors[2 * i + 1]) for i in range(count)], tokens


async def score(server, request, raw: bytes, arrival: float):
    """POST /score and /v1/score: vLLM's ScoreResponse, one score per pair of text_1 and text_2."""
    _pooler(server, "Score")
    body = _body(raw, (), server.limits.max_json_depth)
    names = _score_fields(body)
    rid = _response_id(request, body, "score-")
    got = await _scores(server, request, body, body[names[0]], body[names[1]], names, "score-", arrival)
    if got is None:
        return None
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(got[0])]
    return {"id": rid, "object": "list", "created": p.now(), "model": body.get("model") or
            server.model_id, "data": data, "usage": _usage(got[1])}


SCORE_FIELDS = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))


def _score_fields(body: dict) -> tuple[str, str]:
    """The body's pair of fields of /score, as vLLM's ScoreRequest reads them: text_1 and text_2, data_1 and data_2,
    queries and documents, or queries and items; one pair, else a 400 naming what is missing or too much."""
    given = [pair for pair in SCORE_FIELDS if all(body.get(k) is not None for k in pair)]
    spellings = ", ".join(" and ".join(pair) for pair in SCORE_FIELDS)
    if len(given) == 1:  # a field of another pair beside it would be ignored: refused
        stray = next((k for pair in SCORE_FIELDS for k in pair if k not in given[0] and body.get(k) is not None), None)
        if stray is not None:
            raise p.ApiError(400, f"the body gives {stray} beside {'/'.join(given[0])}, which is not read with them: "
                                  f"give one pair of texts to score (the pairs vLLM reads: {spellings})", param=stray)
        return given[0]
    if given:
        both = " and ".join("/".join(pair) for pair in given)
        raise p.ApiError(400, f"the body gives {both}: give one pair of texts to score (the pairs vLLM reads: "
                              f"{spellings})", param=given[1][1])
    half = next((pair for pair in SCORE_FIELDS if any(body.get(k) is not None for k in pair)), SCORE_FIELDS[0])
    missing = next((k for k in half if body.get(k) is None), half[1])
    raise p.ApiError(400, f"{missing} is required" + (f" beside {half[0]}" if missing != half[0] else "") +
                     f" (give the texts to score as one of the pairs {spellings})", param=missing)


async def rerank(server, request, raw: bytes, arrival: float):
    """POST /rerank, /v1/rerank, /v2/rerank: the documents by their relevance to the query, highest first, the
    first top_n (0 or none: all), each with its index in documents and (return_documents) its text."""
    _pooler(server, "Rerank")
    body = _body(raw, ("query", "documents"), server.limits.max_json_depth)
    rid = _response_id(request, body, "rerank-")
    query, docs, top_n = body["query"], body["documents"], body.get("top_n")
    try:
        if not isinstance(query, str):  # (an empty one: score_pairs' rule, a cross-encoder scores it as vLLM)
            raise RequestError(f"query must be a text, got {type(query).__name__}")
        if not isinstance(docs, list) or not docs:
            raise RequestError("documents must be a non-empty list of texts" +
                               (", got an empty list" if docs == [] else f", got {type(docs).__name__}"),
                               "give the texts to rank")
        if one_text(docs):  # a list of token ids is one text: its ids are not documents (a 500 ranked them)
            raise RequestError("documents is a list of token ids, not a list of documents",
                               "give each document as a text or a list of token ids: [[1, 2, 3]], not [1, 2, 3]")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, numbers.Integral) or top_n < 0):
            raise RequestError(f"top_n must be a non-negative integer, got {top_n!r}"[:200],
                               "0 (or none) returns every document")
        if not isinstance(body.get("return_documents", True), bool):
            raise RequestError("return_documents must be true or false")
    except RequestError as e:
        raise _refused(e) from None
    got = await _scores(server, request, body, query, docs, ("query", "documents"), "rerank-", arrival)
    if got is None:
        return None
    order = sorted(range(len(docs)), key=lambda i: -got[0][i])[:top_n or None]
    keep = body.get("return_documents", True)
    results = [{"index": i, "relevance_score": got[0][i], **({"document": {"text": _text(server, docs[i])}}
                                                            if keep else {})} for i in order]
    usage = {"prompt_tokens": got[1], "total_tokens": got[1]}  # (vLLM's RerankUsage)
    return {"id": rid, "model": body.get("model") or server.model_id, "usage": usage,
            "results": results}


def _text(server, doc) -> str:
    """A document as rerank's `document.text` answers it (a string, as vLLM's RerankDocument): a text as given, a
    list of token ids as the tokenizer decodes it."""
    return doc if isinstance(doc, str) else server.tokenizer.decode(doc)


def _response_id(request, body: dict, prefix: str) -> str:
    """The response's id, as vLLM's: `prefix` and the client's X-Request-Id header, else the body's request_id,
    else a fresh uuid."""
    try:
        rid = embedding_request_id(body, id_prefix=prefix)
    except RequestError as e:
        raise _refused(e) from None
    given = request.headers.get("x-request-id") if request is not None else None
    return prefix + (given or rid or uuid.uuid4().hex)
