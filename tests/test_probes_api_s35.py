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
                                    [np.int64(5), np.int32(6), 7], list(torch.tensor([5, 6, 7])),
                                    {"prompt_token_ids": (5, 6, 7)}],
                         ids=["tuple", "numpy", "tensor", "numpy-ints", "list-of-0d-tensors", "vllm-tokens-prompt"])
def test_engine_add_request_takes_token_ids_in_any_integer_sequence(engine, prompt):
    """A tuple (TypeError: tuple + list), a numpy array (ValueError: truth value ambiguous) or numpy integers (told
    they were outside the vocabulary) were not taken by LLMEngine.add_request, though LLM.generate takes them."""
    engine.add_request("ref", [5, 6, 7], P)
    engine.add_request("x", prompt, P)
    done = _run(engine)
    assert done["x"] == done["ref"]
    assert _idle(engine)


@pytest.mark.parametrize("prompt,params,match", [
    ([True, 5], P, "must be integers, got True"),
    ([1.0, 5], P, "must be integers, got 1.0"),
    (5, P, "must be a list of token ids, got int"),
    ([5, 6], {"max_new_tokens": 3}, "params must be a SamplingParams, got dict"),
    ({"prompt": 5}, P, "'prompt' must be text, got int"),
    ({"prompt_token_ids": "hello"}, P, "token ids are text"),
])
def test_engine_add_request_refuses_what_is_not_a_request_with_a_request_error(engine, prompt, params, match):
    """Text and a dict of params were bare TypeError / AttributeError; a bool was taken as token 1, a float was
    "outside the vocabulary"."""
    with pytest.raises(RequestError, match=match):
        engine.add_request("bad", prompt, params)
    with pytest.raises(RequestError, match=match):
        engine.validate(prompt, params)
    assert _idle(engine)


# ------------------------------------------------------------------ vLLM's prompt dicts
from infer.engine.llm import LLM  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", max_model_len=64) as llm:
        yield llm


def test_vllm_prompt_dicts_are_prompts(llm):
    """vLLM's {"prompt": text} and {"prompt_token_ids": ids} (TextPrompt, TokensPrompt) were read as chat messages
    ("messages must be a list of {role, content} objects"), or refused as one prompt of type dict."""
    ids = llm.tokenizer("hi")["input_ids"]
    want = llm.generate("hi", P)[0].token_ids
    got = llm.generate([{"prompt": "hi"}, {"prompt_token_ids": ids}, {"prompt_token_ids": np.array(ids)}, ids], P)
    assert [o.token_ids for o in got] == [want] * 4
    assert llm.generate({"prompt": "hi"}, P)[0].token_ids == want
    assert llm.generate({"prompt_token_ids": ids}, P)[0].prompt_token_ids == ids
    assert [i for i, _, o in llm.stream([{"prompt": "hi"}, {"prompt": "yo"}], P) if o.finished] == [0, 1]
    assert llm.generate([{"role": "user", "content": "hi"}], P)[0].prompt_token_ids != ids  # chat messages still


@pytest.mark.parametrize("prompt,match", [
    ({"prompt": "hi", "prompt_token_ids": [5]}, "both prompt and prompt_token_ids"),
    ({"prompt": "hi", "multi_modal_data": {"image": None}}, "'multi_modal_data', which infer does not take"),
    ({"prompt": [5, 6]}, '"prompt" must be text, got list'),
    ({"prompt_token_ids": "hi"}, '"prompt_token_ids" must be a list of token ids, got str'),
    ({"prompt_token_ids": []}, "the prompt is empty"),
])
def test_a_bad_prompt_dict_says_what_is_wrong_and_queues_nothing(llm, prompt, match):
    with pytest.raises(RequestError, match=match):
        llm.generate(["hi", prompt], P)
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.scheduler.has_unfinished()


# ------------------------------------------------------------------ engine options given as numpy numbers
def test_engine_options_take_numpy_numbers():
    """LLM(model, max_model_len=np.int64(64)) was refused: "--max-model-len must be an integer, got np.int64(64)"
    (SamplingParams takes numpy numbers)."""
    config = EngineConfig("tiny-llama", max_model_len=np.int64(64), seed=np.int32(3), max_num_seqs=np.uint8(8),
                          gpu_memory_utilization=np.float32(0.5))
    assert (config.max_model_len, config.seed, config.max_num_seqs) == (64, 3, 8)
    assert type(config.max_model_len) is int and type(config.gpu_memory_utilization) is float
    with pytest.raises(Exception, match="must be an integer, got True"):
        EngineConfig("tiny-llama", max_model_len=True)


