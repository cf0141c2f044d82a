"""`infer run --resume`: which ids an output file already holds, and which input and options it belongs to.

The output is read back by the rule it is written with (records end at "\\n", nothing else splits them), and
lines that are not a whole record (a run killed mid-write, a file edited by hand) are removed with a note, so
their requests run again and the file ends with exactly one record per id. A small fingerprint file beside the
output (OUTPUT.resume.json) records the input it was made from and the options that change outputs; resuming with
another input or other options is refused unless asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, runs are not kept apart
    fcntl = None

import typer

from ..errors import ConfigError, OutputError
from .batch_io import is_regular_or_new, lock_output, record_of, written_by_another_run

FINGERPRINT_SUFFIX = ".resume.json"
# options a fingerprint holds only when they are not their default (outputs written before they existed resume as
# they did): a missing one is its default
OPTION_DEFAULTS = {"output_format": "infer", "kv_cache_dtype": "auto"}  # what a key left out of OUT.resume.json means
LOCK_SUFFIX = ".lock"


def done_ids(path: Path, lines_of: dict[str, int] | None = None) -> set[str]:
    """Ids of the whole records in an output file. Any other line is cut out of the file (atomically), with a
    note on stderr saying how many. `lines_of` (the input's id -> line number): an error record that names
    another line than the one that has its id now is cut too (a failed line without an id of its own took its
    line number as id, and a line appended since names that id: the failed line's id is N~2 now, and the
    appended line would have been skipped as done, its request never run). An id's later record replaces its
    error record (--retry-failed appends a retried line's record and removes the error only then: a run killed
    in between left both); any other repeated record is cut, the first kept."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with "\n", else a torn last record
    keep: list[bytes | None] = []
    at: dict[str, tuple[int, bool]] = {}  # id -> (its record's index in keep, whether that record is an error)
    dropped, moved, replaced = 1 if tail else 0, 0, 0
    for raw in lines:
        rec_id, line_no, error = _record_id(raw, with_line=True)
        if rec_id is not None and line_no is not None and (lines_of or {}).get(rec_id, line_no) != line_no:
            moved += 1
            continue
        if rec_id is not None and rec_id in at and at[rec_id][1]:  # a retried line's record after its error
            keep[at[rec_id][0]] = None
            replaced += 1
        elif rec_id is None or rec_id in at:
            dropped += 1
            continue
        at[rec_id] = (len(keep), error)
        keep.append(raw + b"\n")
    if dropped or moved or replaced:
        # the file itself, not a link to it: replacing the link left the records in a new file beside it, and the
        # file it pointed to (on another disk, say) ended torn and without the resumed run's records
        real = path.resolve()
        tmp = real.with_name(real.name + ".tmp")
        try:
            tmp.write_bytes(b"".join(k for k in keep if k is not None))
            os.chmod(tmp, stat.S_IMODE(real.stat().st_mode))  # an output made private (0600) stays so
            os.replace(tmp, real)
        except OSError as e:  # a full disk: a traceback, and a .tmp copy of the records left beside
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise OutputError(f"cannot remove {dropped + moved + replaced} unreadable, repeated or retried "
                              f"line(s) from {path}: "
                              f"{e.strerror or e}; the file is as it was",
                              "make room (the records are copied once), then run the same command again") from None
        if dropped:
            typer.echo(f"note: removed {dropped} unreadable or repeated line(s) from {path} (a run stopped "
                       "mid-write?); their requests run again", err=True)
        if moved:
            typer.echo(f"note: removed {moved} error record(s) from {path} whose id another line of the input has "
                       "now; both lines run again", err=True)
        if replaced:
            typer.echo(f"note: replaced {replaced} error record(s) in {path} with their retried lines' records "
                       "(--retry-failed)", err=True)
    return set(at)


def error_ids(path: Path) -> set[str]:
    """Ids of the error records in an output file (after `done_ids` has cleaned it): a resumed run that leaves them
    there has failed lines, whichever session wrote them."""
    out = set()
    if path.is_file():
        for raw in path.read_bytes().split(b"\n"):
            try:
                rec = json.loads(raw.decode("utf-8")) if raw.strip() else None
            except (ValueError, RecursionError):
                continue
            rec_id, error = record_of(rec)
            if rec_id is not None and error is not None:
                out.add(rec_id)
    return out


def side_files(output: Path) -> list[Path]:
    """The files a run keeps beside OUTPUT (its resume record, the temporary copies it renames into place, and the
    lock it holds while it writes)."""
    fp, real = fingerprint_path(output), output.resolve()
    return [fp, real.with_name(real.name + ".tmp"), fp.with_name(fp.name + ".tmp"), lock_path(output)]


def lock_path(output: Path) -> Path:
    real = output.resolve()
    return real.with_name(real.name + LOCK_SUFFIX)


@contextlib.contextmanager
def output_lock(output: Path):
    """Held while a run writes OUTPUT (a regular file): a second run of the same -o, with --resume or without, is
    refused at once. Without it both wrote: two --resume runs each ran the ids still missing (every such id ended
    with two records), a plain run truncated the file under the other. The lock is an flock on OUTPUT.lock (OUTPUT
    itself is replaced when a resume cuts a torn line), removed at the end; where it cannot be made (a folder that
    takes no new file, a file system without flock) the run goes on unlocked, as before. OUTPUT.lock deleted while
    a run writes does not let a second one in: the run's writer also locks OUTPUT (batch_io.lock_output)."""
    path, fd = lock_path(output), None
    while fd is None and fcntl is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip()
            os.close(fd)
            raise written_by_another_run(output, holder, path) from None
        except OSError:
            os.close(fd)
            fd = None
            break
        try:  # the run that held it may have removed the file meanwhile: lock the one that is there now
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except OSError:
            same = False
        if not same:
            os.close(fd)
            fd = None
    if fd is None:
        _not_being_written(output)
        yield
        return
    try:
        _not_being_written(output)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:  # (not another run's, made after this one's was deleted)
                os.unlink(path)
        os.close(fd)


def _not_being_written(output: Path) -> None:
    """ConfigError when another run holds the output file's own lock (batch_io.lock_output): its OUTPUT.lock was
    deleted, so only the records' file says that a run writes it. Looked at before this run reads, cuts or empties
    the file (its writer locks it for good once the model is loaded)."""
    fd = None
    for mode in (os.O_RDONLY, os.O_WRONLY):  # (a file whose permissions refuse reading is written to alone)
        with contextlib.suppress(OSError):  # no file yet: a writer that makes it second is refused at its lock
            fd = os.open(output, mode | os.O_NONBLOCK)
            break
    if fd is None:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            lock_output(fd, output)
    finally:
        os.close(fd)  # (the lock taken here, if any, goes with it)


_ERROR_LINE = re.compile(r"line ([0-9]+): ")  # how an input line's error record starts


def _record_id(raw: bytes, with_line: bool = False):
    """A record's id (None: not a record); `with_line`: (id, the input line its error names or None, whether it is
    an error record)."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        rec = None
    rec_id, error = record_of(rec)  # either --output-format's record: an OpenAI batch output line's is custom_id
    if rec_id is None:
        return (None, None, False) if with_line else None
    if not with_line:
        return rec_id
    m = _ERROR_LINE.match(error) if error is not None else None
    return rec_id, int(m.group(1)) if m else None, error is not None


def fingerprint_path(output: Path) -> Path:
    """Beside the output file itself (a symlinked output's is beside the file it points to, whichever path names
    it: through the link, a plain re-run did not see that the file's run was unfinished)."""
    real = output.resolve()
    return real.with_name(real.name + FINGERPRINT_SUFFIX)


def is_regular_target(output: Path | None) -> bool:
    """A file the run can resume into (not stdout, a pipe or /dev/null)."""
    return output is not None and is_regular_or_new(output)


def input_digest(path: Path, length: int | None = None) -> str:
    """sha256 of the first `length` bytes of a file (all of it when None)."""
    h = hashlib.sha256()
    left = path.stat().st_size if length is None else length
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def _ends_a_line(path: Path, size: int) -> bool:
    """Whether the file's first `size` bytes end with a newline."""
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) == b"\n"


def _starts_a_line(path: Path, size: int) -> bool:
    """Whether the bytes from `size` on start with a newline ("\n" or "\r\n"): text appended so to a file whose
    last line had none ended that line as it was (an editor's Enter at its end, `echo >> FILE`)."""
    with open(path, "rb") as f:
        f.seek(size)
        head = f.read(2)
    return head.startswith(b"\n") or head == b"\r\n"


def fingerprint(input: Path, options: dict) -> dict:
    return {"input": {"path": str(input), "bytes": input.stat().st_size, "sha256": input_digest(input)},
            "options": options}


def write_fingerprint(output: Path, input: Path, options: dict) -> None:
    """Written when a run starts, with "complete": false until mark_complete says every line has its record."""
    _write_json(fingerprint_path(output), {**fingerprint(input, options), "complete": False})


def mark_complete(output: Path) -> None:
    path = fingerprint_path(output)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(data, dict):
        _write_json(path, {**data, "complete": True},
                    f"every record is in {output}, but {path.name} still says the run did not finish; make room, "
                    "then run the same command with --resume to mark it complete (it generates nothing)")


def _write_json(path: Path, data: dict, hint: str = "make room or fix the folder's permissions, then run the same "
                                                     "command again (with --resume once the output holds records)"
                ) -> None:
    """Written whole or not at all (a temporary file renamed into place). OutputError when the disk is full or the
    folder takes no file: that was a traceback, with the temporary file left behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputError(f"cannot write {path}: {e.strerror or e}", hint) from None


_REQUEST_KEYS = ("prompt", "messages", "prompt_token_ids", "body", "input")  # what an input line has, no record


def _first_line_request(output: Path) -> str | None:
    """The request field (prompt, messages, body...) the first line of OUTPUT has when that line is an input's
    request, not a record of either --output-format (a record has finish_reason, or response); else None."""
    try:
        with open(output, "rb") as f:
            head = next((raw for raw in f if raw.strip()), b"")
        line = json.loads(head.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(line, dict) or "finish_reason" in line or "response" in line:
        return None
    return next((key for key in _REQUEST_KEYS if key in line), None)


def check_not_an_input(output: Path, resume: bool) -> None:
    """Refuse an OUTPUT no run wrote (no fingerprint) whose first line is a request: an input file named by -o by
    mistake. A plain run deleted it; --resume read its requests' ids as records ("nothing to resume", exit 0)."""
    if fingerprint_path(output).exists() or not output.is_file() or not output.stat().st_size:
        return
    key = _first_line_request(output)
    if key is not None:
        did = "--resume would take its requests' ids for records" if resume else "Writing the records would delete it"
        raise ConfigError(f"-o {output} holds requests, not records (its first line has {key!r}), and no infer run "
                          f"wrote it: is it an input file? {did}", "give another -o (the file the records go to), "
                          "or delete the file first")


def check_not_unfinished(output: Path) -> None:
    """A run without --resume starts OUTPUT over. When OUTPUT holds the records of a run that stopped before its
    end (killed, Ctrl-C, a full disk), that would throw away work that --resume keeps: refuse, and say so."""
    path = fingerprint_path(output)
    try:
        if output.stat().st_size == 0 or json.loads(path.read_text(encoding="utf-8")).get("complete") is not False:
            return
    except (OSError, ValueError, AttributeError):
        return
    with open(output, "rb") as f:
        records = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    raise ConfigError(f"-o {output} holds {records} records of a run that did not finish; starting over would "
                      "delete them", "pass --resume to complete that run, or delete the file (or choose another -o) "
                                     "to start over")


def check_resume(output: Path, input: Path, options: dict, retry_failed: bool = False) -> None:
    """Refuse to resume OUTPUT from another input or with options that change outputs. An input that only grew
    (lines appended to the same file) is the same input. `retry_failed` (--retry-failed): adapters added to the
    old ones (--lora NAME=PATH, those already given at the same paths) and --served-model-name ids added after the
    old ones (the first, a line's model where it names none, kept) are taken: they change no record but the error
    of a line that named an unknown adapter or model, which the run retries."""
    path = fingerprint_path(output)
    if not output.is_file():
        return
    if not path.is_file():  # nothing says which input wrote it: its records are kept as they are, said so
        typer.echo(f"note: {path} is missing, so infer cannot check that {output} was written from {input} with "
                   "these options; records whose ids are in both are kept as they are", err=True)
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        old_in, old_opts = old["input"], old["options"]
        size, digest = int(old_in["bytes"]), str(old_in["sha256"])
        if not isinstance(old_opts, dict):
            raise TypeError("options")
    except (OSError, ValueError, KeyError, TypeError):
        typer.echo(f"note: {path} is unreadable; resuming without checking the input", err=True)
        return
    hint = "resume with the same input and options, write to a new -o OUTPUT, or pass --force-resume"
    old_opts, options = {**OPTION_DEFAULTS, **old_opts}, {**OPTION_DEFAULTS, **options}
    changed = sorted(k for k in set(old_opts) | set(options) if old_opts.get(k) != options.get(k)
                     and not (retry_failed and _added(k, old_opts, options)))
    what = ", ".join(f"{k} {old_opts.get(k)!r} -> {options.get(k)!r}" for k in changed)
    if input.stat().st_size < size or input_digest(input, size) != digest:  # every difference at once
        also = f"; it was also written with other options: {what}" if changed else ""
        raise ConfigError(f"{output} was written from another input ({old_in.get('path')}, {size} bytes); "
                          f"{input} is not that file or was changed{also}", hint)
    if input.stat().st_size > size and size and not _ends_a_line(input, size) and not _starts_a_line(input, size):
        # the old input ended without "\n": what was appended joined its last line, a line already answered
        raise ConfigError(f"{input} grew since {output} was written, but its old last line did not end with a "
                          f"newline, so the text appended to it changed that line (byte {size:,} on)",
                          "end the old last line with a newline and put the new requests on lines of their own, or "
                          "write to a new -o OUTPUT")
    if changed and all(_added(k, old_opts, options) for k in changed):
        hint = ("to run again, with the adapters or names added, the lines whose records are errors (an unknown "
                "adapter's or model's), add --retry-failed; else " + hint)
    if changed:
        raise ConfigError(f"{output} was written with other options: {what}", hint)


def _added(key: str, old_opts: dict, options: dict) -> bool:
    """Whether option `key` only adds what a line may name: adapters (loras), or --served-model-name ids after the
    old ones (none given: MODEL's name), the first kept (the model of the records of lines that name none)."""
    old, new = old_opts.get(key), options.get(key)
    if key == "loras":
        return _only_added(old, new)
    if key != "served_model_name" or not isinstance(new, list):
        return False
    if old is None:
        from .options import base_model_id
        old = [base_model_id(str(old_opts.get("model")))]
    return isinstance(old, list) and new[:len(old)] == old


def _only_added(old, new) -> bool:
    """Whether the adapters `new` (name -> folder) keep every one of `old` at its folder and add others."""
    return isinstance(old, dict) and isinstance(new, dict) and all(new.get(k) == v for k, v in old.items())
