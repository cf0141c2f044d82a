"""Options shared by the commands: the MODEL argument, and the engine options generated from EngineConfig.

    @engine_options()
    def run(model: Model, input: ..., engine: EngineConfig) -> None: ...

`engine_options` adds one command-line option per EngineConfig field that has help metadata (its default, help
text and help panel come from the dataclass, so they are declared once) and hands the command a validated
`engine: EngineConfig`. A command that gives an option another meaning (bench's --max-num-seqs defaults to the
largest concurrency) excludes it and declares its own, then `dataclasses.replace`s the config.
"""

from __future__ import annotations

import errno
import functools
import inspect
import os
import re
import typing
from dataclasses import MISSING
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Optional

import typer

try:  # typer >= 0.24 carries its own copy of click
    from typer._click import core as click_core
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import core as click_core
    from click import get_current_context

from ..engine.config import RANGES, EngineConfig, cli_fields, command_line_template, valid_device
from ..errors import ConfigError
from ..models.tiny import BUILTIN_MODELS
from ..parallel.pool import MAX_RESTARTS
from ..parallel.runtime import PLACEMENT_TIMEOUT_S

BUILTIN_HELP = (f"a built-in model with random weights ({', '.join(BUILTIN_MODELS)}; generated on first use, its "
                "text is gibberish)")
Model = Annotated[str, typer.Argument(help=f"A local Hugging Face model folder (float, GPTQ or AWQ), or "
                                           f"{BUILTIN_HELP}.", show_default=False)]


def base_model_id(model: str) -> str:
    """The id HTTP clients send as `model` for the base (serve's default, bench's with --url): a built-in's name, a
    hub id read from the local hub cache as given (as vLLM lists it), or the model folder's name."""
    from ..models.resolve import is_hub_id
    if is_hub_id(model) and not Path(model).exists():
        return model
    return Path(model.rstrip("/\\")).name or model


def served_ids(names: list[str] | None, model: str, command: str = "serve") -> list[str]:
    """--served-model-name's ids (MODEL's name when none), each checked, without repeats; the first is the main one
    (the one reported when a request names none)."""
    if not names:
        return [base_model_id(model)]
    for name in names:
        if not name.strip():  # `"$UNSET"`: was MODEL's name, silently
            who = "clients send" if command == "serve" else "the batch lines name"
            raise ConfigError("--served-model-name is empty", f"give the id {who} as `model`, or leave the option out "
                              f"to {command} under MODEL's name")
    return list(dict.fromkeys(names))


# vLLM's human-readable integers (--max-model-len 32k): lower-case suffixes are decimal and take a fraction (25.6k is
# 25,600), upper-case ones binary and whole (32K is 32,768)
HUMAN_INT_FIELDS = frozenset({"max_model_len", "max_num_batched_tokens"})
_DECIMAL = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
_BINARY = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
_HUMAN_INT = re.compile(r"(-?\d+(?:\.\d+)?)([kmgtKMGT]?)")  # a sign: -1 gets the range's message


def human_int(lo: int | None = None, hi: int | None = None):
    """The parser of an integer option that also takes vLLM's suffixes, checking the option's range."""
    bounds = f"{lo}<=x" if hi is None else f"{lo}<=x<={hi}"

    def parse(value):
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            match = _HUMAN_INT.fullmatch(text)
            if not match:
                raise typer.BadParameter(f"{text!r} is not a whole number: give one such as 4096, or with vLLM's "
                                         "suffixes 8k (8,000) or 8K (8,192)")
            digits, suffix = match.groups()
            if "." in digits and suffix not in _DECIMAL:
                exact = Decimal(digits) * _DECIMAL.get(suffix.lower(), 1)
                if lo is not None and exact < lo or hi is not None and exact > hi:  # "-1.5K": no hint to write -1.5k
                    raise typer.BadParameter(f"{value} is not in the range {bounds}.")
                hint = f": write {digits}{suffix.lower()} for {int(Decimal(digits) * _DECIMAL[suffix.lower()]):,}" \
                    if suffix else ""
                raise typer.BadParameter(f"{text!r} is not a whole number (a fraction takes a lower-case, decimal "
                                         f"suffix: k, m, g, t){hint}")
            number = int(Decimal(digits) * (_DECIMAL.get(suffix) or _BINARY.get(suffix) or 1))
        if lo is not None and number < lo or hi is not None and number > hi:
            raise typer.BadParameter(f"{value} is not in the range {bounds}.")
        return number
    return parse


