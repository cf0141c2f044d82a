"""Soak (issue 16): 1,500 small requests against tiny-llama on 127.0.0.1. RSS after the load stays within 50 MB of
RSS after the first 100, and the engine ends with nothing running and no KV block used. It runs in a fresh process:
the native cache bounds (infer.serve.native) apply only before the first model code runs, as in `infer serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

MARGIN_MB = 50
SCRIPT = r'''
import asyncio, gc, json, os
from infer.serve.native import bound_native_caches
bound_native_caches()
import httpx
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.serve.app import Server, serve_in_thread
from infer.serve.async_engine import AsyncEngine

def rss_mb():
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

WORDS = ["hello world", "the rain in spain", "once upon a time", "a b c d e f g", "how are you today"]

async def drive(url, start, n):
    sem = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def one(i):
            async with sem:
                text = WORDS[i % 5] + " " + str(i) * (1 + i % 7)
                if i % 2:
                    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1 + i % 5}
                    r = await c.post("/v1/chat/completions", json=body)
                else:
                    body = {"prompt": text, "max_tokens": 1 + i % 5, "stream": i % 4 == 0}
                    r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
        await asyncio.gather(*(one(i) for i in range(start, start + n)))

engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=256, max_num_seqs=16))
with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as url:
    asyncio.run(drive(url, 0, 100))
    first = rss_mb()
    for k in range(7):
        asyncio.run(drive(url, 100 + 200 * k, 200))
    last = rss_mb()
    stats = httpx.get(url + "/health").json()["engine"]
print(json.dumps({"first": first, "last": last, "stats": stats}))
'''


def test_rss_levels_off_after_load(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    env.pop("LRU_CACHE_CAPACITY", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["last"] - result["first"] < MARGIN_MB, result
    stats = result["stats"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0, stats
    assert stats["num_in_flight"] == 0