# ------------------------------------------------------------------ vLLM fields spelled out at their defaults
@pytest.mark.parametrize("kwargs", [{"spaces_between_special_tokens": True}, {"best_of": None}, {"best_of": 1},
                                    {"use_beam_search": False}, {"detokenize": True}, {"logits_processors": None},
                                    {"extra_args": None}, {"guided_decoding": None}])
def test_vllm_fields_infer_lacks_are_taken_at_their_defaults(kwargs):
    """vLLM code that spells a default out (SamplingParams(..., spaces_between_special_tokens=True)) was refused:
    "SamplingParams has no field ... (infer does not support it)"."""
    assert SamplingParams(max_tokens=3, **kwargs) == SamplingParams(max_tokens=3)


@pytest.mark.parametrize("kwargs", [{"best_of": 2}, {"best_of": True}, {"use_beam_search": True},
                                    {"logits_processors": [abs]}])
def test_vllm_fields_infer_lacks_are_refused_at_other_values(kwargs):
    with pytest.raises(RequestError, match="infer does not support it: only .* is taken"):
        SamplingParams(**kwargs)
    with pytest.raises(RequestError, match="infer spells it structured_outputs"):
        SamplingParams(guided_decoding={"regex": "a"})


# ------------------------------------------------------------------ a repetition penalty that overflows the logits
@pytest.mark.parametrize("penalty", [1e-300, 1e-45, 0.005])
def test_a_repetition_penalty_near_zero_is_refused_not_blamed_on_the_model(llm, penalty):
    """repetition_penalty=1e-300 passed the (0, 100] check, divided the seen tokens' logits to inf, and the request
    ended with finish_reason error: "the model's logits ... were not finite ... the model overflowed on it"."""
    with pytest.raises(RequestError, match=r"repetition_penalty must be in \[0.01, 100\]"):
        SamplingParams(repetition_penalty=penalty)
    out = llm.generate([[5, 17, 99, 5, 17]], SamplingParams(max_new_tokens=3, repetition_penalty=0.01,
                                                            temperature=1.0, seed=1))[0]
    assert out.finish_reason == "length" and out.error is None


@pytest.mark.parametrize("config", ["tiny-llama", {"model": "tiny-llama"}, None])
def test_an_engine_made_from_something_else_than_an_engine_config_says_so(config):
    """LLMEngine("tiny-llama") failed with AttributeError: 'str' object has no attribute 'model'."""
    from infer.errors import ConfigError
    with pytest.raises(ConfigError, match="LLMEngine takes an EngineConfig"):
        LLMEngine(config)


# ------------------------------------------------------------------ validate() keeps what add_request() keeps
def test_validate_takes_a_long_prompt_that_truncate_prompt_tokens_cuts(engine):
    """add_request cut the prompt to its last truncate_prompt_tokens tokens and ran it; validate (what `infer run
    --strict` and a data-parallel replica check first) refused it for its whole length."""
    long = [5] * 100
    for keep in (10, 63):
        engine.validate(long, SamplingParams(max_new_tokens=3, truncate_prompt_tokens=keep))
    with pytest.raises(RequestError, match="the prompt has 64 tokens, which leaves no room"):
        engine.validate(long, SamplingParams(max_new_tokens=3, truncate_prompt_tokens=-1))  # as add_request
    with pytest.raises(RequestError, match="the prompt has 100 tokens"):
        engine.validate(long, SamplingParams(max_new_tokens=3))


def test_run_strict_runs_a_line_that_truncate_prompt_tokens_makes_fit(tmp_path):
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    line = {"id": "t", "prompt_token_ids": [5] * 100, "truncate_prompt_tokens": 10, "max_new_tokens": 3}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(line) + "\n")
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--strict",
                                   "--max-model-len", "64"])
    assert res.exit_code == 0, res.output
    record = json.loads(out.read_text())
    assert record["finish_reason"] == "length" and len(record["token_ids"]) == 3


# ------------------------------------------------------------------ vLLM's keyword names of generate / chat / stream
def test_vllm_keywords_of_generate_chat_and_stream(llm):
    """llm.generate(prompts, sampling_params=sp, use_tqdm=False), as vLLM code calls it, was a bare TypeError
    (unexpected keyword argument 'sampling_params')."""
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    want = llm.generate(["hi"], sp)[0].token_ids
    assert llm.generate(["hi"], sampling_params=sp, use_tqdm=False)[0].token_ids == want
    assert llm.generate(prompts=["hi"], sampling_params=[sp])[0].token_ids == want
    chat = [{"role": "user", "content": "hi"}]
    assert llm.chat(chat, sampling_params=sp, use_tqdm=False)[0].token_ids == llm.chat(chat, sp)[0].token_ids
    assert [o.token_ids for _, _, o in llm.stream(["hi"], sampling_params=sp) if o.finished] == [want]
    with pytest.raises(RequestError, match="got both params and sampling_params"):
        llm.generate(["hi"], sp, sampling_params=sp)
    with pytest.raises(RequestError, match="lora_request must be a LoRARequest.*lora=NAME"):
        llm.generate(["hi"], sp, lora_request=object())
    with pytest.raises(TypeError):  # any other keyword is still Python's own error
        llm.generate(["hi"], sp, max_tokens=3)
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.scheduler.has_unfinished()


