"""Calibration data for quantization: read texts from a .txt / .jsonl file (or the built-in set) and cut them
into token windows of a fixed length.

A .txt file holds one sample per paragraph (blank-line separated); a file without blank lines holds one sample per
line. A .jsonl file holds one object per line with "text", "prompt" or "messages" (a chat, rendered with the
tokenizer's chat template when it has one).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..checks import reads_content_parts
from ..errors import ConfigError, RequestError, json_problem, read_utf8

BUILTIN_PATH = Path(__file__).parent / "data" / "calibration.txt"
MIN_WINDOW = 16  # a trailing window shorter than this is dropped
BLANK_LINE = re.compile(r"\n[ \t]*\n")  # a line holding only spaces or tabs is blank too, as editors show it

Messages = list[dict]


@dataclass
class CalibrationSet:
    source: str  # "built-in" or the file path
    samples: list[dict]  # {"input_ids": list[int], "attention_mask": list[int]}

    @property
    def num_tokens(self) -> int:
        return sum(len(s["input_ids"]) for s in self.samples)


def read_texts(path: Path | None, render_chat: Callable[[Messages], str] | None = None) -> list[str]:
    """The calibration texts of a .txt or .jsonl file, or of the built-in set when `path` is None."""
    if path is None:
        return _read_txt(BUILTIN_PATH)
    path = Path(path).expanduser()  # `--calibration=~/texts.txt`: the shell expands no ~ after "="
    suffix = path.suffix.lower()  # TEXTS.TXT (a Windows or DOS name) is a .txt file too
    if path.is_dir():
        raise ConfigError(f"calibration file {path} is a directory", "pass a .txt or .jsonl file inside it")
    if not path.is_file():
        if suffix not in (".txt", ".jsonl"):  # "wikitext2", "allenai/c4": GPTQModel's and AutoGPTQ's examples
            raise ConfigError(f"calibration file {path} does not exist (a dataset name is not read: infer downloads "
                              "nothing)", "save the dataset's texts as a .txt or .jsonl file and pass its path")
        raise ConfigError(f"calibration file {path} does not exist", "pass a .txt or .jsonl file")
    if suffix == ".jsonl":
        texts = _read_jsonl(path, render_chat or _plain_chat)
    elif suffix == ".txt":
        texts = _read_txt(path)
    else:
        raise ConfigError(f"calibration file {path} is neither .txt nor .jsonl",
                          "use .txt (one sample per paragraph) or .jsonl (objects with text/prompt/messages)")
    if not texts:
        raise ConfigError(f"calibration file {path} holds no text", "add some representative text")
    return texts


def _read_txt(path: Path) -> list[str]:
    content = read_utf8(path, "calibration file")
    # a Windows editor's file: its byte order mark is no text, and CRLF line ends separate paragraphs as LF ones do
    content = content.removeprefix("\ufeff").replace("\r\n", "\n")
    blocks = BLANK_LINE.split(content) if BLANK_LINE.search(content.strip()) else content.splitlines()
    return [b.strip() for b in blocks if b.strip()]


def _read_jsonl(path: Path, render_chat: Callable[[Messages], str]) -> list[str]:
    texts = []
    text = read_utf8(path, "calibration file")
    text = text[1:] if text.startswith("\ufeff") else text  # a byte order mark (Windows editors), as infer run
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            texts.append(_jsonl_text(line, path, lineno, render_chat))
    return texts


def _text_parts(content) -> bool:
    """Whether `content` is OpenAI's list of text parts ([{"type": "text", "text": "..."}, ...])."""
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)


def _jsonl_text(line: str, path: Path, lineno: int, render_chat: Callable[[Messages], str]) -> str:
    from ..checks import check_text
    where = f"{path}, line {lineno}"
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as e:  # (a 5000-digit integer, arrays nested past the parser)
        raise ConfigError(f"{where} is not valid JSON ({getattr(e, 'msg', None) or json_problem(e)})",
                          "write one JSON object per line") from None
    for key in ("text", "prompt", "messages"):  # a lone surrogate (JSON can carry one) is refused as infer run does
        try:
            check_text(obj.get(key) if isinstance(obj, dict) else None, key)
        except RequestError as e:
            raise ConfigError(f"{where}: {e.message}", e.hint) from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where} is not a JSON object", 'write objects like {"text": "..."}')
    for key in ("text", "prompt"):
        if key in obj:
            if not isinstance(obj[key], str) or not obj[key].strip():
                raise ConfigError(f"{where}: {key!r} must be a non-empty string")
            return obj[key]
    if "messages" in obj:
        msgs = obj["messages"]
        ok = isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and (isinstance(m.get("content"), str) or _text_parts(m.get("content"))) for m in msgs)
        if not ok:
            raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects (a "
                              "content is a string or a list of text parts)")
        try:
            return render_chat(msgs)
        except Exception as e:  # the template's own checks (roles that must alternate, no system role, ...)
            raise ConfigError(f"{where}: the chat template cannot render these messages: {e}",
                              "fix the conversation, or give its text as a 'text' string") from None
    raise ConfigError(f"{where} has none of the keys 'text', 'prompt', 'messages'",
                      'write objects like {"text": "..."} or {"messages": [{"role": "user", "content": "..."}]}')


def _in_format(messages: Messages, parts: bool) -> Messages:
    """The messages in the content format their template reads, as `infer run` and the server (and vLLM) give them:
    OpenAI's list of text parts joined by newlines for a template that renders content as a string; for one that
    loops over the parts (`parts`), every content a list of text parts, a string's too."""
    def content(c):
        if parts:
            return [{"type": "text", "text": c}] if isinstance(c, str) else [dict(p) for p in c]
        return c if isinstance(c, str) else "\n".join(p["text"] for p in c)
    return [{**m, "content": content(m["content"])} for m in messages]


def _plain_chat(messages: Messages) -> str:
    return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in _in_format(messages, False))


def chat_renderer(tokenizer) -> Callable[[Messages], str]:
    """Render a chat with the tokenizer's chat template, or as 'role: content' lines without one."""
    if not getattr(tokenizer, "chat_template", None):
        return _plain_chat
    parts = reads_content_parts(tokenizer)
    return lambda msgs: tokenizer.apply_chat_template(_in_format(msgs, parts), tokenize=False)


def token_windows(texts: list[str], tokenizer, num_samples: int, seq_len: int) -> list[dict]:
    """Join all texts into one token stream (separated by EOS when the tokenizer has one) and cut it into at most
    `num_samples` windows of `seq_len` tokens; a short last window is kept if it has at least MIN_WINDOW tokens."""
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + sep)
        if len(stream) >= num_samples * seq_len:
            break
    windows = [stream[i:i + seq_len] for i in range(0, len(stream), seq_len)][:num_samples]
    windows = [w for w in windows if len(w) >= min(MIN_WINDOW, seq_len)]
    if not windows:
        raise ConfigError(f"the calibration text has only {len(stream)} tokens",
                          f"give at least {MIN_WINDOW} tokens of text")
    return [{"input_ids": w, "attention_mask": [1] * len(w)} for w in windows]


def load_calibration(path: Path | None, tokenizer, num_samples: int, seq_len: int) -> CalibrationSet:
    texts = read_texts(path, chat_renderer(tokenizer))
    return CalibrationSet("built-in" if path is None else str(path),
                          token_windows(texts, tokenizer, num_samples, seq_len))
