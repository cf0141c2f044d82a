"""Run as a script (runtime.ray_runtime starts it next to a local Ray runtime): `python reaper.py DRIVER_PID`.

A driver killed with SIGKILL (or by the OOM killer) runs no `ray.shutdown()`: Ray's own fate-sharing stops its GCS
and raylet, but processes they started (the dashboard and runtime-env agents, a worker that misses it) were left
running for ever, reparented to init. This process, in a session of its own (a Ctrl-C or a kill of the driver's
process group does not reach it), notes the driver's descendants twice a second while the driver lives; when its
stdin closes without the word "done" (the driver is gone without a clean exit), it stops every one of them still
running (the same process, by its start time: never a pid reused since), SIGTERM first, then SIGKILL.
Only psutil is imported: the script runs without the driver's sys.path."""

from __future__ import annotations

import os
import select
import sys

import psutil

POLL_S = 0.5
GRACE_S = 3.0  # how long the processes left get after SIGTERM, before SIGKILL


def watch(driver_pid: int, stdin=None) -> list:
    """Note the driver's descendants until stdin closes: [] after "done" (a clean exit), else those noted."""
    stdin = stdin if stdin is not None else sys.stdin.buffer
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return []
    seen: dict[int, psutil.Process] = {}
    said = b""
    while True:
        try:
            for p in driver.children(recursive=True):
                if p.pid != os.getpid():
                    seen.setdefault(p.pid, p)
        except psutil.Error:
            pass  # the driver is gone: what was noted is what is left
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if ready:
            data = os.read(stdin.fileno(), 64)
            if not data:
                break
            said += data
    return [] if said.strip() == b"done" else list(seen.values())


def reap(procs: list) -> None:
    alive = []
    for p in procs:
        try:
            if p.is_running():
                p.terminate()
                alive.append(p)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(alive, timeout=GRACE_S)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    reap(watch(int(sys.argv[1])))
