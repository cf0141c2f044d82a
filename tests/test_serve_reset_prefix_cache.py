"""POST /reset_prefix_cache (vLLM's, served by its dev mode): the server forgets its cached prefixes, so that
`infer bench --url` starts each concurrency level cold against infer serve as it does in process."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

PROMPT = list(range(5, 53))  # three whole blocks of 16


def _hits(url: str, headers=None) -> int:
    return httpx.get(f"{url}/health", headers=headers, timeout=30).json()["engine"]["prefix_cache_hits"]


def _complete(url: str, headers=None) -> None:
    r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_reset_prefix_cache_forgets_the_cached_prompt_and_the_bench_sees_it_done():
    from infer.bench.http_driver import reset_prefix_cache
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=256, max_num_seqs=4))
    server = Server(AsyncEngine(engine), "tiny", api_key="k")
    auth = {"Authorization": "Bearer k"}
    with serve_in_thread(server) as url:
        _complete(url, auth)
        before = _hits(url, auth)
        _complete(url, auth)
        warm = _hits(url, auth)
        assert warm > before  # the same prompt again: its blocks come from the cache
        assert httpx.post(f"{url}/reset_prefix_cache", timeout=30).status_code == 401  # --api-key guards it
        assert reset_prefix_cache(url, "k")
        _complete(url, auth)
        assert _hits(url, auth) == warm  # forgotten: nothing found this time
        _complete(url, auth)
        assert _hits(url, auth) > warm  # and cached again
