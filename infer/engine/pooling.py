"""Embeddings from a decoder model (vLLM's pooling runner: `--runner pooling`, LLM.embed, POST /v1/embeddings).

A pooling request runs its prompt through the model (prefill only) and ends with one vector: the final hidden
states (after the model's final norm, as transformers' AutoModel last_hidden_state) pooled over the prompt, LAST
(the last token's), MEAN (the mean of every token's) or CLS (the first token's), then cut to the request's
`dimensions` (a matryoshka model only) and L2-normalized when the pooler normalizes. How a model pools is vLLM's
rule: --pooler-config where given, else the sentence-transformers files beside the weights (`modules.json`, its
Pooling module's `config.json`, a Normalize module), else LAST and normalized (vLLM's default for a decoder).

Chunked prefill: a MEAN pool sums each chunk's rows on the device as the chunk runs. A prefix-cache hit skips the
hit's tokens, which MEAN and CLS need: the engine keeps prefix caching for LAST pooling only (as vLLM does).
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import ConfigError, RequestError, bom_error, json_problem
from .sampling_params import RequestOutputKind

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# vLLM's per-token tasks (LLM.encode's pooling_task, POST /pooling): every prompt token's row, in order (pooling type
# ALL): an embedding model's hidden states (token_embed), a classifier's class distributions (token_classify)
TOKEN_TASKS = ("token_embed", "token_classify")
TASKS = ("embed", "classify", *TOKEN_TASKS)
RUNNERS = ("auto", "generate", "pooling")
# sentence-transformers' Pooling config keys -> vLLM's pooling types (the others: max, mean_sqrt_len, weightedmean)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
GENERATE_ONLY = ("this server runs the model as a pooling model (--runner pooling): it answers /v1/embeddings, "
                 "not text generation")
EMBED_ONLY = "this model is served for text generation: /v1/embeddings needs the server started with --runner pooling"
# an engine's (LLM, AsyncLLM, infer run, a server's engine) refusals of the other runner's requests
NOT_POOLING = ("this engine runs the model for text generation: an embedding request (LLM.embed, AsyncLLM.encode, "
               "POST /v1/embeddings, an infer run line of url /v1/embeddings) needs the pooling runner")
NOT_GENERATING = ("LLM.generate() is only supported for generative models: this engine runs the model as a pooling "
                  "model (--runner pooling), which makes embeddings, not text")
EMBED_INSTEAD = ("embed instead (LLM.embed, AsyncLLM.encode, POST /v1/embeddings, infer run lines of url "
                 "/v1/embeddings), or start the engine with --runner generate")


def parse_pooler_config(value) -> dict | None:
    """--pooler-config (JSON text or a dict): {"pooling_type": LAST | MEAN | CLS, "normalize": bool}, either key."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:  # (a 5000-digit integer, arrays nested past the parser)
            raise ConfigError(f"--pooler-config is not JSON: {json_problem(e)}",
                              '--pooler-config \'{"pooling_type": "MEAN", "normalize": true}\'') from None
    if not isinstance(value, dict):
        raise ConfigError(f"--pooler-config must be a JSON object, got {type(value).__name__}",
                          '--pooler-config \'{"pooling_type": "LAST"}\'')
    other = sorted(set(value) - {"pooling_type", "normalize", "use_activation"}, key=str)
    if other:
        raise ConfigError(f"--pooler-config has {', '.join(map(repr, other))}, which infer does not take",
                          "give pooling_type (LAST, MEAN or CLS), normalize (an embedding model's, true or false) "
                          "and/or use_activation (a classifier's, true or false)")
    out = dict(value)
    if "pooling_type" in out:
        kind = out["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ConfigError(f"--pooler-config pooling_type {kind!r} is not one of {', '.join(POOLING_TYPES)}",
                              "LAST: the last token's state; MEAN: the mean over the prompt; CLS: the first token's")
        out["pooling_type"] = kind.upper()
    for key in ("normalize", "use_activation"):
        if key in out and not isinstance(out[key], bool):
            raise ConfigError(f"--pooler-config {key} must be true or false, got {out[key]!r}")
    return out


