"""vLLM's `use_beam_search` on the server: a request's beam search runs on the engine loop as vLLM's online beam
search does, one step at a time (each live beam one engine request of one token and its top 2 x n logprobs, among
the other clients' requests, which keep getting their tokens), and ends in one finished output per choice: prompt
i's beam r (best first) is choice i x n + r, which the routes answer as any other choice (usage, logprobs, echo,
a chat stream's chunks). Aborting it (its client gone) aborts the steps in flight.

POST /pause (AsyncEngine.pause): with mode "keep" or "wait" a search goes on after /resume (its steps in flight are
frozen, or run to their end; the steps it sends while paused wait for /resume, as any request that arrives then);
with mode "abort" it ends at once as vLLM's aborted requests: each choice finish_reason "abort" (a 200), with the
best beams it had (choices it had no beam for: no text).

As vLLM's: a choice's token_ids are the beam's tokens (a final EOS only with include_stop_str_in_output), its text
theirs decoded with the special tokens kept and without the EOS, its stop_reason the EOS id when it ended on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

from ..engine.beam import BeamSearch, BeamSearchParams
from ..engine.outputs import RequestOutput
from ..engine.sleep import PAUSED, SLEPT
from ..errors import SleepModeError
from .async_engine import NO_ENGINE, NoEngineError, QueueFullError, ShuttingDownError

log = logging.getLogger("infer.serve")
RETRY_FULL_S = 0.05  # a later step refused by --max-queue waits this long and is sent again (the search goes on)


class ServedBeamSearch:
    """One request's beam search over an AsyncEngine. `start()` sends the first step (raising what AsyncEngine.add
    raises, so that a bad request or a full server is refused before the response starts), then runs the rest in a
    task; `queue` gets each choice's finished output (request id: `ids[choice]`); `abort()` ends it."""

    def __init__(self, aengine, tokenizer, eos: set[int], max_model_len: int, prompts: list[list[int]],
                 n: int, beam: BeamSearchParams, params, lora: str | None, base_id: str, metrics=None):
        """`prompts`: one per choice (prompt i n times, as GenerationRequest.prompts); `beam`: its params, with
        max_tokens the request's SamplingParams' (`params`: also its priority, cache_salt and logprobs), whose None
        (a chat without max_tokens) is the context left after each prompt, as vLLM's get_max_tokens. `metrics` (the
        server's ServerMetrics): each step is counted as the engine request it is, on the engine that ran it, as
        vLLM's /metrics count its beam search's steps (its choices are no engine requests: the server leaves them
        out)."""
        self.metrics = metrics
        self._arrival: dict[str, float] = {}  # step request id -> when it was sent
        self._counted: dict = {}  # what the metrics counted of each step so far (ServerMetrics.observe_output)
        self.aengine, self.tokenizer, self.lora, self.n, self.beam = aengine, tokenizer, lora, n, beam
        self.logprobs = params.logprobs
        self.ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self.base_id = base_id
        self.searches = []
        for prompt in prompts[::n]:
            asked = params.max_new_tokens
            length = asked if asked is not None else max(1, max_model_len - len(prompt))
            search = BeamSearch([prompt], replace(beam, max_tokens=length), eos, max_model_len,
                                priority=params.priority)
            search.step = replace(search.step, cache_salt=params.cache_salt)
            self.searches.append(search)
        self.queue: asyncio.Queue = asyncio.Queue()
        self._steps: asyncio.Queue = asyncio.Queue()
        self._in_flight: set[str] = set()
        self._count = 0
        self._task: asyncio.Task | None = None
        self._lora = lora  # what the steps name: the engine's hold on the adapter once started (AsyncEngine.hold_lora)
        self._on_pause = None  # what AsyncEngine.pause(mode="abort") calls while the search runs (start: _paused)

    # ------------------------------------------------------------------ the search
    def _beams(self) -> list[tuple[int, int, object]]:
        return [(s, i, beam) for s, search in enumerate(self.searches) for i, beam in search.beams()]

    def _send(self, beams) -> list[str]:
        """One engine request per beam; their ids. The first step's errors go to the caller; a later step's
        QueueFullError too (the caller retries)."""
        rids = []
        try:
            for s, _, beam in beams:
                rid = f"{self.base_id}-beam{self._count}"
                self._count += 1
                self.aengine.add(rid, beam.tokens, self.searches[s].step, self._lora, self._steps)
                self._in_flight.add(rid)
                self._arrival[rid] = time.monotonic()
                rids.append(rid)
        except Exception:
            for rid in rids:  # (never counted: refused with the request, or sent again)
                self._in_flight.discard(rid)
                self._arrival.pop(rid, None)
                self.aengine.abort(rid)
            raise
        return rids

    def start(self) -> None:
        beams = self._beams()
        # every step is a new engine request: the hold keeps the adapter's weights for the later ones, as a request
        # accepted before an unload or an in-place reload finishes with the adapter it began with
        self._lora = self.aengine.hold_lora(self.lora)
        try:
            rids = self._send(beams)
        except Exception:
            self._release()
            raise
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(beams, rids))

        def on_pause():  # (pause() may run on another loop, or after this one closed: nobody waits for it then)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._paused)
        self._on_pause = on_pause
        self.aengine.on_abort_pause(on_pause)

    def _paused(self) -> None:
        """POST /pause?mode=abort came while the search runs: it ends now, each choice with the best beam it had
        and finish_reason "abort" (vLLM's answer of a request a pause aborted), its steps in flight aborted."""
        if self._task is None or self._task.done():
            return
        self._task.cancel()
        self._abort_steps()
        self._release()  # (also when the task was cancelled before it ran)
        self.aengine.on_abort_pause(self._on_pause, remove=True)
        self._finish(aborted=True)

    def _release(self) -> None:
        lora, self._lora = self._lora, self.lora
        self.aengine.release_lora(lora)

    async def _run(self, beams, rids) -> None:
        try:
            while beams:
                outs = await self._collect(rids)
                failed = next((o for o in outs if o.finish_reason in ("error", "abort")), None)
                if failed is not None and failed.finish_reason == "abort" and failed.error == PAUSED:
                    return self._finish(aborted=True)  # (a pause aborted a step: the beams it had, as _paused)
                if failed is not None:  # the engine failed a step, or the server is shutting down
                    return self._fail(failed.finish_reason, failed.error, failed.bad_request)
                for s, search in enumerate(self.searches):
                    mine = [(i, beam) for (t, i, beam) in beams if t == s]
                    if mine:
                        search.advance(mine, [o for (t, _, _), o in zip(beams, outs) if t == s])
                beams = self._beams()
                rids = await self._send_later(beams) if beams else []
            self._finish()
        except asyncio.CancelledError:
            raise
        except ShuttingDownError as e:
            self._fail("abort", str(e))
        except SleepModeError:  # POST /sleep between two steps: as the steps it aborted end the search
            self._fail("abort", SLEPT)
        except NoEngineError:
            self._fail("error", NO_ENGINE)
        except Exception as e:  # noqa: BLE001 (a bug, or a step refused: the client gets the error, not a hang)
            log.exception("beam search %s failed", self.base_id)
            self._fail("error", f"beam search failed: {type(e).__name__}: {e}")
        finally:
            self._abort_steps()  # cancelled (client gone) or failed: free the steps' KV blocks now
            self._release()
            self.aengine.on_abort_pause(self._on_pause, remove=True)

    async def _send_later(self, beams) -> list[str]:
        while True:
            try:
                return self._send(beams)
            except QueueFullError:  # other clients fill the queue: this search waits its turn, as theirs would
                await asyncio.sleep(RETRY_FULL_S)

    async def _collect(self, rids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while len(done) < len(rids):
            out = await self._steps.get()
            self._observe(out)
            if out.finished:
                self._in_flight.discard(out.request_id)
                done[out.request_id] = out
        return [done[rid] for rid in rids]

    def _observe(self, out: RequestOutput) -> None:
        """Count a step's output in /metrics as any engine request's (its tokens, time to first token, finish)."""
        if self.metrics is None:
            return
        arrival = self._arrival.get(out.request_id, 0.0)
        self.metrics.observe_output(out, arrival, self._counted)
        if out.finished:
            self._counted.pop(out.request_id, None)
            self._arrival.pop(out.request_id, None)
            self.metrics.observe_finished(out, arrival, time.monotonic())

    def _abort_steps(self) -> None:
        """Abort the steps in flight; each counts as an abort on the engine it was on, as a request its client left."""
        for rid in list(self._in_flight):
            if self.metrics is not None:
                self.metrics.engine(self.aengine.engine_of(rid)).finished.labels("abort").inc()
            self.aengine.abort(rid)
        self._in_flight.clear()

    # ------------------------------------------------------------------ the choices
    def _fail(self, reason: str, message: str | None, bad_request: bool = False) -> None:
        for cid in self.ids:
            out = RequestOutput(cid, [], finished=True, finish_reason=reason, error=message, bad_request=bad_request)
            self.queue.put_nowait(out)

    def _finish(self, aborted: bool = False) -> None:
        """Each choice's finished output: the best beams, best first. `aborted` (a pause's): the beams so far, each
        with finish_reason "abort" and error PAUSED (a choice with no beam yet: its prompt alone, no text)."""
        for s, search in enumerate(self.searches):
            best = search.finish(self.tokenizer)[0].sequences
            for r in range(self.n):
                cid = self.ids[s * self.n + r]
                if r >= len(best) and aborted:  # (before the first step ended there is one beam, the prompt)
                    prompt = best[0].tokens[:best[0].num_prompt_tokens] if best else []
                    self.queue.put_nowait(RequestOutput(cid, prompt, [], finished=True, finish_reason="abort",
                                                        error=PAUSED))
                elif r >= len(best):  # (each step keeps 2 x n candidates a beam: never fewer beams than n)
                    self.queue.put_nowait(RequestOutput(cid, [], finished=True, finish_reason="error",
                                                        error=f"the beam search found {len(best)} beams, not {self.n}"))
                else:
                    out = self._output(cid, best[r], search)
                    if aborted:
                        out.finish_reason, out.error, out.stop_reason = "abort", PAUSED, None
                    self.queue.put_nowait(out)

    def _output(self, cid: str, beam, search) -> RequestOutput:
        return beam_output(cid, beam, self.tokenizer, self.beam.include_stop_str_in_output, self.logprobs, self.lora)

    def abort(self) -> None:
        """End the search now (its client is gone): the steps in flight are aborted."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._abort_steps()
        self._release()  # (also when the task was cancelled before it ran)
        self.aengine.on_abort_pause(self._on_pause, remove=True)


def beam_output(cid: str, beam, tokenizer, include_stop_str_in_output: bool, logprobs: int | None,
                lora: str | None = None) -> RequestOutput:
    """A finished beam (engine/beam.py's BeamSearchSequence) as one choice's finished output, as vLLM's online beam
    search makes it: token_ids the beam's (a final EOS only with include_stop_str_in_output), text theirs decoded
    with the special tokens kept and never the EOS, stop_reason the EOS id; with `logprobs`, each token's record and
    its top `logprobs` candidates."""
    kept = beam.output_token_ids  # (a final EOS only with include_stop_str_in_output)
    shown = kept[:-1] if beam.finish_reason == "stop" and include_stop_str_in_output else kept
    text = tokenizer.decode(shown, skip_special_tokens=False)  # never the EOS's text (vLLM's)
    records = None
    if logprobs is not None:  # each token's, and the candidates it was chosen from
        records = []
        for token, options in zip(kept, beam.logprobs):
            top = sorted(options.items(), key=lambda kv: -kv[1])[:logprobs]
            chosen = options[token]  # (engine.beam's Logprob: a float with the token's rank)
            records.append({"token_id": token, "logprob": float(chosen), "rank": getattr(chosen, "rank", None),
                            "top_logprobs": [{"token_id": t, "logprob": float(v)} for t, v in top]})
    prompt = beam.tokens[:beam.num_prompt_tokens]
    return RequestOutput(cid, prompt, kept, new_token_ids=kept, text=text, delta_text=text, finished=True,
                         finish_reason=beam.finish_reason, logprobs=records, lora=lora,
                         stop_reason=beam.stop_reason)
