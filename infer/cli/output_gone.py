"""`infer run`'s output file deleted, moved or replaced while the run writes it (`rm out.jsonl`, `rm -r out/`, a
log rotation): the open file still took every record, but no path named it any more, so the records were lost
without a word. The writer (batch_io.RecordWriter) looks before each record: a path left free gets the file back
(made again with the records written so far, then the run goes on); a path another file took keeps that file, and
the run's records are saved beside it (or in the temporary folder) and the run stops, saying where they are."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO

from ..errors import OutputError


def still_there(path: Path, f: IO[bytes]) -> bool | None:
    """Whether `path` still names the open file `f` (True), names another file (False), or nothing (None: deleted,
    moved, or its folder removed)."""
    try:
        now = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    mine = os.fstat(f.fileno())
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def made_again(path: Path, f: IO[bytes], count: int) -> IO[bytes]:
    """`path`, whose file (`f`, holding `count` records) was deleted: made again (its folder too) with those records,
    open for appending the next ones. OutputError, the records saved elsewhere, when it cannot be made."""
    _readable(path, f, count)
    target = path.resolve()  # (a link whose file was deleted: the file it points to made again)
    new = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        new = open(target, "x+b")
        _copy(f, new)
        return new
    except OSError as e:
        if new is not None:
            new.close()
        saved = save_elsewhere(path, f)
        raise OutputError(f"{path} was deleted during the run after {count} records and cannot be made again: "
                          f"{e.strerror or e}; {_where(saved, count)}",
                          _remedy(saved, path, "make its folder writable again, ")) from None


def replaced(path: Path, f: IO[bytes], count: int) -> OutputError:
    """The error for `path` taken by another file than this run's (`f`, holding `count` records), whose records are
    saved elsewhere: the other file is left as it is."""
    _readable(path, f, count)
    saved = save_elsewhere(path, f)
    return OutputError(f"{path} was replaced by another file during the run, after {count} records; that file is left "
                       f"as it is, and {_where(saved, count)}", _remedy(saved, path, "move the other file away, then "))


def save_elsewhere(path: Path, f: IO[bytes]) -> Path | None:
    """A new file holding `f`'s records, beside `path` or else in the temporary folder; None when neither takes one."""
    name = f"{path.name}.saved-{os.getpid()}"
    for folder in (path.parent, Path(tempfile.gettempdir())):
        candidate, made = folder / name, False
        try:
            with open(candidate, "xb") as out:
                made = True
                _copy(f, out)
            return candidate
        except OSError:
            if made:  # (a full disk: a torn copy is no copy)
                with contextlib.suppress(OSError):
                    candidate.unlink()
    return None


def _readable(path: Path, f: IO[bytes], count: int) -> None:
    """OutputError when `f` was opened for writing alone (a file whose permissions refused reading): its records
    cannot be read back."""
    if not f.readable():
        raise OutputError(f"{path} was deleted or replaced during the run after {count} records, which cannot be "
                          "read back (the file's permissions refused reading when the run opened it)",
                          "give the output file read permission too (or choose another -o), then run again")


def _copy(f: IO[bytes], out: IO[bytes]) -> None:
    """Every record of `f` copied to `out`, flushed to its disk; `f`'s position (where it writes) stays its end."""
    f.flush()
    f.seek(0)
    shutil.copyfileobj(f, out)
    f.seek(0, os.SEEK_END)
    out.flush()
    os.fsync(out.fileno())


def _where(saved: Path | None, count: int) -> str:
    if saved is None:
        return f"the {count} records it wrote could not be saved anywhere (no folder took a file)"
    return f"the {count} records it wrote are saved in {saved}"


def _remedy(saved: Path | None, path: Path, before: str) -> str:
    if saved is None:
        return "make room or fix the folders' permissions, then run the same command again"
    return f"{before}move {saved} to {path} and run the same command with --resume to complete the rest"