@dataclass(frozen=True)
class Pooler:
    """How a pooling engine's model pools: its type, whether it normalizes, its matryoshka dimensions (None: not a
    matryoshka model; [] any dimensions up to hidden_size). A classifier's (task "classify", engine.classify): its
    classes' labels, whether its logits go through the activation (softmax; sigmoid for one label) and its
    config.json's problem_type."""

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int = 0
    matryoshka: list[int] | None = None
    task: str = "embed"
    labels: tuple[str, ...] = ()
    use_activation: bool = True
    problem_type: str | None = None
    pad_token_id: int | None = None  # a classifier's config.json pad_token_id (engine.classify.pooled_prompt)
    joins_pair_text: bool = False  # a score's pair run as text_1 + text_2 (vLLM's use_pad_token false: LLM rerankers)

    @property
    def caches_prefixes(self) -> bool:
        """A prefix-cache hit skips tokens: only the last token's state is sure to be computed."""
        return self.pooling_type == "LAST"

    @property
    def classifies(self) -> bool:
        """Whether the model's pooled states go through its score head (a classifier's, of either kind)."""
        return self.task in ("classify", "token_classify")

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks a request may ask of the model (vLLM's supported_tasks): an embedding model's embed and
        token_embed, a sequence classifier's classify and token_classify, a token classifier's token_classify."""
        return {"embed": ("embed", "token_embed"), "classify": ("classify", "token_classify")}.get(self.task,
                                                                                                   (self.task,))


def _json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise bom_error(path) or ConfigError(f"cannot read {path}: {e}", "fix or remove the file") from None


def sentence_transformers_pooling(folder: Path) -> dict:
    """{"pooling_type", "normalize"} from a sentence-transformers model's modules.json (empty without one)."""
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        return {}
    out = {"normalize": any(isinstance(m, dict) and m.get("type") == _ST_NORMALIZE for m in modules)}
    pool = next((m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING), None)
    cfg = _json(folder / str(pool.get("path", "")) / "config.json") if pool is not None else None
    if isinstance(cfg, dict):
        modes = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
        unknown = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES)
        if unknown or len(modes) > 1:
            raise ConfigError(f"{folder / pool['path'] / 'config.json'} asks for pooling "
                              f"{', '.join(unknown) or ' and '.join(modes)}, which infer does not run",
                              "give one of LAST, MEAN or CLS with --pooler-config '{\"pooling_type\": \"MEAN\"}'")
        if modes:
            out["pooling_type"] = modes[0]
    return out


def classifier_folder(model) -> bool:
    """Whether `model` is a folder of a *ForSequenceClassification model (vLLM's runner auto pools it)."""
    from ..models.classifier import is_classifier
    path = Path(str(model)) / "config.json"
    cfg = _json(path) if path.is_file() else None
    return isinstance(cfg, dict) and is_classifier(cfg)


def resolve_pooler(folder: Path, hidden_size: int, override: dict | None, model_config=None) -> Pooler:
    """The model's Pooler: --pooler-config's keys, else the sentence-transformers files', else LAST, normalized; a
    classifier's (`model_config` of a ForSequenceClassification): LAST, its logits through the activation."""
    from ..models.classifier import is_classifier, is_token_classifier, labels, token_head
    if model_config is not None and is_classifier(model_config):
        if "normalize" in (override or {}):
            raise ConfigError("--pooler-config normalize is for an embedding model: this model is a classifier",
                              "give use_activation (false: the raw logits) instead")
        if is_token_classifier(model_config):  # every token's class distribution (vLLM's token_classify, ALL)
            if "pooling_type" in (override or {}):
                raise ConfigError("--pooler-config pooling_type is not for a token classifier (a "
                                  "*ForTokenClassification model): it classifies every token of the prompt",
                                  "leave pooling_type out (use_activation false gives the raw logits)")
            return Pooler("ALL", False, hidden_size, None, "token_classify", tuple(labels(model_config)),
                          (override or {}).get("use_activation", True), getattr(model_config, "problem_type", None))
        spec = {"pooling_type": "LAST", "use_activation": True, **(override or {})}
        # a classifier of lm_head's rows of tokens (an LLM reranker, vLLM's): the causal LM's last token, the pair
        # as one text unless config.json's use_pad_token (vLLM's) says to join it as the tokenizer joins a pair
        tokens = token_head(model_config) is not None
        return Pooler(spec["pooling_type"], False, hidden_size, None, "classify", tuple(labels(model_config)),
                      spec["use_activation"], getattr(model_config, "problem_type", None),
                      None if tokens else getattr(model_config, "pad_token_id", None),
                      tokens and getattr(model_config, "use_pad_token", False) is not True)
    if "use_activation" in (override or {}):
        raise ConfigError("--pooler-config use_activation is for a classifier (a *ForSequenceClassification "
                          "model): this model makes embeddings", "give normalize instead")
    spec = {"pooling_type": "LAST", "normalize": True}
    spec.update(sentence_transformers_pooling(Path(folder)))
    spec.update(override or {})
    cfg = _json(Path(folder) / "config.json") or {}
    dims = cfg.get("matryoshka_dimensions") if isinstance(cfg, dict) else None
    matryoshka = list(dims) if isinstance(dims, list) else ([] if isinstance(cfg, dict) and cfg.get("is_matryoshka")
                                                            else None)
    return Pooler(spec["pooling_type"], spec["normalize"], hidden_size, matryoshka)


