"""Probes of the fifty-ninth session (review of the engine lock and pause): LLM's calls other than its steps
(close, apply_model; add_lora and remove_lora likewise) from a second thread while a generate steps in a first get
the engine's lock before its next step, as pause_generation() does (they waited for the whole generate: a lock is
not first come, first served); LLM.close() frees the engine under the lock, so another thread's control waits for it
(it ran on the engine being freed); a call that raises under the lock leaves no turn behind (the generate goes on)."""

from __future__ import annotations

import threading

import pytest

from helpers import hf_greedy, wait_until
from infer import LLM
from infer.errors import ClosedError
from test_probes_session58_pause import LONG, PROMPTS, _in_thread
from test_probes_session59_pause import _calling_mid_step, _Watched, path  # noqa: F401


def _generate(llm, errors: list):
    """llm.generate(PROMPTS, LONG), its ClosedError kept in `errors`."""
    try:
        return llm.generate(PROMPTS, LONG)
    except ClosedError as e:
        errors.append(e)


def test_close_from_another_thread_runs_before_the_next_step_of_a_generate(path):
    """llm.close() from a second thread while a generate steps: it waits for the step running, then the generate
    takes no further step (ClosedError), where it stepped on to its end before the close got the lock."""
    with LLM(path, block_size=4, max_model_len=64) as llm:
        seen = _calling_mid_step(llm.llm_engine, llm.close)
        errors: list = []
        gen, got = _in_thread(lambda: _generate(llm, errors))
        assert wait_until(lambda: "thread" in seen)
        seen["thread"].join(60)
        gen.join(60)
        assert seen["waited"] and not seen["ran_mid_step"]
        assert seen["steps"] == [3] and got == [None] and "closed" in str(errors[0])


def test_apply_model_from_another_thread_runs_between_two_steps_of_a_generate(path):
    """llm.apply_model(func) from a second thread while a generate steps: func runs after the step running and
    before the next one; the generate then answers Hugging Face's greedy tokens."""
    want = [hf_greedy(path, prompt, 20) for prompt in PROMPTS]
    with LLM(path, block_size=4, max_model_len=64) as llm:
        ran: list = []
        seen = _calling_mid_step(llm.llm_engine, lambda: ran.extend(llm.apply_model(lambda m: seen["steps"][0])))
        gen, got = _in_thread(lambda: llm.generate(PROMPTS, LONG))
        assert wait_until(lambda: "thread" in seen)
        seen["thread"].join(60)
        gen.join(60)
        assert seen["waited"] and ran == [3]
        assert [(o.finish_reason, list(o.token_ids)) for o in got[0]] == [("length", w) for w in want]


def test_close_waits_for_another_threads_control_and_the_control_is_then_refused(path):
    """llm.close() frees the engine under its lock: another thread's control (collective_rpc) that comes while
    it frees waits for it and is then refused (ClosedError), never run on an engine half freed."""
    with LLM(path, block_size=4, max_model_len=64) as llm:
        engine = llm.llm_engine
        closing, go, real_close = threading.Event(), threading.Event(), engine.close

        def slow_close():
            closing.set()
            go.wait(60)
            real_close()
        engine.close = slow_close
        closer = threading.Thread(target=llm.close)
        closer.start()
        assert closing.wait(60)
        engine.lock = _Watched(engine.lock)  # (close holds the lock it took before)
        ran, errors = [], []

        def rpc():
            try:
                engine.collective_rpc(lambda worker: ran.append(worker))
            except ClosedError as e:
                errors.append(e)
        caller = threading.Thread(target=rpc)
        caller.start()
        waited = engine.lock.waiting.wait(10)
        go.set()
        closer.join(60)
        caller.join(60)
        assert waited and ran == [] and "closed" in str(errors[0])


@pytest.mark.parametrize("call", ["apply_model", "collective_rpc"])
def test_a_call_that_raises_under_the_lock_leaves_the_generates_their_turn(path, call):
    """A function that raises in apply_model or collective_rpc (a control): the caller gets its error and the
    engine's turn is given back: a generate afterwards, in another thread, answers Hugging Face's greedy tokens."""
    want = [hf_greedy(path, prompt, 20) for prompt in PROMPTS]
    with LLM(path, block_size=4, max_model_len=64) as llm:
        with pytest.raises(ZeroDivisionError):
            getattr(llm, call)(lambda _: 1 / 0)
        gen, got = _in_thread(lambda: llm.generate(PROMPTS, LONG))
        gen.join(60)
        assert [(o.finish_reason, list(o.token_ids)) for o in got[0]] == [("length", w) for w in want]


class _InterruptedOnce(threading.Condition):
    """The engine's _turn, with a KeyboardInterrupt delivered once as a control leaves it (`armed`): the moment
    the control's count went up, before it waits for the lock."""

    def __init__(self):
        super().__init__(threading.Lock())
        self.armed = False

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def test_a_keyboard_interrupt_as_a_control_counts_itself_leaves_no_turn_behind(path):
    """Ctrl-C the moment a control (collective_rpc) counted itself: the control is interrupted, and a generate
    afterwards, in another thread, answers Hugging Face's greedy tokens (it waited for ever for the control)."""
    want = [hf_greedy(path, prompt, 20) for prompt in PROMPTS]
    with LLM(path, block_size=4, max_model_len=64) as llm:
        engine = llm.llm_engine
        engine._turn = _InterruptedOnce()
        engine._turn.armed = True
        with pytest.raises(KeyboardInterrupt):
            engine.collective_rpc(lambda worker: None)
        got: list = []
        gen = threading.Thread(target=lambda: got.append(llm.generate(PROMPTS, LONG)), daemon=True)  # (hung: left)
        gen.start()
        gen.join(60)
        assert got, "the generate waits for the interrupted control's turn"
        assert [(o.finish_reason, list(o.token_ids)) for o in got[0]] == [("length", w) for w in want]
