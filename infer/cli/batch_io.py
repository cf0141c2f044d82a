"""JSONL in and out for `infer run`: read and validate input lines, write records as they finish, resume."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shlex
import signal
import stat
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from ..engine.inputs import ModelNames, ParsedRequest, is_request_id, parse_request
from ..engine.pooling import PoolingRequestOutput
from ..errors import ConfigError, OutputError, RequestError, UnknownModelError, json_problem


@dataclass
class InputLine:
    line_no: int
    id: str
    request: ParsedRequest | None = None
    error: str | None = None
    made_id: bool = False  # the id is infer's (a failed line without its own id): it gives way to every line's own
    status: int = 400  # a failed line's status in an OpenAI batch output line: 404 for a body.model that is no model


def _own_id(obj) -> str | None:
    """The id a line gives itself: an OpenAI batch line's custom_id (a string only, as OpenAI's), else its "id"."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("custom_id"), str):
        return obj["custom_id"]
    return str(obj["id"]) if obj.get("custom_id") is None and is_request_id(obj.get("id")) else None


def _line_id(obj, line_no: int) -> str:
    own = _own_id(obj)
    return str(line_no) if own is None else own


def unreadable_id(line_no: int) -> str:
    """The id of a line that cannot be read (bad JSON or UTF-8): whatever id it meant to have is unknown, and its
    line number would take the id of a later line that names that number ("id": 2 after a broken line 2)."""
    return f"line{line_no}"


