"""Data parallelism through Ray: N engine replicas (Ray actors, one per GPU, or CPU replicas) fed by one driver.

The driver keeps everything that must happen once — reading the input, the single output writer, --resume — and
hands requests to whichever replica has free slots (load-based, not by line count). A replica that dies has its
unfinished requests re-run on the others. `ray` is imported only here (the optional extra `infer[ray]`).

    runtime.py   import ray or say what to install; start or join a runtime; place and start the replicas
    replica.py   the actor: one LLMEngine, `validate(requests)` and `step(new requests) -> finished outputs`
    pool.py      the driver loop: keep every replica's slots full, collect outputs, re-run a dead replica's work
    batch.py     `infer run --data-parallel N`: inputs, resume, writer and progress around the pool
"""