@dataclass
class PoolingParams:
    """vLLM's PoolingParams for an embedding: `dimensions` (a matryoshka model's shorter vector), `normalize` (None:
    the model's pooler decides), `truncate_prompt_tokens` (keep the prompt's last tokens; -1: the context's worth)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    use_activation: bool | None = None  # a classifier's: softmax/sigmoid of its logits (None: the pooler's choice)
    task: str | None = None  # "embed" or "classify": what the request asks of the model (None: whatever it does)
    n: int = field(default=1, init=False, repr=False)  # (one vector a request: LLM fans nothing out)
    output_kind = RequestOutputKind.FINAL_ONLY  # (AsyncLLM.encode yields the finished output alone)

    def checked(self) -> "PoolingParams":
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, numbers.Integral)):
            raise RequestError(f"dimensions must be an integer, got {self.dimensions!r}")
        for key in ("normalize", "use_activation"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), bool):
                raise RequestError(f"{key} must be true, false or None, got {getattr(self, key)!r}"[:200])
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Integral) or (t < 1 and t != -1)):
            raise RequestError(f"truncate_prompt_tokens must be a positive integer or -1, got {t!r}")
        if self.task not in (None, *TASKS):
            raise RequestError(f"task must be {', '.join(TASKS)} or None, got {self.task!r}"[:200])
        if self.priority is None:  # (the server's field sent as null: its default)
            self.priority = 0
        if isinstance(self.priority, bool) or not isinstance(self.priority, numbers.Integral):
            raise RequestError(f"priority must be an integer, got {self.priority!r}"[:200],
                               "lower values run first under --scheduling-policy priority")
        return self

    def check_dimensions(self, pooler: Pooler, model: str) -> None:
        """vLLM's rule: `dimensions` only for a matryoshka model, within its dimensions."""
        d = self.dimensions
        if d is None:
            return
        if pooler.matryoshka is None:
            raise RequestError(f"model {model!r} does not support matryoshka representation, changing output "
                               "dimensions will lead to poor results", "leave dimensions out")
        if d < 1 or d > pooler.hidden_size:
            raise RequestError(f"dimensions must be in 1..{pooler.hidden_size}, got {d}", "leave dimensions out")
        if pooler.matryoshka and d not in pooler.matryoshka:
            raise RequestError(f"model {model!r} only supports {pooler.matryoshka} matryoshka dimensions, got {d}",
                               f"give one of {pooler.matryoshka}")


class EmbeddingOutput:
    """vLLM's EmbeddingOutput: the vector as a list of floats (`data`: the float32 tensor)."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        return self.data.shape[-1]


class EmbeddingRequestOutput:
    """vLLM's EmbeddingRequestOutput (a finished pooling request): `.outputs.embedding`, `.prompt_token_ids`."""

    finished = True
    finish_reason = "stop"
    error = None
    bad_request = False
    prompt: str | None = None
    engine_index = 0  # (what the server's metrics read of an output: no token generated, no token times)
    num_generated = 0
    new_token_ids = ()
    first_token_time = None

    def __init__(self, seq, outputs: EmbeddingOutput):
        self.request_id, self.outputs = seq.request_id, outputs
        self.prompt_token_ids = getattr(seq, "given_prompt_ids", seq.prompt_token_ids)  # (LLMEngine.add_request's)
        self.lora, self.lora_request, self.num_cached_tokens = seq.lora_name, seq.lora_request, seq.num_cached_tokens
        self.arrival_time, self.first_scheduled_time = seq.arrival_time, seq.first_scheduled_time

    @staticmethod
    def token_times_from(start: int) -> list[float]:
        return []

    def __repr__(self) -> str:
        return (f"EmbeddingRequestOutput(request_id={self.request_id!r}, hidden_size={self.outputs.hidden_size}, "
                f"prompt_tokens={len(self.prompt_token_ids)})")


