"""Data parallelism through Ray: N engine replicas (Ray actors, one per GPU, or CPU replicas) fed by one driver.

The driver keeps everything that must happen once — reading the input, the single output writer, --resume, the
HTTP endpoint — and hands requests to whichever replica has free slots (load-based, not by line count). A replica
that dies has its unfinished requests re-run on the others, and a fresh one is started in its place. `ray` is
imported only here (the extra `infer[ray]`). (The folder is not called dist/: .gitignore ignores that name.)

    runtime.py       import ray or say what to install; start or join a runtime; place and start the replicas
    replica.py       the actor: one LLMEngine; `validate`, `step` (until something finishes), `serve_step`
    pool.py          `infer run`'s driver loop: keep every replica's slots full, re-run a dead replica's work
    progress.py      its progress bar: total and per-replica throughput
    serve_engine.py  `infer serve`'s engine over the replicas, with serve.AsyncEngine's interface
    serve.py         the same app over that engine, per-replica /health and /metrics
    reaper.py        a script beside a local runtime: stops what it started if the driver dies without ray.shutdown

The commands live in cli/: run_parallel.py (inputs, resume, writer around the pool) and serve_parallel.py (uvicorn).
"""
