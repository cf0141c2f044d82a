"""Session 41, `infer run` with OpenAI batch lines (as `vllm run-batch` reads them): probes of the line contract."""

from __future__ import annotations

import json

from infer.cli.batch_io import read_inputs


class _Tok:
    """Enough of a tokenizer for the reader: one id per byte."""
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __call__(self, text):
        return {"input_ids": list(text.encode("utf-8"))[:50] or [0]}

    def apply_chat_template(self, messages, tokenize=True, return_dict=True, **kwargs):
        return {"input_ids": list("".join(m["content"] for m in messages).encode("utf-8")) or [0]}


def _read(tmp_path, lines: list[dict]):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {item.id: item for item in read_inputs(path, _Tok(), {"max_new_tokens": 4})}


def _batch(cid: str, url: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


CHAT = [{"role": "user", "content": "hi"}]


def test_a_batch_lines_logprobs_is_read_by_its_endpoints_type(tmp_path):
    """A chat line's "logprobs": 1 gave one alternative per token (vLLM and OpenAI read a boolean there: none), and
    a completion line's "logprobs": true gave none (vLLM reads it as the count 1): both are refused, as the server
    refuses them, and the well-typed forms still give what they ask."""
    items = _read(tmp_path, [
        _batch("chat-int", "/v1/chat/completions", messages=CHAT, logprobs=1),
        _batch("chat-3", "/v1/chat/completions", messages=CHAT, logprobs=3),
        _batch("cmpl-bool", "/v1/completions", prompt="hi", logprobs=True),
        _batch("chat-ok", "/v1/chat/completions", messages=CHAT, logprobs=True, top_logprobs=2),
        _batch("chat-none", "/v1/chat/completions", messages=CHAT, logprobs=False),
        _batch("cmpl-ok", "/v1/completions", prompt="hi", logprobs=3),
        _batch("cmpl-0", "/v1/completions", prompt="hi", logprobs=0)])
    assert "body.logprobs must be a boolean for a chat" in items["chat-int"].error
    assert "top_logprobs" in items["chat-3"].error
    assert "body.logprobs must be an integer for a completion" in items["cmpl-bool"].error
    assert items["chat-ok"].request.params.logprobs == 2
    assert items["chat-none"].request.params.logprobs is None
    assert items["cmpl-ok"].request.params.logprobs == 3 and items["cmpl-0"].request.params.logprobs == 0


def test_a_completion_prompt_list_of_neither_text_nor_ids_names_the_problem(tmp_path):
    """"prompt": [true] was refused as "body.prompt holds 1 prompts; a batch line answers one"."""
    items = _read(tmp_path, [_batch("b", "/v1/completions", prompt=[True]),
                             _batch("f", "/v1/completions", prompt=[1.5]),
                             _batch("two", "/v1/completions", prompt=["a", "b"]),
                             _batch("one", "/v1/completions", prompt=["a"])])
    for cid in ("b", "f"):
        assert "holds" not in items[cid].error and "must be a string, a list of token ids" in items[cid].error
    assert "holds 2 prompts" in items["two"].error
    assert items["one"].error is None and items["one"].request.prompt_token_ids == list(b"a")


def test_a_batch_lines_sampling_errors_name_the_fields_its_body_gave(tmp_path):
    """"max_tokens": 0 was refused as "max_new_tokens must be in 1..", and a response_format with min_tokens as
    "structured_outputs cannot be combined with min_tokens": fields the line never wrote (the server names the
    client's)."""
    items = _read(tmp_path, [
        _batch("mt", "/v1/completions", prompt="hi", max_tokens=0),
        _batch("mct", "/v1/chat/completions", messages=CHAT, max_completion_tokens=0, max_tokens=5),
        _batch("min", "/v1/completions", prompt="hi", max_tokens=3, min_tokens=5),
        _batch("rf", "/v1/chat/completions", messages=CHAT, response_format={"type": "json_object"}, min_tokens=2),
        _batch("gc", "/v1/completions", prompt="hi", guided_choice=["a", "b"], ignore_eos=True),
        _batch("so", "/v1/completions", prompt="hi", structured_outputs={"choice": ["a"]}, ignore_eos=True)])
    assert items["mt"].error.startswith("line 1: body.max_tokens must be in 1..")
    assert "body.max_completion_tokens must be in 1.." in items["mct"].error
    assert "min_tokens (5) must be at most body.max_tokens (3)" in items["min"].error
    assert "body.response_format cannot be combined with min_tokens" in items["rf"].error
    assert "or body.response_format)" in items["rf"].error and "structured_outputs" not in items["rf"].error
    assert "body.guided_choice cannot be combined with ignore_eos" in items["gc"].error
    assert "structured_outputs cannot be combined with ignore_eos" in items["so"].error  # the field it gave


def test_a_batch_line_asking_for_a_stream_is_refused_as_openai_and_vllm_refuse_it(tmp_path):
    """"stream": true in a batch line ran as if absent; OpenAI's Batch API rejects such a line and vllm run-batch
    writes an error for it ("Request must not be sent in stream mode"): a file infer took was refused there."""
    items = _read(tmp_path, [_batch("s", "/v1/chat/completions", messages=CHAT, stream=True),
                             _batch("so", "/v1/completions", prompt="hi", stream=True,
                                    stream_options={"include_usage": True}),
                             _batch("f", "/v1/completions", prompt="hi", stream=False),
                             _batch("n", "/v1/completions", prompt="hi", stream=None)])
    assert "body.stream" in items["s"].error and "body.stream" in items["so"].error
    assert items["f"].error is None and items["n"].error is None


def test_resume_takes_lines_appended_after_a_newline_that_ends_the_old_last_line(tmp_path):
    """An input whose last line had no newline, grown by an editor's Enter at its end and new lines (or `echo >>`
    then `cat >>`): the old last line is as it was, yet --resume refused it as changed and told the user to do
    what they had done ("end the old last line with a newline")."""
    import pytest
    from infer.cli.resume import check_resume, write_fingerprint
    from infer.errors import ConfigError
    old = json.dumps(_batch("a", "/v1/completions", prompt="hi")) + "\n" + \
        json.dumps(_batch("b", "/v1/completions", prompt="yo"))
    new = json.dumps(_batch("c", "/v1/completions", prompt="hey")) + "\n"
    for grown, ok in ((old + "\n" + new, True), (old + "\r\n" + new, True), (old + new, False),
                      (old + " \n" + new, False)):
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text(old, newline="")
        out.write_text("")
        write_fingerprint(out, inp, {"model": "m"})
        inp.write_text(grown, newline="")
        if ok:
            check_resume(out, inp, {"model": "m"})
        else:
            with pytest.raises(ConfigError, match="old last line did not end with a newline"):
                check_resume(out, inp, {"model": "m"})


def test_resume_runs_an_appended_line_that_names_the_id_a_failed_line_had_taken(tmp_path):
    """A failed line without an id of its own takes its line number as id, and N~2 once a later line names N. A
    line appended since with "custom_id": "2" made the failed line 2's id "2~2", and --resume took the appended
    line for done (the output held a record "2": line 2's error): its request never ran, and line 2 had two error
    records. The resumed output is the one a fresh run of the grown input writes."""
    from typer.testing import CliRunner
    from infer.cli.main import app
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt": "a", "max_new_tokens": 2}\n{"prompt": "b", "temperature": "hot"}\n')
    cli = CliRunner()
    assert cli.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"]).exit_code == 1
    with open(inp, "a") as f:
        f.write(json.dumps(_batch("2", "/v1/completions", prompt="c", max_tokens=2, temperature=0)) + "\n")
    res = cli.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume"])
    assert res.exit_code == 1, res.output
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {r["id"]: r for r in recs}
    assert len(recs) == 3 and set(by_id) == {"1", "2", "2~2"}
    assert by_id["2"]["error"] is None and len(by_id["2"]["token_ids"]) == 2
    assert by_id["2~2"]["error"].startswith("line 2: ")
