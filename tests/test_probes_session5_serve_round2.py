"""`infer serve` under adapter churn (session 5, second probe round): concurrent streams over more adapters than
--max-loras, mixed with base requests, with clients leaving mid-stream and an adapter whose folder disappears
while serving. Every request that stays gets its answer (the vanished adapter's as an error), and afterwards no
KV block is used and no adapter is pinned."""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.models.tiny import ensure_builtin
from infer.serve.app import Server, serve_in_thread
from infer.serve.async_engine import AsyncEngine

from lora_helpers import ALL, hf_float, save_adapter

N, CONCURRENCY = 48, 12
NAMES = ["a", "b", "c", "gone", None]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = ensure_builtin("tiny-llama")
    root = tmp_path_factory.mktemp("adapters")
    hf = hf_float(base)
    targets = {"a": ALL, "b": ["q_proj", "v_proj"], "c": ["down_proj"], "gone": ALL}
    paths = {n: save_adapter(hf, root / n, seed=i + 1, r=2 + 2 * i, lora_alpha=8, target_modules=t)
             for i, (n, t) in enumerate(targets.items())}
    engine = LLMEngine(EngineConfig(str(base), max_model_len=128, max_num_seqs=8, max_loras=2, max_cpu_loras=2,
                                    max_lora_rank=8, loras={n: str(p) for n, p in paths.items()}))
    shutil.rmtree(paths["gone"])  # read again from its folder when it next gets a slot: it is gone
    for name in ["a", "b"]:  # registration left "gone" in the CPU LRU (max_cpu_loras=2): a request that got a slot
        engine.lora_manager.cpu_adapter(name)  # before "a" and "b" evicted it would run on the cached weights
    assert "gone" not in engine.lora_manager.cpu_resident() and "gone" not in engine.lora_manager.resident()
    return engine


def _job(i: int) -> dict:
    name = NAMES[i % len(NAMES)]
    leave = i % 7 == 3
    body = {"prompt": f"probe {i} says", "max_tokens": 40 if leave else 3 + i % 5, "ignore_eos": True,
            "stream": leave or i % 2 == 0, **({"model": name} if name else {})}
    return {"body": body, "leave": leave, "lora": name}


async def _one(client, job) -> dict:
    if not job["body"]["stream"]:
        r = await client.post("/v1/completions", json=job["body"])
        data = r.json()
        return {"status": r.status_code, "data": data, "left": False}
    lines = []
    async with client.stream("POST", "/v1/completions", json=job["body"]) as r:
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
            if job["leave"] and len(lines) >= 2:
                return {"status": r.status_code, "left": True}
    return {"status": r.status_code, "lines": lines, "left": False}


async def _drive(url: str) -> list[dict]:
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def run(i):
            async with sem:
                return await _one(client, _job(i))
        return await asyncio.gather(*(run(i) for i in range(N)))


def _settled(url: str) -> dict:
    with httpx.Client(base_url=url) as c:
        for _ in range(500):  # the last leavers' aborts reach the engine thread within a step or two
            stats = c.get("/health").json()["engine"]
            if not (stats["num_running"] or stats["num_waiting"] or stats["num_in_flight"]):
                return stats
            asyncio.run(asyncio.sleep(0.02))
    return stats


def test_adapter_churn_with_disconnects_and_a_vanished_adapter(served):
    engine = served
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as url:
        results = asyncio.run(_drive(url))
        stats = _settled(url)
        after = httpx.post(f"{url}/v1/completions", json={"prompt": "still", "model": "b", "max_tokens": 2})
        metrics = httpx.get(f"{url}/metrics").text
    ended = {m.group(1): float(m.group(2))
             for m in re.finditer(r'infer:request_finished_total\{[^}]*finished_reason="(\w+)"[^}]*\} ([\d.]+)',
                                  metrics)}
    assert sum(ended.values()) == N + 1, ended  # every request ended exactly once
    assert ended.get("error") == sum(_job(i)["lora"] == "gone" for i in range(N)), ended
    for i, r in enumerate(results):
        job = _job(i)
        if r["left"]:
            continue
        if job["lora"] == "gone":  # its folder vanished: an error for this request only, never a hang or 5xx
            assert r["status"] != 200 or "folder not found" in json.dumps(r.get("data") or r.get("lines")), r
            continue
        assert r["status"] == 200, (i, r)
        if "data" in r:
            assert r["data"]["choices"][0]["finish_reason"] == "length"
        else:
            assert r["lines"][-1] == "data: [DONE]" and '"finish_reason": "length"' in r["lines"][-2].replace(
                '":"', '": "'), r["lines"][-3:]
    assert after.status_code == 200, after.text
    assert stats["kv_blocks_used"] == 0 and stats["num_in_flight"] == 0, stats
    assert engine.lora_manager.swaps > 4  # adapters did take turns in the two slots
    assert all(engine.lora_manager.pins(n) == 0 for n in ["a", "b", "c", "gone"])
