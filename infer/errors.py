"""Every error a user can cause: a message that names the thing, and a hint that says what to do."""

from __future__ import annotations


class InferError(Exception):
    """Base class. `exit_code` is what the CLI exits with when this reaches it."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def reworded(self, message: str) -> "InferError":
        """This error with another message: its class and fields kept (an UnknownAdapterError stays one, with its
        name and the registered adapters), where a caller says which of its inputs it is ("prompt 2: ...")."""
        import copy
        e = copy.copy(self)
        e.message, e.args = message, (message,)
        return e


class ConfigError(InferError):
    """A bad flag or option value."""


class UnknownOptionError(ConfigError, TypeError):
    """A keyword the API does not take (LLM(model, foo=1)); a TypeError too, as Python's own for an unknown
    keyword argument is."""


class ModelLoadError(InferError):
    """A model folder that is missing, incomplete, corrupted or of an unsupported kind."""


class UnsupportedModelError(ModelLoadError):
    """An architecture or a quantization setting that infer does not implement."""


class OutputError(InferError):
    """An output that cannot be written (a full disk, a closed pipe); what was written before stays."""


class RequestError(InferError, ValueError):
    """One request (one input line, one HTTP body) is invalid; the others still run. A ValueError too, as vLLM's
    invalid sampling parameters and prompts are (`except ValueError` catches it)."""

    exit_code = 1


class RequestIdTypeError(RequestError, TypeError):
    """A request id that is not a string (LLMEngine.add_request / abort_request); a TypeError too, as vLLM's."""


class UnknownAdapterError(RequestError):
    """A request names a LoRA adapter the engine does not have. `name`: the one named; `known`: the registered ones;
    `slots`: whether the engine has adapter slots (adapters can be registered while it runs). The hint is the API's
    remedy (LLM.add_lora, lora_request); a front end (infer run, infer serve) says its own from these fields."""

    def __init__(self, message: str, hint: str | None = None, *, name: str | None = None, known=(),
                 slots: bool = False):
        super().__init__(message, hint)
        self.name, self.known, self.slots = name, tuple(known), slots


class UnknownModelError(RequestError):
    """An OpenAI batch line's body.model names no model of the run: neither the base (by any of its names) nor a
    registered adapter (vLLM's 404 "The model `X` does not exist."). `name`: the one named; `known`: the names the
    run accepts. Only that line fails: its record says so (status 404 in an OpenAI batch output line)."""

    def __init__(self, message: str, hint: str | None = None, *, name: str | None = None, known=()):
        super().__init__(message, hint)
        self.name, self.known = name, tuple(known)


class LoRAError(InferError):
    """An adapter that cannot be loaded or does not fit the base model."""


class LoRANameError(LoRAError):
    """The adapter's name is the problem (not a string, taken, or its earlier adapter still finishing), not its
    folder: a server answers it naming lora_name."""


class OutOfMemoryError(InferError):
    """The model, its activations or its KV cache do not fit the memory budget (the engine cannot start)."""


class ClosedError(InferError, RuntimeError):
    """An object used after its close() (an LLM whose engine memory was freed)."""


class SleepModeError(InferError, RuntimeError):
    """Sleep mode (LLM(..., enable_sleep_mode=True)) used where it cannot be: a request while the engine is asleep,
    or woken from sleep(level=2) without its weights loaded again; sleep() of an engine started without it.
    `route`: what an HTTP client of `infer serve --enable-sleep-mode` does about it (the hint is the Python API's)."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None, route: str | None = None):
        super().__init__(message, hint)
        self.route = route


class PauseError(SleepModeError):
    """pause_generation (vLLM's) used where it cannot be: mode "wait" while requests an earlier pause froze cannot run
    to their end (nor can a sleep's "wait" while generation is paused). `route`: what an HTTP client does about it."""


class SleepTimeoutError(SleepModeError):
    """sleep(mode="wait", timeout=...) ran out of time with requests still running: the engine goes to sleep once
    they end (new requests are refused meanwhile), as it would have without the timeout."""


class PauseTimeoutError(PauseError):
    """pause_generation(mode="wait", timeout=...) ran out of time with requests still running: generation stays paused
    (new requests wait), those requests run on to their end."""


def read_utf8(path, what: str) -> str:
    """A text file's content, or a ConfigError naming `what` and where the first byte that is not UTF-8 sits."""
    from pathlib import Path
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})",
                          "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def bom_error(path, cls: type[InferError] = ConfigError) -> InferError | None:
    """The refusal of a JSON file that starts with a UTF-8 byte-order mark (a Windows editor's "UTF-8 with BOM"),
    or None when it has none: transformers (and so vLLM) cannot read such a config.json or tokenizer_config.json
    (json.loads: "Unexpected UTF-8 BOM"), so infer refuses it with the fix instead of a decoder's words."""
    import shlex
    from pathlib import Path
    try:
        with Path(path).open("rb") as f:
            if f.read(3) != b"\xef\xbb\xbf":
                return None
    except OSError:
        return None
    return cls(f"{path} starts with a UTF-8 byte-order mark (BOM), which transformers cannot read as JSON",
               f"save it as UTF-8 without a BOM (e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' {shlex.quote(str(path))})")


def json_problem(e: Exception) -> str:
    """Why json.loads refused a text, in words for whoever wrote it: a JSONDecodeError's own, "nested too deeply"
    for a RecursionError, and an integer of more than 4300 digits without Python's advice to raise the limit
    (sys.set_int_max_str_digits(): a program's remedy, not the text's)."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return str(e).split(";")[0]
