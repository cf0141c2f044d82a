"""Hostile inputs to what session 61 built (multimodal checkpoints served as their text model, the new dense
families, the qwen3_coder / seed_oss / openai tool parsers, classification and scoring, the benchmarks' new flags):
each a crash, a 500 or a wrong result found by a probe, now a clear error or the right answer."""

from __future__ import annotations

import json

import pytest

from infer import LLM
from infer.engine.inputs import chat_messages
from infer.errors import UnsupportedModelError
from infer.serve.tools import parse_tools, split, visible

from helpers import tiny_llama_with_json
from test_probes_session61_tools import TOOLS


@pytest.mark.parametrize("eos", ["2", True, [2, "x"], 2.0])
def test_a_multimodal_top_level_eos_token_id_of_another_type_is_refused(tmp_path, eos):
    """A multimodal config.json's top-level eos_token_id that is no token id ("2", true, a list holding text) was set
    on the text config, whose typed field raised huggingface_hub's validation error: a traceback out of `infer run`.
    It is now refused naming config.json's field, as a text model's config.json of that value is."""
    folder = tiny_llama_with_json(tmp_path / "mm", "config.json", "tiny-gemma3-mm", eos_token_id=eos)
    with pytest.raises(UnsupportedModelError, match="config.json's eos_token_id .* is not a value "
                                                    "Gemma3ForConditionalGeneration's text model takes"):
        LLM(str(folder), block_size=4)


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is no JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("parser, reply, want", [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=options>\n{\"wind\": NaN}\n</parameter>\n"
                    "<parameter=hours>\n[Infinity, 1]\n</parameter>\n</function>\n</tool_call>",
     [{"options": "{\"wind\": NaN}", "hours": "[Infinity, 1]"}]),
    ("seed_oss", "<seed:tool_call>\n<function=get_weather>\n<parameter=options>{\"wind\": -Infinity}</parameter>\n"
                 "</function>\n</seed:tool_call>", [{"options": "{\"wind\": -Infinity}"}]),
    ("hermes", "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"temp\": NaN}}</tool_call>", None),
    ("llama3_json", "{\"name\": \"get_weather\", \"parameters\": {\"temp\": Infinity}}", None),
    ("mistral", "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"temp\": NaN}}]", None),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{\"temp\": NaN}", None),
    ("pythonic", "[get_weather(temp=1e999)]", None),
])
def test_a_call_holding_nan_or_infinity_never_sends_them_as_arguments(parser, reply, want):
    """Python's JSON reads NaN and Infinity (and a Python literal 1e999 is infinity), which json.dumps wrote back into
    a call's `arguments` ('{"wind": NaN}'): no JSON, which a client's JSON.parse refuses. A typed parser's object or
    array value holding them stays its text (as a value that does not read does); the other parsers' reply stays
    text, as a call that is not JSON does (the openai parser's already did)."""
    content, calls = split(parse_tools({"tools": TOOLS}, parser), reply)
    if want is None:
        assert (content, calls) == (reply, None)
    else:
        assert [_strict_json(c["function"]["arguments"]) for c in calls] == want


def _on_a_gpu_that_never_times(monkeypatch):
    """What a GPU machine answers, with every timing entry point failing the test if the bench got that far."""
    import torch

    def never(*a, **k):
        raise AssertionError("the bench ran")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for target in ("infer.bench.kernels.copy_bandwidth", "infer.bench.kernels.tune",
                   "infer.bench.kernels.tune_missing", "infer.bench.lora_kernels.main",
                   "infer.bench.attention_kernels.main"):
        monkeypatch.setattr(target, never)


