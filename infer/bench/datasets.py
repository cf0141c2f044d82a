"""Benchmark workloads: a list of `BenchRequest`s, from a spec string.

    random          `num_prompts` prompts of exactly `input_len` random token ids (special tokens excluded,
                    seeded), each asking for exactly `output_len` tokens (EOS ignored); with a `range_ratio` r > 0
                    (vLLM's --random-range-ratio) each request's lengths are drawn uniformly from
                    [len x (1 - r), len x (1 + r)] instead, so the batch holds uneven contexts as a server's does
    liteqwen        the liteqwen README comparison (Qwen1.5-14B-Chat GPTQ int4 on one V100 against vLLM):
                    16 concurrent clients, 44-token prompts, replies of about 230 characters on average,
                    max_length 4096 per request, no LoRA; figure of merit: reply characters per second.
                    Here: 44 random prompt tokens, `liteqwen_output_len(tokenizer)` tokens of reply (230 characters
                    at this tokenizer's characters-per-token on plain English text), EOS ignored,
                    max_length 4096, 5 rounds of 16 requests (80), run at concurrency 16
    jsonl:PATH      one JSON object a line: "prompt" (text) or "messages" (chat, rendered with the chat template;
                    a content may be OpenAI's list of text parts, joined, as `infer run` reads it), optional
                    "max_new_tokens" (or "max_tokens"), "lora", "ignore_eos" (a JSON boolean), "id" (not used);
                    any other field is refused, as `infer run` refuses it, rather than silently ignored
    sharegpt:PATH   a ShareGPT json file: the first human turn of each conversation is the prompt, the length in
                    tokens of the gpt turn that answers it is the output length (as vLLM's benchmark_serving)

Files are UTF-8, with or without a byte order mark (as `infer run` reads its input).
`assign_loras` spreads adapter names over the requests round-robin (`--lora-mix`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..engine.inputs import prompt_lookalike
from ..engine.sampling_params import MAX_TOKENS
from ..errors import ConfigError, RequestError, read_utf8

LITEQWEN = dict(concurrency=16, input_len=44, reply_chars=230, max_length=4096, rounds=5)
WORKLOADS = ("random", "liteqwen", "jsonl:PATH", "sharegpt:PATH")
JSONL_KEYS = ("prompt", "messages", "max_new_tokens", "max_tokens", "lora", "ignore_eos", "id")  # id: a label only


@dataclass
class BenchRequest:
    prompt: str | None  # text (what an HTTP server gets)
    prompt_token_ids: list[int] | None  # token ids (what the in-process engine gets)
    output_len: int  # max_new_tokens
    lora: str | None = None
    ignore_eos: bool = False
    max_length: int | None = None  # prompt + output cap, if the workload has one

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids or [])


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    description: str
    concurrency: int | None = None  # the concurrency the workload is defined at (liteqwen: 16)


def load_workload(spec: str, tokenizer, *, num_prompts: int | None = None, input_len: int = 128,
                  output_len: int = 128, seed: int = 0, ignore_eos: bool | None = None,
                  range_ratio: float = 0.0, pooling: bool = False) -> Workload:
    """Build the workload named by `spec` (see the module docstring). `ignore_eos=None` keeps the workload's
    default (random, liteqwen: True; jsonl, sharegpt: False). `range_ratio` applies to random only. `pooling`
    (embeddings: no token generated): a random workload's description says no output length."""
    if range_ratio and spec != "random":
        raise ConfigError(f"a range ratio of {range_ratio} applies to the random dataset, not {spec!r}",
                          "drop --random-range-ratio, or use --dataset random")
    if spec == "random":
        reqs = random_requests(tokenizer, num_prompts or 100, input_len, output_len, seed, range_ratio=range_ratio)
        if range_ratio:
            (ilo, ihi), (olo, ohi) = length_range(input_len, range_ratio), length_range(output_len, range_ratio)
            out = "" if pooling else f", {olo}-{ohi} output tokens"
            desc = f"random: {len(reqs)} prompts of {ilo}-{ihi} tokens{out} (uniform, range ratio {range_ratio:g})"
        else:
            desc = f"random: {len(reqs)} prompts of {input_len} tokens" + \
                ("" if pooling else f", {output_len} output tokens")
        wl = Workload("random", reqs, desc)
    elif spec == "liteqwen":
        wl = liteqwen_workload(tokenizer, num_prompts, seed)
    elif spec.startswith("jsonl:"):
        reqs = jsonl_requests(spec[6:], tokenizer, output_len)[:num_prompts]
        wl = Workload("jsonl", reqs, f"{spec}: {len(reqs)} prompts")
    elif spec.startswith("sharegpt:"):
        reqs = sharegpt_requests(spec[9:], tokenizer, num_prompts or 1000, seed)
        wl = Workload("sharegpt", reqs, f"{spec}: {len(reqs)} conversations")
    else:
        raise ConfigError(f"unknown workload {spec!r}", f"use one of {', '.join(WORKLOADS)}")
    if ignore_eos is not None:
        wl.requests = [replace(r, ignore_eos=ignore_eos) for r in wl.requests]
    return wl


