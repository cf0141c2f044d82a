"""Checks of user input that every layer applies the same way: text that is valid Unicode, sizes in bytes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from .errors import ConfigError, RequestError

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*((?:[KMGT]i?)?B?)?\s*$", re.I)


def check_text(value: Any, name: str) -> None:
    """Every string in `value` (a string, or the lists and objects of a messages array) must be valid Unicode:
    JSON can carry an escaped lone surrogate (\\ud800) that no tokenizer or UTF-8 writer accepts."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"{name} contains an unpaired surrogate (U+{ord(item[e.start]):04X}), which is "
                                   "not valid Unicode", "send valid UTF-8 text (escape pairs like "
                                   "\\ud83d\\ude00 are fine)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_size(text: str | int | None, flag: str = "the size", decimal: bool = False) -> int | None:
    """'8GB', '512MiB', '1e9', 2**30 -> bytes (binary units: 1 GB = 2**30 bytes); `flag` names the option.
    `decimal`: KB/MB/GB/TB (and K/M/G/T) are powers of 1000, as Hugging Face writes shard sizes; KiB/MiB/GiB/TiB
    stay powers of 1024."""
    if isinstance(text, bool):
        raise ConfigError(f"{flag} {text!r} is not a size", "write it like 8GB, 512MB or 2GiB")
    if isinstance(text, int):
        if text < 1:
            raise ConfigError(f"{flag} {text} is not a positive number of bytes", "e.g. 8GB, or leave it unset")
        return text
    if text is None:
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{flag} {text!r} is not a size", "write it like 8GB, 512MB or 2GiB")
    suffix = (m.group(2) or "").upper()
    unit = suffix.replace("I", "").replace("B", "")
    base = 1000 if decimal and "I" not in suffix else 1024
    value = float(m.group(1)) * base ** " KMGT".index(unit or " ")
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"{flag} {text!r} is not a positive number of bytes", "e.g. 8GB")
    return int(value)


# Files a tokenizer of a supported model is read from (fast, sentencepiece, BPE, WordPiece vocabularies); the JSON ones
# are checked for being readable when loading fails
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model")
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                  "added_tokens.json")


def tokenizer_problem(path: Path | str, error: BaseException) -> tuple[str, str]:
    """(message, hint) for a tokenizer that transformers could not load from the folder `path`, in one paragraph:
    no tokenizer file at all, or a named file that is truncated or not JSON, before transformers' own words (which
    span several lines for a missing tokenizer)."""
    path = Path(path)
    names = {f.name for f in path.iterdir()} if path.is_dir() else set()
    if not any(n in VOCAB_FILES or n.endswith((".tiktoken", ".model")) for n in names):
        return (f"{path} has no tokenizer files (tokenizer.json, tokenizer.model, or vocab.json and merges.txt)",
                "copy the tokenizer files of the model the weights come from into the folder (e.g. huggingface-cli "
                "download ORG/NAME tokenizer.json tokenizer_config.json --local-dir FOLDER)")
    for name in TOKENIZER_JSON:
        if name in names:
            try:
                json.loads((path / name).read_bytes())
            except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
                return (f"tokenizer file {path / name} cannot be read: {' '.join(str(e).split())}",
                        "the file is corrupted or truncated: copy it again from the model's source")
    detail = " ".join(str(error).split())
    if isinstance(error, KeyError) or not detail:
        detail = f"{type(error).__name__} {detail}".strip()
    return (f"cannot load the tokenizer of {path}: {detail}",
            "the model folder needs its tokenizer files (tokenizer.json or tokenizer.model) as the model's source has "
            "them")
