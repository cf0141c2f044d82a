"""Probes of the Python API as a user of vLLM's LLM class uses it (session 35)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams
from infer.errors import RequestError

P = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=64))


def _run(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


def _idle(engine) -> bool:
    return not engine.requests and engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt", [(5, 6, 7), np.array([5, 6, 7]), torch.tensor([5, 6, 7]),
                                    [np.int64(5), np.int32(6), 7]], ids=["tuple", "numpy", "tensor", "numpy-ints"])
def test_engine_add_request_takes_token_ids_in_any_integer_sequence(engine, prompt):
    """A tuple (TypeError: tuple + list), a numpy array (ValueError: truth value ambiguous) or numpy integers (told
    they were outside the vocabulary) were not taken by LLMEngine.add_request, though LLM.generate takes them."""
    engine.add_request("ref", [5, 6, 7], P)
    engine.add_request("x", prompt, P)
    done = _run(engine)
    assert done["x"] == done["ref"]
    assert _idle(engine)


@pytest.mark.parametrize("prompt,params,match", [
    ("hello", P, "token ids, not text"),
    ([True, 5], P, "must be integers, got True"),
    ([1.0, 5], P, "must be integers, got 1.0"),
    (5, P, "must be a list of token ids, got int"),
    ([5, 6], {"max_new_tokens": 3}, "params must be a SamplingParams, got dict"),
])
def test_engine_add_request_refuses_what_is_not_a_request_with_a_request_error(engine, prompt, params, match):
    """Text and a dict of params were bare TypeError / AttributeError; a bool was taken as token 1, a float was
    "outside the vocabulary"."""
    with pytest.raises(RequestError, match=match):
        engine.add_request("bad", prompt, params)
    with pytest.raises(RequestError, match=match):
        engine.validate(prompt, params)
    assert _idle(engine)
