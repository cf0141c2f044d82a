"""Session 39 probes of how chat messages become token ids (LLM.chat, the server's chat and /tokenize, `infer run`
lines, bench datasets), compared with vLLM: it renders with apply_chat_template(tokenize=False) and tokenizes
the text with add_special_tokens=False, and gives a template that loops over a message's content (its "openai"
content format) every content as a list of parts."""

from __future__ import annotations

import pytest

from infer.bench.datasets import _render
from infer.engine.inputs import encode_prompt, parse_request, reads_content_parts
from infer.models.tiny import ensure_builtin
from infer.serve.protocol import parse_chat, tokenize

# a template that only loops over the parts (idefics2 / llava style): a string content has no parts to loop over
LOOPS = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for part in message['content'] %}"
         "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def tok(monkeypatch):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-qwen2")))
    return t


def _every_entry_point(tok, messages) -> list[list[int]]:
    return [encode_prompt(tok, messages=messages),
            parse_chat({"messages": messages}, tok).prompts[0],
            tokenize({"messages": messages}, tok, 4096)[1]["tokens"],
            parse_request({"messages": messages}, tok, "0").prompt_token_ids,
            parse_request({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": messages}}, tok, "0").prompt_token_ids,
            _render(tok, {"messages": messages}, "line 1")[1]]


def test_string_content_reaches_a_template_that_loops_over_the_parts(tok, monkeypatch):
    """A template that loops over `message['content']` got a string content as the string: its loop went over the
    characters, found no text part, and the user's words were silently dropped from the prompt (an empty turn),
    in every entry point. vLLM gives such a template every content as a list of parts: a string is one text part,
    a null content (an assistant's tool call) none."""
    monkeypatch.setattr(tok, "chat_template", LOOPS)
    assert reads_content_parts(tok)
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "again"}]}]
    as_vllm = [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]},
               {"role": "assistant", "content": []}, messages[2]]
    want = tok(tok.apply_chat_template(as_vllm, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    assert "Hello there" in tok.decode(want)
    for got in _every_entry_point(tok, messages):
        assert got == want, tok.decode(got)


def test_tools_in_chat_template_kwargs_point_at_the_tools_field(tok):
    """`chat_template_kwargs: {"tools": [...]}` was refused as "an argument of the tokenization, not a variable of
    the template": tools is the request's own field, which the error now names (as it does add_generation_prompt)."""
    from infer.serve.protocol import ApiError
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": tools}}, tok)
    assert "cannot set tools" in e.value.message and "send tools as a field of the request" in e.value.message
    assert "tokenization" not in e.value.message


# Llama-3.1's rule on an assistant turn with tool_calls (trimmed): exactly one call, its arguments as JSON
ONE_CALL = ("{% for message in messages %}{% if 'tool_calls' in message %}{% if not message.tool_calls|length == 1 %}"
            "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
            "{% set fn = message.tool_calls[0].function %}<|im_start|>assistant\n"
            "{\"name\": \"{{ fn.name }}\", \"parameters\": {{ fn.arguments | tojson }}}<|im_end|>\n"
            "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("calls, turn", [
    ([], "ok"),  # an empty list (clients that always send the field): a plain assistant turn
    ([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}], '{"name": "f", "parameters": {}}'),
    ([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": None}}],
     '{"name": "f", "parameters": {}}'),
    ([{"id": "c1", "type": "function", "function": {"name": "f"}}], '{"name": "f", "parameters": {}}'),
], ids=["empty-list", "empty-arguments", "null-arguments", "no-arguments"])
def test_assistant_tool_calls_reach_the_template_as_vllm_gives_them(tok, monkeypatch, calls, turn):
    """vLLM drops an assistant's empty `tool_calls` list and gives a call without arguments (null, "" or none)
    `{}`. infer passed both as sent: Llama-3.1's template refused the conversation ("only supports single
    tool-calls") for `tool_calls: []`, and rendered `"parameters": ""` or `null` for a call without arguments."""
    monkeypatch.setattr(tok, "chat_template", ONE_CALL)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "tool_calls": calls},
                {"role": "user", "content": "x"}]
    want = tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + turn + "<|im_end|>\n"
               "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for got in _every_entry_point(tok, messages):
        assert got == want, tok.decode(got)
    assert messages[1]["tool_calls"] == calls  # the caller's messages are left as they were