def read_lines(path: Path):
    """(line number, text or None, reason) for every line of a JSONL file. Lines end at "\\n" only (a CRLF's
    "\\r" is dropped; U+2028, U+0085 or a bare "\\r" inside a line do not split it), so the numbering is the one
    any editor shows, and outputs are read back by the same rule they are written with."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (Windows editors)
                raw = raw[3:]
            raw = raw[:-1] if raw.endswith(b"\n") else raw
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            try:
                yield line_no, raw.decode("utf-8"), None
            except UnicodeDecodeError as e:
                yield line_no, None, f"not valid UTF-8 (byte {e.start + 1} of the line)"


def one_request_file(path: str) -> str:
    """A shell command that writes a JSONL file of one request to `path` (what a newcomer without one is shown)."""
    return f"echo '{{\"prompt\": \"Hello\"}}' > {shlex.quote(path)}"


# the shell commands _check_jsonl tells: JSONL of an array, of JSON strings, of lines of text, of comma-ended lines
_SED_COMMAS, _JQ_ARRAY = "sed 's/,$//'", "jq -c '.[]'"
_JQ_ARRAY_PROMPTS, _JQ_PROMPTS = "jq -c '.[] | {prompt: .}'", "jq -c '{prompt: .}'"
_JQ_TEXT_PROMPTS = "jq -R -c '{prompt: .}'"


def _into_new_file(command: str, path: Path, want: str = "prompts.jsonl") -> str:
    """`command INPUT > OUT`, a shell command that writes what `command` makes of the input `path` (quoted for the
    shell: a name with a space or a quote) to a file of the current folder that is not the input: the shell empties
    OUT before the command reads it, so `jq -c '.[]' prompts.jsonl > prompts.jsonl` lost the file."""
    out = Path(want)
    if out.resolve() == path.expanduser().resolve():
        out = out.with_name(f"{out.stem}-lines{out.suffix}")
    return f"{command} {shlex.quote(str(path))} > {shlex.quote(str(out))}"


def check_input_encoding(path: Path) -> None:
    """A UTF-16 file (what Windows PowerShell's `>` writes) would fail on every line with "not valid UTF-8": say
    what it is once, before the model loads."""
    if not path.is_file():  # a pipe is refused by read_inputs; reading its first bytes here would eat them
        return
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise ConfigError(f"cannot read input {path}: {e.strerror or e}", "check the file's permissions") from None
    wide = "UTF-32" if head[:4] in (b"\x00\x00\xfe\xff", b"\xff\xfe\x00\x00") else "UTF-16"  # (iconv reads the BOM)
    if head[:2] in (b"\xff\xfe", b"\xfe\xff") or wide == "UTF-32":
        iconv = _into_new_file(f"iconv -f {wide} -t UTF-8", path, "prompts-utf8.jsonl")
        raise ConfigError(f"input {path} is UTF-16 or UTF-32 text (it starts with that byte order mark); infer reads "
                          "UTF-8", f"save it as UTF-8, e.g. {iconv}")
    packed = next((name for magic, name in _COMPRESSED if head.startswith(magic)), None) or \
        ("bzip2" if head[:3] == b"BZh" and head[4:10] == b"1AY&SY" else None)
    if packed is not None:  # every line was an error record "not valid UTF-8", after the model had loaded
        raise ConfigError(f"input {path} is {packed}-compressed; infer reads plain JSONL text",
                          f"decompress it first, e.g. {_into_new_file(_UNPACK[packed], path)}")
    if len(head) >= 64 and head.count(0) * 4 > len(head):  # JSON text never holds a raw NUL byte
        raise ConfigError(f"input {path} is not a JSONL text file: {head.count(0):,} of its first {len(head):,} "
                          "bytes are NUL (a binary file, or UTF-16 without a byte order mark?)",
                          "give the JSONL file of prompts, saved as UTF-8")
    _check_jsonl(path, head)


def _check_jsonl(path: Path, head: bytes) -> None:
    """A CSV, a plain text file or one JSON document (an array of requests, a pretty-printed object) got one error
    record per line, "bad JSON" or "expected a JSON object", after the model had loaded: when no line of the file's
    start is a JSON object, say once what the file is and how to make JSONL of it. A JSONL file with a bad line (one
    that starts as an object does) still gets its error records."""
    text = head.removeprefix(b"\xef\xbb\xbf").decode("utf-8", "replace")
    lines = text.split("\n")
    if len(head) == 1 << 16 and len(lines) > 1:
        lines = lines[:-1]  # the last line may be cut in the middle
    lines = [line.strip() for line in lines if line.strip()]
    if not lines:
        return
    if lines[0].startswith("{") and lines[0] != "{":
        commas = sum(line.endswith(",") for line in lines)
        if commas >= max(1, len(lines) - 1) and all(_is_object(line.removesuffix(",")) for line in lines):
            raise ConfigError(f"input {path}: its lines end with a comma (the items of a JSON array?), which makes "
                              "them bad JSON; a JSONL line is the object alone",
                              f"remove the commas, e.g. {_into_new_file(_SED_COMMAS, path)}")
        return
    document = lines[0] in ("[", "{")  # a line of JSONL is never a bracket alone: one JSON value over many lines
    for line in lines if not document else ():
        try:
            if isinstance(json.loads(line), dict):
                return
        except (ValueError, RecursionError):
            pass
    example = '{"prompt": "The weather today is"}'
    if document or lines[0].startswith("["):  # one JSON document: an array of requests, or an object over lines
        first = lines[0][1:].strip() or (lines[1] if len(lines) > 1 else "")  # the array's first item
        if lines[0].startswith("{"):  # objects over many lines each: jq reads them one after the other
            convert = f"{_into_new_file('jq -c .', path)} for pretty-printed objects"
        elif first.startswith('"'):
            convert = f"{_into_new_file(_JQ_ARRAY_PROMPTS, path)} for an array of prompt strings"
        else:
            convert = f"{_into_new_file(_JQ_ARRAY, path)} for an array"
        raise ConfigError(f"input {path} is a JSON document (it starts with {lines[0][0]!r}), not JSONL: infer run "
                          f"reads one request object per line, e.g. {example}",
                          f"write each request on a line of its own, e.g. {convert}")
    quoted = _is_string(lines[0])  # a JSON string a line (what `jq -c '.[]'` makes of an array of prompts)
    raise ConfigError(f"input {path} is not JSONL: no line of it is a JSON object (line 1: {lines[0][:40]!r}); infer "
                      f"run reads one request object per line, e.g. {example}",
                      f"to make one request of each JSON string: {_into_new_file(_JQ_PROMPTS, path)}"
                      if quoted else
                      f"to make one request of each line of a text file: "
                      f"{_into_new_file(_JQ_TEXT_PROMPTS, path)} (a CSV needs its prompt column taken out "
                      "first)")


def _is_object(text: str) -> bool:
    return isinstance(_json_value(text), dict)


def _is_string(text: str) -> bool:
    return isinstance(_json_value(text), str)


def _json_value(text: str):
    """The JSON value `text` holds, or None where it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


# the magic numbers of compressed files, none of which UTF-8 text can start with (bzip2's, tested apart, is text)
_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"),
               (b"PK\x03\x04", "zip"))
