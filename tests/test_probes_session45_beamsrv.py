"""The server's use_beam_search (vLLM's online beam search): a request's choices are LLM.beam_search's beams on the
same model, best first (and so transformers' num_beams beams with EOS ignored), with vLLM's token_ids, text,
logprobs and usage; chat (template, stream), adapters by model name, vLLM's 400s, a normal request served while a
beam search runs, and a client gone mid-search freeing its steps. And LLM.beam_search's text keeps the special
tokens, as vLLM's."""

from __future__ import annotations

import json
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from helpers import StepGate, wait_until

from infer import LLM, BeamSearchParams
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.models.tiny import ensure_builtin
from infer.serve.app import Server, serve_in_thread
from infer.serve.async_engine import AsyncEngine

MAX_LEN = 64
PROMPT = [5, 9, 13, 21, 30]


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


@pytest.fixture(scope="module")
def engine(path):
    return LLMEngine(EngineConfig(path, max_model_len=MAX_LEN, block_size=4))


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        yield base


@pytest.fixture(scope="module")
def llm(path):
    with LLM(path, block_size=4, max_model_len=MAX_LEN) as engine:
        yield engine


def _post(url, route, body, timeout=60):
    return httpx.post(f"{url}/v1/{route}", json={"model": "tiny-llama", **body}, timeout=timeout)


def _beams(llm, prompt, width, n, **kw):
    return llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=n, temperature=0.0, **kw))[0]


def test_completion_choices_are_llm_beam_search_beams(url, llm):
    r = _post(url, "completions", {"prompt": PROMPT, "n": 3, "max_tokens": 5, "use_beam_search": True,
                                   "temperature": 0, "ignore_eos": True, "logprobs": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = _beams(llm, PROMPT, 3, 5, ignore_eos=True).sequences
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in body["choices"]] == [s.output_token_ids for s in want]
    tok = llm.tokenizer
    for c, s in zip(body["choices"], want):
        assert c["text"] == tok.decode(s.output_token_ids, skip_special_tokens=False)
        assert c["finish_reason"] == "length"
        assert sum(c["logprobs"]["token_logprobs"]) == pytest.approx(s.cum_logprob, abs=1e-4)
        assert all(len(top) <= 3 for top in c["logprobs"]["top_logprobs"])  # its own and the top 2
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 15, "total_tokens": 20}


def test_eos_finished_beams_as_vllm(url, llm, engine, monkeypatch):
    """A beam ended by EOS: finish_reason stop, stop_reason the EOS id, the EOS in token_ids only with
    include_stop_str_in_output, never in the text; usage counts the token_ids."""
    plain = _beams(llm, PROMPT, 2, 4, ignore_eos=True).sequences[0].output_token_ids
    eos = plain[1]
    monkeypatch.setattr(engine, "eos_token_ids", {eos})
    monkeypatch.setattr(llm.engine, "eos_token_ids", {eos})
    for keep in (False, True):
        want = _beams(llm, PROMPT, 2, 4, include_stop_str_in_output=keep).sequences
        stopped = [k for k, s in enumerate(want) if s.finish_reason == "stop"]
        assert stopped
        r = _post(url, "completions", {"prompt": PROMPT, "n": 2, "max_tokens": 4, "use_beam_search": True,
                                       "temperature": 0, "return_token_ids": True,
                                       "include_stop_str_in_output": keep})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["token_ids"] for c in choices] == [s.output_token_ids for s in want]
        for k in stopped:
            c, s = choices[k], want[k]
            assert c["finish_reason"] == "stop" and c["stop_reason"] == eos
            assert (s.output_token_ids[-1] == eos) is keep
            assert c["text"] == llm.tokenizer.decode([t for t in s.output_token_ids if t != eos],
                                                     skip_special_tokens=False)
        assert r.json()["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)


def test_chat_beams_render_the_template_and_stream_at_the_end(url, llm):
    messages = [{"role": "user", "content": "hello there"}]
    body = {"messages": messages, "n": 2, "max_tokens": 4, "use_beam_search": True, "temperature": 0,
            "ignore_eos": True}
    r = _post(url, "chat/completions", body)
    assert r.status_code == 200, r.text
    prompt = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]  # the template's ids
    want = _beams(llm, prompt, 2, 4, ignore_eos=True).sequences
    texts = [llm.tokenizer.decode(s.output_token_ids, skip_special_tokens=False) for s in want]
    assert [c["message"]["content"] for c in r.json()["choices"]] == texts
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)
    events = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}},
                      timeout=60) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    content = {0: "", 1: ""}
    for e in events:
        for c in e["choices"]:
            content[c["index"]] += c["delta"].get("content") or ""
    assert [content[0], content[1]] == texts
    assert events[-1]["usage"] == r.json()["usage"]