class PoolingOutput:
    """vLLM's PoolingOutput: `data`, the request's float32 tensor (a per-token task's: [prompt tokens, dim])."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    @property
    def hidden_size(self) -> int:
        return self.data.shape[-1]


class PoolingRequestOutput(EmbeddingRequestOutput):
    """vLLM's PoolingRequestOutput (LLM.encode's of a per-token task): `.outputs.data`, `.prompt_token_ids`."""

    def __repr__(self) -> str:
        return (f"PoolingRequestOutput(request_id={self.request_id!r}, shape={list(self.outputs.data.shape)}, "
                f"prompt_tokens={len(self.prompt_token_ids)})")


def task_refusal(task: str, pooler: Pooler) -> RequestError:
    """The refusal of a request asking a pooling model for a task it does not do (vLLM's supported_tasks)."""
    if task in ("embed", "classify") and pooler.task in ("embed", "classify"):
        from .classify import NOT_CLASSIFIER, NOT_EMBEDDER
        return RequestError(NOT_EMBEDDER if task == "embed" else NOT_CLASSIFIER,
                            "embed with an embedding model" if task == "embed" else "load a classifier")
    needs = {"embed": "an embedding model", "token_embed": "an embedding model",
             "classify": "a *ForSequenceClassification model",
             "token_classify": "a *ForTokenClassification or *ForSequenceClassification model"}
    return RequestError(f"pooling task {task!r} is not supported by this model: it does "
                        f"{', '.join(pooler.tasks)}", f"ask for one of those, or run {task} on {needs[task]}")


def output_tokens(out) -> int:
    """The tokens a finished or partial output counts for a run's throughput: a generation's new tokens, an
    embedding's prompt (it generates none: `infer run --runner pooling` said 0 tokens, 0.0 tok/s)."""
    return len(out.prompt_token_ids) if isinstance(out, EmbeddingRequestOutput) else len(out.new_token_ids)


def throughput_words(task: str | None) -> str:
    """What a run's summary calls the tokens output_tokens counts (`task`: the pooling engine's, embed or classify;
    None: a generating engine's)."""
    return {None: "tokens", "classify": "prompt tokens classified", "token_classify": "prompt tokens classified"
            }.get(task, "prompt tokens embedded")


EMBEDDINGS_URL = "/v1/embeddings"
POOLING_URL = "/pooling"  # vLLM's PoolingRequest: a task of the model's (pooling_task_params)
ENCODINGS = ("float", "base64")
_INPUT_FORMS = "give a string, a list of strings, a list of token ids, or a list of token-id lists"


def _is_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def embedding_inputs(value, name: str = "input", verb: str = "embed", empty: bool = False) -> list:
    """An embeddings body's `input` (OpenAI's four forms) as a list of prompts, each text or a list of token ids;
    RequestError naming the item otherwise (an empty text: nothing to `verb`, the route's task; `empty`: an empty
    text taken, for the tokenizer's special tokens alone, as vLLM's /classify runs just the BOS)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_id(t) for t in value)):
        value = [value]
    if not isinstance(value, list):
        raise RequestError(f"{name} must be text or token ids, got {type(value).__name__}", _INPUT_FORMS)
    if not value:
        raise RequestError(f"{name} is an empty list", _INPUT_FORMS)
    for i, item in enumerate(value):
        if isinstance(item, str) and not item and not empty:
            raise RequestError(f"{name}[{i}] is an empty string: there is nothing to {verb}", "remove it")
        if isinstance(item, list) and not item:
            raise RequestError(f"{name}[{i}] is an empty list of token ids", "remove it")
        if not isinstance(item, str) and not (isinstance(item, list) and all(_is_id(t) for t in item)):
            raise RequestError(f"{name}[{i}] is neither text nor a list of token ids (integers)", _INPUT_FORMS)
    return value


@dataclass(frozen=True)
class Encoding:
    """How an embeddings response writes its vectors (vLLM's body fields): `format` float (JSON numbers) or
    base64 (the vector's bytes as `dtype`, in `endianness`: native is the server's, as vLLM's)."""

    format: str = "float"
    dtype: str = "float32"
    endianness: str = "native"


def _choice(body: dict, key: str, default: str, allowed: tuple, prefix: str, hint: str | None = None) -> str:
    value = body.get(key)
    value = default if value is None else value
    if value not in allowed:
        raise RequestError(f"{prefix}{key} {value!r} is not one of {', '.join(allowed)}"[:300], hint)
    return value


def embedding_encoding(body: dict, prefix: str = "") -> Encoding:
    """The Encoding of an embeddings body: encoding_format, embed_dtype, endianness (vLLM's); RequestError naming
    the field otherwise (vLLM's encoding_format "bytes", a binary response, is refused)."""
    if body.get("encoding_format") == "bytes":
        raise RequestError(f"{prefix}encoding_format 'bytes' (vLLM's binary response) is not supported by infer",
                           "send encoding_format base64: the same bytes (embed_dtype, endianness), base64-encoded")
    fmt = _choice(body, "encoding_format", "float", ENCODINGS, prefix)  # ("" or {} was float)
    dtype = _choice(body, "embed_dtype", "float32", tuple(EMBED_DTYPES), prefix)
    return Encoding(fmt, dtype, _choice(body, "endianness", "native", ENDIANNESS, prefix))


# vLLM's embed_dtype names (the fp8 ones: the bytes of the float8 values, as vLLM writes them)
EMBED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ENDIANNESS = ("native", "little", "big")


def embedding_fields(body: dict, prefix: str = "", chat: bool = False) -> tuple[PoolingParams, Encoding]:
    """(PoolingParams, Encoding) of an embeddings body (`chat`: its messages form); RequestError naming the field
    otherwise."""
    fmt = embedding_encoding(body, prefix)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"{prefix}model must be a string, got {type(model).__name__}")
    from .inputs import check_add_special_tokens  # (inputs imports this module)
    try:  # (vLLM's add_special_tokens: a text's special tokens, which infer always adds; false is refused)
        check_add_special_tokens(body.get("add_special_tokens"), chat=chat)
        params = PoolingParams(dimensions=body.get("dimensions"), normalize=body.get("normalize"),
                               truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
                               priority=body.get("priority", 0), task="embed").checked()
    except RequestError as e:
        raise RequestError(prefix + e.message, e.hint) from None
    return params, fmt


def default_task(classifies: bool, per_token: bool = False) -> str:
    """The task of a POST /pooling body without one (vLLM's ModelConfig.get_pooling_task): the model's own, embed for
    an embedding model, classify for a sequence classifier (`classifies`), token_classify for a token classifier
    (`per_token`); a per-token task of the others only when asked."""
    return "token_classify" if per_token else "classify" if classifies else "embed"


def pooling_task_params(body: dict, params: PoolingParams, classifies: bool, pooler: Pooler | None = None,
                        prefix: str = "", per_token: bool = False) -> PoolingParams:
    """A POST /pooling body's params (vLLM's PoolingRequest): its `task` (by default the model's own, default_task:
    `pooler`'s where known, else `classifies` and `per_token` say it) and a classifier's use_activation;
    RequestError naming the field for a task the model (`pooler`, where known) does not do, or a field the task does
    not take."""
    task = body.get("task")
    if task is None:
        task = pooler.task if pooler is not None else default_task(classifies, per_token)
    if task not in TASKS:
        raise RequestError(f"{prefix}task {task!r} is not one of {', '.join(TASKS)}"[:200],
                           "token_embed / token_classify: a row per prompt token; embed / classify: one vector")
    if pooler is not None and task not in pooler.tasks:
        e = task_refusal(task, pooler)
        raise RequestError(f"{prefix}task: {e.message}", e.hint)
    use = body.get("use_activation")
    if use is not None and "classify" not in task:
        raise RequestError(f"{prefix}use_activation is a classifier's field: task {task} gives hidden states",
                           "leave use_activation out")
    # (vLLM's PoolingParams: embed and token_embed's fields only)
    for key, why in (("normalize", "use_activation false gives the raw logits"),
                     ("dimensions", "a classifier's output has one value per label")):
        if body.get(key) is not None and "embed" not in task:
            raise RequestError(f"{prefix}{key} is an embedding's field: task {task} gives class probabilities",
                               f"leave {key} out ({why})")
    try:
        return replace(params, task=task, use_activation=use).checked()
    except RequestError as e:
        raise RequestError(prefix + e.message, e.hint) from None


def embedding_request_id(body: dict, prefix: str = "", id_prefix: str = "embd-") -> str | None:
    """An embeddings body's request_id (vLLM's field: the response's id is `id_prefix` and it, else a uuid); "" is
    none given, as vLLM's; RequestError otherwise."""
    rid = body.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise RequestError(f"{prefix}request_id must be a string, got {type(rid).__name__}",
                           f'e.g. "request_id": "job-7" (the response\'s id is then {id_prefix}job-7)')
    return rid or None


def pool_rows(hidden: torch.Tensor, seqs: list, num_new: list[int], order: list[int], pooler: Pooler) -> dict:
    """{index in the batch: the pooled float32 vector} for the sequences whose prompt this step completes; `hidden`
    holds the step's rows in `order` (ModelRunner.prepare's). MEAN sums each chunk into seq.pool_sum; CLS keeps the
    first position's row (a chunk that starts the prompt again, after a preemption, starts them over)."""
    out, at = {}, 0
    for i in order:
        seq, n = seqs[i], num_new[i]
        rows, start = hidden[at:at + n], seq.num_computed_tokens
        at += n
        if every_token(seq, pooler):  # each chunk's rows kept, in order, gathered when the prompt completes
            kept = rows.clone()  # (a copy, in the model's dtype: a long prompt's rows held on the device at half
            # float32's size, outside the KV cache, while its chunks run; float32 of them is exact)
            seq.pool_rows = [kept] if start == 0 else [*seq.pool_rows, kept]
            if start + n >= len(seq.prompt_token_ids):
                out[i] = _gathered(seq.pool_rows)
                seq.pool_rows = None
            continue
        if pooler.pooling_type == "MEAN":
            part = rows.float().sum(0)
            seq.pool_sum = part if start == 0 or getattr(seq, "pool_sum", None) is None else seq.pool_sum + part
        elif pooler.pooling_type == "CLS" and start == 0:
            seq.pool_sum = _copied(rows[0])
        if start + n < len(seq.prompt_token_ids):
            continue
        if pooler.pooling_type == "LAST":
            out[i] = _copied(rows[-1])
        elif pooler.pooling_type == "MEAN":
            out[i] = seq.pool_sum / len(seq.prompt_token_ids)
        else:
            out[i] = seq.pool_sum
        seq.pool_sum = None
    return out


def _gathered(parts: list[torch.Tensor]) -> torch.Tensor:
    """A per-token request's rows, its chunks' in order, as one float32 tensor (filled part by part: no
    model-dtype copy of them all beside it)."""
    whole = torch.empty((sum(len(p) for p in parts), parts[0].shape[-1]), dtype=torch.float32,
                        device=parts[0].device)
    at = 0
    for part in parts:
        whole[at:at + len(part)] = part
        at += len(part)
    return whole


def every_token(seq, pooler: Pooler) -> bool:
    """Whether a pooling sequence keeps every prompt token's row (a per-token task, or a token classifier's ALL)."""
    return pooler.pooling_type == "ALL" or getattr(getattr(seq, "pooling", None), "task", None) in TOKEN_TASKS


def _copied(row: torch.Tensor) -> torch.Tensor:
    """A row of the step's hidden states as a float32 tensor of its own: a CUDA graph's hidden states are its static
    output buffer, which the next step's replay overwrites (`.float()` of float32 rows is the row itself: a float32
    model's CLS row, kept across the prompt's chunks, and a LAST vector not normalized, were the next step's)."""
    return row.to(torch.float32, copy=True)


def finish_vector(vec: torch.Tensor, pooler: Pooler, params: PoolingParams) -> torch.Tensor:
    """The request's vector: cut to its dimensions, then L2-normalized (as vLLM's embedding head), on the host; a
    classifier's logits through its activation (engine.classify)."""
    if pooler.classifies:
        from .classify import activated
        return activated(vec, pooler, params).cpu()
    if params.dimensions is not None:  # (a token_embed's [tokens, hidden]: each row cut and normalized)
        vec = vec[..., :params.dimensions]
    if pooler.normalize if params.normalize is None else params.normalize:
        vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
    return vec.cpu()