_UNPACK = {"gzip": "gunzip -c", "zstd": "zstd -dc", "bzip2": "bunzip2 -c", "xz": "xz -dc", "zip": "unzip -p"}


def _loads(text: str):
    """json.loads, with every way a line can be unreadable turned into a ValueError that names it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"bad JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise ValueError("bad JSON: nested too deeply") from None
    except ValueError as e:  # an integer of more than 4300 digits (Python's advice to raise the limit left out)
        raise ValueError(f"bad JSON: {json_problem(e)}") from None


def _parse_line(line_no: int, text: str, tokenizer, defaults: dict, names: ModelNames,
                max_tokens: int | None) -> InputLine:
    try:
        obj = _loads(text)
    except ValueError as e:
        return InputLine(line_no, unreadable_id(line_no), error=f"line {line_no}: {e}", made_id=True)
    item = InputLine(line_no, _line_id(obj, line_no))
    try:
        item.request = parse_request(obj, tokenizer, item.id, defaults, names, max_tokens)
    except RequestError as e:
        item.error = f"line {line_no}: {e}"
        item.status = 404 if isinstance(e, UnknownModelError) else 400  # vLLM's "The model `X` does not exist."
    except Exception as e:  # never let one line end the run: the reason goes into its error record
        item.error = f"line {line_no}: cannot read this request ({type(e).__name__}: {e})"
    # a failed line whose id is its line number (it gave none, or none usable: a JSON array, "id": 1.5) gives way
    # to a later line's own id: that valid line was refused as its duplicate and never ran
    item.made_id = item.error is not None and _own_id(obj) is None
    return item


def unused_adapters_note(loras, lines: list[InputLine]) -> str | None:
    """The note for `--lora NAME=PATH` adapters that no line of the input names: each line picks its adapter with
    "lora" (or a batch line's body.model), and a newcomer who registered one and named it nowhere got base-model
    replies without a word. None when every adapter is named (or none is registered)."""
    named = {item.request.lora for item in lines if item.request is not None}
    unused = [name for name in (loras or {}) if name not in named]
    if not unused:
        return None
    which = ", ".join(unused)
    return (f"note: no line of the input names the adapter(s) {which} given with --lora; lines without \"lora\" run "
            f"the base model (a line picks an adapter with \"lora\": \"{unused[0]}\", an OpenAI batch line with "
            f"\"model\": \"{unused[0]}\")")


def read_inputs(path: Path, tokenizer, defaults: dict, names: ModelNames = ModelNames(),
                max_tokens: int | None = None) -> list[InputLine]:
    """Every non-blank line of the input, parsed, or with the reason it is bad (line numbers start at 1); `names`
    maps a batch line's body.model to an adapter; a prompt certainly longer than `max_tokens` is not tokenized."""
    if not path.is_file():
        raise ConfigError(f"input file {path} does not exist" if not path.exists() else f"input {path} is not a file",
                          "give a JSONL file with one request per line")
    lines = []
    for line_no, text, reason in read_lines(path):
        if reason is not None:
            item = InputLine(line_no, unreadable_id(line_no), error=f"line {line_no}: {reason}", made_id=True)
        elif not text.strip():
            continue
        else:
            item = _parse_line(line_no, text, tokenizer, defaults, names, max_tokens)
        lines.append(item)
    # a made-up id (an unreadable line's, a repeated id's) must be no other line's id, even a later one: two records
    # with one id would make --resume drop one of them for good
    taken = {item.id for item in lines if not item.made_id}
    seen: dict[str, int] = {}  # id -> the line that has it
    for item in lines:
        if item.made_id:
            item.id = _fresh(item.id, taken)
        elif item.id in seen:
            item.request, item.error = None, item.error or _duplicate(item, seen[item.id])
            item.id = _fresh(f"{item.id}#line{item.line_no}", taken)
        seen[item.id] = item.line_no
    return lines


def _fresh(want: str, taken: set[str]) -> str:
    """`want`, or want~2, want~3... : the first that no line has; taken then holds it."""
    got, k = want, 1
    while got in taken:
        k += 1
        got = f"{want}~{k}"
    taken.add(got)
    return got


def model_names(engine, served: list[str] | None = None) -> ModelNames:
    """The names a batch line's body.model may give for the base (as on the command line, its folder's name; with
    --served-model-name `served`, those names alone, as vllm run-batch) and the registered adapters of an
    EngineConfig, and the sampling defaults of the model's generation config."""
    from ..engine.inputs import openai_sampling_defaults
    from ..models.resolve import resolve_model
    given = Path(str(engine.model)).expanduser()
    base = set(served) if served else \
        {str(engine.model), given.name, given.resolve().name if given.exists() else given.name}
    path = resolve_model(engine.model)
    sampling = tuple(openai_sampling_defaults(path).items())
    from ..models.classifier import is_token_classifier
    from ..models.loader import load_config
    labels = classifier_labels(path)
    return ModelNames(frozenset(base), frozenset(engine.loras), sampling, engine.max_logprobs, labels,
                      bool(labels) and is_token_classifier(load_config(path)))


def classifier_labels(path) -> tuple:
    """A classifier folder's label names (config.json's id2label, in class order); () for any other model."""
    from ..engine.pooling import classifier_folder
    if not classifier_folder(path):
        return ()
    from ..models.classifier import labels
    from ..models.loader import load_config
    return tuple(labels(load_config(path)))


def _duplicate(item: InputLine, first: int) -> str:
    why = " (a line without an id has its line number as id)" if item.id == str(first) else ""
    return (f"line {item.line_no}: duplicate id {item.id!r}: line {first} already has it{why}; give every line its "
            "own id")


def encode_record(record: dict) -> bytes:
    """One output line: UTF-8 JSON, "\\n"-terminated. Text that cannot be encoded (a lone surrogate in an id) is
    written \\u-escaped, which reads back to the same string. A number JSON cannot hold (NaN, infinity: the prompt
    logprobs of a model that overflowed) is written as null: json.dumps wrote NaN, which is not JSON (JavaScript's,
    Go's, Rust's and Java's readers refuse the line)."""
    try:
        text = json.dumps(record, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a float that is not finite
        record = _finite(record)
        text = json.dumps(record, ensure_ascii=False)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record, ensure_ascii=True) + "\n").encode("ascii")