def _cli_annotation(f):
    """The Annotated type the command line reads for an EngineConfig field."""
    meta = f.metadata
    hints = typing.get_type_hints(EngineConfig)
    base = meta["cli_type"] or hints[f.name]
    args = [a for a in typing.get_args(base) if a is not type(None)]
    if type(None) in typing.get_args(base) and len(args) == 1:
        base = args[0]
    if meta["cli_type"] is not None or f.default is None:
        base = Optional[base]
    decls = [meta["flag"]] if meta["flag"] else []
    show_default = f.default not in (None, MISSING)
    lo, hi = RANGES.get(f.name, (None, None))
    hi = hi if hi is not None and hi < 2 ** 31 else None  # a seed's 2^63 bound is checked, not shown
    if f.name in HUMAN_INT_FIELDS:
        return Annotated[base, typer.Option(*decls, help=meta["help"], rich_help_panel=meta["panel"],
                                            show_default=show_default, parser=human_int(lo, hi), metavar="INTEGER")]
    return Annotated[base, typer.Option(*decls, help=meta["help"], rich_help_panel=meta["panel"],
                                        show_default=show_default, min=lo, max=hi, metavar=meta.get("metavar"))]


def _cli_default(f):
    return None if f.default is MISSING else f.default  # dict/list options: empty (None) on the command line


def engine_options(exclude: tuple[str, ...] = ()):
    """Decorate a command whose signature has `model` and `engine: EngineConfig`: the engine options become
    command-line options, and the command receives `engine=EngineConfig(model=model, **options)`."""
    chosen = [f for f in cli_fields() if f.name not in exclude]

    def decorate(fn):
        hints = typing.get_type_hints(fn, include_extras=True)
        sig = inspect.signature(fn)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()
               if p.name != "engine"]
        added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_cli_default(f),
                                   annotation=_cli_annotation(f)) for f in chosen]
        aliased = [f for f in chosen if f.metadata.get("vllm")]
        added += [inspect.Parameter(_alias(f), inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation=Annotated[Optional[bool], typer.Option(f.metadata["vllm"], hidden=True)])
                  for f in aliased]

        @functools.wraps(fn)
        def command(*args, **kwargs):
            values = {f.name: kwargs.pop(f.name) for f in chosen if f.name in kwargs}
            values = {k: v for k, v in values.items() if v is not None}
            for f in aliased:
                _take_alias(f, kwargs.pop(_alias(f), None), values, _given(f.name))
            if "chat_template" in values:  # the command line's text, as vLLM reads it (escapes decoded)
                values["chat_template"] = command_line_template(values["chat_template"])
            model = kwargs["model"] if "model" in kwargs else args[0]
            if "max_num_seqs" in exclude and "max_num_batched_tokens" in values:  # the command sets its own (warmup's
                # --concurrency) and checks it against the tokens: the default's 64 is no conflict of the user's
                values["max_num_seqs"] = min(default("max_num_seqs"), values["max_num_batched_tokens"])
            if "max_cpu_loras" in values and ("max_loras" in exclude or not _given("max_loras")):
                # --max-cpu-loras 2 alone: the default slots (4) no more than it, as vLLM's default (1) never is (a
                # command that sets its own, bench's --max-loras, has it checked then)
                values["max_loras"] = min(values.get("max_loras", default("max_loras")), values["max_cpu_loras"])
            kwargs["engine"] = EngineConfig(model=model, **values)
            return fn(*args, **kwargs)

        params = own + added
        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def _alias(f) -> str:
    return f"{f.name}_as_vllm"


def _given(name: str) -> bool:
    """Whether option `name` was set on the command line (or from its environment variable), not left at its
    default: `--prefix-caching` given is its default's value too."""
    ctx = get_current_context(silent=True)
    if ctx is None:  # called as a plain function: only a value other than the default tells
        return False
    return ctx.get_parameter_source(name) not in (None, click_core.ParameterSource.DEFAULT,
                                                  click_core.ParameterSource.DEFAULT_MAP)


def _take_alias(f, given: bool | None, values: dict, ours_given: bool = False) -> None:
    """vLLM's spelling of a bool option (`--enforce-eager`), given: its value, unless infer's spelling set another
    (also its default's value, as `--prefix-caching --no-enable-prefix-caching`)."""
    if given is None:
        return
    if f.name in values and (ours_given or values[f.name] != f.default) and values[f.name] != given:
        ours, theirs = f.metadata["flag"].split("/"), f.metadata["vllm"].split("/")
        raise ConfigError(f"{ours[0] if values[f.name] else ours[-1]} and {theirs[0] if given else theirs[-1]} "
                          "ask for opposite things", "give one of them")
    values[f.name] = given


def _field(name: str):
    return next(f for f in cli_fields() if f.name == name)


def default(name: str):
    """The one default of an engine option, for a command that takes it without the whole engine."""
    return _cli_default(_field(name))


def _check_device(value: str) -> str:
    if not valid_device(value):
        raise typer.BadParameter(f"{value!r} is not one of auto, cpu, cuda, cuda:N")
    return value


