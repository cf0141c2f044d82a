"""Other libraries' output (banners, INFO lines, warnings, loading bars) kept off the terminal.

`library_output(log)` sends everything written to stdout and stderr while it is open — by Python code
(print, logging, warnings, tqdm) and by native code alike — to the file `log` (appended), or to nowhere when `log`
is None, then puts the terminal back. A command wraps its heavy work in it and prints its own lines afterwards.
With `infer --debug` (or INFER_DEBUG=1) nothing is hidden.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from pathlib import Path

# Set before the libraries are imported: they read these once.
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
             "TOKENIZERS_PARALLELISM": "false"}


# Loggers that speak at import time about optional parts the machine lacks, with nothing for the user to do:
# torchao (GPTQModel needs it; transformers imports it with any model class) cannot load its CUDA extensions on a
# CPU machine, and the deprecation it then triggers in torch's pytree. Their errors still show.
IMPORT_BANNERS = ("torchao", "torch.utils._pytree")


def debug_env() -> bool:
    """Whether INFER_DEBUG asks for debugging: set to anything but empty, 0, false, no or off (INFER_DEBUG=0 turned
    it on)."""
    return os.environ.get("INFER_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def quiet_import_banners(argv: list[str]) -> None:
    """Raise IMPORT_BANNERS' loggers to ERROR for this process, unless --debug or INFER_DEBUG asks for everything.
    Called by the console script before anything is imported (`cli.entry`)."""
    if "--debug" in argv or debug_env():
        return
    for name in IMPORT_BANNERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def debugging() -> bool:
    from .main import _state
    return bool(_state["debug"] or debug_env())


def _fd(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        return None  # a captured stream (tests): the Python-level redirection covers it


class _Sink(io.TextIOBase):
    """The log file (or nothing) as a text stream that, once closed, drops what is still written to it: a library
    may keep a reference to the stream it found and write from a thread after the command is done with it."""

    def __init__(self, log: Path | None):
        self._f = open(log, "a", encoding="utf-8", errors="replace") if log else None

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if self._f is not None and not self._f.closed:
            self._f.write(s)
        return len(s)

    def flush(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.flush()

    def fileno(self) -> int:
        if self._f is None:
            raise io.UnsupportedOperation("no file")
        return self._f.fileno()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


@contextlib.contextmanager
def library_output(log: Path | None = None):
    """Everything written while open goes to `log` (or nowhere); see the module docstring."""
    if debugging():
        yield
        return
    added = [k for k in QUIET_ENV if k not in os.environ]  # set while open, then taken back: a process that
    for k in added:                                          # goes on (a test, a Python caller) keeps its own
        os.environ[k] = QUIET_ENV[k]
    sink = _Sink(log)
    target = os.open(log if log else os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    saved = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always" if log else "ignore")
            for stream in (sys.stdout, sys.stderr):  # native code and Python alike, where the streams are real
                fd = _fd(stream)
                if fd is not None:
                    stream.flush()
                    saved.append((fd, os.dup(fd)))
                    os.dup2(target, fd)
            handlers = _point_log_handlers(sink)
            try:
                if len(saved) == 2:
                    yield
                else:  # captured streams (tests): redirect at the Python level
                    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                        yield
            finally:
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                for handler, stream in handlers:
                    handler.setStream(stream)
                for fd, copy in saved:
                    os.dup2(copy, fd)
                    os.close(copy)
    finally:
        os.close(target)
        sink.close()
        for k in added:
            os.environ.pop(k, None)


def _point_log_handlers(sink) -> list:
    """Logging handlers that hold the terminal's stream write to `sink` for now; returns what to put back."""
    out = []
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                        if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) \
                    and h.stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
                try:
                    out.append((h, h.setStream(sink)))
                except AttributeError:  # logging's last-resort handler: its stream is always sys.stderr
                    pass
    return out


@contextlib.contextmanager
def library_output_to_bar():
    """Other libraries' output (transformers' warnings, GPTQModel's banner and INFO lines) off the terminal while
    the HF baseline loads and generates, as `infer convert` does (`library_output`; --debug shows it).
    Yields a rich Console on the terminal for our own progress bar, or None (not a terminal, or --debug: the
    default console works)."""
    term = None
    if not debugging():
        try:
            fd = sys.stdout.fileno()
            if os.isatty(fd):  # a copy of the terminal, which the redirection below leaves alone
                term = os.fdopen(os.dup(fd), "w", encoding="utf-8", errors="replace")
        except (AttributeError, OSError, ValueError):
            term = None  # a captured stream (tests)
    try:
        with library_output():
            if term is None:
                yield None
            else:
                from rich.console import Console
                yield Console(file=term)
    finally:
        if term is not None:
            term.close()
