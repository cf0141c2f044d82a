"""Session 43 probes of --reasoning-parser (serve/reasoning.py) on a tokenizer whose <think> and </think> are added
tokens of their own, as real reasoning models' are (DeepSeek R1, Qwen3), also marked special (a fine-tune's
tokenizer that added them with add_special_tokens)."""

from __future__ import annotations

import functools
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

from helpers import (forced_chat_body, joined_deltas, streamed_chat_choices,  # noqa: E402
                     tiny_llama_with_added_tokens)

MESSAGES = [{"role": "user", "content": "think, then answer"}]


@pytest.fixture(scope="module")
def special_model(tmp_path_factory):
    return tiny_llama_with_added_tokens(tmp_path_factory.mktemp("s43") / "think-special", ["<think>", "</think>"],
                                        special=True)


@pytest.fixture(scope="module")
def special_engine(special_model):
    return LLMEngine(EngineConfig(special_model, block_size=4, max_num_seqs=4))


_body = functools.partial(forced_chat_body, MESSAGES, max_tokens=40)  # _body(reply, **extra)
_streamed, _joined = streamed_chat_choices, joined_deltas


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_think_tags_that_are_special_tokens_still_split_the_reply(special_engine, parser):
    """The tags were special tokens, which the reply's text leaves out (skip_special_tokens): the parser saw no
    </think> and answered everything as reasoning ("abcxyz", content null), whole and streamed. The tags now stay in
    the text with a reasoning parser (as the hermes tool parser keeps its tags)."""
    tok = special_engine.tokenizer
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    with serve_in_thread(Server(AsyncEngine(special_engine), "think", reasoning_parser=parser)) as base:
        for reply, want in [("<think>abc</think>xyz", ("abc", "xyz")), ("abc</think>xyz", ("abc", "xyz")),
                            ("abc</think>", ("abc", None))]:
            r = httpx.post(f"{base}/v1/chat/completions", json=_body(reply, return_token_ids=True), timeout=120)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert end in c["token_ids"] and (start in c["token_ids"]) == reply.startswith("<think>")  # own tokens
            assert (c["message"]["reasoning"], c["message"]["content"]) == want, reply
            deltas = _streamed(base, _body(reply))
            assert (_joined(deltas, "reasoning"), _joined(deltas, "content")) == (want[0], want[1] or ""), reply
    # without a parser the reply's text is as before: special tokens left out
    with serve_in_thread(Server(AsyncEngine(special_engine), "think")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=_body("<think>abc</think>xyz"), timeout=120)
        assert r.json()["choices"][0]["message"]["content"] == "abcxyz"


# ------------------------------------------------------------------------------------------- infer run
def _line(custom_id: str, reply: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": _body(reply, **body)})


def test_infer_run_splits_the_reasoning_of_openai_batch_lines(special_model, tmp_path):
    """vllm run-batch takes --reasoning-parser and writes each chat.completion's message split as the server's;
    `infer run --reasoning-parser` was "No such option", so a batch of a reasoning model's replies had the think
    block in the content (or, with special tags, lost). Now it splits as infer serve does, reads a line's
    include_reasoning and chat_template_kwargs, and is refused (exit 2) without --output-format openai."""
    from typer.testing import CliRunner
    from infer.cli.main import app
    model = special_model
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([_line("a", "<think>abc</think>xyz"), _line("b", "abc</think>", include_reasoning=False),
                              _line("c", "abc", chat_template_kwargs={"enable_thinking": False}),
                              _line("d", "abc", include_reasoning="no")]) + "\n")
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(app, ["run", model, str(src), "-o", str(out), "-q", "--output-format", "openai",
                                   "--reasoning-parser", "qwen3"])
    assert res.exit_code == 1, res.output  # line d is bad
    recs = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    message = {k: r["response"]["body"]["choices"][0]["message"] for k, r in recs.items() if r["error"] is None}
    assert (message["a"]["reasoning"], message["a"]["content"]) == ("abc", "xyz")
    assert (message["b"]["reasoning"], message["b"]["content"]) == (None, None)
    assert (message["c"]["reasoning"], message["c"]["content"]) == (None, "abc")
    assert "include_reasoning must be a boolean" in recs["d"]["error"]["message"]
    res = CliRunner().invoke(app, ["run", model, str(src), "-o", str(tmp_path / "o2.jsonl"), "--reasoning-parser",
                                   "qwen3"])
    assert res.exit_code == 2 and "--output-format openai" in res.output
    res = CliRunner().invoke(app, ["run", model, str(src), "-o", str(tmp_path / "o3.jsonl"), "--output-format",
                                   "openai", "--reasoning-parser", "step3"])
    assert res.exit_code == 2 and "deepseek_r1 | qwen3" in res.output


# ------------------------------------------------------------------------------------------- reasoning_effort
QWEN3_LIKE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n[effort={{ reasoning_effort }}]"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}")


@pytest.mark.parametrize("effort,kwargs,thinking", [("none", None, False), ("low", None, True),
                                                    ("none", {"enable_thinking": True}, True), (None, None, True)])
def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(special_engine, effort, kwargs, thinking):
    """vLLM passes reasoning_effort to the chat template, and enable_thinking = (reasoning_effort != "none") unless
    chat_template_kwargs sets it: "none" turns Qwen3's thinking off. infer dropped the field (the model thought, and
    the qwen3 parser split a reply that was all answer)."""
    from infer.serve.protocol import parse_chat
    tok = special_engine.tokenizer
    body = {"messages": MESSAGES, "chat_template": QWEN3_LIKE, "reasoning_effort": effort,
            "chat_template_kwargs": kwargs}
    req = parse_chat(body, tok, 4096, trust_template=True, reasoning_parser="qwen3")
    prompt = tok.decode(req.prompts[0], skip_special_tokens=False)
    assert f"[effort={effort or ''}]" in prompt
    assert prompt.endswith("</think>\n\n") is not thinking
    assert req.reasoning.ended is not thinking  # the reply is all content when thinking is off


def test_a_bad_reasoning_effort_is_refused_naming_it(special_engine):
    with serve_in_thread(Server(AsyncEngine(special_engine), "think", reasoning_parser="qwen3")) as base:
        for bad in ["extreme", 3]:
            r = httpx.post(f"{base}/v1/chat/completions", json=_body("abc", reasoning_effort=bad), timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
        r = httpx.post(f"{base}/v1/chat/completions", json=_body("abc", reasoning_effort="high"), timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["reasoning"] == "abc", r.text
