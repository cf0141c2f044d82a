"""Checks of user input that every layer applies the same way: text that is valid Unicode, sizes in bytes."""

from __future__ import annotations

import math
import re
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
