"""`infer` command line: one file per command; user errors become one line on stderr and an exit code."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

try:  # typer >= 0.24 carries its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_errors

from ..errors import InferError
from .entry import Terminated


class _Commands(TyperGroup):
    """Command-line mistakes click finds itself (a value that is not a number, an unknown option, a missing
    argument) print the same two lines as every other error — `error: ...` and `hint: ...` — and exit 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click_errors.NoArgsIsHelpError as e:
            e.show()
            sys.exit(e.exit_code)
        except click_errors.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else self._command_path(args)
            from .vllm_flags import request_field_hint, vllm_hint
            unknown = isinstance(e, click_errors.NoSuchOption)
            option = e.option_name if unknown else None
            hint = vllm_hint(option, where)
            if unknown and hint is None and vllm_hint(_one_dash_token(e, args), where):  # vLLM's -tp, which click
                option = _one_dash_token(e, args).split("=")[0]  # read as -t -p ("No such option: -t")
                hint = vllm_hint(option, where)
            field = request_field_hint(where, e.option_name) if unknown and hint is None else None
            if hint is not None:  # vLLM's option: say what to do in infer, not click's guesses at a misspelling
                typer.echo(f"error: {option} is vLLM's option, which `{where}` does not take\n"
                           f"  hint: {hint}", err=True)
            elif field is not None:  # a request's field (--temperature): where it goes instead
                typer.echo(f"error: `{where}` has no option {e.option_name.split('=', 1)[0]}\n  hint: {field}",
                           err=True)
            else:
                hint = (_extra_argument_hint(where, e) or (_one_dash_hint(e, args) if unknown else None)
                        or _command_hint(e) or _missing_hint(e, where) or f"see `{where} --help`")
                typer.echo(f"error: {_with_value(e)}\n  hint: {hint}", err=True)
            sys.exit(2)
        except click_errors.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def _command_path(self, args) -> str:
        """`infer COMMAND` for an error click raises without its context (an option missing its value, as in
        `infer serve M --port`): the first of `args` that is a command, else `infer`."""
        args = sys.argv[1:] if args is None else list(args)
        name = next((a for a in args if not a.startswith("-")), None)
        return f"infer {name}" if name in self.commands else "infer"


def _with_value(error) -> str:
    """click's message, naming the value when typer's own check (pydantic's) left it out: `--max-num-seqs 0` said
    only "Invalid value for '--max-num-seqs': Input should be greater than or equal to 1"."""
    message = error.format_message()
    try:
        found = error.__cause__.errors()  # pydantic's ValidationError: the input it refused
        value = found[0]["input"]
    except Exception:  # noqa: BLE001 - any other cause: click's message as it is
        return message
    text = str(value)
    return f"{message} (got {text if text and text == text.strip() else repr(text)})"


def _one_dash_hint(error, args) -> str | None:
    """`infer run -help` or `-max-new-tokens 8`: click reads one dash as short options, one letter each, and named
    the first it did not know ("No such option: -e"). Say that long options take two dashes."""
    token = _one_dash_token(error, args)
    if token is None:
        return None
    name = token.split("=")[0]
    return f"{name} is read as one-letter options (-{name[1]} -{name[2]} ...); long options take two dashes: -{name}"


def _one_dash_token(error, args) -> str | None:
    """The argument of one dash and several letters (`-tp`, `-help`) that click read as the unknown one-letter
    option it names, or None."""
    args = sys.argv[1:] if args is None else list(args)
    letter = (error.option_name or "")[1:]
    if len(letter) != 1:
        return None
    return next((a for a in args if a.startswith("-") and not a.startswith("--") and len(a) > 2
                 and a[1:2].isalpha() and letter in a[1:].split("=")[0]), None)


_GENERATE = ("infer run MODEL INPUT.jsonl -o OUT.jsonl generates a reply for each line of a JSONL file (e.g. "
             "{example}), infer serve MODEL answers OpenAI requests")
