"""Session 45 probes of known gaps: data-parallel poison requests, vLLM option hints per command, LoRARequest
registration order, add_request's positional LoRARequest hint, data-parallel metric labels, Responses reasoning."""

from __future__ import annotations

import time

import pytest

from infer import SamplingParams
from infer.errors import RequestError

from helpers import tiny_llama_str as path, tiny_llama_with_template  # noqa: F401 (path: a fixture)
from test_probes_session44_api import adapters, lora_llm  # noqa: F401 (fixtures)


@pytest.mark.parametrize("method", ["generate", "chat", "stream"])
def test_lora_request_list_of_the_wrong_length_registers_nothing(lora_llm, adapters, method):
    """vLLM refuses a lora_request list whose length is not the prompts' before it adds anything; infer registered
    every adapter of the list first (list_loras grew) and only then refused the call."""
    from infer import LoRARequest
    before = lora_llm.list_loras()
    prompt = [{"role": "user", "content": "hi"}] if method == "chat" else "hello"
    requests = [LoRARequest(f"{method}-a", 1, adapters["a"]), LoRARequest(f"{method}-b", 2, adapters["b"])]
    with pytest.raises(RequestError, match="3 prompts but 2 lora"):
        getattr(lora_llm, method)([prompt] * 3 if method != "chat" else [[prompt[0]]] * 3,
                                  SamplingParams(max_new_tokens=2), lora_request=requests)
    assert lora_llm.list_loras() == before
    with pytest.raises(RequestError):  # a bad prompt refuses the call before its adapters are registered too
        long = "word " * 400
        getattr(lora_llm, method)([long] if method != "chat" else [[{"role": "user", "content": long}]],
                                  SamplingParams(max_new_tokens=2), lora_request=[requests[0]])
    assert lora_llm.list_loras() == before


def test_lora_request_list_still_registers_and_runs(lora_llm, adapters):
    from infer import LoRARequest
    outs = lora_llm.generate(["hello", "hello"], SamplingParams(max_new_tokens=3, ignore_eos=True),
                             lora_request=[None, LoRARequest("b", 2, adapters["b"])])
    assert "b" in lora_llm.list_loras() and len(outs) == 2
    again = lora_llm.generate(["hello"], SamplingParams(max_new_tokens=3, ignore_eos=True), lora="b")
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_add_request_positional_lora_request_hint_names_lora_request():
    """vLLM's add_request(request_id, prompt, params, arrival_time, lora_request): a LoRARequest fifth was refused
    with the hint `pass lora='sql'`, an adapter name that is not registered; the keyword that takes the request (and
    registers its folder) is lora_request=."""
    from infer import EngineConfig, LLMEngine

    class LoRARequest:
        lora_name, lora_int_id, lora_path = "sql", 1, "/adapters/sql"

    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4))
    try:
        with pytest.raises(RequestError) as e:
            engine.add_request("b", [5, 6, 7], SamplingParams(max_new_tokens=2), None, LoRARequest())
        assert "lora_request=" in e.value.hint and "lora='sql'" not in e.value.hint
        assert "'sql'" in e.value.hint
        assert not engine.requests
    finally:
        engine.close()


