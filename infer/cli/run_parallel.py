"""`infer run --data-parallel N`: the same records, error records, --resume and exit status as one engine, with
the requests spread over N replicas by load. The driver reads the input and is the only writer."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from ..engine.pooling import throughput_words
from ..parallel.pool import MAX_RESTARTS, ReplicaPool, Work
from ..parallel.progress import ReplicaProgress
from ..parallel.replica import ENGINE_FAILURE
from ..parallel.runtime import (PLACEMENT_TIMEOUT_S, ReplicaError, check_local_replicas, local_cpus, placement,
                                ray_runtime, require_ray, start_replicas)
from .banner import replica_traits
from .batch_io import Records, RecordWriter, check_format, model_names, read_inputs, unused_adapters_note
from .entry import terminate_as_interrupt
from .run import _prechecked_lines, _strict_exit, exit_interrupted, line_reason, model_id, open_output

VALIDATE_CHUNK = 4096  # requests per validation call (one message each way)


def run_data_parallel(engine, input: Path, output: Path | None, *, replicas: int, address: str | None,
                      defaults: dict, strict: bool, resume: bool, resumable: bool, options: dict,
                      quiet: bool, output_format: str = "infer", max_restarts: int = MAX_RESTARTS,
                      placement_timeout: float = PLACEMENT_TIMEOUT_S, retry_failed: bool = False) -> tuple[int, int]:
    """Run every line of `input` on `replicas` engine replicas: (this run's failed lines, earlier error records of
    this input's lines in the resumed output), as run._run_in_process. A replica that stops is replaced by a fresh
    one `max_restarts` times at most (--max-replica-restarts; 0: never); one Ray has not placed after
    `placement_timeout` seconds (--replica-placement-timeout) fails (at the start: the run; a fresh one: it stays
    stopped, or another is started, and the others go on)."""
    require_ray()  # before anything loads: a missing extra is a one-line error
    check_local_replicas(replicas, address, engine.device)  # (--data-parallel 1000 on one machine)
    from ..engine.setup import load_tokenizer
    from ..models.resolve import resolve_model
    model_path = resolve_model(engine.model)
    tokenizer = load_tokenizer(model_path, engine.chat_template)
    if strict:  # a bad line (by the engine's own checks too) stops the run before any replica loads the model
        _strict_exit(_prechecked_lines(engine, input, defaults, output_format, options.get("served_model_name")))
    # ray.init installs its own SIGTERM handler (sys.exit(15)): ours goes in after it, so SIGTERM stops the run
    # as it stops one engine's (exit 143, saying how many records are on disk)
    with ray_runtime(address, local_cpus(replicas)) as ray, terminate_as_interrupt():
        handles, infos = start_replicas(ray, engine, model_path, replicas, placement_timeout=placement_timeout)
        pool = ReplicaPool(ray, handles, capacity=engine.max_num_seqs + max(1, engine.max_num_seqs // 4),
                           notify=lambda message: typer.echo(message, err=True),
                           restart=getattr(handles, "restart", None), max_restarts=max_restarts,
                           placement_timeout=placement_timeout)
        try:
            if not quiet:
                _announce(infos, engine)
            # read against the replicas' context, as one engine reads against its own: a prompt certainly longer
            # is refused untokenized, with one engine's message
            names = model_names(engine, options.get("served_model_name"))
            lines = read_inputs(input, tokenizer, defaults, names, infos[0]["max_model_len"])
            check_format(lines, output_format, parallel=True)
            _check_lines(ray, handles, lines, strict)
            note = unused_adapters_note(engine.loras, lines)
            if note and not quiet:
                typer.echo(note, err=True)
            todo, writer, earlier = open_output(lines, output, input, options, resume, resumable, retry_failed)
            try:
                records = Records(output_format, tokenizer, lines, model_id(engine, options),
                                  options.get("reasoning_parser"), options.get("prompt_tokens_details", False),
                                  names.labels)
                task = ("classify" if names.labels else "embed") if engine.pooling() else None
                return _generate(pool, todo, writer, tokenizer, quiet, records, task), earlier
            except KeyboardInterrupt as e:  # as one engine: every finished record is on disk, say so
                exit_interrupted(e, output, resumable, len(lines), len(todo), writer.count)
            finally:
                writer.close()
        finally:
            pool.close()


def _announce(infos: list[dict], engine) -> None:
    """As one engine's banner (cli/banner.py), for every replica."""
    typer.echo(f"infer: {len(infos)} replicas of {infos[0]['model']} ({placement(infos)}), "
               f"{replica_traits(infos, engine)}", err=True)


def _check_lines(ray, replicas: list, lines: list, strict: bool) -> None:
    """Every parsed line checked against a replica's engine (the same checks and messages as one engine); with
    --strict, any bad line stops the run before generating. A replica that dies meanwhile leaves the checks to the
    next one (the pool finds it dead when it sends it work)."""
    todo, live = [item for item in lines if item.request is not None], list(replicas)
    for start in range(0, len(todo), VALIDATE_CHUNK):
        chunk = todo[start:start + VALIDATE_CHUNK]
        wires = [(item.id, item.request.prompt_token_ids, item.request.params, item.request.lora) for item in chunk]
        bad = None
        while bad is None:
            if not live:
                raise ReplicaError("every engine replica has stopped", "nothing was generated yet: run again")
            try:
                bad = ray.get(live[0].validate.remote(wires))
            except ray.exceptions.RayError:
                live.pop(0)
        for item in chunk:
            if item.id in bad:
                item.request, item.error = None, f"line {item.line_no}: {line_reason(bad[item.id])}"
    if strict:
        _strict_exit(lines)


def _generate(pool: ReplicaPool, todo: list, writer: RecordWriter, tokenizer, quiet: bool,
              records: Records | None = None, task: str | None = None) -> int:
    records = records or Records("infer", tokenizer)
    failed, work = 0, []
    for item in todo:  # (a line of several engine requests is an error already: check_format, parallel)
        if item.error:
            writer.write(records.error(item.id, item.error, status=item.status))
            failed += 1
        else:
            r = item.request
            work.append(Work(item.id, item.line_no, r.prompt_token_ids, r.params, r.lora))
    # the pool hands requests out in this order as replicas have room: under --scheduling-policy priority the most
    # urgent first (each replica's engine orders only what it holds); stable, so equal priorities keep file order
    work.sort(key=lambda w: w.params.priority)
    progress = ReplicaProgress(pool, total=len(todo), completed=failed, quiet=quiet)

    def on_output(item: Work, out, replica: int) -> None:
        nonlocal failed
        writer.write(records.output(item.id, out))
        failed += out.finish_reason == "error"  # ended by the engine with an error (as one engine counts it)
        progress.advance()

    def on_rejected(item: Work, reason: str) -> None:
        nonlocal failed
        # a request the replica could not add is a bad line ("line N: ..."); one its engine failed on inside a step
        # gets one engine's record for that, the error as it is (run._step)
        engine_failure = reason.startswith(ENGINE_FAILURE)
        writer.write(records.error(item.id, reason if engine_failure else f"line {item.line_no}: {reason}",
                                   engine=engine_failure))
        failed += 1
        progress.advance()

    start = time.monotonic()
    with progress:
        pool.run(work, on_output, on_rejected, progress.refresh)
    writer.finish()
    if not quiet:
        elapsed = time.monotonic() - start
        tokens = sum(r.tokens for r in pool.replicas)
        each = ", ".join(f"replica {r.index} {r.done} requests {r.rate():,.1f} tok/s" for r in pool.replicas)
        restarted = f"; {pool.restarted} replica(s) restarted" if pool.restarted else ""
        words = throughput_words(task)
        typer.echo(f"infer: {len(todo) - failed} ok, {failed} failed, {tokens} {words} in {elapsed:.1f} s "
                   f"({tokens / max(elapsed, 1e-9):,.1f} tok/s; {each}){restarted}", err=True)
        if writer.error_note():
            typer.echo(writer.error_note(), err=True)
    return failed