# commands a newcomer guesses from other tools (vLLM's `vllm chat`/`complete`, ollama's `pull`), and what does it here
_GUESSED_COMMANDS = {
    "version": "the version is an option: infer --version",
    "generate": _GENERATE, "complete": _GENERATE, "predict": _GENERATE, "infer": _GENERATE,
    "chat": "infer has no interactive chat: infer serve MODEL and an OpenAI client (or curl) chat with it; infer run "
            "takes chat lines, {\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}",
    "download": "infer downloads nothing: fetch a model with `hf download ORG/NAME` (then pass ORG/NAME as MODEL), "
                "or a built-in one (tiny-llama, ...) is made on first use",
}
_GUESSED_COMMANDS["pull"] = _GUESSED_COMMANDS["download"]


def _missing_hint(error, where: str) -> str | None:
    """`infer serve` without MODEL, `infer convert M` without -o: the command's example (its --help's `Example:`
    line) shows what it takes."""
    import re
    if not isinstance(error, click_errors.MissingParameter) or error.ctx is None:
        return None
    found = re.search(r"Example: (.+?)(?:\n\s*\n|$)", error.ctx.command.help or "", re.S)
    return f"e.g. {' '.join(found.group(1).split())} (see `{where} --help`)" if found else None


def _command_hint(error) -> str | None:
    """`infer version` (the version is an option), `infer generate`, `infer chat`, `infer download`: what does that
    job here."""
    import re
    found = re.match(r"No such command '([^']*)'", error.format_message())
    hint = _GUESSED_COMMANDS.get(found.group(1).lower()) if found else None
    if hint == _GENERATE:
        from .batch_io import one_request_file
        return hint.format(example=one_request_file("prompts.jsonl"))
    return hint


def _extra_argument_hint(where: str, error) -> str | None:
    """What a newcomer meant by one positional argument too many: `infer run M in.jsonl out.jsonl` (the output is
    -o OUT), `infer serve M 8000` (the port is --port); None for anything else."""
    import re
    found = re.fullmatch(r"Got unexpected extra argument(?:s|\(s\))? \((.*)\)", error.format_message())
    if found is None:
        return None
    extra = found.group(1)
    pairs = extra.split(" ")
    if all("=" in p and not p.startswith("-") and p.split("=")[0] for p in pairs):  # vLLM's --lora-modules a=x b=y
        more = " ".join(f"--lora {p}" for p in pairs)
        return f"--lora takes one NAME=PATH: repeat the option for each adapter (... {more})"
    if " " in extra:
        return None
    if where == "infer run":
        return f"the output file is an option: infer run MODEL INPUT -o {extra}"
    if where == "infer serve" and extra.isdigit():
        return f"the port is an option: infer serve MODEL --port {extra}"
    return None


