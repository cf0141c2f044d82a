"""Twenty-first session: a request whose own constraints reach a dead end mid-reply (a grammar rule that never
ends, bad_words that ban every token the rest allows) is the client's to change: the server answers 400 with the
engine's message, whole or streamed, not a 500 "engine_error" that says infer failed; the server goes on."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from helpers import served_tiny_llama  # noqa: E402

DEAD = 'root ::= "a" b\nb ::= b "x"'  # compiles; after "a" no token can follow


@pytest.fixture(scope="module")
def served():
    yield from served_tiny_llama()


BODIES = {
    "grammar": {"structured_outputs": {"grammar": DEAD}},
    # allowed_token_ids [3] ("!") with the bad word "!!": after one "!" nothing is left
    "bad_words": {"allowed_token_ids": [3], "bad_words": ["!!"]},
}


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_a_dead_end_of_the_requests_own_constraints_is_a_400(served, kind):
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 6, "temperature": 0, **BODIES[kind]}
    r = httpx.post(f"{served}/v1/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "no_token_left"
    assert ("allows no token after the reply so far" if kind == "grammar" else "bad_words leave no token") \
        in err["message"]
    with httpx.stream("POST", f"{served}/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    (error,) = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert error["code"] == "no_token_left" and error["type"] == "invalid_request_error"
    ok = httpx.post(f"{served}/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3},
                    timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_an_engine_failure_stays_a_500():
    """Only the request's own dead end is a 400: an error finish without it is infer's, a 500 engine_error."""
    from infer.engine.outputs import RequestOutput
    from infer.serve.app import _error
    out = RequestOutput("r", [1], finished=True, finish_reason="error", error="internal engine error: boom")
    assert (_error(out).status, _error(out).code) == (500, "engine_error")
    out = RequestOutput("r", [1], finished=True, finish_reason="error", error="dead", bad_request=True)
    assert (_error(out).status, _error(out).code) == (400, "no_token_left")


def test_the_late_bitmask_bans_what_the_samplers_masks_ban():
    """SamplingInputs.settle's bitmask (a step prepared while a constrained row's last token was on the device) bans
    what `_masks` bans for bad words at prepare time, on random words and replies, with and without a grammar
    (then also what the matcher refuses)."""
    import random

    import torch

    from infer.engine.sampler import _masks, apply_masks, late_bitmask
    from infer.engine.structured import apply_bitmask, fill_bitmask
    from infer.engine.sequence import Sequence
    from infer.engine.sampling_params import SamplingParams
    rng, vocab = random.Random(0), 77
    for _ in range(40):
        seqs = []
        for k in range(rng.randint(1, 5)):
            s = Sequence(f"r{k}", [1, 2], SamplingParams())
            s.output_token_ids = [rng.randrange(4) for _ in range(rng.randint(0, 4))]
            s.bad_words = [[rng.randrange(4) for _ in range(rng.randint(1, 3))] + [rng.randrange(vocab)]
                           for _ in range(rng.randint(0, 4))]
            seqs.append(s)
        logits = torch.randn(len(seqs), vocab)
        banned = _masks(seqs, vocab)[2]
        want = apply_masks(logits, None, None, torch.tensor(banned) if banned else None, None, None)
        got = apply_bitmask(logits, None, late_bitmask(seqs, vocab))
        assert torch.equal(got, want)
        assert banned == [] or not torch.equal(got, logits)
    xgr = pytest.importorskip("xgrammar")
    from infer.engine.structured import GrammarBackend, StructuredOutputsParams as S  # noqa: F401
    from transformers import AutoTokenizer
    from infer.models.tiny import ensure_builtin
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiled = xgr.GrammarCompiler(info).compile_regex("[ab]+")
    s = Sequence("g", [1, 2], SamplingParams())
    s.grammar, s.bad_words = xgr.GrammarMatcher(compiled), [[tok.convert_tokens_to_ids("a")]]
    vocab = len(tok)
    logits = torch.zeros(1, vocab)
    want = apply_bitmask(logits, None, fill_bitmask([s.grammar], vocab))
    want[0, s.bad_words[0][0]] = float("-inf")
    assert torch.equal(apply_bitmask(logits, None, late_bitmask([s], vocab)), want)
    assert want.isfinite().any()


def test_a_late_step_that_fails_after_completing_the_step_before_loses_no_output(monkeypatch):
    """The late path completes the step before inside the launch (settle): when the launch then fails (here the
    sampler), the outputs that completion made are handed out by the next step, not dropped, so every token of
    the reply reaches the caller once."""
    from infer import SamplingParams, StructuredOutputsParams as S
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    eng = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4, overlap=True))
    eng.add_request("c", [5, 6, 7], SamplingParams(max_new_tokens=8, structured_outputs=S(regex="[ab]{1,12}")))
    eng.add_request("p", [5, 6, 8], SamplingParams(max_new_tokens=8))
    seen, final, failed = {"c": [], "p": []}, {}, 0
    real = eng.runner.sampler.sample

    def sample(logits, seqs, inputs=None):
        nonlocal failed
        if inputs is not None and inputs.late and not failed:
            failed += 1
            raise RuntimeError("boom")
        return real(logits, seqs, inputs)
    monkeypatch.setattr(eng.runner.sampler, "sample", sample)
    while eng.has_unfinished_requests():
        try:
            outs = eng.step()
        except RuntimeError:
            continue
        for o in outs:
            seen[o.request_id] += o.new_token_ids
            if o.finished:
                final[o.request_id] = o.token_ids
    assert failed == 1
    assert seen == final and len(final["c"]) >= 2, (seen, final)


def test_truncate_prompt_tokens_minus_one_is_the_context_length():
    """vLLM's truncate_prompt_tokens=-1: keep the context's worth of the prompt's end (SamplingParams refused it).
    A prompt shorter than the context is unchanged; a longer one is cut to the context, which then leaves no room,
    as in vLLM; anything below -1 or 0 is refused naming the value."""
    from infer import LLM, SamplingParams
    from infer.errors import RequestError
    from infer.models.tiny import ensure_builtin
    with pytest.raises(RequestError, match=r"truncate_prompt_tokens must be at least 1 \(or -1: the context length\), "
                                           r"got -2"):
        SamplingParams(truncate_prompt_tokens=-2)
    with LLM(str(ensure_builtin("tiny-llama")), block_size=4, max_model_len=32) as llm:
        ids = list(range(5, 25))
        a = llm.generate([ids], SamplingParams(max_new_tokens=4, truncate_prompt_tokens=-1))[0]
        b = llm.generate([ids], SamplingParams(max_new_tokens=4))[0]
        assert a.prompt_token_ids == ids and a.token_ids == b.token_ids
        with pytest.raises(RequestError, match="the prompt has 32 tokens, which leaves no room"):
            llm.generate([list(range(5, 55))], SamplingParams(max_new_tokens=4, truncate_prompt_tokens=-1))


def test_the_server_reads_truncate_minus_one_as_its_context(served):
    body = {"model": "tiny-llama", "prompt": "hi there", "max_tokens": 3, "temperature": 0}
    plain = httpx.post(f"{served}/v1/completions", json=body, timeout=120).json()
    cut = httpx.post(f"{served}/v1/completions", json={**body, "truncate_prompt_tokens": -1}, timeout=120)
    assert cut.status_code == 200, cut.text
    assert cut.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    assert cut.json()["usage"] == plain["usage"]
    long = httpx.post(f"{served}/v1/completions", json={**body, "prompt": "hi " * 200, "truncate_prompt_tokens": -1},
                      timeout=120)
    # cut to the context (64) first, as vLLM does, then no room is left: not refused for its untruncated length
    assert long.status_code == 400 and "the prompt has 64 tokens, which leaves no room" in long.text, long.text
