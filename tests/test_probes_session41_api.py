"""Probes of the Python API (LLM, its engine and outputs) as a vLLM user uses it (session 41)."""

from __future__ import annotations

import os
import signal

import pytest

from infer.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm():
    from infer import LLM
    llm = LLM("tiny-llama", max_model_len=128)
    yield llm
    llm.close()


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt), whatever this process was started with: a shell's
    background job (`cmd &`) starts with SIGINT ignored, and the tests would then prove nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("paused_first", [True, False], ids=["paused-stream-first", "paused-stream-last"])
def test_ctrl_c_while_a_step_appends_its_tokens_loses_nothing_of_another_call(llm, monkeypatch, paused_first,
                                                                            python_sigint):
    """A Ctrl-C (SIGINT) that came while a step was appending its sampled tokens (the detokenizer's work, per
    sequence, on the host) stopped the step half way: a paused stream of another call lost that step's text delta
    (its deltas no longer joined to its text) when its sequence came before the interrupted one, and ended with
    finish_reason error after two tokens when it came after (its token was sampled and counted, never appended).
    The host's bookkeeping of a step now holds the interrupt back until it is done."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = llm.generate(["paused stream", "interrupted call"], params)
    if paused_first:
        events = llm.stream(["paused stream"], params)
        got = [next(events)]
        other = ["interrupted call"]
    else:  # the interrupted call's request comes first in the batch
        first = llm.stream(["interrupted call"], params)
        next(first)
        events = llm.stream(["paused stream"], params)
        got = []
    paused_id = f"llm-{llm._counter}"  # the paused stream's request: the last one made
    detok = llm.engine.detokenizer
    real, calls = detok.update, []

    def update(seq, stop):
        if seq.request_id != paused_id:
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # Python raises it at its next check, here without the fix
                    pass
        return real(seq, stop)
    monkeypatch.setattr(detok, "update", update)
    with pytest.raises(KeyboardInterrupt):
        if paused_first:
            llm.generate(other, params)
        else:
            list(first)
    monkeypatch.setattr(detok, "update", real)
    got += list(events)
    final = got[-1][2]
    assert (final.finish_reason, final.token_ids) == ("length", ref[0].token_ids)
    assert "".join(delta for _, delta, _ in got) == final.text == ref[0].text
    again = llm.generate(["interrupted call", "paused stream"], params)
    assert [o.token_ids for o in again] == [ref[1].token_ids, ref[0].token_ids]
    assert not llm.engine.requests and llm.engine.block_manager.num_used_blocks == 0


def test_ctrl_c_while_a_steps_outputs_go_to_their_calls_loses_nothing_of_another_call(llm, monkeypatch,
                                                                                     python_sigint):
    """The outputs of a step are put in the mailboxes of the calls that made their requests; a Ctrl-C in the middle
    lost the rest of them: a paused stream of another call then missed that step's text delta."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = llm.generate(["paused stream"], params)[0]
    events = llm.stream(["paused stream"], params)
    got = [next(events)]
    paused_id = f"llm-{llm._counter}"
    real_step, steps = llm._step, []

    def interrupting(outs):  # the interrupted call's outputs first, then the SIGINT, then the paused stream's
        outs = sorted(outs, key=lambda out: out.request_id == paused_id)
        for k, out in enumerate(outs):
            if k == 1:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # Python raises it at its next check, here without the fix
                    pass
            yield out

    def step(engine):
        steps.append(1)
        outs = real_step(engine)
        return interrupting(outs) if len(steps) == 2 else outs
    monkeypatch.setattr(llm, "_step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["interrupted call"], params)
    monkeypatch.setattr(llm, "_step", real_step)
    got += list(events)
    final = got[-1][2]
    assert (final.finish_reason, final.token_ids) == ("length", ref.token_ids)
    assert "".join(delta for _, delta, _ in got) == final.text == ref.text
    assert not llm.engine.requests and llm.engine.block_manager.num_used_blocks == 0


def test_vllms_priority_keyword_is_taken_at_its_default_and_refused_otherwise(llm):
    """vLLM's LLM.generate / chat take `priority` (one int per prompt; only 0 without priority scheduling); here it
    was Python's bare TypeError ("unexpected keyword argument 'priority'")."""
    from infer import RequestError
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(["a", "b"], params)]
    assert [o.token_ids for o in llm.generate(["a", "b"], params, priority=None)] == ref
    assert [o.token_ids for o in llm.generate(["a", "b"], params, priority=[0, 0])] == ref
    assert llm.chat([{"role": "user", "content": "a"}], params, priority=[0])[0].finish_reason == "length"
    for bad in ([1, 0], 3):  # without scheduling_policy="priority" (tests/test_priority_scheduling.py)
        with pytest.raises(RequestError, match="first come, first served"):
            llm.generate(["a", "b"], params, priority=bad)
    with pytest.raises(RequestError, match="integer per prompt"):
        llm.generate(["a", "b"], params, priority=[True, 0])
    assert not llm.engine.requests


def test_chat_with_no_conversations_returns_no_outputs_as_generate_does(llm):
    """vLLM's LLM.chat([]) is a list of no conversations (its outputs: []), as generate([]) is here; chat([])
    raised RequestError, so a program that filtered its batch of conversations down to none failed."""
    params = SamplingParams(max_new_tokens=2)
    assert llm.generate([], params) == []
    assert llm.chat([], params) == []
    assert llm.chat((), params) == []
    assert not llm.engine.requests


def test_sampling_params_clone_is_an_independent_copy_as_in_vllm(llm):
    """vLLM's SamplingParams.clone() (a deep copy, e.g. to change one request's params): an AttributeError here."""
    params = SamplingParams(max_tokens=3, stop=["zz"], logit_bias={5: 1.0}, ignore_eos=True)
    copied = params.clone()
    assert copied == params and copied is not params
    copied.stop.append("yy")
    copied.logit_bias[6] = 2.0
    copied.max_tokens = 2
    assert params.stop == ["zz"] and params.logit_bias == {5: 1.0} and params.max_tokens == 3
    assert len(llm.generate(["a"], copied)[0].token_ids) == 2
