"""Load: 200 requests at concurrency 32 against an in-process server, 20 clients leaving mid-stream. Every request
that stays completes, nothing answers 5xx, every engine request is accounted for, and no KV block leaks."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

httpx = pytest.importorskip("httpx")  # the serve extra (the GPU machine has no server packages)
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.serve.app import Server, serve_in_thread
from infer.serve.async_engine import AsyncEngine

N, CONCURRENCY, N_LEAVE = 200, 32, 20
PROMPTS = ["hello world", "the rain in spain", "once upon a time", "a b c d e f g", "how are you today"]


def _job(i: int) -> dict:
    """Request i: completions or chat, streamed or not; every 10th is a client that leaves after one chunk."""
    leave = i % (N // N_LEAVE) == 0
    chat = i % 3 == 1
    body = {"max_tokens": 64 if leave else 4 + i % 9, "stream": leave or i % 2 == 0, "ignore_eos": leave}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    else:
        body["prompt"] = PROMPTS[i % len(PROMPTS)]
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body, "leave": leave}


async def _one(client: httpx.AsyncClient, job: dict) -> dict:
    if not job["body"]["stream"]:
        r = await client.post(job["path"], json=job["body"])
        data = r.json()
        return {"status": r.status_code, "finish": data["choices"][0]["finish_reason"] if r.status_code == 200
                else None, "left": False}
    events, finish = [], None
    async with client.stream("POST", job["path"], json=job["body"]) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "finish": None, "left": False}
        async for line in r.aiter_lines():
            if not line:
                continue
            events.append(line)
            if job["leave"] and len(events) >= 2:
                return {"status": 200, "finish": None, "left": True}  # closing the stream drops the connection
            if line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                finish = choices[0].get("finish_reason") or finish
    assert events[-1] == "data: [DONE]"
    return {"status": 200, "finish": finish, "left": False}


async def _drive(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        async def run(i):
            async with sem:
                return await _one(client, _job(i))
        return await asyncio.gather(*(run(i) for i in range(N)))


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=256, max_num_seqs=32))


def _health(client: httpx.Client) -> dict:
    return client.get("/health").json()["engine"]


def _count_aborts(engine) -> list[str]:
    """Record every request the engine really aborts (it was still live in the engine)."""
    aborted, real = [], engine.abort_request

    def abort_request(rid):
        if rid in engine.requests and not engine.requests[rid].finished:
            aborted.append(rid)
        real(rid)
    engine.abort_request = abort_request
    return aborted


def test_load_with_disconnects(engine):
    aengine = AsyncEngine(engine)
    aborted = _count_aborts(engine)
    with serve_in_thread(Server(aengine, "tiny-llama")) as url:
        results = asyncio.run(_drive(url))
        with httpx.Client(base_url=url) as c:
            for _ in range(500):  # the aborts of the last leavers reach the engine thread within a step or two
                stats = _health(c)
                if not (stats["num_running"] or stats["num_waiting"] or stats["num_in_flight"]):
                    break
                asyncio.run(asyncio.sleep(0.02))
            metrics = c.get("/metrics").text
    assert all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200][:5]
    stayed = [r for r in results if not r["left"]]
    assert len(stayed) == N - N_LEAVE and all(r["finish"] in ("stop", "length") for r in stayed)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert stats["num_in_flight"] == 0 and aengine.num_step_errors == 0
    assert not re.search(r'status="5\d\d"', metrics)
    ended = {m.group(1): float(m.group(2))
             for m in re.finditer(r'infer:request_finished_total\{[^}]*finished_reason="(\w+)"[^}]*\} ([\d.]+)',
                                  metrics)}
    assert sum(ended.values()) == N, ended  # every engine request ended exactly once
    assert 1 <= ended.get("abort", 0) <= N_LEAVE, ended  # leavers abort unless they had already finished
    assert len(aborted) == ended["abort"]  # ... and each of those was stopped inside the engine
