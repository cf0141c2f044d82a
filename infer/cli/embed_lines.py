"""`infer run`'s OpenAI batch lines of url /v1/embeddings whose body.input holds several inputs (a list of strings
or of token lists, as vLLM's run-batch takes the server's body): each input one pooling request on the run's
engine, beside the other lines, and the line's record the server's response to that body (serve/embeddings.py's
response_body): every vector, in order. The same interface as a beam search line's (cli/beam_lines.py), so that
_generate and a failed step treat both alike."""

from __future__ import annotations


def inputs_of(request) -> list:
    """An embeddings line's inputs (token id lists); [] for any other request."""
    if request is None or request.openai is None or not request.openai.get("embedding"):
        return []
    return request.openai.get("inputs") or [request.prompt_token_ids]


def is_many_inputs_line(request) -> bool:
    return len(inputs_of(request)) > 1


class LineInputs:
    """One line's inputs: `send(engine)` adds them all (their ids), and nothing once sent, `take(out)` one finished
    output (True once every input's is in), `advance()` a failed output (if one failed), `outputs(tokenizer)` the
    finished outputs in the body's order."""

    def __init__(self, engine, item):
        self.item, self.sent, self.rids, self.outs = item, False, [], {}

    def send(self, engine) -> list[str]:
        if self.sent:
            return []
        self.sent = True
        r = self.item.request
        try:
            for i, prompt in enumerate(inputs_of(r)):
                rid = f"{self.item.id}\0input{i}"  # (no line's id holds a NUL)
                engine.add_request(rid, prompt, r.params, r.lora)
                self.rids.append(rid)
        except Exception:  # none of the line runs: what was added is taken back
            for rid in self.rids:
                engine.abort_request(rid)
            raise
        return list(self.rids)

    def take(self, out) -> bool:
        self.outs[out.request_id] = out
        return len(self.outs) == len(self.rids)

    def advance(self):
        return next((o for o in self.outs.values() if o.finish_reason in ("error", "abort")), None)

    def outputs(self, tokenizer) -> list:
        return [self.outs[rid] for rid in self.rids]