app = typer.Typer(
    cls=_Commands,
    name="infer",
    help="Deploy GPTQ int4 language models with batched multi-LoRA, and measure them.\n\n"
         "Example: infer run tiny-llama prompts.jsonl -o out.jsonl",
    no_args_is_help=True,
    rich_markup_mode=None,  # click's plain help: never cuts an option name at 80 columns
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
_state = {"debug": False}


def handle_errors(fn, command: str = "COMMAND"):
    """Map InferError to a one-line message and its exit code (traceback only with --debug); an error without a
    hint of its own points at the command's --help."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InferError as e:
            from .quiet import debug_env
            if _state["debug"] or debug_env():
                raise
            hint = e.hint or f"see `infer {command} --help`"
            typer.echo(f"error: {e.message}\n  hint: {hint}", err=True)
            raise typer.Exit(e.exit_code)
        except KeyboardInterrupt as e:
            terminated = isinstance(e, Terminated)  # SIGTERM inside `terminate_as_interrupt`
            typer.echo("terminated" if terminated else "interrupted", err=True)
            raise typer.Exit(143 if terminated else 130)
        except (typer.Exit, typer.Abort, click_errors.ClickException):  # the command's own exit, as it chose
            raise
        except BrokenPipeError:  # click turned it into a silent exit 1: warmup's "does not fit", lora-validate's fail
            if not _stdout_closed():
                raise
            _to_devnull(sys.stdout)
            try:
                typer.echo(f"error: stdout was closed by its reader before infer {command} wrote all of its output\n"
                           "  hint: pipe the output into a program that reads all of it, or redirect it to a file",
                           err=True)
            except OSError:  # stderr into the same closed pipe (`2>&1 | head -c 0`): the exit status says it alone
                _to_devnull(sys.stderr)
            raise typer.Exit(2) from None
        except Exception as e:
            extra = missing_extra(e)
            if extra is not None and not (_state["debug"] or _debug()):  # `pip install -e .` without the extra
                typer.echo(f"error: infer {command} needs {extra[0]!r}, which is not installed\n"
                           f"  hint: pip install 'infer[{extra[1]}]' (the {extra[1]} extra)", err=True)
                raise typer.Exit(2) from None
            if not _from_ctrl_c(e):
                raise
            typer.echo("interrupted", err=True)  # e.g. transformers' lazy imports turn it into an import error
            raise typer.Exit(130) from None

    return wrapper


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (`infer warmup M --json | head -c 0`): poll says POLLERR."""
    import select
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or stdout is no file (a test's capture)
        return False


def _to_devnull(stream) -> None:
    """Point `stream` (stdout, stderr) at /dev/null, so the interpreter's last flush of what is still buffered does
    not fail again (which made the exit status 120)."""
    import os
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


# the packages of infer's extras (pyproject.toml), by the name they import as: which extra installs each
_EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve", "starlette": "serve",
           "pandas": "bench", "matplotlib": "bench", "httpx": "bench", "peft": "lora", "gptqmodel": "quantize",
           "optimum": "quantize", "ray": "ray", "xgrammar": "structured"}


def missing_extra(e: BaseException) -> tuple[str, str] | None:
    """(the package, the extra that installs it) when `e` is the import of an extra's package that is not
    installed, else None: a traceback from deep inside serve or bench said only "No module named 'fastapi'"."""
    if not isinstance(e, ModuleNotFoundError) or not e.name:
        return None
    package = e.name.split(".")[0]
    return (package, _EXTRAS[package]) if package in _EXTRAS else None


def _debug() -> bool:
    from .quiet import debug_env
    return debug_env()


def _from_ctrl_c(e: BaseException) -> bool:
    """Whether `e` comes from a Ctrl-C: one reached the process (cli.entry), or a KeyboardInterrupt is in the
    error's cause or context chain."""
    from .entry import interrupted
    if interrupted():
        return True
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__
        typer.echo(f"infer {__version__}")
        raise typer.Exit()


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
         version: Annotated[bool, typer.Option("--version", help="Print infer's version and exit.",
                                               callback=_print_version, is_eager=True)] = False) -> None:
    """Deploy GPTQ int4 language models with batched multi-LoRA, and measure them."""
    _state["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")


def _debug_after_the_command(fn):
    """`fn` taking `--debug` too, so that `infer run M in.jsonl --debug` means `infer --debug run M in.jsonl`
    (hidden from the command's --help: the option belongs to `infer`)."""
    sig = inspect.signature(fn, eval_str=True)

    @functools.wraps(fn)
    def wrapper(*args, debug: bool = False, **kwargs):
        if debug:
            _state["debug"] = True
            logging.getLogger().setLevel(logging.DEBUG)
        return fn(*args, **kwargs)

    opt = inspect.Parameter("debug", inspect.Parameter.KEYWORD_ONLY, default=False,
                            annotation=Annotated[bool, typer.Option("--debug", hidden=True)])
    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), opt])
    return wrapper


def register(module: str, name: str, command: str | None = None, **kwargs) -> None:
    import importlib
    fn = getattr(importlib.import_module(f"infer.cli.{module}"), name)
    command = command or name.replace("_", "-")
    app.command(command, **kwargs)(handle_errors(_debug_after_the_command(fn), command))


from .many import ManyValuesCommand  # noqa: E402  (--served-model-name A B, --lora-target-modules o_proj qkv_proj)

register("run", "run", cls=ManyValuesCommand)
register("warmup", "warmup", cls=ManyValuesCommand)
register("quantize", "quantize")
register("convert", "convert")
register("serve", "serve", cls=ManyValuesCommand)
register("bench", "bench", cls=ManyValuesCommand)
register("demo", "demo")
register("lora", "lora_validate", "lora-validate", cls=ManyValuesCommand)
