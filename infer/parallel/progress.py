"""The progress bar of a data-parallel run: all requests with the total throughput, and one row per replica
with its share of the requests and its own throughput."""

from __future__ import annotations

import sys
import time


class ReplicaProgress:
    def __init__(self, pool, total: int, completed: int, quiet: bool):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.pool, self.total = pool, total
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                                 console=Console(stderr=True), disable=quiet or not sys.stderr.isatty())
        self.task = self.progress.add_task("requests", total=total, completed=completed, rate="0 tok/s")
        self.rows = [self.progress.add_task(f"  replica {r.index}", total=total, rate="0 tok/s")
                     for r in pool.replicas]
        self.start = time.monotonic()

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.refresh()
        return self.progress.__exit__(*exc)

    def advance(self) -> None:
        self.progress.advance(self.task)

    def refresh(self) -> None:
        tokens = sum(r.tokens for r in self.pool.replicas)
        rate = tokens / max(time.monotonic() - self.start, 1e-9)
        self.progress.update(self.task, rate=f"{rate:,.0f} tok/s")
        for r, row in zip(self.pool.replicas, self.rows):
            state = f"{r.rate():,.0f} tok/s" if r.alive else "restarting" if r.starting is not None else "stopped"
            self.progress.update(row, completed=r.done, rate=state)