def assign_loras(requests: list[BenchRequest], names: list[str], include_base: bool = False) -> list[BenchRequest]:
    """Give request i the adapter names[i % K] (with the base model, None, as one more choice if include_base)."""
    choices: list[str | None] = list(names) + ([None] if include_base else [])
    if not choices:
        return list(requests)
    return [replace(r, lora=choices[i % len(choices)]) for i, r in enumerate(requests)]


# ---------------------------------------------------------------------------------------------- random / liteqwen
def normal_token_ids(tokenizer) -> np.ndarray:
    """Every id of the tokenizer's vocabulary that is not a special token."""
    special = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, t in added.items() if getattr(t, "special", False)}
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """The lengths a range ratio draws from: [length x (1 - ratio), length x (1 + ratio)], rounded inward, at
    least 1 (vLLM's random dataset)."""
    if not 0 <= ratio < 1:
        raise ConfigError(f"the range ratio must be in [0, 1), got {ratio}",
                          "e.g. --random-range-ratio 0.5 draws lengths from half to one and a half times "
                          "--input-len and --output-len")
    return max(1, math.ceil(length * (1 - ratio))), max(1, math.floor(length * (1 + ratio)))


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                    max_length: int | None = None, range_ratio: float = 0.0) -> list[BenchRequest]:
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ConfigError(f"random workload needs num_prompts, input_len and output_len >= 1 "
                          f"(got {num_prompts}, {input_len}, {output_len})")
    ilo, ihi = length_range(input_len, range_ratio)
    olo, ohi = length_range(output_len, range_ratio)
    vocab = normal_token_ids(tokenizer)
    rng = np.random.default_rng(seed)
    lengths = np.random.default_rng([seed, 1])  # its own stream: range ratio 0 keeps the same prompts as before
    reqs = []
    for _ in range(num_prompts):
        n = int(lengths.integers(ilo, ihi + 1)) if range_ratio else input_len
        out = int(lengths.integers(olo, ohi + 1)) if range_ratio else output_len
        ids = rng.choice(vocab, size=n).tolist()
        reqs.append(BenchRequest(tokenizer.decode(ids), ids, out, ignore_eos=True, max_length=max_length))
    return reqs


def liteqwen_output_len(tokenizer, reply_chars: int = LITEQWEN["reply_chars"]) -> int:
    """Tokens that make `reply_chars` characters of plain text with this tokenizer (measured on the built-in
    English corpus)."""
    text = (Path(__file__).resolve().parents[1] / "models" / "data" / "corpus.txt").read_text()
    n_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    return max(1, round(reply_chars * n_tokens / len(text)))


def liteqwen_workload(tokenizer, num_prompts: int | None = None, seed: int = 0) -> Workload:
    c = LITEQWEN
    n = num_prompts or c["concurrency"] * c["rounds"]
    out_len = liteqwen_output_len(tokenizer)
    reqs = random_requests(tokenizer, n, c["input_len"], out_len, seed, max_length=c["max_length"])
    desc = (f"liteqwen: {n} requests at concurrency {c['concurrency']}, {c['input_len']}-token prompts, "
            f"{out_len} output tokens (~{c['reply_chars']} characters), max_length {c['max_length']}")
    return Workload("liteqwen", reqs, desc, concurrency=c["concurrency"])


# ---------------------------------------------------------------------------------------------- files
def _read(path: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"workload file {p} does not exist", "pass an existing file: jsonl:PATH or sharegpt:PATH")
    text = read_utf8(p, "workload file")
    return text[1:] if text.startswith("\ufeff") else text  # a byte order mark (Windows editors), as infer run


def _loads(text: str, where: str, hint: str):
    """json.loads, with every way a text can be unreadable (bad JSON, an integer of more than 4300 digits, arrays
    nested too deeply for the decoder) a ConfigError naming `where`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = f"column {e.colno}" if e.lineno == 1 else f"line {e.lineno}, column {e.colno}"
        raise ConfigError(f"{where} is not valid JSON: {e.msg} ({at})", hint) from None
    except RecursionError:
        raise ConfigError(f"{where} is not valid JSON: nested too deeply", hint) from None
    except ValueError as e:  # an integer of more than 4300 digits (Python's advice to raise the limit left out)
        raise ConfigError(f"{where} is not valid JSON: {str(e).split(';')[0]}", hint) from None


def _check_text(value, name: str, where: str) -> None:
    """`infer run`'s check (a lone surrogate, which JSON can carry, is refused), as a ConfigError naming `where`."""
    from ..engine.inputs import check_text
    try:
        check_text(value, name)
    except RequestError as e:
        raise ConfigError(f"{where}: {e.message}", e.hint) from None


