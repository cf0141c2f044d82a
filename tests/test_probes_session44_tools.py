"""Probes of the forty-fourth session (tools: tool calls on `infer serve`'s chat endpoint, streamed and whole, as
the official OpenAI SDK reads them and as vLLM answers them)."""

from __future__ import annotations

import re
import shutil

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

MESSAGES = [{"role": "user", "content": "add 1 and 2"}]


class Add(pydantic.BaseModel):
    a: int
    b: int


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools44") / "tiny-tools"
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    return LLMEngine(EngineConfig(str(path), block_size=4, max_num_seqs=4))


def test_the_sdks_stream_helper_ends_each_streamed_call_and_parses_its_arguments(engine):
    """openai-python's `chat.completions.stream` (the helper its docs show for tools) emits
    `tool_calls.function.arguments.done`, with the parsed arguments of a strict (pydantic) tool, for a call it saw in
    a chunk before the choice's finish. infer sent the calls and finish_reason "tool_calls" in one chunk, so the
    helper never ended the last call: a client waiting for that event got none, though the final completion had it.
    OpenAI streams the finish alone, with an empty delta."""
    tool = openai.pydantic_function_tool(Add, name="add")
    reply = ('Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tools", tool_parser="hermes")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        kw = dict(model="tiny-tools", messages=MESSAGES, max_tokens=200, temperature=0, tools=[tool],
                  extra_body={"guided_regex": re.escape(reply)})
        whole = client.chat.completions.parse(**kw).choices[0]
        with client.chat.completions.stream(**kw) as stream:
            done = [(e.index, e.name, e.parsed_arguments) for e in stream
                    if e.type == "tool_calls.function.arguments.done"]
            final = stream.get_final_completion().choices[0]
    assert done == [(0, "add", Add(a=1, b=2)), (1, "add", Add(a=3, b=4))]
    assert whole.finish_reason == final.finish_reason == "tool_calls"
    assert whole.message.content == final.message.content == "Sure. "
    assert [c.function.parsed_arguments for c in final.message.tool_calls] == [
        c.function.parsed_arguments for c in whole.message.tool_calls]
