"""`infer run MODEL INPUT.jsonl -o OUTPUT.jsonl`: batched generation for every line of a JSONL file."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..checks import missing_file_hint
from ..engine.config import EngineConfig
from ..engine.pooling import output_tokens, throughput_words
from ..errors import ConfigError, RequestError, UnknownAdapterError
from . import options as o
from ..engine.sampling_params import MAX_TOKENS
from .banner import start_traits
from .batch_io import (OUTPUT_FORMATS, Records, RecordWriter, check_batch_lines, check_format, check_input_encoding,
                       model_names, one_request_file, read_inputs, unused_adapters_note)
from .beam_lines import LineBeams, is_beam_line
from .embed_lines import LineInputs, inputs_of, is_many_inputs_line
from .entry import Terminated, terminate_as_interrupt
from .resume import (check_not_an_input, check_not_unfinished, check_resume, done_ids, error_ids, is_regular_target,
                     mark_complete, output_lock, side_files, write_fingerprint)


def _check_format(value: str) -> str:
    if value not in OUTPUT_FORMATS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(OUTPUT_FORMATS)}")
    return value


@o.engine_options()
def run(
    model: o.Model,
    input: Annotated[Path, typer.Argument(help="JSONL file: one request per line (prompt | messages | "
                                               "prompt_token_ids, or an OpenAI batch line).", show_default=False,
                                          parser=o.input_file_path)],
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="Output JSONL (default, or -o -: stdout).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Skip ids already in OUTPUT and complete the rest (OUTPUT must come "
                                              "from the same input and options).")] = False,
    force_resume: Annotated[bool, typer.Option("--force-resume", help="Resume even if OUTPUT was written from another input or with "
                                                    "other options.")] = False,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="With --resume: run again the lines whose "
                                               "records in OUTPUT are errors (after fixing their cause, e.g. with "
                                               "--lora for an unknown body.model), each new record replacing its "
                                               "error; --lora may add adapters.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Check every line first; exit 2 before generating if one is bad.")]
    = False,
    max_new_tokens: Annotated[int, typer.Option(help="Default for lines without max_new_tokens (generated tokens, "
                                                     "1..2^31-1).")] = 256,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or summary.")] = False,
    data_parallel: Annotated[int, typer.Option("--data-parallel", min=1, help="Engine replicas as Ray actors, one per "
                                               "GPU (CPU replicas without GPUs); needs infer[ray].")] = 1,
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", help="Join this Ray cluster (HOST:6379 or "
                                                       "ray://HOST:10001); default: a local Ray runtime.",
                                                       callback=o.check_ray_address)] = None,
    max_replica_restarts: o.MaxReplicaRestarts = o.MAX_REPLICA_RESTARTS,
    replica_placement_timeout: o.ReplicaPlacementTimeout = o.REPLICA_PLACEMENT_TIMEOUT,
    output_format: Annotated[str, typer.Option("--output-format", help="infer: infer's own record per line (id, text, "
                                               "token_ids, ...); openai: OpenAI's batch output line (custom_id, "
                                               "response.body: the server's chat.completion or text_completion), as "
                                               "vllm run-batch writes it; every line must be an OpenAI batch line.",
                                               callback=_check_format)] = "infer",
    reasoning_parser: Annotated[Optional[str], typer.Option("--reasoning-parser", help="With --output-format openai: "
                                                            "split a chat line's reasoning from its answer into the "
                                                            "message's `reasoning`, as infer serve's option (and "
                                                            "vllm run-batch's): deepseek_r1 | qwen3 | "
                                                            "seed_oss | openai_gptoss | hunyuan_a13b | "
                                                            "exaone4 | mistral | olmo3 | ernie45 | glm45 | "
                                                            "apertus | cohere_command | granite | "
                                                            "deepseek_v3 | kimi_k2.")] = None,
    enable_prompt_tokens_details: Annotated[bool, typer.Option("--enable-prompt-tokens-details",
                                                               help="With --output-format openai: each body's usage "
                                                                    "reports prompt_tokens_details.cached_tokens, "
                                                                    "the prompt tokens found in the prefix cache, as "
                                                                    "infer serve's option (and vllm run-batch's).")
                                              ] = False,
    served_model_name: Annotated[Optional[list[str]], typer.Option(
        "--served-model-name", metavar="NAME [NAME ...]", show_default=False,
        help="The base model's names a batch line's body.model may give (default: MODEL as given and its folder's "
             "name), as vllm run-batch's (and infer serve's) option; the first is the `model` of OpenAI output "
             "bodies whose line names none. Any other name but a --lora adapter's is that line's error.")] = None,
    engine: EngineConfig = None,
) -> None:
    """Generate a reply for every line of INPUT; records are appended to OUTPUT as requests finish.

    Example: infer run tiny-llama prompts.jsonl -o out.jsonl --max-new-tokens 64

    Exit status: 0 all lines ok, 1 some lines failed (each has an error record), 2 the run could not start.
    """
    resume = resume or force_resume
    o.check_replica_options(data_parallel, ray_address)
    if retry_failed and not resume:
        raise ConfigError("--retry-failed runs again the lines whose records in -o OUTPUT are errors: it needs "
                          "--resume", "add --resume (without it the run starts OUTPUT over and runs every line)")
    if output is not None and not output.strip():  # `-o "$UNSET"`: Path('') is the current folder
        raise ConfigError("-o is empty", "give a file path, e.g. -o out.jsonl, or -o - (or no -o) for stdout")
    if output is not None and output.endswith(("/", os.sep)):  # (a Path would drop the slash: a file of that name)
        raise ConfigError(f"-o {output} names a directory (it ends with a slash)",
                          "give a file path, e.g. -o out/records.jsonl")
    # "-" is the usual spelling of stdout (a file named "-" is -o ./-)
    output = None if output is None or output == "-" else Path(output).expanduser()  # --output=~/o.jsonl: no shell ~
    input = input.expanduser()  # a quoted "~/my prompts.jsonl" reaches infer unexpanded, as -o's does
    given = Path(str(engine.model)).expanduser()
    if str(input) != "-" and not input.exists() and given.is_file():  # `infer run prompts.jsonl tiny-llama`
        raise ConfigError(f"input file {input} does not exist, and MODEL {given} is a file: the two are swapped?",
                          f"MODEL comes first: infer run MODEL INPUT, e.g. infer run {input} {given}")
    _check_paths(input, output, resume, max_new_tokens)
    options = _output_options(engine, max_new_tokens, output_format, _reasoning_option(reasoning_parser, output_format),
                              _details_option(enable_prompt_tokens_details, output_format))
    if served_model_name:  # (only when given: outputs written before the option existed resume as they did)
        options["served_model_name"] = o.served_ids(served_model_name, str(engine.model), "run")
    resumable = is_regular_target(output)
    with output_lock(output) if resumable else contextlib.nullcontext():  # one run at a time writes a file
        _run_locked(engine, input, output, resume, force_resume, strict, max_new_tokens, quiet, data_parallel,
                    ray_address, options, resumable, output_format,
                    replica_options={"max_restarts": max_replica_restarts,
                                     "placement_timeout": replica_placement_timeout}, retry_failed=retry_failed)


def _run_locked(engine: EngineConfig, input: Path, output: Path | None, resume: bool, force_resume: bool,
                strict: bool, max_new_tokens: int, quiet: bool, data_parallel: int, ray_address: str | None,
                options: dict, resumable: bool, output_format: str = "infer",
                replica_options: dict | None = None, retry_failed: bool = False) -> None:
    """`run` once its paths are checked, with the output locked (`replica_options`: run_data_parallel's
    max_restarts and placement_timeout, for --data-parallel; `retry_failed`: --retry-failed)."""
    if resumable:
        check_not_an_input(output, resume)
    if resume and resumable and not force_resume:
        check_resume(output, input, options, retry_failed)
    if not resume and resumable:
        check_not_unfinished(output)
    if _holds_no_request(input):  # nothing to generate: say so, without loading a model for it
        typer.echo(f"note: {input} holds no requests (it is empty or has only blank lines); nothing to generate",
                   err=True)
        if output is not None and not resume:
            open(output, "wb").close()  # the (empty) output a next step expects
        return
    check_batch_lines(input, output_format)  # an input for the other format costs no model load
    defaults = {"max_new_tokens": max_new_tokens}
    if data_parallel > 1 or ray_address:
        from .run_parallel import run_data_parallel
        failed, earlier = run_data_parallel(engine, input, output, replicas=data_parallel, address=ray_address,
                                            defaults=defaults, strict=strict, resume=resume, resumable=resumable,
                                            options=options, quiet=quiet, output_format=output_format,
                                            retry_failed=retry_failed, **(replica_options or {}))
    else:
        failed, earlier = _run_in_process(engine, input, output, defaults, strict=strict, resume=resume,
                                          resumable=resumable, options=options, quiet=quiet,
                                          output_format=output_format, retry_failed=retry_failed)
    if resumable:
        if retry_failed:
            done_ids(output)  # the retried lines' error records out (each new record replaces its error)
        mark_complete(output)  # every line has its record: a later run may start this output over
    if not failed and earlier:  # error records an earlier session wrote for this input fail the run as well
        typer.echo(f"note: {output} holds {earlier} error record(s) from before this resume (a resume keeps them; "
                   "to run their lines again once their cause is fixed, add --retry-failed)", err=True)
        failed = earlier
    if failed:
        raise typer.Exit(1)


def _run_in_process(engine: EngineConfig, input: Path, output: Path | None, defaults: dict, *, strict: bool,
                    resume: bool, resumable: bool, options: dict, quiet: bool,
                    output_format: str = "infer", retry_failed: bool = False) -> tuple[int, int]:
    """Load the engine, check every line against it, and generate what is still to do: (this run's failed lines,
    error records of this input's lines that the resumed output already held)."""
    if strict:  # every line is read and checked before the model loads: a bad file costs no load time
        _strict_exit(_prechecked_lines(engine, input, defaults, output_format, options.get("served_model_name")))
    try:  # Ctrl-C while the model loads (tens of seconds for a real one): nothing is written yet, say so
        llm = _start_engine(engine, quiet)
        names = model_names(engine, options.get("served_model_name"))
        lines = _checked_lines(llm, input, defaults, strict, names, output_format)
    except KeyboardInterrupt as e:
        exit_interrupted_loading(e, output, resume)
    note = unused_adapters_note(engine.loras, lines)
    if note and not quiet:
        typer.echo(note, err=True)
    todo, writer, earlier = open_output(lines, output, input, options, resume, resumable, retry_failed)
    if resume and not todo and lines:  # (not "0 ok, 0 failed, 0 tokens": nothing was left to generate)
        writer.close()
        if not quiet:
            typer.echo(f"infer: nothing to resume: {output} already holds a record for each of the {len(lines)} "
                       f"request(s) in {input}", err=True)
        return 0, earlier
    try:
        with terminate_as_interrupt():
            records = Records(output_format, llm.tokenizer, lines, model_id(engine, options),
                              options.get("reasoning_parser"), options.get("prompt_tokens_details", False),
                              names.labels)
            return _generate(llm, todo, writer, quiet, records), earlier
    except KeyboardInterrupt as e:  # every finished record is on disk already: say how to get the rest
        exit_interrupted(e, output, resumable, len(lines), len(todo), writer.count)
    finally:
        writer.close()


def exit_interrupted(e: KeyboardInterrupt, output: Path | None, resumable: bool, lines: int, todo: int,
                     written: int):
    """Ctrl-C or SIGTERM while generating: say how many records are on disk and how to get the rest, and exit 130
    (143 for SIGTERM). `lines`: the input's requests, `todo`: those this run had to do, `written`: this run's."""
    where = f"to {output}" if output is not None else "to stdout"
    more = "; run the same command with --resume to complete the rest" if resumable else ""
    before = lines - todo  # written by the runs this one resumes
    # an empty OUTPUT: a plain run starts it as --resume does (not one that holds error records a --retry-failed run
    # was to replace, or another input's records: a plain run is refused, and would start it over)
    if resumable and not before + written and (not output.exists() or output.stat().st_size == 0):
        more = "; run the same command again (with or without --resume: nothing was written to keep)"
    count = f"{written} of {todo} records" if not before else \
        f"{written} of the {todo} records still to do ({before + written} of {lines} in all)"
    terminated = isinstance(e, Terminated)
    typer.echo(f"{'terminated' if terminated else 'interrupted'}: {count} written {where}{more}", err=True)
    raise typer.Exit(143 if terminated else 130) from None


def exit_interrupted_loading(e: KeyboardInterrupt, output: Path | None, resume: bool):
    """Ctrl-C (or SIGTERM) before the first request was generated, while the model loaded or the lines were
    checked: nothing was written, so say that and what to do (it printed a bare "interrupted"); exit 130 (143)."""
    state = f"{output} is as it was" if resume and output is not None else "nothing was written" + (
        f" to {output}" if output is not None else "")
    again = "run the same command with --resume again" if resume else "run the same command again"
    terminated = isinstance(e, Terminated)
    typer.echo(f"{'terminated' if terminated else 'interrupted'} while loading the model, before generating: "
               f"{state}; {again}", err=True)
    raise typer.Exit(143 if terminated else 130) from None


def _start_engine(engine: EngineConfig, quiet: bool):
    """The in-process engine, announced on stderr (model, device, dtype, KV cache, max length, speculative decoding)
    unless quiet."""
    from ..engine.llm_engine import LLMEngine
    llm = LLMEngine(engine)
    if not quiet:
        from ..models.resolve import BUILTIN_MODELS, is_hub_id
        given = str(engine.model)
        # a hub id or a built-in as given (as serve lists them), not the snapshot's or the cache folder's name
        builtin = given in BUILTIN_MODELS and not Path(given).exists()
        name = given if builtin or (is_hub_id(given) and not Path(given).exists()) else llm.model_path.name
        typer.echo(f"infer: {name} on {llm.device.type}, {start_traits(llm)}", err=True)
    return llm


def _check_paths(input: Path, output: Path | None, resume: bool, max_new_tokens: int) -> None:
    """Everything about the paths and plain options that can be wrong, found before the model loads."""
    if not 1 <= max_new_tokens <= MAX_TOKENS:
        raise ConfigError(f"--max-new-tokens must be in 1..{MAX_TOKENS}, got {max_new_tokens}", "e.g. 256")
    if resume and output is None:
        raise ConfigError("--resume needs -o OUTPUT", "resume reads the ids already written to OUTPUT")
    if str(input) == "-" and not input.exists():  # "-" reads stdin in many tools; here it was "file - does not exist"
        raise ConfigError("the input cannot be stdin (-): a run reads its input file twice, once to check every line "
                          "and once more to resume", "save the requests to a file first, e.g. ... > prompts.jsonl, "
                          "and give its path")
    if not input.exists():
        near = missing_file_hint(input)  # a typo (examples/prompt.jsonl): the folder's closest file
        raise ConfigError(f"input file {input} does not exist",
                          near or f"give a JSONL file with one request per line, e.g. {one_request_file(str(input))}")
    if input.is_dir():
        raise ConfigError(f"input {input} is a directory, not a file", "give a JSONL file with one request per line")
    if not input.is_file():
        raise ConfigError(f"input {input} is not a regular file (a pipe or a device?)",
                          "save the requests to a JSONL file first and give its path (a run is read twice: once "
                          "to check every line, once to resume)")
    check_input_encoding(input)
    if output is None:
        return
    if o.symlink_loop(output):  # its side files go beside a symlink's target: Path.resolve() raised on 3.11
        raise ConfigError(f"-o {output} is a symbolic link that leads back to itself (a loop)",
                          "remove the link or point it at a file, or give another -o")
    if output.is_dir():
        raise ConfigError(f"-o {output} is a directory", "give a file path, e.g. -o out.jsonl")
    if output.exists() and os.path.samefile(output, input):
        raise ConfigError(f"-o {output} is the input file: writing would destroy it",
                          "write the records to another file, e.g. -o out.jsonl")
    for side in side_files(output):
        if side.exists() and os.path.samefile(side, input):
            raise ConfigError(f"the input {input} is {side.name}, a file infer run keeps beside -o {output}: the "
                              "run would overwrite it", "rename the input, or write to another -o OUTPUT")
    parent = output.parent if str(output.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"-o {output}: {parent} is not a directory", "give a path inside a directory")
    target = output if output.exists() else _first_existing(parent)
    if not os.access(target, os.W_OK):
        raise ConfigError(f"-o {output} is not writable ({target} does not allow writing)",
                          "choose another output path or fix its permissions")
    _try_writing(output, target)


def _holds_no_request(input: Path) -> bool:
    """Whether a regular input file has nothing but whitespace (and a byte order mark); a pipe is not read here."""
    if not input.is_file():
        return False
    with open(input, "rb") as f:
        head = f.read(3)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            if chunk.strip():
                return False
    return not head.removeprefix(b"\xef\xbb\xbf").strip()


def _try_writing(output: Path, target: Path) -> None:
    """os.access says yes to root even where nothing can be written (/proc, /sys, a read-only mount): open for real
    before the model loads, writing nothing (an existing file is opened for appending and closed)."""
    try:
        if target == output:
            if output.is_file():
                open(output, "ab").close()
        else:
            tempfile.TemporaryFile(dir=target).close()
    except OSError as e:
        raise ConfigError(f"-o {output} cannot be written: {e.strerror or e}",
                          "choose another output path or fix its permissions") from None


def _first_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _reasoning_option(parser: str | None, output_format: str) -> str | None:
    """--reasoning-parser: a parser serve's option names; it splits the chat.completion messages of OpenAI output."""
    from .serve import _reasoning_parser
    parser = _reasoning_parser(parser)
    if parser is not None and output_format != "openai":
        raise ConfigError("--reasoning-parser splits the messages of OpenAI batch output: infer's own records have "
                          "the reply's text alone", "add --output-format openai (as vllm run-batch writes)")
    return parser


def _details_option(details: bool, output_format: str) -> bool:
    """--enable-prompt-tokens-details: vLLM's field of the usage of OpenAI output's bodies, not of infer's records."""
    if details and output_format != "openai":
        raise ConfigError("--enable-prompt-tokens-details fills vLLM's usage.prompt_tokens_details of OpenAI batch "
                          "output; infer's own records keep their usage as it is",
                          "add --output-format openai (as vllm run-batch writes)")
    return details


def _output_options(engine: EngineConfig, max_new_tokens: int, output_format: str = "infer",
                    reasoning_parser: str | None = None, prompt_tokens_details: bool = False) -> dict:
    """The options that change what a run writes: a resumed run must use the same ones."""
    model = Path(engine.model).expanduser()
    return {"model": str(model.resolve()) if model.exists() else engine.model, "dtype": engine.dtype,
            "seed": engine.seed, "max_model_len": engine.max_model_len, "max_new_tokens": max_new_tokens,
            "loras": {k: str(Path(v).resolve()) for k, v in sorted(engine.loras.items())},
            # only when given: outputs written before the option existed resume as they did
            **({"chat_template": "sha256:" + hashlib.sha256(engine.chat_template.encode()).hexdigest()[:16]}
               if engine.chat_template is not None else {}),
            **({"output_format": output_format} if output_format != "infer" else {}),
            # an fp8 KV cache changes the tokens (fp8 and fp8_e4m3 are one type)
            **({"kv_cache_dtype": {"fp8": "fp8_e4m3"}.get(engine.kv_cache_dtype, engine.kv_cache_dtype)}
               if engine.kv_cache_dtype != "auto" else {}),
            **({"reasoning_parser": reasoning_parser} if reasoning_parser is not None else {}),
            **({"prompt_tokens_details": True} if prompt_tokens_details else {}),
            # --runner pooling's pooling type and normalization change every embedding
            **({"pooler_config": engine.pooler_config} if engine.pooler_config is not None else {}),
            # speculation draws a seeded sampled request's random numbers otherwise (rejection sampling)
            **({"speculative_config": _speculation(engine.speculative_config)} if engine.speculative_config else {})}


def _speculation(config: dict) -> dict:
    """--speculative-config as a resume fingerprint holds it: a draft model's folder as an absolute path."""
    model = config.get("model")
    if model is not None and Path(model).expanduser().exists():
        return {**config, "model": str(Path(model).expanduser().resolve())}
    return dict(config)


def _strict_exit(lines: list) -> None:
    bad = [item for item in lines if item.error]
    if bad:
        for item in bad:
            typer.echo(f"error: {item.error}", err=True)
        raise ConfigError(f"{len(bad)} of {len(lines)} input lines are invalid (--strict)", "fix them and run again")


def model_id(engine: EngineConfig, options: dict) -> str:
    """The base model's name in OpenAI output bodies whose line names no model: --served-model-name's first."""
    return o.served_ids(options.get("served_model_name"), str(engine.model), "run")[0]


def _prechecked_lines(engine: EngineConfig, input: Path, defaults: dict, output_format: str = "infer",
                      served: list[str] | None = None) -> list:
    """--strict before the model loads: every line read, then checked by the engine's own checks (LLMEngine.validate,
    on a view of what the engine will be: the model's vocabulary, context, EOS ids and adapter names) all in one
    round. Only the KV cache's size, which the memory plan sets, is checked after the load (_checked_lines)."""
    from ..engine.pooling import resolve_pooler
    from ..engine.setup import context_limit, eos_ids, load_tokenizer, model_max_len
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    from ..parallel.serve_engine import ReplicaView
    path = resolve_model(engine.model)
    tokenizer = load_tokenizer(path, engine.chat_template)
    lines = read_inputs(input, tokenizer, defaults, model_names(engine, served), engine.max_model_len)
    check_format(lines, output_format)
    config = load_config(path)
    limit = model_max_len(config, replace(engine, max_model_len=None))
    view = ReplicaView(engine, path, tokenizer, {
        "max_model_len": model_max_len(config, engine), "model_limit": limit,
        "model_limit_reason": context_limit(config)[1], "vocab_size": config.vocab_size,
        "eos_token_ids": sorted(eos_ids(path, config, tokenizer)), "num_blocks": sys.maxsize,
        "adapters": sorted(engine.loras), "lora_enabled": engine.enable_lora,
        "pooler": resolve_pooler(path, config.hidden_size, engine.pooler_config, config) if engine.pooling() else None})
    _validate_lines(view, lines)
    return lines


def _validate_lines(engine, lines: list) -> None:
    """Each line's request checked by `engine.validate`: one that can never run becomes that line's error."""
    for item in lines:
        prompts = (inputs_of(item.request) or [item.request.prompt_token_ids]) if item.request is not None else []
        bad = []  # (input, its reason): an embeddings line's inputs each checked, named as the server names them
        for i, prompt in enumerate(prompts):
            try:
                engine.validate(prompt, item.request.params, item.request.lora)
            except RequestError as e:
                bad.append((i, line_reason(e)))
        if bad:  # (one reason for every input is the body's, not an input's: dimensions, the model's adapter...)
            i, reason = bad[0]
            which = f"body.input[{i}]: " if len(bad) < len(prompts) or len({r for _, r in bad}) > 1 else ""
            item.request, item.error = None, f"line {item.line_no}: {which}{reason}"


def line_reason(e: RequestError | str) -> str:
    """Why an input line can never run, in infer run's terms (the engine's error, or a replica's text): an unknown
    adapter's remedy is --lora NAME=PATH (the engine's hint is the API's: LLM.add_lora)."""
    return adapter_remedy(e) if isinstance(e, UnknownAdapterError) else str(e)


def adapter_remedy(e: UnknownAdapterError) -> str:
    """An input line's unknown adapter in infer run's terms: the adapters --lora gave, and how to give it."""
    known = f"registered adapters: {', '.join(e.known) or 'none'}"
    if not (e.name or "").strip():  # ("--lora =PATH" was the remedy)
        return (f"{e.message} ({known}; leave the line's lora out, or null, for the base model, or name one of "
                "them)")
    folder = _folder_named(e.name)
    if folder is not None:  # a line that gives the adapter's folder, not its --lora name
        name = folder.name or "adapter"  # (the root folder "/" has no name: the remedy was --lora =/ and "lora": "")
        return (f"{e.message}: {e.name} is a folder, and a line's lora names an adapter given to infer run ({known}; "
                f"give it with --lora {name}={e.name} and write \"lora\": \"{name}\")")
    return f"{e.message} ({known}; give it to infer run with --lora {e.name}=PATH, PATH its PEFT folder)"


def _folder_named(name: str) -> Path | None:
    """The folder a line's lora names, resolved, or None: also for a name no path can be (a name longer than the
    file system takes, "~user" of no user, a NUL byte), which was a traceback that ended the whole run."""
    try:
        path = Path(name).expanduser()
        return path.resolve() if path.is_dir() else None
    except (OSError, RuntimeError, ValueError):
        return None


def _checked_lines(llm, input: Path, defaults: dict, strict: bool, names, output_format: str = "infer") -> list:
    """Every input line, parsed and checked against the engine: a request that can never run is an error now,
    not in the middle of the run. With --strict, any bad line stops the run before generating."""
    lines = read_inputs(input, llm.tokenizer, defaults, names, llm.max_model_len)
    check_format(lines, output_format)
    _validate_lines(llm, lines)
    if strict:
        _strict_exit(lines)
    return lines


def open_output(lines, output, input, options: dict, resume: bool, resumable: bool, retry_failed: bool = False):
    """(the lines still to run, the record writer, how many of the input's ids the output holds error records
    of): with --resume, the ids already in the output are skipped, and records of ids the input does not have
    (an output resumed from another input with --force-resume) are kept, said so, and fail nothing; the output's
    resume fingerprint is (re)written when the output is a regular file. `retry_failed` (--retry-failed): the
    input's ids whose records are errors run again, their new records appended (resume.done_ids then removes the
    errors they replace)."""
    skip = done_ids(output, {item.id: item.line_no for item in lines}) if resume and resumable else set()
    ids = {item.id for item in lines}
    others = len(skip - ids)
    if others:
        typer.echo(f"note: {output} holds {others} record(s) whose ids are not in {input} (written from another "
                   "input?); they are kept as they are", err=True)
    earlier = len(error_ids(output) & ids) if skip else 0
    if earlier and retry_failed:
        skip -= error_ids(output)
        typer.echo(f"note: running again the {earlier} line(s) whose records in {output} are errors "
                   "(--retry-failed)", err=True)
        earlier = 0
    todo = [item for item in lines if item.id not in skip]
    fingerprinted = (lambda: write_fingerprint(output, input, options)) if resumable else None
    writer = RecordWriter(output, append=resume, recreated=fingerprinted)
    if resumable:
        fingerprinted()
    return todo, writer, earlier


def _generate(engine, todo, writer: RecordWriter, quiet: bool, records: Records | None = None) -> int:
    records = records or Records("infer", engine.tokenizer)
    failed = 0
    pending = {}
    beams: dict = {}  # a use_beam_search line's step request id -> its search (cli/beam_lines.py)
    for item in todo:  # (a line its format cannot hold is an error already: check_format)
        if item.error:
            writer.write(records.error(item.id, item.error, status=item.status))
            failed += 1
            continue
        r = item.request
        if is_beam_line(r) or is_many_inputs_line(r):  # a line of several engine requests
            try:
                search = LineBeams(engine, item) if is_beam_line(r) else LineInputs(engine, item)
                beams.update(dict.fromkeys(search.send(engine), search))
            except RequestError as e:
                writer.write(records.error(item.id, f"line {item.line_no}: {e}"))
                failed += 1
            continue
        engine.add_request(item.id, r.prompt_token_ids, r.params, r.lora)
        pending[item.id] = item
    start, tokens = time.monotonic(), 0
    progress = _progress(len(todo), quiet)
    with progress:
        task = progress.add_task("requests", total=len(todo), completed=failed, tokens="0 tok/s")
        while engine.has_unfinished_requests():
            outs, lost = _step(engine, pending, writer, records, beams)
            failed += lost
            progress.advance(task, lost)
            for out in outs:
                tokens += output_tokens(out)
                search = beams.pop(out.request_id, None) if out.finished else None
                if search is not None:  # a beam search's step request: its next step, or the line's record
                    if not search.take(out):
                        continue
                    try:
                        bad = search.advance()
                    except Exception as e:  # this line's record, as a failed step's (_step): the run goes on
                        writer.write(records.error(search.item.id, f"internal engine error: {type(e).__name__}: {e}",
                                                   engine=True))
                        failed += 1
                        progress.advance(task)
                        continue
                    rids = search.send(engine) if bad is None else []
                    beams.update(dict.fromkeys(rids, search))
                    if not rids:
                        writer.write(records.choices(search.item.id, [bad] if bad else search.outputs(
                            engine.tokenizer)))
                        failed += bad is not None
                        progress.advance(task)
                    continue
                if out.finished and pending.pop(out.request_id, None) is not None:
                    writer.write(records.output(out.request_id, out))
                    failed += out.finish_reason == "error"
                    progress.advance(task)
            rate = tokens / max(time.monotonic() - start, 1e-9)
            progress.update(task, tokens=f"{rate:,.0f} tok/s")
    writer.finish()
    if not quiet:
        elapsed = time.monotonic() - start
        words = throughput_words(getattr(getattr(engine, "pooler", None), "task", None))
        typer.echo(f"infer: {len(todo) - failed} ok, {failed} failed, {tokens} {words} in {elapsed:.1f} s "
                   f"({tokens / max(elapsed, 1e-9):,.1f} tok/s)", err=True)
        if writer.error_note():
            typer.echo(writer.error_note(), err=True)
    return failed


def _step(engine, pending: dict, writer: RecordWriter, records: Records, beams: dict | None = None
          ) -> tuple[list, int]:
    """One engine step: (outputs, 0); or, when the step fails, error records for the requests it was running
    (as the server does) and ([], how many), so that one request the engine cannot run never ends the run. A beam
    search line (`beams`: its step requests' ids -> its search) with a step among them fails whole."""
    beams = {} if beams is None else beams
    try:
        return engine.step(), 0
    except Exception as e:
        message = f"internal engine error: {type(e).__name__}: {e}"
        victims = [s.request_id for s in engine.scheduler.running] or list(engine.requests)
        lost = 0
        for rid in victims:
            engine.abort_request(rid)
            search = beams.get(rid)
            if search is not None:  # the whole search ends: its other steps too
                for other in [k for k, v in beams.items() if v is search]:
                    del beams[other]
                    engine.abort_request(other)
                writer.write(records.error(search.item.id, message, engine=True))
                lost += 1
            if pending.pop(rid, None) is not None:
                writer.write(records.error(rid, message, engine=True))
                lost += 1
        if not lost:  # nothing to blame: the failure is not about a request
            raise
        return [], lost


def _progress(total: int, quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    console = Console(stderr=True)
    disable = quiet or not sys.stderr.isatty()
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[tokens]}"), TimeElapsedColumn(), console=console, disable=disable,
                    transient=False)