def _render(tokenizer, obj: dict, where: str) -> tuple[str, list[int]]:
    from ..engine.inputs import chat_messages, reads_content_parts, template_error
    if isinstance(obj.get("prompt"), str) and obj["prompt"]:
        text = obj["prompt"]  # tokenized as infer run and the server tokenize a prompt: with its special tokens
        _check_text(text, "prompt", where)
        return text, tokenizer.encode(text)
    msgs = obj.get("messages")
    if isinstance(msgs, list) and msgs:
        try:  # as `infer run` reads them: text parts joined, other parts (images, audio) refused
            msgs = chat_messages(msgs, reads_content_parts(tokenizer))
        except RequestError as e:
            raise ConfigError(f"{where}: {e.message}", e.hint) from None
        _check_text(msgs, "messages", where)
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{where}: has 'messages' but the tokenizer has no chat template",
                              "give it one with --chat-template, or a 'prompt' string instead")
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (roles that must alternate, ...), or its syntax
            error = template_error(e)
            raise ConfigError(f"{where}: {error.message}", error.hint) from None
        return text, tokenizer.encode(text, add_special_tokens=False)
    raise ConfigError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list",
                      'e.g. {"prompt": "Hello"} or {"messages": [{"role": "user", "content": "Hello"}]}')


def jsonl_requests(path: str, tokenizer, default_output_len: int) -> list[BenchRequest]:
    reqs = []
    for lineno, line in enumerate(_read(path).split("\n"), 1):  # not splitlines: U+2028 may sit inside a string
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        obj = _loads(line, where, "one JSON object per line")
        if not isinstance(obj, dict):
            raise ConfigError(f"{where} is not a JSON object", "one JSON object per line")
        unknown = sorted(set(obj) - set(JSONL_KEYS))
        if unknown:  # as `infer run` refuses them: a field that would change the request is not silently dropped
            rename = prompt_lookalike(obj, unknown)
            raise ConfigError(f"{where}: unknown field(s) {unknown}",
                              f"{rename + '; ' if rename else ''}allowed: {', '.join(JSONL_KEYS)}")
        text, ids = _render(tokenizer, obj, where)
        n = obj.get("max_new_tokens", obj.get("max_tokens", default_output_len))
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_TOKENS:
            raise ConfigError(f"{where}: max_new_tokens must be an integer in 1..{MAX_TOKENS}, got {n!r}")
        lora = obj.get("lora")
        if lora is not None and not isinstance(lora, str):
            raise ConfigError(f"{where}: lora must be an adapter name (a string), got {lora!r}")
        ignore_eos = obj.get("ignore_eos")
        if ignore_eos is not None and not isinstance(ignore_eos, bool):
            raise ConfigError(f"{where}: ignore_eos must be true or false, got {ignore_eos!r}",
                              'write a JSON boolean: "ignore_eos": true')
        reqs.append(BenchRequest(text, ids, n, lora=lora, ignore_eos=bool(ignore_eos)))
    if not reqs:
        raise ConfigError(f"workload file {path} has no requests", "one JSON object per line")
    return reqs


def _first_exchange(conv) -> tuple[str, str] | None:
    """(first human turn, the gpt turn that answers it), or None."""
    if not isinstance(conv, list):
        return None
    for a, b in zip(conv, conv[1:]):
        if isinstance(a, dict) and isinstance(b, dict) and a.get("from") in ("human", "user") \
                and b.get("from") in ("gpt", "assistant", "chatgpt"):
            if isinstance(a.get("value"), str) and isinstance(b.get("value"), str):
                return a["value"], b["value"]
            return None
    return None


def sharegpt_requests(path: str, tokenizer, num_prompts: int, seed: int = 0, max_prompt_len: int = 1024,
                      max_total_len: int = 2048) -> list[BenchRequest]:
    """Like vLLM: shuffle (seeded), skip pairs with fewer than 4 prompt or output tokens, prompts over
    `max_prompt_len` tokens and pairs over `max_total_len` tokens, keep the first `num_prompts`."""
    data = _loads(_read(path), path, "a ShareGPT file is one JSON list of {\"conversations\": [...]}")
    if not isinstance(data, list):
        raise ConfigError(f"{path} is not a JSON list", "a ShareGPT file is one JSON list of {\"conversations\": ...}")
    pairs = []
    for i, d in enumerate(data):
        pair = _first_exchange(d.get("conversations")) if isinstance(d, dict) else None
        if pair:
            _check_text(list(pair), "the conversation", f"{path} item {i}")
            pairs.append(pair)
    random.Random(seed).shuffle(pairs)
    reqs = []
    for prompt, reply in pairs:
        if len(reqs) >= num_prompts:
            break
        ids = tokenizer.encode(prompt)  # as the prompt is sent (a completions request: with special tokens)
        out_len = len(tokenizer.encode(reply, add_special_tokens=False))
        if len(ids) < 4 or out_len < 4 or len(ids) > max_prompt_len or len(ids) + out_len > max_total_len:
            continue
        reqs.append(BenchRequest(prompt, ids, out_len))
    if not reqs:
        raise ConfigError(f"{path} has no usable conversations",
                          "each needs a human turn followed by a gpt turn, both of at least 4 tokens")
    return reqs