def test_vllm_refusals(url):
    base = {"prompt": PROMPT, "max_tokens": 3, "use_beam_search": True}
    for extra, param in (({"stream": True}, "stream"), ({"n": 11}, "n"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"echo": True, "logprobs": 1}, "logprobs"), ({"use_beam_search": "yes"}, None)):
        r = _post(url, "completions", {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        if param:
            assert r.json()["error"]["param"] == param, r.text


def test_a_normal_request_gets_tokens_while_a_beam_search_runs(engine):
    """Held between steps, a beam search's steps and a plain request share the engine: the plain one finishes while
    the beam search is still searching."""
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base, StepGate(engine, closed=True) as gate:
        results, steps, rest, inner = {}, [], threading.Event(), gate.inner

        def step():  # the engine holds at its 8th step until the test has seen the plain reply
            steps.append(1)
            if len(steps) >= 8:
                rest.wait(30)
            return inner()
        gate.inner = step

        def send(name, body):
            results[name] = _post(base, "completions", body)
        beam = threading.Thread(target=send, args=("beam", {"prompt": PROMPT, "n": 2, "max_tokens": 30,
                                                            "use_beam_search": True, "ignore_eos": True}))
        beam.start()
        assert wait_until(lambda: engine.has_unfinished_requests())
        plain = threading.Thread(target=send, args=("plain", {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}))
        plain.start()
        assert wait_until(lambda: httpx.get(f"{base}/health").json()["engine"]["num_in_flight"] >= 2)
        gate.open.set()
        plain.join(60)
        assert results["plain"].status_code == 200
        assert "beam" not in results and len(steps) <= 8  # the plain request did not wait for the 30 beam steps
        rest.set()
        beam.join(120)
        assert results["beam"].status_code == 200 and len(results["beam"].json()["choices"]) == 2


def test_client_gone_ends_the_beam_search(engine):
    """The client gives up while a step is held: the search ends (no further step is sent) and its step requests
    are aborted, so the engine runs at most the step it held."""
    server = Server(AsyncEngine(engine), "tiny-llama")
    with serve_in_thread(server) as base, StepGate(engine, closed=True) as gate:
        steps, inner = [], gate.inner
        gate.inner = lambda: (steps.append(1), inner())[1]

        def send():
            try:
                _post(base, "completions", {"prompt": PROMPT, "n": 3, "max_tokens": 40, "use_beam_search": True},
                      timeout=httpx.Timeout(60, read=1.0))
            except httpx.TimeoutException:
                pass
        t = threading.Thread(target=send)
        t.start()
        assert wait_until(lambda: server._beams)
        search = next(iter(server._beams.values()))
        t.join(30)  # the client gave up (its read timeout) while the step was held
        assert wait_until(lambda: not server._beams and search._task.done())
        gate.open.set()
        assert wait_until(lambda: not engine.has_unfinished_requests()
                          and httpx.get(f"{base}/health").json()["engine"]["num_in_flight"] == 0)
        assert len(steps) <= 1
        assert _post(base, "completions", {"prompt": PROMPT, "n": 2, "max_tokens": 2,
                                           "use_beam_search": True}).status_code == 200


def test_llm_beam_search_text_keeps_special_tokens(llm):
    """vLLM's LLM.beam_search decodes a beam's tokens as they are (tokenizer.decode: special tokens kept)."""
    special = llm.tokenizer.all_special_ids[-1]
    prompt = [special] + PROMPT
    out = _beams(llm, prompt, 2, 3, ignore_eos=True)
    for s in out.sequences:
        assert s.text == llm.tokenizer.decode(s.tokens, skip_special_tokens=False)
        assert s.text.startswith(llm.tokenizer.decode([special], skip_special_tokens=False))


def test_an_adapter_named_as_the_model_runs_the_beams_with_priority(path, tmp_path):
    """`model` naming an adapter searches with it (LLM.beam_search's beams with that lora); under the priority
    policy the request's priority reaches every step."""
    from lora_helpers import THREE, hf_float, save_adapter
    adapter = str(save_adapter(hf_float(path), tmp_path / "a", seed=5, **THREE["a"]))
    engine = LLMEngine(EngineConfig(path, max_model_len=MAX_LEN, block_size=4, loras={"a": adapter},
                                    scheduling_policy="priority"))
    seen = []
    add = engine.add_request
    engine.add_request = lambda rid, ids, params, *a, **k: (seen.append(params.priority), add(rid, ids, params,
                                                                                               *a, **k))[1]
    body = {"prompt": PROMPT, "n": 2, "max_tokens": 4, "use_beam_search": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "priority": -2}
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        r = httpx.post(f"{base}/v1/completions", json={**body, "model": "a"}, timeout=60)
        plain = httpx.post(f"{base}/v1/completions", json={**body, "model": "tiny-llama"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "a", r.text
    assert seen and set(seen) == {-2}
    with LLM(path, block_size=4, max_model_len=MAX_LEN, loras={"a": adapter}) as llm:
        want = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True), lora="a")[0]
    assert [c["token_ids"] for c in r.json()["choices"]] == [s.output_token_ids for s in want.sequences]
    assert [c["token_ids"] for c in plain.json()["choices"]] != [c["token_ids"] for c in r.json()["choices"]]


def test_a_batch_lines_beam_search_fields_are_checked(tmp_path):
    """A use_beam_search line (run as the server runs it) is refused what the server refuses: a beam width past 10,
    a constraint, prompt_logprobs; and a use_beam_search that is no boolean."""
    from infer.cli.batch_io import read_inputs

    class Tok:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": list(text.encode("utf-8"))[:50] or [0]}
    bodies = {"wide": {"n": 11}, "json": {"response_format": {"type": "json_object"}},
              "plp": {"prompt_logprobs": 1}, "yes": {"use_beam_search": "yes"}, "ok": {"n": 3, "length_penalty": 2}}
    lines = [{"custom_id": k, "url": "/v1/completions", "body": {"prompt": "hi", "use_beam_search": True, **v}}
             for k, v in bodies.items()]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    items = {i.id: i for i in read_inputs(tmp_path / "in.jsonl", Tok(), {"max_new_tokens": 4})}
    assert "body.n (the beam width of use_beam_search) must be an integer in 1..10" in items["wide"].error
    assert "cannot be combined with body.use_beam_search" in items["json"].error
    assert "cannot be combined with body.use_beam_search" in items["plp"].error
    assert "body.use_beam_search must be true or false" in items["yes"].error
    assert items["ok"].error is None and items["ok"].request.openai["beam"] == {"n": 3, "length_penalty": 2.0}


def test_llm_beam_search_finished_beam_holds_its_eos_only_when_asked(llm, monkeypatch):
    """vLLM's LLM.beam_search: a beam ended by EOS has it in its tokens and text only with
    include_stop_str_in_output (infer kept it in the tokens always), and its stop_reason is the EOS id."""
    plain = _beams(llm, PROMPT, 2, 4, ignore_eos=True).sequences[0].output_token_ids
    eos = plain[1]
    monkeypatch.setattr(llm.engine, "eos_token_ids", {eos})
    for keep in (False, True):
        out = _beams(llm, PROMPT, 2, 4, include_stop_str_in_output=keep).sequences
        stopped = [s for s in out if s.finish_reason == "stop"]
        assert stopped
        for s in stopped:
            assert s.stop_reason == eos and (s.output_token_ids[-1] == eos) is keep
            assert eos not in s.output_token_ids[:-1]
            assert s.text == llm.tokenizer.decode(s.tokens, skip_special_tokens=False)


def test_async_llm_beam_search_is_vllms_engine_client_beam_search(path, llm):
    """vLLM's EngineClient.beam_search (AsyncLLM) was missing: it yields one finished output whose outputs are
    LLM.beam_search's beams, best first, while a generate of the same event loop runs beside it."""
    import asyncio

    from infer import AsyncLLM, SamplingParams
    want = _beams(llm, PROMPT, 3, 5, ignore_eos=True).sequences

    async def main():
        async with AsyncLLM(path, block_size=4, max_model_len=MAX_LEN) as engine:
            async def beams():
                return [o async for o in engine.beam_search(
                    PROMPT, "b1", BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, temperature=0.0))]

            async def plain():
                return [o async for o in engine.generate("hi", SamplingParams(max_new_tokens=3, ignore_eos=True),
                                                         "p1")]
            return await asyncio.gather(beams(), plain())
    found, plain = asyncio.run(main())
    assert len(found) == 1 and found[0].finished and found[0].request_id == "b1"
    assert [o.token_ids for o in found[0].outputs] == [s.output_token_ids for s in want]
    assert [o.index for o in found[0].outputs] == [0, 1, 2]
    assert plain[-1].finished and plain[-1].num_generated == 3


def test_infer_run_answers_beam_search_lines_as_the_server(llm, tmp_path):
    """vllm run-batch answers a use_beam_search line as its server does; `infer run` refused it. A beam line's record
    body is the server's response (n choices, the beams best first, usage over them), beside other lines; alone in
    the file its beams are LLM.beam_search's."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    beam = {"prompt": PROMPT, "n": 3, "max_tokens": 4, "use_beam_search": True, "temperature": 0, "logprobs": 2,
            "return_token_ids": True, "ignore_eos": True}
    bodies = [("/v1/completions", beam),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "n": 2, "max_tokens": 3,
                                        "use_beam_search": True, "temperature": 0, "length_penalty": 0.5}),
              ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})]

    def run(bodies, name, *extra):
        inp, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.jsonl"
        inp.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": route, "body": body}) + "\n"
                               for i, (route, body) in enumerate(bodies)))
        res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--block-size", "4",
                                       *extra])
        assert res.exit_code in (0, 1), res.output
        return {r.get("custom_id", r.get("id")): r for r in map(json.loads, out.read_text().splitlines())}
    records = run(bodies, "mixed", "--output-format", "openai")
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in records.values()), records
    tok = llm.tokenizer
    first, chat = records["c0"]["response"]["body"], records["c1"]["response"]["body"]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2] and len(chat["choices"]) == 2
    assert all(c["text"] == tok.decode(c["token_ids"], skip_special_tokens=False) and len(c["token_ids"]) == 4
               and len(c["logprobs"]["tokens"]) == 4 for c in first["choices"])
    assert first["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert chat["object"] == "chat.completion" and all(c["message"]["role"] == "assistant" for c in chat["choices"])
    alone = run(bodies[:1], "alone", "--output-format", "openai")["c0"]["response"]["body"]
    want = _beams(llm, PROMPT, 3, 4, ignore_eos=True).sequences
    assert [c["token_ids"] for c in alone["choices"]] == [s.output_token_ids for s in want]
    own = run(bodies, "own")  # infer's own records hold one reply a line
    assert "--output-format openai" in own["c0"]["error"] and own["c2"]["finish_reason"] == "length"