def _finite(value):
    """`value` with every float that is not finite replaced by None (JSON's null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class RecordWriter:
    """Appends one JSON object per line and flushes it (and fsyncs a regular file), so an interrupted run loses
    nothing it finished. Works on pipes, /dev/stdout and /dev/null too. A regular file deleted (or replaced) while it
    is written is noticed at the next record (cli/output_gone.py): made again with the records so far, then
    `recreated()` is called (the run's resume fingerprint, removed with the file's folder, is written again)."""

    def __init__(self, path: Path | None, append: bool, recreated: Callable[[], None] | None = None):
        self.path, self.recreated = path, recreated
        if path is None:
            sys.stdout.flush()
            self.f: IO[bytes] = getattr(sys.stdout, "buffer", None) or _TextAsBytes(sys.stdout)
        else:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.f = _open_output(path, append)
            except OSError as e:
                raise OutputError(f"cannot open {path} for writing: {e.strerror or e}",
                                  "choose another output path or fix its permissions") from None
        self.sync = path is not None and stat.S_ISREG(os.fstat(self.f.fileno()).st_mode)
        self.count = 0  # records written
        self.first_error: tuple[str, str] | None = None  # (id, error) of the first error record written

    def write(self, record: dict) -> None:
        with _interrupts_held():
            if self.sync:
                self._follow()
            try:
                self.f.write(encode_record(record))
                self.f.flush()
                if self.sync:
                    os.fsync(self.f.fileno())
            except OSError as e:
                raise self._failed(e) from None
            self.count += 1
            if self.first_error is None:
                rec_id, error = record_of(record)
                if error is not None:
                    self.first_error = (str(rec_id), error)

    def error_note(self) -> str | None:
        """The line a run's summary adds when it wrote error records: the first one's id and error, and where the
        others are (a user who sees "1 failed" sees why without opening the output)."""
        if self.first_error is None:
            return None
        where = "stdout" if self.path is None else str(self.path)
        rec_id = self.first_error[0]  # (an id of control characters, e.g. a NUL, shown escaped as its record has it)
        shown = rec_id if rec_id.isprintable() else json.dumps(rec_id, ensure_ascii=False)[1:-1]
        return f"infer: first error (id {shown}): {self.first_error[1]} [every failed line has an " \
               f"error record in {where}]"

    def finish(self) -> None:
        """After the last record: an output deleted since it was written gets its records back (as `write` does
        before each record), before the run says it is complete."""
        if self.sync:
            with _interrupts_held():
                self._follow()

    def _follow(self) -> None:
        """Before a record: the output's path still names this run's file, or gets it back (output_gone)."""
        from .output_gone import made_again, replaced, still_there
        there = still_there(self.path, self.f)
        if there:
            return
        if there is False:
            raise replaced(self.path, self.f, self.count)
        new = made_again(self.path, self.f, self.count)
        with contextlib.suppress(OSError):
            self.f.close()
        self.f = new
        lock_output(new.fileno(), self.path)  # (the deleted file's lock went with it)
        print(f"note: {self.path} was deleted during the run; it is made again with the {self.count} records "
              "written so far, and the run goes on", file=sys.stderr)
        if self.recreated is not None:
            self.recreated()

    def close(self) -> None:
        if self.path is not None:
            try:
                self.f.close()
            except OSError:  # the write that failed has raised already; the records before it are on disk
                pass

    def _failed(self, e: OSError) -> OutputError:
        where = self.path or "stdout"
        if e.errno == errno.EPIPE:
            return OutputError(f"{where} was closed by its reader after {self.count} records",
                               "pipe the output into a program that reads all of it, or write it with -o FILE")
        more = ", then run the same command with --resume to complete the rest" if self.sync else ""
        return OutputError(f"cannot write to {where} after {self.count} records: {e.strerror or e}",
                           f"make room or choose another output{more}")


def _open_output(path: Path, append: bool) -> IO[bytes]:
    """The output file, open for reading too when it is a regular file (or a new one): records written to a file
    deleted meanwhile are read back to make it again (output_gone). A file whose permissions refuse reading is written
    to alone. A regular file is locked (lock_output) before a plain run empties it: another run's file is refused
    whole."""
    if not is_regular_or_new(path):
        return open(path, "ab" if append else "wb")
    try:
        f = open(path, "a+b")
    except PermissionError:
        f = open(path, "ab")
    try:
        lock_output(f.fileno(), path)
    except BaseException:
        f.close()
        raise
    if not append:
        f.truncate(0)
    return f


def lock_output(fd: int, path: Path) -> None:
    """An flock on the output file itself, held while this run writes it (released when `fd` closes). OUTPUT.lock
    (resume.output_lock) keeps a second run out only while that file is there: once it was deleted (`rm out.jsonl*`,
    a cleanup of stale locks) a second run made a new one and wrote the same ids beside the first (with --resume), or
    emptied the file under it (without). The output's own lock goes with the records: ConfigError when another run
    holds it. Where flock is missing or refused (Windows, some network file systems) nothing is locked, as before."""
    try:
        import fcntl
    except ImportError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise written_by_another_run(path) from None
    except OSError:
        pass


def written_by_another_run(output: Path, holder: str = "", lock: Path | None = None) -> ConfigError:
    """The refusal of a second run of one -o (`holder`: the other run's process id, when known; `lock`: its lock file,
    which the user may delete when no run is left)."""
    by = f" (process {holder})" if holder.isdigit() else ""
    stale = f"; if no run is left, delete {lock}" if lock is not None else ""
    return ConfigError(f"-o {output} is being written by another infer run{by}; two runs would each write the records "
                       "still missing", "wait for that run to end (then --resume completes what it did not), or choose "
                       f"another -o{stale}")


def is_regular_or_new(path: Path) -> bool:
    """Whether `path` is a regular file, or nothing yet (not a pipe, a device or /dev/stdout)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _interrupts_held():
    """Ctrl-C (SIGINT) and SIGTERM held while a record is written and counted, and acted on right after: an interrupt
    lands between records, so the count it reports is the number of records on disk. (Masking the signal would not
    do: the kernel may hand it to another thread of the process, torch's, and Python still raises in this one.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig in held:
            signal.signal(sig, previous[sig])
        for sig in dict.fromkeys(caught):  # each signal acted on once, in the order they came
            if callable(previous[sig]):
                previous[sig](sig, None)  # e.g. Python's handler: KeyboardInterrupt, here, after the record
            elif previous[sig] == signal.SIG_DFL:
                os.kill(os.getpid(), sig)


class _TextAsBytes:
    """A text stream without a byte buffer (a test runner's stdout), written to as bytes."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode("utf-8"))

    def flush(self) -> None:
        self.stream.flush()


OUTPUT_FORMATS = ("infer", "openai")  # --output-format: infer's own record, or OpenAI's batch output line
NOT_A_BATCH_LINE = ("--output-format openai writes OpenAI batch output lines, one per OpenAI batch line (custom_id, "
                    "method, url, body); this line is in infer's own format")


def record_of(rec) -> tuple[str | None, str | None]:
    """(id, error message or None) of an output record of either format (id None: not a record). An OpenAI batch
    output line's id is its custom_id (its own "id" is the line's, new each time it is written)."""
    if not isinstance(rec, dict):
        return None, None
    if "custom_id" in rec and "response" in rec:  # --output-format openai
        error = rec.get("error")
        if isinstance(error, dict):  # {"message", "type", "param", "code"} (vLLM's {"error": {...}} read too)
            error = (error["error"] if isinstance(error.get("error"), dict) else error).get("message", error)
        rec_id = rec["custom_id"]
        return (rec_id if isinstance(rec_id, str) else None), (None if error is None else str(error))
    rec_id = rec.get("id")
    failed = rec.get("finish_reason") == "error"
    return (rec_id if isinstance(rec_id, str) else None), (str(rec.get("error")) if failed else None)


class Records:
    """The records of one --output-format. "infer": infer's own (output_record, error_record). "openai": OpenAI's
    batch output line, as `vllm run-batch` writes it: {"id", "custom_id", "response": {"status_code", "request_id",
    "body"}, "error"}, the body being the chat.completion or text_completion object `infer serve` answers the
    line's body with (serve.protocol.WholeResponse); a failed line has status 400 (the line is bad) or 500 (the
    engine failed), a null body and, as error, the error object the server answers that request with: {"message",
    "type", "param", "code"} (OpenAI's batch error has code and message; vLLM writes the server's error there)."""

    def __init__(self, fmt: str = "infer", tokenizer=None, lines=(), model: str = "", reasoning_parser=None,
                 prompt_tokens_details: bool = False, labels: tuple = ()):
        """`prompt_tokens_details`: --enable-prompt-tokens-details, each body's usage.prompt_tokens_details (as the
        server's option)."""
        self.fmt, self.tokenizer, self.model = fmt, tokenizer, model
        self.details = prompt_tokens_details
        self.requests = {item.id: item.request for item in lines if item.request is not None}
        self.labels = labels  # a classifier's label names (model_names'), which its records name
        self.reasoning = {}  # --reasoning-parser (openai): each chat line's split, as the server's (serve/reasoning.py)
        if reasoning_parser is not None and fmt == "openai":
            self._split_reasoning(reasoning_parser)

    def _split_reasoning(self, parser: str) -> None:
        """Each chat line's ReasoningRequest, read from its body as the server reads it; the think tags stay in the
        text where they are special tokens (the split needs them). Before the lines are generated."""
        from dataclasses import replace
        from ..serve.reasoning import keeps_special_tokens, reasoning_request
        skipped = keeps_special_tokens(parser, self.tokenizer)
        for req_id, request in self.requests.items():
            if request.openai is None or not request.openai["chat"]:
                continue
            split = reasoning_request(parser, request.openai["reasoning"], request.prompt_token_ids, self.tokenizer,
                                      request.params.structured_outputs)
            self.reasoning[req_id] = split
            if skipped and not split.ended:
                request.params = replace(request.params, skip_special_tokens=False)

    def output(self, req_id: str, out) -> dict:
        request = self.requests.get(req_id)
        pooled = request is not None and (request.openai or {}).get("embedding")  # (a /pooling line's: any task's)
        if pooled or hasattr(out, "outputs") and hasattr(out.outputs, "embedding"):  # a /v1/embeddings line's vector
            return self._embedding(req_id, [out])
        if hasattr(out, "outputs") and hasattr(out.outputs, "probs"):  # a classifier's line (infer's format)
            from ..serve.scoring import class_entry
            return {"id": req_id, **class_entry(out.outputs.data, self.labels), "finish_reason": "stop",
                    "error": None, "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": 0}}
        if isinstance(out, PoolingRequestOutput):  # a token classifier's line (infer's format): each token's
            rows = out.outputs.data
            return {"id": req_id, "labels": [self.labels[int(k)] for k in rows.argmax(-1)], "probs": rows.tolist(),
                    "num_classes": rows.shape[-1], "finish_reason": "stop", "error": None,
                    "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": 0}}
        if self.fmt == "infer":
            return output_record(req_id, out, self.tokenizer)
        return self.choices(req_id, [out])

    def _embedding(self, req_id: str, outs: list) -> dict:
        """An embeddings line's record: infer's own ({"id", "embedding", "usage"...}; one input), or the OpenAI batch
        output line whose body is the server's embeddings response (every input's vector, in order)."""
        tokens = sum(len(out.prompt_token_ids) for out in outs)
        if self.fmt == "infer":
            return {"id": req_id, "embedding": outs[0].outputs.data.tolist(), "finish_reason": "stop", "error": None,
                    "usage": {"prompt_tokens": tokens, "completion_tokens": 0}}
        from ..serve.embeddings import response_body
        info = self.requests[req_id].openai
        body = response_body([out.outputs.data for out in outs], tokens, info["model"] or self.model,
                             info["encoding_format"], info["request_id"], info.get("pooling", False))
        return {"id": _batch_id(), "custom_id": req_id,
                "response": {"status_code": 200, "request_id": _batch_id("req"), "body": body}, "error": None}

    def choices(self, req_id: str, outs: list) -> dict:
        """(openai) The record of a line answered with these choices' finished outputs (a beam search's n)."""
        from ..serve import protocol as p
        failed = next((out for out in outs if out.finish_reason in ("error", "abort")), None)
        if failed is not None:
            return self._failed(req_id, p.engine_error(failed))
        request = self.requests[req_id]
        info = request.openai
        if info.get("embedding"):  # a line of several inputs (cli/embed_lines.py)
            return self._embedding(req_id, outs)
        req = p.GenerationRequest([request.prompt_token_ids] * len(outs), request.params, info["model"],
                                  chat=info["chat"], return_token_ids=info["return_token_ids"], n=len(outs),
                                  tokens_as_ids=info["tokens_as_ids"],
                                  asked_prompt_logprobs=request.params.prompt_logprobs)
        req.reasoning = self.reasoning.get(req_id)
        req.cached_details = self.details
        response = p.WholeResponse(req, self.tokenizer)
        for i, out in enumerate(outs):
            response.add(i, out)
        body = response.body(p.new_id(info["chat"], info["request_id"]), info["model"] or self.model, p.now())
        return {"id": _batch_id(), "custom_id": req_id,
                "response": {"status_code": 200, "request_id": _batch_id("req"), "body": body}, "error": None}

    def error(self, req_id: str, message: str, engine: bool = False, status: int = 400) -> dict:
        """A line's error record: a bad line's (400; `status` 404: its body.model names no model of the run, as
        the server answers it), or with `engine` one the engine failed on (500)."""
        if self.fmt == "infer":
            return error_record(req_id, message)
        from ..serve import protocol as p
        if engine:
            e = p.ApiError(500, message, type="server_error", code="engine_error")
        elif status == 404:
            e = p.ApiError(404, message, param="model", code="model_not_found")
        else:
            e = p.ApiError(400, message)
        return self._failed(req_id, e)

    @staticmethod
    def _failed(req_id: str, e) -> dict:
        return {"id": _batch_id(), "custom_id": req_id,
                "response": {"status_code": e.status, "request_id": _batch_id("req"), "body": None},
                "error": e.body()["error"]}


