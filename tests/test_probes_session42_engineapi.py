"""Session 42 probes of the low-level LLMEngine API as vLLM's users drive it."""

from __future__ import annotations

import time

import pytest

from infer import LLM, LLMEngine, SamplingParams
from infer.engine.config import EngineConfig
from infer.errors import ClosedError, RequestError

P = SamplingParams(max_new_tokens=3, ignore_eos=True)


def test_llm_llm_engine_is_vllms_way_to_the_engine():
    """vLLM code reaches the engine under an LLM as `llm.llm_engine` (llm.llm_engine.get_tokenizer(), an
    add_request/step loop on it); infer named it only `llm.engine`, so that code was an AttributeError."""
    llm = LLM("tiny-llama", max_model_len=64, block_size=4)
    engine = llm.llm_engine
    assert engine is llm.engine and engine.get_tokenizer() is llm.get_tokenizer()
    engine.add_request("own", [5, 6, 7], P)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["own"]
    assert done[0].token_ids == llm.generate([[5, 6, 7]], P)[0].token_ids
    llm.close()
    with pytest.raises(ClosedError):
        llm.llm_engine


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4))
    yield eng
    eng.close()


def test_vllms_positional_arrival_time_and_lora_request_are_named(engine):
    """vLLM's add_request(request_id, prompt, params, arrival_time, lora_request) order put a vLLM caller's
    arrival_time where infer reads lora: the error was "lora must be an adapter name (a string) or None, got
    25714.7", and a LoRARequest fifth was "arrival_time=LoRARequest(...) is not a time.monotonic() reading"."""

    class LoRARequest:  # vLLM's, as far as add_request reads it
        lora_name, lora_int_id, lora_path = "sql", 1, "/adapters/sql"

    now = time.monotonic()
    with pytest.raises(RequestError, match="fourth argument is lora.*vLLM's is arrival_time") as e:
        engine.add_request("a", [5, 6, 7], P, now)
    assert f"arrival_time={now!r}" in str(e.value)
    with pytest.raises(RequestError, match="fifth argument is arrival_time.*lora='sql'"):
        engine.add_request("b", [5, 6, 7], P, None, LoRARequest())
    assert not engine.requests and not engine.has_unfinished_requests()
    engine.add_request("c", [5, 6, 7], P, None, now)  # by keyword or positionally in infer's order: taken
    while engine.has_unfinished_requests():
        engine.step()
