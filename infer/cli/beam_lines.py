"""`infer run`'s OpenAI batch lines with use_beam_search, as `vllm run-batch` answers them (its server's beam
search): each line's search runs on the run's engine one step at a time, beside the other lines (each live beam one
request of one token and its top 2 x n logprobs; engine/beam.py), and its record is the response the server gives
that body: n choices, the best beams first (serve/beams.py's beam_output)."""

from __future__ import annotations

from dataclasses import replace

from ..engine.beam import BeamSearch, BeamSearchParams
from ..engine.llm_engine import truncated
from ..serve.beams import beam_output


def is_beam_line(request) -> bool:
    return request is not None and request.openai is not None and bool(request.openai.get("beam"))


class LineBeams:
    """One line's search: `send(engine)` adds its next step's requests (their ids; none once it is over), `take(out)`
    one of their finished outputs (True once the step is complete), `advance()` the step (a failed output, if one
    failed), `outputs(tokenizer)` the n choices' finished outputs."""

    def __init__(self, engine, item):
        r = item.request
        beam = r.openai["beam"]
        # a line without max_tokens (None, or the run's --max-new-tokens): at most the context left, as a plain
        # line's reply is cut there (a body's own max_tokens past the context was refused when the line was read)
        prompt = truncated(r.prompt_token_ids, r.params, engine.max_model_len)  # truncate_prompt_tokens: its end
        room = max(1, engine.max_model_len - len(prompt))
        length = room if r.params.max_new_tokens is None else min(r.params.max_new_tokens, room)
        self.params = BeamSearchParams(beam_width=beam["n"], max_tokens=length, ignore_eos=r.params.ignore_eos,
                                       temperature=r.params.temperature, length_penalty=beam["length_penalty"],
                                       include_stop_str_in_output=r.params.include_stop_str_in_output)
        self.search = BeamSearch([prompt], self.params, set(engine.eos_token_ids), engine.max_model_len,
                                 priority=r.params.priority)
        self.search.step = replace(self.search.step, cache_salt=r.params.cache_salt)
        self.item, self.lora, self.logprobs = item, r.lora, r.params.logprobs
        self.count, self.beams, self.rids, self.outs = 0, [], [], {}

    def send(self, engine) -> list[str]:
        self.beams = self.search.beams()
        self.rids = []
        for _, beam in self.beams:
            rid = f"{self.item.id}\0beam{self.count}"  # (no line's id holds a NUL)
            self.count += 1
            engine.add_request(rid, beam.tokens, self.search.step, self.lora)
            self.rids.append(rid)
        return list(self.rids)

    def take(self, out) -> bool:
        self.outs[out.request_id] = out
        return len(self.outs) == len(self.rids)

    def advance(self):
        outs = [self.outs.pop(rid) for rid in self.rids]
        failed = next((o for o in outs if o.finish_reason in ("error", "abort")), None)
        if failed is None:
            self.search.advance(self.beams, outs)
        return failed

    def outputs(self, tokenizer) -> list:
        best = self.search.finish(tokenizer)[0].sequences
        return [beam_output(f"{self.item.id}-{r}", beam, tokenizer, self.params.include_stop_str_in_output,
                            self.logprobs, self.lora) for r, beam in enumerate(best)]