def check_format(lines: list[InputLine], fmt: str, parallel: bool = False) -> None:
    """--output-format openai answers OpenAI batch lines: a line of infer's own format gets an error record (it has no
    custom_id an OpenAI batch output line could carry), and an input without any batch line is refused whole. A
    line of several engine requests (a beam search, an embeddings body of several inputs) that infer's own records
    cannot hold, or that `parallel` (--data-parallel, Ray: one line's requests on several replicas) cannot run, is
    an error now, so that --strict refuses it before anything runs."""
    for item in lines:
        reason = _unrunnable(item.request, fmt, parallel) if item.request is not None else None
        if reason:
            item.request, item.error = None, f"line {item.line_no}: {reason}"
    if fmt != "openai":
        return
    plain = [item for item in lines if item.request is not None and item.request.openai is None]
    if plain and not any(item.request is not None and item.request.openai is not None for item in lines):
        raise _no_batch_line(plain[0].line_no)
    for item in plain:
        item.request, item.error = None, f"line {item.line_no}: {NOT_A_BATCH_LINE}"


def _unrunnable(request, fmt: str, parallel: bool) -> str | None:
    """Why a line of several engine requests cannot run here (None: it can)."""
    from .beam_lines import is_beam_line
    from .embed_lines import inputs_of, is_many_inputs_line
    if is_beam_line(request) and parallel:  # (its steps would go to any replica: one engine runs it)
        return ("body.use_beam_search is not run with --data-parallel or Ray: run the file without them (or send the "
                "lines to infer serve)")
    if is_many_inputs_line(request) and parallel:  # (its inputs would go to several replicas)
        return (f"body.input holds {len(inputs_of(request))} inputs, which are not run with --data-parallel or Ray: "
                "write one line per input, or run the file without them (or send the body to infer serve)")
    if is_beam_line(request) and fmt != "openai":
        return "body.use_beam_search answers n choices, which infer's own records do not hold: run with " \
               "--output-format openai"
    if is_many_inputs_line(request) and fmt != "openai":
        return (f"body.input holds {len(inputs_of(request))} inputs, answered with one vector each, which infer's own "
                "records do not hold: run with --output-format openai (or write one line per input)")
    return None