@pytest.mark.parametrize("loops", [False, True], ids=["prints-content", "loops-over-parts"])
def test_responses_style_text_parts_are_text(tok, monkeypatch, loops):
    """vLLM's chat reads `input_text` and `output_text` parts (the Responses API's) as text; infer refused them with
    "only text parts are supported", which they are."""
    if loops:
        monkeypatch.setattr(tok, "chat_template", LOOPS)
    sent = [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}]
    same = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]}]
    want = encode_prompt(tok, messages=same)
    assert "Hello" in tok.decode(want) and "Hi" in tok.decode(want)
    for got in _every_entry_point(tok, sent):
        assert got == want, tok.decode(got)


def test_a_template_that_is_not_jinja_is_named_not_the_messages(tok, monkeypatch, tmp_path):
    """A model whose own chat template does not parse failed every chat with "the chat template cannot render these
    messages: unexpected '}'", which blames the messages; it now says the template is not valid Jinja (its line) and
    how to give another, and a request's own chat_template (--trust-request-chat-template) is a 400 naming that
    field. A template's refusal of the messages (raise_exception) keeps its message."""
    from infer.errors import ConfigError, RequestError
    from infer.serve.protocol import ApiError
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}\n{{ m.content }")
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(RequestError, match=r"^this model's chat template is not valid Jinja \(line 2\)") as e:
        encode_prompt(tok, messages=messages)
    assert "--chat-template" in e.value.hint
    with pytest.raises(ApiError, match="this model's chat template is not valid Jinja") as e:
        parse_chat({"messages": messages}, tok)
    assert e.value.status == 400 and e.value.param == "messages"
    with pytest.raises(ConfigError, match="line 1: this model's chat template is not valid Jinja"):
        _render(tok, {"messages": messages}, "line 1")
    monkeypatch.setattr(tok, "chat_template", LOOPS)
    with pytest.raises(ApiError, match="the request's chat_template is not valid Jinja") as e:
        parse_chat({"messages": messages, "chat_template": "{{ x"}, tok, trust_template=True)
    assert e.value.status == 400 and e.value.param == "chat_template"
    monkeypatch.setattr(tok, "chat_template", "{{ raise_exception('System role not supported') }}")
    with pytest.raises(ApiError, match="^the chat template cannot render these messages: System role not supported"):
        parse_chat({"messages": messages}, tok)


LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
          "{% for message in messages %}{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}")


def test_a_bos_template_with_a_bos_tokenizer_gives_one_bos_everywhere():
    """Guard (no defect found): a Llama-2-style template that writes bos_token, with a tokenizer that adds BOS to
    text, gives the BOS once in every entry point, and special-token text inside a user's content is the special
    token, as vLLM's rendering then tokenizing without special tokens gives them; a text prompt gets its BOS."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast
    from infer.models.tiny import _tokenizer_json
    from infer.serve.protocol import parse_completion
    backend = Tokenizer.from_str(_tokenizer_json(256))
    backend.add_special_tokens(["<s>", "</s>", "[INST]", "[/INST]"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", backend.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = LLAMA2
    bos = tok.convert_tokens_to_ids("<s>")
    messages = [{"role": "user", "content": "Hi <|im_end|> [/INST]"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    want = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert want[:2] == [bos, tok.convert_tokens_to_ids("[INST]")] and want.count(bos) == 2  # one per user turn
    assert tok.convert_tokens_to_ids("<|im_end|>") in want and want.count(tok.convert_tokens_to_ids("[/INST]")) == 3
    for got in _every_entry_point(tok, messages):
        assert got == want, tok.convert_ids_to_tokens(got)
    text = parse_completion({"prompt": "hello"}, tok).prompts[0]
    assert text == tok("hello")["input_ids"] and text[0] == bos and text.count(bos) == 1
    assert parse_request({"prompt": "hello"}, tok, "0").prompt_token_ids == text


def test_named_templates_content_format_is_the_one_rendered(tok, monkeypatch):
    """A tokenizer with named templates (Hermes / Command-R style: "default" and "tool_use") renders a request with
    tools with "tool_use", but infer found the content format from "default": a "tool_use" template that loops over
    the parts got the text joined into one string and rendered an empty turn. vLLM finds the format of the template
    it renders with."""
    named = {"default": tok.chat_template, "tool_use": "{{ tools | length }}" + LOOPS}
    monkeypatch.setattr(tok, "chat_template", named)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    want = tok(tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    assert tok.decode(want).startswith("1<|im_start|>user\nonetwo<|im_end|>")
    assert encode_prompt(tok, messages=messages, template={"tools": tools}) == want
    assert parse_chat({"messages": messages, "tools": tools, "tool_choice": "none"}, tok).prompts[0] == want
    assert tokenize({"messages": messages, "tools": tools}, tok, 4096)[1]["tokens"] == want
    plain = encode_prompt(tok, messages=messages)  # no tools: "default", which prints the content (joined)
    assert "one\ntwo" in tok.decode(plain)