# ------------------------------------------------------------------ text fields of SamplingParams that are not Unicode
@pytest.mark.parametrize("field", ["bad_words", "stop"])
def test_a_lone_surrogate_in_bad_words_or_stop_is_a_request_error(llm, field):
    """bad_words=["\\ud800"] reached the tokenizer when the request was added: TypeError (TextEncodeInput must be
    Union[...]); a stop string with one could never match."""
    with pytest.raises(RequestError, match=f"{field} contains an unpaired surrogate"):
        SamplingParams(**{field: ["ok", "a\ud800"]})
    assert SamplingParams(**{field: ["\U0001F600"]})  # a character outside the BMP is fine


def test_a_closed_engine_has_no_unfinished_requests():
    """An abort whose output no step had handed out yet kept has_unfinished_requests() true after close(), so a loop
    `while engine.has_unfinished_requests(): engine.step()` met ClosedError instead of ending."""
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64))
    engine.add_request("a", [1, 2, 3], P)
    engine.step()
    engine.abort_request("a")
    engine.add_request("b", [1, 2, 3], P)
    engine.close()
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("ids", [["a", "b"], ("a", "b"), {"a", "b"}], ids=["list", "tuple", "set"])
def test_abort_request_takes_several_ids_as_vllm_s_does(engine, ids):
    """abort_request(["a", "b"]) looked up the one id "['a', 'b']" and aborted nothing: both ran to the end."""
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [5, 6, 7], SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.step()
    engine.abort_request(ids)
    reasons = {}
    while engine.has_unfinished_requests():
        reasons.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
    assert reasons == {"a": "abort", "b": "abort", "c": "length"}
    assert _idle(engine)


# ------------------------------------------------------------------ vLLM's RequestOutput.prompt
def test_outputs_carry_the_prompt_text_as_vllm_s_do(llm):
    """vLLM's quick-start loop `for o in outputs: print(o.prompt, o.outputs[0].text)` failed: AttributeError,
    RequestOutput has no attribute 'prompt'."""
    ids = llm.tokenizer("yo")["input_ids"]
    outs = llm.generate(["hi", {"prompt": "there"}, ids, {"prompt_token_ids": ids}], P)
    assert [o.prompt for o in outs] == ["hi", "there", None, None]
    assert llm.generate("hi", SamplingParams(n=2, max_new_tokens=2, temperature=1.0))[0].prompt == "hi"
    assert {o.prompt for _, _, o in llm.stream(["a b", "c"], P)} == {"a b", "c"}
    assert llm.chat([{"role": "user", "content": "hi"}], P)[0].prompt is None
    assert llm.get_tokenizer() is llm.tokenizer  # vLLM's accessor: AttributeError
    assert not llm._texts  # nothing kept once the calls are over


def test_a_token_id_outside_the_vocabulary_is_named_with_its_place(engine):
    """"a token id is outside the vocabulary (0..511)" did not say which of a prompt's ids, nor what to do."""
    with pytest.raises(RequestError, match=r"outside the vocabulary \(0\.\.511\): the prompt's token 2 is 512 "
                                           r"\(give token ids of this model's tokenizer\)"):
        engine.add_request("v", [5, 6, 512, 7, -1], P)
    with pytest.raises(RequestError, match="prefix_token_ids's token 1 is 9999"):
        engine.validate([5, 6], SamplingParams(prefix_token_ids=[5, 9999]))
    assert _idle(engine)


@pytest.mark.parametrize("keep,hint", [(1000, r"lower truncate_prompt_tokens \(1000\) to 63 or less"),
                                       (-1, r"lower truncate_prompt_tokens to 63 or less \(-1 keeps the context")])
def test_a_prompt_truncate_prompt_tokens_leaves_too_long_says_to_lower_it(engine, keep, hint):
    """truncate_prompt_tokens=1000 on a 64-token context kept the whole prompt, and the refusal said to shorten the
    prompt or raise --max-model-len, not that the request's own cut was too large."""
    with pytest.raises(RequestError, match=hint):
        engine.add_request("t", [5] * 100, SamplingParams(max_new_tokens=3, truncate_prompt_tokens=keep))
    assert _idle(engine)