@pytest.mark.parametrize("argv, words, wrong", [
    (["run", "tiny-llama", "IN", "--disable-tqdm"], "infer run's -q/--quiet", "infer bench"),
    (["serve", "tiny-llama", "--disable-tqdm"], "no progress bar", "infer bench"),
    (["bench", "tiny-llama", "--disable-tqdm"], "infer bench's -q/--quiet", "vllm bench"),
    (["run", "tiny-llama", "IN", "--ignore-eos"], "set per line of INPUT", "infer bench"),
    (["serve", "tiny-llama", "--ignore-eos"], "send it in each request's body", "infer bench"),
    (["run", "tiny-llama", "IN", "--output-json", "x.json"], "-o/--output FILE", "infer bench"),
    (["run", "tiny-llama", "IN", "--max-concurrency", "4"], "--max-num-seqs", "infer bench"),
    (["serve", "tiny-llama", "--max-concurrency", "4"], "--max-queue", "infer bench"),
    (["run", "tiny-llama", "IN", "--batch-size", "4"], "--max-num-seqs", "infer bench"),
    (["run", "tiny-llama", "IN", "--disable-log-stats"], "infer run logs no periodic stats", "infer serve"),
    (["run", "tiny-llama", "IN", "--disable-log-requests"], "infer run logs no request contents", "infer serve"),
    (["run", "tiny-llama", "IN", "--model", "m"], "`infer run ./my-model", "infer serve"),
    (["run", "tiny-llama", "IN", "--dataset-name", "random"], "`vllm bench`'s option", None),
    (["serve", "tiny-llama", "--num-warmups", "2"], "`vllm bench`'s option", None),
    (["run", "tiny-llama", "IN", "--ssl-keyfile", "k.pem"], "`vllm serve`'s option", None),
    (["bench", "tiny-llama", "--uds", "/tmp/s"], "`vllm serve`'s option", None),
    (["serve", "tiny-llama", "--uds", "/tmp/s"], "listens on TCP", "vllm serve"),
])
def test_vllm_option_hints_name_what_the_command_used_takes(tmp_path, argv, words, wrong):
    """vLLM's option hints were one table for every command: `infer run --disable-tqdm` was told "infer bench's
    -q/--quiet hides the progress bars" (run's own -q/--quiet was not named), `infer run --ignore-eos` got infer
    bench's random dataset instead of the line's "ignore_eos", `infer run --disable-log-stats` was told about
    infer serve. Each hint now names what the command typed takes, or whose option it is."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    argv = [str(src) if a == "IN" else a for a in argv]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2, res.output
    assert words in res.output, res.output
    assert wrong is None or wrong not in res.output, res.output


def test_a_deeply_nested_json_schema_travels_to_a_data_parallel_replica():
    """`infer run --data-parallel 2` with one line whose structured_outputs.json schema nests 900 levels (one engine
    runs it, and the JSONL reader takes it) stopped the whole run with a traceback: Ray's cloudpickle could not
    send the line's params to a replica ("Could not pickle object as excessively deep recursion required"). The
    schema now travels as its JSON text."""
    from ray import cloudpickle

    from infer.engine.structured import StructuredOutputsParams
    schema = {"type": "string"}
    for _ in range(900):
        schema = {"type": "array", "items": schema}
    params = SamplingParams(max_new_tokens=4, structured_outputs={"json": schema, "disable_any_whitespace": True})
    wire = cloudpickle.loads(cloudpickle.dumps([("a", [5, 6], params, None)]))
    got = wire[0][2].structured_outputs
    assert got._text == params.structured_outputs._text and got.kind == "json" and got.disable_any_whitespace
    for spec in (StructuredOutputsParams(regex="a+"), StructuredOutputsParams(choice=["x", "y"]),
                 StructuredOutputsParams(json={"type": "object"}), StructuredOutputsParams(json_object=True)):
        back = cloudpickle.loads(cloudpickle.dumps(spec))
        assert (back.kind, back._text, back.choice, back.regex) == (spec.kind, spec._text, spec.choice, spec.regex)


RTEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
             "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}"
             "{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    model = tiny_llama_with_template(tmp_path_factory.mktemp("p45resp") / "tiny-resp", RTEMPLATE)
    engine = LLMEngine(EngineConfig(str(model), block_size=4, max_num_seqs=2, max_model_len=256))
    try:
        with serve_in_thread(Server(AsyncEngine(engine), "tiny-resp", reasoning_parser="deepseek_r1")) as base:
            yield base
    finally:
        engine.close()


def test_a_reply_cut_inside_its_reasoning_has_an_incomplete_reasoning_item(reasoning_server):
    """A Responses reply cut by max_output_tokens before its reasoning ended marked the reasoning item "completed"
    (whole and streamed); OpenAI and vLLM mark it incomplete. A reasoning that ended keeps "completed"."""
    import json

    import httpx
    body = {"input": "q", "max_output_tokens": 3, "temperature": 0, "guided_regex": "abcdefgh"}
    whole = httpx.post(f"{reasoning_server}/v1/responses", json=body, timeout=120).json()
    assert whole["status"] == "incomplete"
    [rs] = [o for o in whole["output"] if o["type"] == "reasoning"]
    assert rs["status"] == "incomplete"
    with httpx.stream("POST", f"{reasoning_server}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "reasoning"]
    assert [d["status"] for d in done] == ["incomplete"]
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    ended = httpx.post(f"{reasoning_server}/v1/responses", timeout=120,
                       json={**body, "max_output_tokens": 20, "guided_regex": "ab</think>cdefghijklmnopqrstuvwxyz"})
    [rs] = [o for o in ended.json()["output"] if o["type"] == "reasoning"]
    assert ended.json()["status"] == "incomplete" and rs["status"] == "completed"


def test_a_reasoning_item_before_a_user_message_reaches_the_prompt(reasoning_server):
    """A reasoning item followed by a user message (or last in the input) was dropped from the prompt: it waited
    for an assistant message to join. vLLM reads each reasoning item as an assistant turn of its own."""
    import httpx
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "deep thought here"}]}

    def prompt_tokens(items) -> int:
        r = httpx.post(f"{reasoning_server}/v1/responses", timeout=120,
                       json={"input": items, "max_output_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]

    chat = httpx.post(f"{reasoning_server}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "reasoning":
                                                         "deep thought here"}, {"role": "user", "content": "b"}],
        "max_tokens": 1, "temperature": 0}).json()["usage"]["prompt_tokens"]
    plain = prompt_tokens([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert prompt_tokens([{"role": "user", "content": "a"}, thought, {"role": "user", "content": "b"}]) == chat > plain
    # joined to the assistant message that follows it, as before
    joined = prompt_tokens([{"role": "user", "content": "a"}, thought, {"role": "assistant", "content": ""},
                            {"role": "user", "content": "b"}])
    assert joined == chat


def test_beam_search_lora_request_list_of_the_wrong_length_registers_nothing(lora_llm, adapters):
    """LLM.beam_search registered a lora_request list's adapters before it refused the list's length."""
    from infer import BeamSearchParams, LoRARequest
    before = lora_llm.list_loras()
    requests = [LoRARequest("beam-a", 1, adapters["a"]), LoRARequest("beam-b", 2, adapters["b"])]
    with pytest.raises(RequestError, match="1 prompts but 2 lora"):
        lora_llm.beam_search(["hello"], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=requests)
    with pytest.raises(RequestError):  # a prompt it cannot take: refused before the adapter is registered too
        lora_llm.beam_search([[{"role": "user", "content": "hi"}]], BeamSearchParams(beam_width=2, max_tokens=2),
                             lora_request=requests[:1])
    assert lora_llm.list_loras() == before
    out = lora_llm.beam_search(["hello"], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=requests[:1])
    assert len(out) == 1 and "beam-a" in lora_llm.list_loras()


def test_a_request_that_raises_inside_a_replica_fails_alone(monkeypatch):
    """A request whose add_request raised anything but a RequestError inside a data-parallel replica escaped the
    replica's call: the driver took the replica for dead, re-ran its requests on the others, where it raised again,
    and with two replicas the whole run stopped. Now that request gets an error record and the rest complete on
    both replicas, each once (a validation that raises likewise fails its line only)."""
    from fakeray import Died, FakeRay, Handle
    from infer.engine.config import EngineConfig
    from infer.parallel.pool import ReplicaPool, Work
    from infer.parallel.replica import ENGINE_FAILURE, Replica

    class _Ray(FakeRay):
        def call(self, ref):
            try:
                return super().call(ref)
            except Exception as e:  # as Ray hands an actor method's exception to the driver
                raise Died(str(e)) from e

    cfg = EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=3, memory_limit=2 ** 29)
    replicas = [Replica(cfg) for _ in range(2)]
    for rep in replicas:
        real = rep.engine.add_request

        def add(rid, *args, _real=real, **kwargs):
            if rid == "poison":
                raise OverflowError("crafted")
            return _real(rid, *args, **kwargs)
        monkeypatch.setattr(rep.engine, "add_request", add)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    work = [Work(rid, i + 1, [5 + i, 6, 7], params, None) for i, rid in enumerate(["a", "poison", "b", "c", "d"])]
    outs, rejected = {}, {}
    pool = ReplicaPool(_Ray(), [Handle(r) for r in replicas], capacity=2, notify=lambda m: None)
    pool.run(work, lambda item, out, i: outs.setdefault(item.id, out),
             lambda item, why: rejected.setdefault(item.id, why))
    assert sorted(outs) == ["a", "b", "c", "d"] and all(o.finish_reason == "length" for o in outs.values())
    assert list(rejected) == ["poison"] and rejected["poison"].startswith(ENGINE_FAILURE)
    assert "OverflowError: crafted" in rejected["poison"]
    assert all(r.alive for r in pool.replicas)
    for rep in replicas:
        assert not rep.engine.requests or all(s.finished for s in rep.engine.requests.values())
        monkeypatch.setattr(rep.engine, "validate", lambda *a: (_ for _ in ()).throw(RecursionError("deep")))
    bad = replicas[0].validate([("x", [5, 6], params, None)])
    assert bad["x"].startswith(ENGINE_FAILURE) and "RecursionError" in bad["x"]


def test_a_copied_json_schema_stays_as_it_was_given():
    """(The schema travels to a replica as its text; a copy, SamplingParams.clone() included, keeps the dict.)"""
    import copy
    params = SamplingParams(structured_outputs={"json": {"type": "object"}})
    for spec in (params.clone().structured_outputs, copy.copy(params.structured_outputs)):
        assert spec.json == {"type": "object"} and spec._text == params.structured_outputs._text
