"""The `infer` console script (and `python -m infer.cli`). Ctrl-C while the commands are still being imported
(torch and transformers take a second or more) says "interrupted" and exits 130, as it does once a command runs,
instead of a traceback from deep inside an import. Ctrl-C is also remembered: an import it cut short can surface
later as another error (transformers' lazy modules report "Could not import module ..."), which the commands'
error handler then reports as the interruption it is (`cli.main.handle_errors`)."""

from __future__ import annotations

import signal
import sys

_ctrl_c = [False]


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