def check_batch_lines(path: Path, fmt: str) -> None:
    """--output-format openai with an input that holds no OpenAI batch line, only lines of infer's own format: refused
    before the model loads (check_format refused it only once every line was parsed, after the load)."""
    if fmt != "openai" or not path.is_file():
        return
    plain = None
    for line_no, text, _ in read_lines(path):
        try:
            obj = _loads(text) if text is not None and text.strip() else None
        except ValueError:  # a bad line gets its own error record
            continue
        if isinstance(obj, dict):
            if "body" in obj or "custom_id" in obj:  # parse_request's test for a batch line
                return
            plain = plain or line_no
    if plain is not None:
        raise _no_batch_line(plain)


def _no_batch_line(line_no: int) -> ConfigError:
    return ConfigError(f"--output-format openai writes OpenAI batch output, but no line of the input is an OpenAI "
                       f"batch line (line {line_no} is in infer's own format)",
                       'write each line as {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", '
                       '"body": {...}}, or leave out --output-format openai for infer\'s own records')


def _batch_id(kind: str = "batch_req") -> str:
    import uuid
    return f"{kind}_{uuid.uuid4().hex}"


def error_record(req_id: str, message: str) -> dict:
    return {"id": req_id, "text": "", "token_ids": [], "finish_reason": "error", "stop_reason": None,
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "error": message}


def output_record(req_id: str, out, tokenizer) -> dict:
    rec = {"id": req_id, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
           "stop_reason": out.stop_reason, "usage": out.usage, "error": out.error}
    if out.logprobs is not None:
        rec["logprobs"] = [_named(r, tokenizer) for r in out.logprobs]
    if out.prompt_logprobs is not None:  # null for the first prompt token, which nothing predicts
        rec["prompt_logprobs"] = [r and _named(r, tokenizer) for r in out.prompt_logprobs]
    return rec


def _named(record: dict, tokenizer) -> dict:
    r = dict(record, token=tokenizer.convert_ids_to_tokens(record["token_id"]))
    if "top_logprobs" in r:
        r["top_logprobs"] = [dict(t, token=tokenizer.convert_ids_to_tokens(t["token_id"]))
                             for t in r["top_logprobs"]]
    return r
