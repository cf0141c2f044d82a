"""`infer serve` under load (session 41): what a stream's reader that has not taken its outputs yet costs."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams
from infer.serve.async_engine import AsyncEngine

TOKENS = 200


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=256, max_num_seqs=4))
    yield engine
    engine.close()


def _unread_outputs(engine, params: SamplingParams) -> list:
    """Every output of one request, left in its queue until it finished, as a stream whose client does not read
    (a slow reader: the socket is full) leaves them; no timing: the loop waits for the request to end."""
    async def run():
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            queue: asyncio.Queue = asyncio.Queue()
            aengine.add("slow", engine.tokenizer.encode("once upon a time"), params, None, queue)
            for _ in range(6000):  # bounded; each turn lets the engine thread's deliveries land
                if not aengine.num_in_flight():
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0)
            return [queue.get_nowait() for _ in range(queue.qsize())]
        finally:
            await asyncio.to_thread(aengine.shutdown, 0)
    return asyncio.run(run())


def _held_text(outputs: list) -> int:
    """Characters of the strings the queued outputs hold themselves (read before anything asks for their text)."""
    return sum(len(v) for o in outputs for v in vars(o).values() if isinstance(v, str))


@pytest.mark.parametrize("stop", [False, True], ids=["no-stop", "stop-string"])
def test_outputs_a_slow_reader_has_not_taken_hold_no_copy_of_the_text_so_far(engine, stop):
    """Each step's output held a copy of the request's whole text so far, so a stream whose client reads slowly (or
    not at all) kept every one of them in its queue: memory quadratic in the reply's length (16 choices of 2,000
    tokens: +100 MB against +26 MB read at once; an 8K-token reply, over a GB). Now an output holds the length of
    its text and reads it when asked, and that text is the same: the deltas handed out until then."""
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.0)
    if stop:  # a stop string the reply reaches (found from the reply without it): the text is cut before it
        whole = _unread_outputs(engine, params)[-1].text
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.0, stop=[whole[len(whole) // 2:][:3]])
    outs = _unread_outputs(engine, params)
    assert outs and outs[-1].finished and outs[-1].finish_reason == ("stop" if stop else "length")
    final = outs[-1].text
    assert len(outs) > 40 and len(final) > 40, (len(outs), final)
    held = _held_text(outs)
    assert held <= 2 * len(final) + 16 * len(outs), held  # each output's delta (and a few short fields), no more
    sent = ""
    for o in outs:  # read now, after the request ended: the text each output had at its step
        sent += o.delta_text
        assert o.text == (final if o.finished else sent), (o.text, sent)
    assert sent == final
