"""JSONL in and out for `infer run`: read and validate input lines, write records as they finish, resume."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..engine.inputs import ParsedRequest, parse_request
from ..errors import ConfigError, RequestError


@dataclass
class InputLine:
    line_no: int
    id: str
    request: ParsedRequest | None = None
    error: str | None = None


def _line_id(obj, line_no: int) -> str:
    if isinstance(obj, dict):
        if "custom_id" in obj:
            return str(obj["custom_id"])
        if obj.get("id") is not None:
            return str(obj["id"])
    return str(line_no)


def read_inputs(path: Path, tokenizer, defaults: dict) -> list[InputLine]:
    """Every non-blank line of the input, parsed, or with the reason it is bad (line numbers start at 1)."""
    if not path.is_file():
        raise ConfigError(f"input file {path} does not exist", "give a JSONL file with one request per line")
    lines, seen = [], set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                lines.append(InputLine(line_no, str(line_no), error=f"line {line_no}: bad JSON: {e.msg}"))
                continue
            item = InputLine(line_no, _line_id(obj, line_no))
            try:
                item.request = parse_request(obj, tokenizer, item.id, defaults)
            except RequestError as e:
                item.error = f"line {line_no}: {e}"
            if item.id in seen:
                item.request, item.error = None, f"line {line_no}: duplicate id {item.id!r}"
                item.id = f"{item.id}#line{line_no}"
            seen.add(item.id)
            lines.append(item)
    return lines


def done_ids(path: Path) -> set[str]:
    """Ids already written to an output file; a torn last line (a killed run) is cut off first."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    ids = set()
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            ids.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return ids


class RecordWriter:
    """Appends one JSON object per line and flushes it, so an interrupted run loses nothing it finished."""

    def __init__(self, path: Path | None, append: bool):
        self.path = path
        if path is None:
            import sys
            self.f: IO[str] = sys.stdout
        else:
            if path.parent and not path.parent.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.f.flush()
        if self.path is not None:
            os.fsync(self.f.fileno())

    def close(self) -> None:
        if self.path is not None:
            self.f.close()


def error_record(req_id: str, message: str) -> dict:
    return {"id": req_id, "text": "", "token_ids": [], "finish_reason": "error",
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "error": message}


def output_record(req_id: str, out, tokenizer) -> dict:
    rec = {"id": req_id, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
           "usage": out.usage, "error": out.error}
    if out.logprobs is not None:
        rec["logprobs"] = [_named(r, tokenizer) for r in out.logprobs]
    return rec


def _named(record: dict, tokenizer) -> dict:
    r = dict(record, token=tokenizer.convert_ids_to_tokens(record["token_id"]))
    if "top_logprobs" in r:
        r["top_logprobs"] = [dict(t, token=tokenizer.convert_ids_to_tokens(t["token_id"]))
                             for t in r["top_logprobs"]]
    return r
