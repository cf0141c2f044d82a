"""The `infer` console script (and `python -m infer.cli`). Ctrl-C while the commands are still being imported
(torch and transformers take a second or more) says "interrupted" and exits 130, as it does once a command runs,
instead of a traceback from deep inside an import. Ctrl-C is also remembered: an import it cut short can surface
later as another error (transformers' lazy modules report "Could not import module ..."), which the commands'
error handler then reports as the interruption it is (`cli.main.handle_errors`)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

_ctrl_c = [False]


class Terminated(KeyboardInterrupt):
    """SIGTERM (a timeout, docker stop, a job scheduler), raised where Ctrl-C raises KeyboardInterrupt while
    `terminate_as_interrupt` is in force: a terminated command stops as an interrupted one does (`infer run` between
    records, saying how many it wrote; quantize and convert removing their staging folders), says "terminated" and
    exits 143 (128 + SIGTERM; `cli.main.handle_errors`)."""


_terminated = [False]


def _raise_terminated(signum, frame):
    _terminated[0] = True
    raise Terminated


def terminated() -> bool:
    """Whether SIGTERM reached the latest `terminate_as_interrupt` block (for a command whose loop turns the
    interruption into a partial result, as `infer bench` does, and still has to exit 143)."""
    return _terminated[0]


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM raises `Terminated` inside the block (main thread only), instead of ending the process on the spot
    without a word and leaving what it was writing behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _terminated[0] = False
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted() -> bool:
    """Whether Ctrl-C reached this process (through the handler `main` installs)."""
    return _ctrl_c[0]


def _on_sigint(signum, frame):
    _ctrl_c[0] = True
    raise KeyboardInterrupt


def main() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    from .quiet import quiet_import_banners
    quiet_import_banners(sys.argv[1:])
    try:
        from .main import app
    except KeyboardInterrupt:
        _exit_interrupted()
    except Exception:
        if not interrupted():  # Ctrl-C cut an import short and something else failed on the half-made module
            raise
        _exit_interrupted()
    if interrupted():  # a library's import swallowed the KeyboardInterrupt: the user still asked to stop
        _exit_interrupted()
    app(prog_name="infer")


def _exit_interrupted():
    sys.stderr.write("interrupted\n")
    raise SystemExit(130) from None
