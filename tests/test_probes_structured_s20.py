"""Structured outputs probes: a forced prefix that ends the constraint (an EOS it accepts) is refused when the
request is added, not left to fail the whole step in xgrammar (every request in it); a constraint that allows no
token (a rule that never ends) is refused when added, and one that reaches such a dead end mid-reply says so instead
of blaming token 0; a falsy value (json=0, regex=0) is told what is wrong with it, not that no kind was given; and a
bad guided_* or response_format value names the field the client sent (a batch line's error, the server's
message)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("xgrammar")

from infer import LLM, SamplingParams, StructuredOutputsParams as S  # noqa: E402
from infer.errors import RequestError  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402

from helpers import infer_run_records, served_tiny_llama  # noqa: E402

EOS = 2
NEVER_ENDS = 'root ::= a\na ::= a "x"'  # compiles in xgrammar, matches no text


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_builtin("tiny-llama")), block_size=4) as llm:
        yield llm


def test_a_prefix_that_ends_the_constraint_is_refused_and_the_others_run(llm):
    """prefix_token_ids ending with EOS, which regex a* accepts: the matcher is terminated, and filling its row
    raised inside the step, which ended every request of the batch with an internal engine error."""
    with pytest.raises(RequestError, match=r"prefix_token_ids\[0\] \(2\) ends structured_outputs.regex"):
        llm.generate("hi", SamplingParams(max_new_tokens=4, prefix_token_ids=[EOS], structured_outputs=S(regex="a*")))
    eng = llm.engine
    eng.add_request("plain", [5, 6, 7], SamplingParams(max_new_tokens=4))
    eng.add_request("ruled", [5, 6, 7], SamplingParams(max_new_tokens=4, structured_outputs=S(regex="[ab]+")))
    with pytest.raises(RequestError, match="ends structured_outputs"):
        eng.add_request("bad", [5, 6, 7], SamplingParams(max_new_tokens=4, prefix_token_ids=[67, EOS],
                                                         structured_outputs=S(regex="a*")))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert set(outs) == {"plain", "ruled"}
    assert outs["plain"].finish_reason == "length" and outs["ruled"].finish_reason in ("stop", "length")
    assert outs["ruled"].error is None and set(outs["ruled"].text) <= {"a", "b"}


def test_an_infer_run_line_with_such_a_prefix_fails_alone(tmp_path):
    lines = [{"id": "bad", "prompt": "hi", "max_new_tokens": 4, "prefix_token_ids": [EOS],
              "structured_outputs": {"regex": "a*"}},
             {"id": "ok", "prompt": "hi", "max_new_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}},
             {"id": "plain", "prompt": "hi", "max_new_tokens": 3}]
    recs, output = infer_run_records(tmp_path, lines)
    assert set(recs) == {"bad", "ok", "plain"}, output
    assert "ends structured_outputs.regex" in recs["bad"]["error"]
    assert recs["ok"]["error"] is None and recs["ok"]["text"] in ("yes", "no")
    assert recs["plain"]["error"] is None and recs["plain"]["finish_reason"] == "length"


@pytest.mark.parametrize("spec", [S(grammar=NEVER_ENDS), S(regex=r"[^\x00-\U0010FFFF]")], ids=["grammar", "regex"])
def test_a_constraint_that_allows_no_token_is_refused_when_added(llm, spec):
    """It compiled, and the request ended with finish_reason "error" after a step sampled token 0 (every logit -inf),
    saying that token 0 "does not follow" the constraint."""
    with pytest.raises(RequestError, match=f"structured_outputs.{spec.kind} allows no token: nothing can match it"):
        llm.generate("hi", SamplingParams(max_new_tokens=4, structured_outputs=spec))
    assert llm.generate("hi", SamplingParams(max_new_tokens=4, structured_outputs=S(regex="[ab]+")))[0].error is None


def test_a_dead_end_reached_mid_reply_says_so(llm):
    out = llm.generate("hi", SamplingParams(max_new_tokens=4, structured_outputs=S(grammar='root ::= "a" b\n'
                                                                                           'b ::= b "x"')))[0]
    assert out.finish_reason == "error" and out.text == "a"
    assert len(out.token_ids) == 1 and not out.token_times[1:]  # the token sampled from nothing is left out
    assert "structured_outputs.grammar allows no token after the reply so far" in out.error, out.error


@pytest.mark.parametrize("kwargs,message", [
    (dict(json=0), "structured_outputs.json must be a JSON schema (an object), got int"),
    (dict(regex=0), "structured_outputs.regex must be a non-empty string"),
    (dict(choice=0), "structured_outputs.choice must be a non-empty list"),
    (dict(grammar=0.0), "structured_outputs.grammar must be a non-empty string"),
])
def test_a_falsy_value_is_told_what_is_wrong_with_it(kwargs, message):
    """0 == False: `value not in (None, False)` took json=0 for no json at all ("needs exactly one of ...")."""
    with pytest.raises(RequestError, match=re.escape(message)):
        S(**kwargs)
    assert S(regex="a", json_object=False).kind == "regex"  # json_object: false still asks for nothing


def test_json_false_is_a_schema_xgrammar_refuses(llm):
    with pytest.raises(RequestError, match="the structured output's JSON schema does not compile"):
        llm.generate("hi", SamplingParams(max_new_tokens=4, structured_outputs=S(json=False)))


def test_a_batch_lines_bad_guided_field_is_named(tmp_path):
    lines = [{"custom_id": "c", "body": {"prompt": "hi", "max_tokens": 4, "guided_choice": "yes"}},
             {"custom_id": "j", "body": {"prompt": "hi", "max_tokens": 4, "guided_json": 0}},
             {"custom_id": "ok", "body": {"prompt": "hi", "max_tokens": 4, "temperature": 0,
                                          "guided_choice": ["yes", "no"]}}]
    recs, output = infer_run_records(tmp_path, lines)
    assert set(recs) == {"c", "j", "ok"}, output
    assert "body.guided_choice: structured_outputs.choice must be a non-empty list" in recs["c"]["error"]
    assert "body.guided_json: structured_outputs.json must be a JSON schema" in recs["j"]["error"]
    assert recs["ok"]["error"] is None and recs["ok"]["text"] in ("yes", "no")


@pytest.fixture(scope="module")
def served():
    yield from served_tiny_llama()


@pytest.mark.parametrize("extra,param,message", [
    ({"guided_choice": [1, 2]}, "guided_choice", "guided_choice: structured_outputs.choice must be a non-empty list"),
    ({"guided_regex": 0}, "guided_regex", "guided_regex: structured_outputs.regex must be a non-empty string"),
    ({"guided_grammar": NEVER_ENDS}, "guided_grammar", "structured_outputs.grammar allows no token"),
])
def test_the_server_names_the_field_the_client_sent(served, extra, param, message):
    import httpx
    r = httpx.post(f"{served}/v1/completions", json={"prompt": "hi", "max_tokens": 4, **extra}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param, error
    ok = httpx.post(f"{served}/v1/completions", json={"prompt": "hi", "max_tokens": 6, "temperature": 0,
                                                      "guided_choice": ["yes", "no"]}, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no")
