"""Checks of user input that every layer applies the same way: text that is valid Unicode, sizes in bytes, and the
content format a chat template reads (the parts of a message, or its text)."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

from .errors import ConfigError, RequestError, bom_error

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


def _source_repo(path: Path) -> str | None:
    """The hub id ORG/NAME the folder's config.json names as its source (`_name_or_path`, which transformers'
    save_pretrained writes), or None: where the tokenizer the folder lacks can be fetched from."""
    try:
        named = json.loads((path / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(named, str) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", named):
        return None
    return None if Path(named).exists() else named


def tokenizer_problem(path: Path | str, error: BaseException) -> tuple[str, str]:
    """(message, hint) for a tokenizer that transformers could not load from the folder `path`, in one paragraph:
    no tokenizer file at all, or a named file that is truncated or not JSON, before transformers' own words (which
    span several lines for a missing tokenizer)."""
    path = Path(path)
    names = {f.name for f in path.iterdir()} if path.is_dir() else set()
    if not any(n in VOCAB_FILES or n.endswith((".tiktoken", ".model")) for n in names):
        source = _source_repo(path)
        return (f"{path} has no tokenizer files (tokenizer.json, tokenizer.model, or vocab.json and merges.txt)",
                f"copy the tokenizer files of the model the weights come from into the folder (e.g. hf download "
                f"{source or 'ORG/NAME'} tokenizer.json tokenizer_config.json --local-dir {shlex.quote(str(path))}"
                f"{', its config.json naming ' + source + ' as its source' if source else ''})")
    for name in TOKENIZER_JSON:
        if name in names:
            bom = bom_error(path / name)
            if bom is not None:  # (json.loads of the bytes skips it; transformers reads the text, and fails)
                return bom.message, bom.hint
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


_PART_TEMPLATES: dict[str, bool] = {}
_PART_TEMPLATES_MAX = 256


def reads_content_parts(tokenizer, template: str | None = None, tools: bool = False) -> bool:
    """Whether the tokenizer's chat template loops over a message's content (OpenAI's list of parts, as vision and
    newer chat templates do) rather than printing it as a string: vLLM's "openai" content format, found as vLLM
    finds it, by a `for` over `<message>['content']` (or `.content`, or a variable set from it) in the template's
    syntax tree. Such a template gets list content as the list, not the joined text. `template`: a call's own
    template, read instead of the tokenizer's. A tokenizer's named templates resolve as apply_chat_template resolves
    them (and vLLM, which finds the format of that one): a call's template may be one's name, and with `tools` (the
    call renders some) "tool_use" is the one used where there is one."""
    named = getattr(tokenizer, "chat_template", None)
    if isinstance(named, dict) and (template is None or template in named):
        template = named.get(template if template is not None else "tool_use" if tools and "tool_use" in named
                             else "default")
    elif template is None:
        template = named
    if not isinstance(template, str):
        return False
    if template not in _PART_TEMPLATES:
        if len(_PART_TEMPLATES) >= _PART_TEMPLATES_MAX:  # requests' own templates (--trust-request-chat-template)
            _PART_TEMPLATES.clear()
        _PART_TEMPLATES[template] = _loops_over_content(template)
    return _PART_TEMPLATES[template]


def _jinja_environment(template: str):
    """The Jinja environment transformers renders `template` in (vLLM parses templates in it): its loop controls
    (`{% break %}`) and its `{% generation %}` tag are Jinja there; a plain environment cannot parse them."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: Jinja's loop controls at least
        import jinja2
        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    return _compile_jinja_template(template).environment


def _loops_over_content(template: str) -> bool:
    import jinja2
    from jinja2 import nodes
    try:
        tree = _jinja_environment(template).parse(template)
    except (jinja2.TemplateError, RecursionError):  # nested deeper than Jinja's parser recurses: rendering says so
        return False

    def bare(node):  # what a filter, a test or a slice is applied to (`content | selectattr(...)`, `content[1:]`)
        while isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None \
                or isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        return node

    def is_content(node) -> bool:
        node = bare(node)
        return (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"
                or isinstance(node, nodes.Getattr) and node.attr == "content")
    names = {a.target.name for a in tree.find_all(nodes.Assign)
             if isinstance(a.target, nodes.Name) and is_content(a.node)}
    return any(is_content(f.iter) or isinstance(bare(f.iter), nodes.Name) and bare(f.iter).name in names
               for f in tree.find_all(nodes.For))


def closest_sibling(p: Path, folders: bool) -> list[str] | None:
    """The name in p's folder closest to p's own (a typo in the last part), among its files or its folders (not
    hidden): [that name], [] where none is close, None where p's folder cannot be listed."""
    import difflib
    try:
        names = sorted(e.name for e in p.parent.iterdir()
                       if (e.is_dir() if folders else e.is_file()) and not e.name.startswith("."))
    except OSError:
        return None
    return difflib.get_close_matches(p.name, names, n=1, cutoff=0.6)


def missing_file_hint(path: Path | str) -> str | None:
    """For a file that is not there: the closest file name in its folder (`examples/prompt.jsonl` ->
    `examples/prompts.jsonl`), or that the folder itself does not exist; None where neither helps."""
    p = Path(path).expanduser()
    parent = p.parent
    if p.name in ("", ".", ".."):
        return None
    if not parent.is_dir():
        return f"the folder {str(parent)!r} does not exist (check the path)" if str(parent) != "." else None
    close = closest_sibling(p, folders=False)
    if close:
        return f"did you mean {str(parent / close[0])!r}?"
    return None


def processor_chat_template(path: Path) -> str | None:
    """The chat template of a multimodal folder's processor (chat_template.json: {"chat_template": "..."}, which the
    tokenizer does not read), else None."""
    try:
        template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) and template.strip() else None
