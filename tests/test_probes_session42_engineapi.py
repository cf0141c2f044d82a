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
    with pytest.raises(RequestError, match="fifth argument is arrival_time.*lora_request="):
        engine.add_request("b", [5, 6, 7], P, None, LoRARequest())
    assert not engine.requests and not engine.has_unfinished_requests()
    engine.add_request("c", [5, 6, 7], P, None, now)  # by keyword or positionally in infer's order: taken
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("overlap", [False, True])
def test_one_requests_token_that_raises_ends_it_and_not_the_engine(monkeypatch, overlap):
    """An exception while a step handled one request's new token (its tokenizer's decode raised) left the rest of
    the batch's tokens pending: every later step raised "a pending token without the step that made it" and
    has_unfinished_requests() stayed true, so a vLLM-style `while has_unfinished_requests(): step()` loop never
    ended. Now that request ends with finish_reason "error" naming the exception; the others go on unchanged."""
    eng = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4, overlap=overlap))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 12, 13], "c": list(range(20, 37))}

    def run() -> dict:
        for rid, ids in prompts.items():
            eng.add_request(rid, ids, params)
        done, steps = {}, 0
        while eng.has_unfinished_requests() and steps < 50:
            steps += 1
            done.update({o.request_id: o for o in eng.step() if o.finished})
        return done

    ref = run()
    update, raised = eng.detokenizer.update, []

    def failing(seq, stop_token):
        if seq.request_id == "b" and len(seq.output_token_ids) == 3 and not raised:
            raised.append(True)
            raise ValueError("decode failed")
        return update(seq, stop_token)

    monkeypatch.setattr(eng.detokenizer, "update", failing)
    done = run()
    assert raised and sorted(done) == ["a", "b", "c"]
    assert done["a"].token_ids == ref["a"].token_ids and done["c"].token_ids == ref["c"].token_ids
    assert done["b"].finish_reason == "error" and "ValueError: decode failed" in done["b"].error
    assert done["b"].token_ids == ref["b"].token_ids[:3]
    assert not eng.requests and eng.block_manager.num_used_blocks == 0
    assert run()["b"].token_ids == ref["b"].token_ids  # the engine goes on
    eng.close()
