"""The Python API's inputs beyond text and lists: token ids as numpy arrays and torch tensors, lora values that are
not names, a bad prompt in a batch (named by its index), stream() checking its prompts at the call, the output of a
request a failed step ended (its prompt and tokens kept), and the warning for an adapter trained on another base."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from infer import LLM, SamplingParams
from infer.errors import LoRAError, RequestError
from infer.models.tiny import ensure_builtin

P = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", max_model_len=64) as llm:
        yield llm


def test_token_ids_as_arrays_and_tensors_are_prompts_not_lists_of_prompts(llm):
    want = [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], P)]
    assert [o.token_ids for o in llm.generate(np.array([5, 6, 7]), P)] == want[:1]
    assert [o.token_ids for o in llm.generate(torch.tensor([5, 6, 7]), P)] == want[:1]
    assert [o.token_ids for o in llm.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), P)][0] == want[0]
    assert [o.token_ids for o in llm.generate([np.array([5, 6, 7]), torch.tensor([8, 9])], P)] == want


def test_a_lora_that_is_not_a_name_is_a_request_error(llm):
    with pytest.raises(RequestError, match=r"lora must be an adapter name \(a string\) or None, got \{'x': 1\}"):
        llm.generate(["a", "b"], P, lora={"x": 1})
    with pytest.raises(RequestError, match=r"lora of prompt 1 must be an adapter name .*got \['y'\]"):
        llm.generate(["a", "b"], P, lora=[None, ["y"]])
    with pytest.raises(RequestError, match="lora must be an adapter name"):
        llm.engine.validate([5, 6], SamplingParams(), ["y"])


def test_an_unknown_adapter_on_an_engine_without_adapters_says_how_to_start_one(llm):
    with pytest.raises(RequestError) as e:
        llm.generate("a", P, lora="support")
    assert "unknown LoRA adapter 'support'" in str(e.value)
    assert "LLM(..., loras={NAME: PATH})" in str(e.value) and "enable_lora=True" in str(e.value)


def test_a_bad_prompt_in_a_batch_is_named_by_its_index_and_nothing_is_queued(llm):
    with pytest.raises(RequestError, match="prompt 1: the prompt is empty"):
        llm.generate(["a", [], "c"], P)
    with pytest.raises(RequestError, match="prompt 2: a token id is outside the vocabulary"):
        llm.generate(["a", "b", [10 ** 9]], P)
    with pytest.raises(RequestError, match="^the prompt is empty"):  # one prompt: no index
        llm.generate([[]], P)
    assert all(s.finished for s in llm.engine.requests.values())  # the good ones before it were taken back


def test_stream_checks_its_prompts_at_the_call(llm):
    with pytest.raises(RequestError, match="prompt 1: the prompt is empty"):
        llm.stream(["a", []], P)  # not at the first next()
    events = llm.stream(["a"], P)
    last = [out for _, _, out in events][-1]
    assert last.finished and len(last.token_ids) == 4


def test_a_stream_dropped_unread_frees_its_requests(llm):
    import gc
    events = llm.stream(["a", "b"], P)
    assert len(llm._mail) == 2
    del events
    gc.collect()
    assert not llm._mail
    assert llm.generate("c", P)[0].finished  # the engine still serves


def test_a_request_a_failed_step_ended_keeps_its_prompt_and_tokens(llm, monkeypatch):
    """The output of a request ended by an engine error had prompt_token_ids [] and token_ids []."""
    events = llm.stream([[5, 6, 7]], SamplingParams(max_new_tokens=20, ignore_eos=True))
    got = []
    for _, _, out in events:
        got = out.token_ids
        if len(got) >= 2:
            break
    monkeypatch.setattr(llm.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("device lost")))
    out = next(events)[2]
    assert out.finish_reason == "error" and "device lost" in out.error
    assert out.prompt_token_ids == [5, 6, 7] and out.token_ids[:len(got)] == got and len(out.token_ids) >= 2


def test_add_lora_with_a_name_that_is_not_a_string_says_so():
    with LLM("tiny-llama", enable_lora=True, max_lora_rank=8, max_model_len=64) as llm:
        for name in (5, None, ""):
            with pytest.raises(LoRAError, match=f"invalid LoRA adapter name {name!r}: it must be a non-empty string"):
                llm.add_lora(name, "/nowhere")


def test_an_adapter_trained_on_another_base_is_a_warning_when_added(tmp_path, caplog):
    from lora_helpers import hf_float, save_adapter
    hf = hf_float(Path(ensure_builtin("tiny-llama")))
    folder = save_adapter(hf, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    other = shutil.copytree(folder, tmp_path / "other")
    cfg = json.loads((other / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "meta-llama/Llama-2-7b-hf"
    (other / "adapter_config.json").write_text(json.dumps(cfg))
    with LLM("tiny-llama", enable_lora=True, max_lora_rank=8, max_model_len=64) as llm:
        with caplog.at_level(logging.WARNING, logger="infer"):
            llm.add_lora("mine", str(folder))
            assert not [r for r in caplog.records if "trained on" in r.getMessage()]
            llm.add_lora("theirs", str(other))
        msgs = [r.getMessage() for r in caplog.records if "trained on" in r.getMessage()]
        assert len(msgs) == 1 and "adapter 'theirs' was trained on 'meta-llama/Llama-2-7b-hf'" in msgs[0]
        assert llm.list_loras() == ["mine", "theirs"]  # a warning, not a refusal


def test_an_unknown_option_is_named_with_the_nearest_known_one():
    """LLM("tiny-llama", foo=1) was a bare TypeError from EngineConfig.__init__; still a TypeError (as Python's)."""
    from infer.errors import ConfigError
    with pytest.raises(ConfigError, match=r"LLM\(\) has no option 'max_num_seq'") as e:
        LLM("tiny-llama", max_num_seq=4)
    assert isinstance(e.value, TypeError) and e.value.hint.startswith("did you mean 'max_num_seqs'?")
    with pytest.raises(TypeError, match=r"LLM\(\) has no option 'bar', 'foo'") as e:
        LLM("tiny-llama", foo=1, bar=2)
    assert "max_model_len" in e.value.hint and "did you mean" not in e.value.hint