@pytest.mark.parametrize("argv, message", [
    (["--out", "{tmp}/missing/k.csv"], "missing does not exist"),
    (["--out", "{tmp}"], "is a folder: give the CSV file to write"),
    (["--out", "{tmp}/k.csv", "--tune", "--tuned-out", "{tmp}/missing/t.json"], "--tuned-out {tmp}/missing/t.json"),
    (["--out", "{tmp}/k.csv", "--quick"], "--quick goes with --tune"),
    (["--out", "{tmp}/k.csv", "--tuned-out", "{tmp}/t.json"], "--tuned-out goes with --tune"),
    (["--out", "{tmp}/k.csv", "--tune-m", "1"], "--tune-m goes with --tune"),
    (["--out", "{tmp}/k.csv", "--pdl-prefetch", "2"], "--pdl-prefetch times the kernels launched with --pdl"),
    (["--out", "{tmp}/k.csv", "--lora", "--attention"], "--lora and --attention time different kernels"),
    (["--out", "{tmp}/k.csv", "--lora", "--m", "1"], "--lora times its kernels at its own sizes"),
    (["--out", "{tmp}/k.csv", "--attention", "--pdl"], "--attention times its kernels at its own sizes"),
])
def test_the_kernels_bench_refuses_an_unwritable_out_and_ignored_flags_first(tmp_path, monkeypatch, capsys, argv,
                                                                              message):
    """`python -m infer.bench.kernels --out DIR/missing/k.csv` (or a folder) timed every kernel for minutes, then
    ended in pandas' traceback, the rows lost; --quick, --tuned-out and --tune-m without --tune, --pdl-prefetch
    without --pdl, and --tune / --m / --pdl with --lora or --attention were ignored silently. Each is refused naming
    the flag before the GPU times anything, exit code 2."""
    from infer.bench.kernels import main
    _on_a_gpu_that_never_times(monkeypatch)
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize("out, message", [("missing/m.csv", "missing does not exist"),
                                          ("", "is a folder: give the CSV file to write")])
def test_the_moe_bench_refuses_an_out_it_cannot_write_first(tmp_path, monkeypatch, capsys, out, message):
    """`python -m infer.bench.moe --oai --out DIR/missing/m.csv` timed the experts, then ended in open()'s
    traceback, the rows lost: refused naming --out before the GPU times anything, exit code 2."""
    from infer.bench.moe import main
    _on_a_gpu_that_never_times(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        main(["--oai", "--out", str(tmp_path / out)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("reply", [
    " to=functions.get_time<|channel|>commentary json<|message|>{\"zone\": \"Europe/Paris\"}",
    "to=functions.get_time<|channel|>commentary<|message|>{}",
    " toast, then<|channel|>final<|message|>done",
])
def test_a_harmony_reply_that_starts_with_its_recipient_streams_no_stray_content(reply):
    """gpt-oss's first header may start with its recipient (the prompt ends `<|start|>assistant`, the model writes
    " to=functions.f<|channel|>commentary json<|message|>..."): streamed, its first tokens " to" went out as content
    (they did not yet read as "to="), a content the whole reply does not have. What the stream sends (the tool
    parser's and the reasoning parser's content) is now always a start of the whole reply's content."""
    from infer.serve.reasoning import ReasoningRequest, parts
    req = parse_tools({"tools": TOOLS}, "openai")
    content = split(req, reply)[0]
    reasoning = ReasoningRequest("openai_gptoss")
    whole = parts(reasoning, reply)[1]
    for k in range(len(reply) + 1):
        assert content.startswith(visible(req, reply[:k])), reply[:k]
        assert whole.startswith(parts(reasoning, reply[:k], False)[1]), reply[:k]


def test_an_assistants_reasoning_reaches_thinking_beside_a_null_thinking():
    """An assistant message sent back with its reasoning and "thinking": null (a client that writes every field of
    its message type; a null field is not given, as vLLM reads it) lost the reasoning for gpt-oss's template, which
    reads `thinking`: the null kept it from being filled. It is filled as when thinking is absent."""
    out = chat_messages([{"role": "assistant", "content": "x", "reasoning": "r", "thinking": None},
                         {"role": "assistant", "content": "y", "reasoning_content": "old", "thinking": None}])
    assert [m.get("thinking") for m in out] == ["r", "old"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "pick"}}])
@pytest.mark.parametrize("kind", ["array", "integer", ["array", "null"]])
def test_a_forced_call_of_parameters_that_are_no_object_is_refused(choice, kind):
    """A function whose parameters schema is typed "array" (or "integer"), forced by tool_choice "required" or by
    name, constrained its call's arguments to that type: `[343460083]`, which no client can call a function with
    (a call's arguments are a JSON object). Refused naming the function's tools entry; "auto" and "none", which
    only render the tools, take it as before."""
    from infer.errors import RequestError
    tools = [TOOLS[0], {"type": "function", "function": {"name": "pick", "parameters": {"type": kind}}}]
    with pytest.raises(RequestError, match=r"tools\[1\]\.function\.parameters has type .*: a forced call's "
                                           "arguments are constrained to it") as e:
        parse_tools({"tools": tools, "tool_choice": choice}, "hermes")
    assert e.value.field == "tools"
    assert parse_tools({"tools": tools, "tool_choice": "auto"}, "hermes").mode == "auto"
    assert parse_tools({"tools": tools[:1], "tool_choice": "required"}, "hermes").mode == "required"
