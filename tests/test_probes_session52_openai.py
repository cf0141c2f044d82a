"""Probes of `infer serve` through the official OpenAI Python SDK, session 52: a Responses reply said `store: true`
though infer stores nothing (vLLM without its store sets the request's store to false, and its reply says so)."""

from __future__ import annotations

from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

from helpers import tiny_chat_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_chat_model(tmp_path_factory, "probes_s52_openai")


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine(EngineConfig(str(model), block_size=4, max_num_seqs=4))


@pytest.fixture(scope="module")
def client(engine):
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=64), "tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.mark.parametrize("store", [None, True, False])
def test_a_response_says_it_was_not_stored(client, store):
    extra = {} if store is None else {"store": store}
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2, **extra)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=2, stream=True, **extra))
    assert events[0].response.store is False and events[-1].response.store is False
