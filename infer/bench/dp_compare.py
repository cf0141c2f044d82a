"""Data-parallel measurement: throughput of 1 and of N engine replicas (Ray actors) on the same requests, side by side.

    python -m infer.bench.dp_compare --model tiny-llama --replicas 1,2 --num-prompts 64 --output-len 64

Starts a local Ray runtime (or joins --ray-address), and for each replica count starts that many replicas (one
GPU each, or CPU replicas of --threads torch threads each), warms them up, then times the whole workload
through the same driver `infer run --data-parallel` uses (load-based dispatch). Model loading is not timed.
Prints output tok/s and requests/s per replica count, each replica's own tok/s, and the ratio to the first count;
a last row runs the same workload on one engine in this process without Ray (what the driver costs).
"""

from __future__ import annotations

import argparse
import time

import torch


def workload(vocab: int, num: int, input_len: int, output_len: int, seed: int = 0) -> list:
    from ..parallel.pool import Work
    from ..engine.sampling_params import SamplingParams
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    return [Work(f"b{i}", i + 1, torch.randint(3, vocab, (input_len,), generator=g).tolist(), params, None)
            for i in range(num)]


def measure(ray, config, model_path, replicas: int, work: list, threads: int | None) -> dict:
    from ..parallel.pool import ReplicaPool
    from ..parallel.runtime import start_replicas
    handles, infos = start_replicas(ray, config, model_path, replicas, threads)
    pool = ReplicaPool(ray, handles, capacity=config.max_num_seqs + max(1, config.max_num_seqs // 4))
    try:
        warm = [type(w)(f"warm{i}", 0, w.prompt_token_ids[:8], w.params, None) for i, w in enumerate(work[:replicas])]
        pool.run(warm, lambda *a: None, _fail)
        for r in pool.replicas:
            r.tokens = r.done = 0
        start = time.monotonic()
        pool.run(work, lambda item, out, i: None, _fail)
        elapsed = time.monotonic() - start
        tokens = sum(r.tokens for r in pool.replicas)
        return {"replicas": replicas, "device": infos[0]["device"], "seconds": elapsed, "tokens": tokens,
                "tok_s": tokens / elapsed, "req_s": len(work) / elapsed,
                "per_replica": [r.tokens / elapsed for r in pool.replicas],
                "requests": [r.done for r in pool.replicas]}
    finally:
        pool.close()


def measure_in_process(config, work: list, threads: int | None) -> dict:
    """The same workload on one engine in this process, without Ray: what the replicas' driver costs."""
    from ..engine.llm_engine import LLMEngine
    if threads:
        torch.set_num_threads(threads)
    engine = LLMEngine(config)
    engine.warm_kernels()
    for w in work:
        engine.add_request(w.id, w.prompt_token_ids, w.params, w.lora)
    tokens, start = 0, time.monotonic()
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = time.monotonic() - start
    return {"replicas": "no Ray", "device": str(engine.device), "seconds": elapsed, "tokens": tokens,
            "tok_s": tokens / elapsed, "req_s": len(work) / elapsed, "per_replica": [tokens / elapsed],
            "requests": [len(work)]}


def _fail(item, reason: str) -> None:
    raise SystemExit(f"request {item.id} was rejected: {reason}")


def _replica_counts(ap: argparse.ArgumentParser, value: str) -> list[int]:
    """--replicas 1,2,4: each a positive whole number (0 was a ZeroDivisionError traceback, `2,` a ValueError)."""
    try:
        counts = [int(c) for c in value.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        ap.error(f"--replicas {value!r}: give replica counts of 1 or more, separated by commas, e.g. 1,2,4")
    return counts


def _threads(value: str) -> int:
    """--threads: 0 (an even share) or more; -1 reached Ray as a replica of -1 CPUs."""
    if not value.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of 0 or more")
    return int(value)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama", help="model folder, hub id in the local cache, or built-in name")
    ap.add_argument("--replicas", default="1,2", help="comma-separated replica counts, e.g. 1,2,4")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests in the workload")
    ap.add_argument("--input-len", type=int, default=32, help="prompt tokens of each request")
    ap.add_argument("--output-len", type=int, default=64, help="tokens generated per request (EOS ignored)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="sequences in one step, per replica")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--threads", type=_threads, default=1, help="torch threads per CPU replica (0: an even share of "
                    "the cores); fixed by default so that only the replica count changes")
    ap.add_argument("--ray-address", default=None, help="join this Ray cluster instead of a local runtime")
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-engine run without Ray")
    args = ap.parse_args(argv)
    from ..parallel.runtime import local_cpus, ray_runtime
    from ..engine.config import EngineConfig
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    counts = _replica_counts(ap, args.replicas)
    config = EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs, device=args.device)
    path = resolve_model(args.model)
    work = workload(load_config(path).vocab_size, args.num_prompts, args.input_len, args.output_len)
    with ray_runtime(args.ray_address, local_cpus(max(counts))) as ray:
        rows = [measure(ray, config, path, n, work, args.threads or None) for n in counts]
    if not args.no_baseline:
        rows.append(measure_in_process(config, work, args.threads or None))
    print(f"{args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), max_num_seqs "
          f"{args.max_num_seqs}, model {args.model}, device {rows[0]['device']}")
    print(f"{'replicas':>8} {'seconds':>8} {'tok/s':>9} {'req/s':>7} {'ratio':>6}  per replica tok/s (requests)")
    for row in rows:
        each = ", ".join(f"{t:,.0f} ({n})" for t, n in zip(row["per_replica"], row["requests"]))
        print(f"{row['replicas']:>8} {row['seconds']:>8.2f} {row['tok_s']:>9,.0f} {row['req_s']:>7.1f} "
              f"{row['tok_s'] / rows[0]['tok_s']:>6.2f}  {each}")


if __name__ == "__main__":
    from ..errors import InferError
    try:
        main()
    except InferError as e:  # a bad option or cluster (no room for the replicas, no GPU): one line, not a traceback
        raise SystemExit(f"error: {e}") from None
