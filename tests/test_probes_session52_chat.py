"""Session 52 probes of chat templates as real models ship them (Qwen3, DeepSeek-R1...), through the entry points
that render one, compared with transformers' apply_chat_template."""

from __future__ import annotations

import json

import pytest

from infer.models.tiny import ensure_builtin

# Qwen3's handling of the reasoning of earlier turns: an assistant turn before the last user message is rendered
# without its <think> block
QWEN3_HISTORY = (
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))


def test_reasoning_the_template_drops_from_history_does_not_make_the_chat_too_long(tok, monkeypatch):
    """A conversation sent back with an earlier turn's long <think> reasoning (what a reasoning model's reply holds)
    was refused as longer than the context by the sum of its contents, though Qwen3's and DeepSeek-R1's templates
    drop that reasoning and the rendered prompt is a few tokens: vLLM renders it and answers. Every entry point
    (LLM.chat, infer run, the server's chat and /tokenize) shares encode_prompt; the chat is measured as rendered."""
    from infer.engine.inputs import encode_prompt
    from infer.engine.prompt_size import longest_token_bytes
    from infer.serve.protocol import parse_chat
    context = 200
    thought = "<think>" + "ab " * (longest_token_bytes(tok) * 2 * context) + "</think>"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": thought + "ok"},
                {"role": "user", "content": "again"}]
    want = tok.apply_chat_template(messages, chat_template=QWEN3_HISTORY, tokenize=True, return_dict=True,
                                   add_generation_prompt=True)["input_ids"]
    assert len(want) < context
    assert encode_prompt(tok, messages=messages, max_tokens=context,
                         template={"chat_template": QWEN3_HISTORY}) == list(want)
    monkeypatch.setattr(tok, "chat_template", QWEN3_HISTORY)
    assert parse_chat({"messages": messages}, tok, context).prompts[0] == list(want)


def test_a_chat_whose_rendering_is_too_long_is_still_refused_untokenized(tok):
    """The rendered text, not the contents, is what is measured: a long chat the template keeps is refused."""
    from infer.engine.inputs import encode_prompt
    from infer.engine.prompt_size import PromptTooLongError, longest_token_bytes
    messages = [{"role": "user", "content": "ab " * (longest_token_bytes(tok) * 2 * 200)}]
    with pytest.raises(PromptTooLongError):
        encode_prompt(tok, messages=messages, max_tokens=200, template={"chat_template": QWEN3_HISTORY})


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _calibration_and_served(tok, tmp_path, messages: list[dict]) -> tuple[str, str]:
    """The text `infer quantize --calibration` reads from a chats.jsonl of `messages`, and the text the server renders
    of them (no generation prompt)."""
    from infer.engine.inputs import encode_prompt
    from infer.quant.calibration import chat_renderer, read_texts
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    [text] = read_texts(path, chat_renderer(tok))
    return text, tok.decode(encode_prompt(tok, messages=messages, template={"add_generation_prompt": False}))


def test_a_calibration_chat_of_text_parts_renders_as_infer_run_renders_it(tok, tmp_path, monkeypatch):
    """`infer quantize --calibration chats.jsonl`: a message of several text parts was joined with nothing between
    them ("first partsecond part"), where infer run, the server and vLLM join them with a newline for a template
    that renders content as a string: the calibration text was not the conversation the model is served."""
    monkeypatch.setattr(tok, "chat_template", CHATML)
    messages = [{"role": "user", "content": [{"type": "text", "text": "first part"},
                                             {"type": "text", "text": "second part"}]},
                {"role": "assistant", "content": "ok"}]
    text, served = _calibration_and_served(tok, tmp_path, messages)
    assert "first part\nsecond part" in text
    assert text == served


# Gemma 3's way with content: a string is trimmed, a list's text parts are trimmed and written one after another
GEMMA3_CONTENT = ("{%- for message in messages -%}{{ '<start_of_turn>' + message['role'] + '\n' }}"
                  "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
                  "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}"
                  "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\n' }}"
                  "{%- endfor -%}")
# a template that only loops over the parts (SmolVLM's, Idefics3's): a string's characters are no parts
PARTS_ONLY = ("{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}{% if p['type'] == 'text' %}"
              "{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}")


@pytest.mark.parametrize("template", [GEMMA3_CONTENT, PARTS_ONLY], ids=["gemma3", "parts-only"])
def test_a_calibration_chat_reaches_a_template_that_loops_over_parts_as_parts(tok, tmp_path, monkeypatch, template):
    """Calibration chats reached every template as strings: one that only loops over a message's parts rendered no
    words at all (a calibration set of role names), and Gemma 3's got the parts joined, not its own rendering of
    them. They now get the content format infer run and the server give them (vLLM's, found in the template)."""
    monkeypatch.setattr(tok, "chat_template", template)
    messages = [{"role": "user", "content": [{"type": "text", "text": "first part"},
                                             {"type": "text", "text": "second part"}]},
                {"role": "assistant", "content": "a plain string"}]
    text, served = _calibration_and_served(tok, tmp_path, messages)
    assert "a plain string" in text and "second part" in text
    assert text == served


@pytest.mark.parametrize("template", [CHATML, PARTS_ONLY], ids=["string", "parts"])
def test_a_function_call_output_of_parts_is_the_tool_messages_content(tok, monkeypatch, template):
    """/v1/responses: a function_call_output whose output is a list of input_text parts was glued into one string
    ("sunnywarm"), where vLLM gives it to the chat as the tool message's content: joined by newlines for a template
    that renders a string, the parts themselves for one that loops over them (as the same chat through
    /v1/chat/completions renders)."""
    from infer.serve.protocol import parse_chat
    from infer.serve.responses import to_chat
    monkeypatch.setattr(tok, "chat_template", template)
    parts = [{"type": "input_text", "text": "sunny"}, {"type": "input_text", "text": "warm"}]
    body = {"input": [{"role": "user", "content": "weather?"},
                      {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": parts}]}
    chat = {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"},
                                                                            {"type": "text", "text": "warm"}]}]}
    want = parse_chat(chat, tok, 4096).prompts[0]
    assert parse_chat(to_chat(body), tok, 4096).prompts[0] == want
    if template == CHATML:
        assert "sunny\nwarm" in tok.decode(want)