def one_path(flag: str, given: list[Path] | None, remedy) -> Path | None:
    """The one value of a file option that click would take the last of when given twice (the others silently
    dropped: a second --merge-lora adapter not merged, a second --calibration file not read): refused instead,
    with remedy(given) as the hint."""
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(f"{flag} is given {len(given)} times ({', '.join(map(str, given))}); it takes one",
                          remedy(given))
    return given[0]


def folder_path(value) -> Path:
    """An output folder option's value as a Path, `~` expanded (the shell leaves `--output=~/x` as it is, which made a
    folder named `~` in the current one); an empty one (`-o "$UNSET"`) is refused: Path('') is the current folder,
    which --overwrite would replace."""
    if not isinstance(value, Path) and not str(value).strip():
        raise typer.BadParameter("it is empty; give a folder path")
    path = Path(value).expanduser()
    if symlink_loop(path):  # the source-folder and staging checks resolve it: Path.resolve() raised on 3.11
        raise typer.BadParameter(f"{path} is a symbolic link that leads back to itself (a loop); remove the link or "
                                 "give another folder")
    return path


def given_path(what: str):
    """A parser of a path argument or option naming `what` ("a JSONL file"): the value as a Path, `~` expanded; an
    empty one (`infer run MODEL "$UNSET"`) is refused: Path('') is the current folder, which was then refused as
    "input . is a directory" (or --merge-lora's "--merge-lora .: adapter_config.json is missing")."""
    def parse(value) -> Path:
        if not isinstance(value, Path) and not str(value).strip():
            raise typer.BadParameter(f"it is empty; give the path of {what}")
        return Path(value).expanduser()
    return parse


input_file_path = given_path("a JSONL file")


def symlink_loop(path: Path) -> bool:
    """Whether `path` (or a folder above it) is a symbolic link that leads back to itself."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def check_ray_address(value: str | None) -> str | None:
    """--ray-address: an empty one (`--ray-address "$UNSET"`) was taken as none, and the run went to a local Ray
    runtime without a word."""
    if value is not None and not value.strip():
        raise typer.BadParameter("it is empty; give HOST:6379 or ray://HOST:10001, or leave the option out for a "
                                 "local Ray runtime")
    return value


MAX_REPLICA_RESTARTS = MAX_RESTARTS  # --max-replica-restarts' default
REPLICA_RESTARTS_HELP = ("With --data-parallel: how many times a replica that stops (its process died) is replaced by "
                         "a fresh one (the same config, the model loaded again), per replica; 0: never (the others "
                         "go on without it).")
MaxReplicaRestarts = Annotated[int, typer.Option("--max-replica-restarts", min=0, max=1000,
                                                 help=REPLICA_RESTARTS_HELP)]
REPLICA_PLACEMENT_TIMEOUT = PLACEMENT_TIMEOUT_S  # --replica-placement-timeout's default
PLACEMENT_HELP = ("With --data-parallel: seconds Ray may take to place a replica (a node with the GPU, or the CPUs, "
                  "it asks for free, e.g. one an autoscaler adds) before that replica counts as failed: at the "
                  "start the command stops; a fresh replica in place of one that stopped stays stopped (or, with "
                  "restarts left, another is tried) while the others go on.")


def check_placement_timeout(value: float) -> float:
    """--replica-placement-timeout: a positive, finite number of seconds."""
    if not value > 0 or value == float("inf"):
        raise typer.BadParameter(f"must be a positive number of seconds, got {value}")
    return value


ReplicaPlacementTimeout = Annotated[float, typer.Option("--replica-placement-timeout", help=PLACEMENT_HELP,
                                                        metavar="SECONDS", callback=check_placement_timeout)]


def check_replica_options(data_parallel: int, ray_address: str | None) -> None:
    """--max-replica-restarts and --replica-placement-timeout tune --data-parallel replicas (Ray actors): given to
    one engine in the command's own process (no --data-parallel above 1, no --ray-address) they were silently
    ignored (the user believing a crashed engine would be restarted): refused, naming them."""
    if data_parallel > 1 or ray_address:
        return
    given = [flag for name, flag in (("max_replica_restarts", "--max-replica-restarts"),
                                     ("replica_placement_timeout", "--replica-placement-timeout")) if _given(name)]
    if given:
        raise ConfigError(f"{' and '.join(given)} only apply to --data-parallel replicas; without --data-parallel N "
                          "(N above 1) or --ray-address one engine runs in this process, with no replica to restart "
                          "or place", f"add --data-parallel N to run N replicas, or leave {' and '.join(given)} out")


# Single engine options for commands that do not run the engine (lora-validate).
Device = Annotated[str, typer.Option(help=_field("device").metadata["help"], callback=_check_device)]
MaxLoraRank = _cli_annotation(_field("max_lora_rank"))
LoraTargetModules = _cli_annotation(_field("lora_target_modules"))
