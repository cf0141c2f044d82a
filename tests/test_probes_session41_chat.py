"""Session 41 probes of chat templates across model families (Llama-2/3.1, Mistral, Gemma, Phi-3, Qwen2.5/3,
DeepSeek-R1, ChatML) and of vLLM's chat options, compared with transformers' apply_chat_template and vLLM's
handling of the same request."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli.main import app
from infer.models.tiny import ensure_builtin

runner = CliRunner()


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_an_inline_command_line_template_has_its_escapes_decoded_as_vllm(tmp_path):
    """`--chat-template '{% for m in messages %}{{ m.content }}\\n{% endfor %}'` (the template text on the command
    line, where the shell leaves `\\n` as a backslash and an n) rendered the two characters into the prompt; vLLM's
    load_chat_template decodes an inline template's escapes, so the same command line gave another prompt there.
    Non-ASCII text stays as typed; a file's text is read as it is; a bad escape is refused naming the option."""
    from transformers import AutoTokenizer
    model = str(ensure_builtin("tiny-llama"))
    typed = "{% for m in messages %}{{ m['content'] }}\\n{% endfor %}é=>"
    real = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}é=>"
    messages = [{"role": "user", "content": "hello"}, {"role": "user", "content": "again"}]
    tok = AutoTokenizer.from_pretrained(model)
    want = tok.apply_chat_template(messages, chat_template=real, tokenize=True, return_dict=True,
                                   add_generation_prompt=True)["input_ids"]
    inp = _write(tmp_path / "in.jsonl", [{"id": "a", "messages": messages, "max_new_tokens": 1,
                                          "prompt_logprobs": 0}])
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["run", model, str(inp), "-o", str(out), "-q", "--chat-template", typed])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert rec["error"] is None and rec["usage"]["prompt_tokens"] == len(want), tok.decode(want)
    assert [p["token_id"] for p in rec["prompt_logprobs"][1:]] == list(want[1:])
    path = tmp_path / "t.jinja"  # a file's backslashes are the template's own
    path.write_text(typed)
    res = runner.invoke(app, ["run", model, str(inp), "-o", str(tmp_path / "f.jsonl"), "-q", "--chat-template",
                              str(path)])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "f.jsonl").read_text())["usage"]["prompt_tokens"] != len(want)
    res = runner.invoke(app, ["run", model, str(inp), "-o", str(tmp_path / "b.jsonl"), "-q", "--chat-template",
                              "{{ messages[0]['content'] }}\\x4"])
    assert res.exit_code == 2 and "--chat-template" in res.output and "escape" in res.output, res.output


# llava-hf's style (llava-1.5, llava-onevision, Emu3...): the parts of one type, through a filter
SELECT = ("{% for message in messages %}{{ message['role'].upper() + ': ' }}"
          "{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] + ' ' }}{% endfor %}"
          "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
SLICED = ("{% for message in messages %}{% set parts = message.content[0:] | list %}{% for p in parts %}"
          "<{{ p.text }}>{% endfor %}{% endfor %}{% if add_generation_prompt %}=>{% endif %}")


@pytest.mark.parametrize("template", [SELECT, SLICED], ids=["selectattr", "slice-then-filter"])
def test_a_template_that_filters_the_parts_gets_them_as_parts(template, monkeypatch):
    """vLLM's content-format detection sees a loop over `message['content'] | selectattr(...)` (or a slice of it,
    or a variable set from such) as a loop over the parts ("openai" format); infer looked for the bare
    `message['content']` only, gave such a template the string, whose characters the filter dropped: the user's
    words were silently missing from the prompt in every entry point."""
    from transformers import AutoTokenizer
    from infer.engine.inputs import encode_prompt, parse_request, reads_content_parts
    from infer.serve.protocol import parse_chat, tokenize
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))
    monkeypatch.setattr(tok, "chat_template", template)
    assert reads_content_parts(tok)
    messages = [{"role": "user", "content": "Hello there"}]
    want = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
                                   tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
    assert "Hello there" in tok.decode(want)
    for got in (encode_prompt(tok, messages=messages), parse_chat({"messages": messages}, tok).prompts[0],
                tokenize({"messages": messages}, tok, 4096)[1]["tokens"],
                parse_request({"messages": messages}, tok, "0").prompt_token_ids):
        assert list(got) == list(want), tok.decode(got)


# Llama 3.1-3.3's test for a tool-call turn (trimmed): the key's presence, whatever its value
LLAMA31_CALLS = ("{% for message in messages %}{% if 'tool_calls' in message %}"
                 "{% if not message.tool_calls|length == 1 %}"
                 "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
                 "CALL {{ message.tool_calls[0].function.name }}\n{% else %}{{ message['role'] }}: "
                 "{{ message['content'] | trim }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def test_null_fields_of_a_message_do_not_reach_the_template(monkeypatch):
    """A client that sends back the assistant message it got (the OpenAI SDK's `message.model_dump()`) sends
    `tool_calls: null`, `refusal: null`, `function_call: null`, `audio: null`. vLLM gives the template the message
    without them; infer passed them on, and Llama 3.x's template, which asks `'tool_calls' in message`, refused the
    conversation ("object of type 'NoneType' has no len()": a 400) with transformers 4 (transformers 5 drops null
    fields itself). What the template is given is checked here, whatever transformers does with it."""
    from transformers import AutoTokenizer
    from infer.engine.inputs import encode_prompt, parse_request
    from infer.serve.protocol import parse_chat, tokenize
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))
    monkeypatch.setattr(tok, "chat_template", LLAMA31_CALLS)
    given = []
    real = type(tok).apply_chat_template

    def spy(self, conversation, *args, **kwargs):
        given.append(conversation)
        return real(self, conversation, *args, **kwargs)
    monkeypatch.setattr(type(tok), "apply_chat_template", spy)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello!", "tool_calls": None, "refusal": None,
                 "function_call": None, "audio": None, "name": None},
                {"role": "user", "content": "again"}]
    want = tok("user: hi\nassistant: Hello!\nuser: again\nassistant:", add_special_tokens=False)["input_ids"]
    for got in (encode_prompt(tok, messages=messages), parse_chat({"messages": messages}, tok).prompts[0],
                tokenize({"messages": messages}, tok, 4096)[1]["tokens"],
                parse_request({"messages": messages}, tok, "0").prompt_token_ids):
        assert list(got) == want, tok.decode(got)
    assert given and all(None not in m.values() for conv in given for m in conv), given[-1]
    assert given[-1][1] == {"role": "assistant", "content": "Hello!"}
    assert messages[1]["tool_calls"] is None  # the caller's messages are left as they were


@pytest.mark.parametrize("flag, words", [
    (["--chat-template-content-format", "string"], "content format"),
    (["--default-chat-template-kwargs", '{"enable_thinking": false}'], "chat_template_kwargs"),
    (["--response-role", "bot"], "assistant"),
], ids=["content-format", "default-kwargs", "response-role"])
def test_vllms_chat_options_say_what_to_do(flag, words):
    """vLLM's chat options of `vllm serve` were "No such option (Possible options: --chat-template)", a guess that
    points a vLLM user at another option; they now say what infer does instead, as vLLM's other options do."""
    res = runner.invoke(app, ["serve", "tiny-llama", *flag])
    assert res.exit_code == 2
    assert "is vLLM's option" in res.output and words in res.output, res.output
    assert "Possible options" not in res.output


# templates that loop over the parts with transformers' Jinja extensions: loop controls, the {% generation %} tag
# (templates written for assistant-token masks in training)
BREAKS = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for part in message['content'] %}"
          "{% if part['type'] != 'text' %}{% continue %}{% endif %}{{ part['text'] }}{% endfor %}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GENERATION = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
              "{% generation %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}<|im_end|>\n"
              "{% endgeneration %}{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
              "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [BREAKS, GENERATION], ids=["continue", "generation-tag"])
def test_a_template_with_transformers_jinja_extensions_gets_its_content_format(template, monkeypatch):
    """infer parsed the template in a plain Jinja environment to find its content format: a template with
    `{% continue %}` / `{% break %}` or transformers' `{% generation %}` tag did not parse there, was taken as
    printing the content, got the string, looped over its characters and rendered empty turns (the user's words
    missing). vLLM parses it in transformers' environment, finds the loop, and gives it the parts."""
    from transformers import AutoTokenizer
    from infer.engine.inputs import encode_prompt, reads_content_parts
    from infer.serve.protocol import parse_chat
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))
    monkeypatch.setattr(tok, "chat_template", template)
    assert reads_content_parts(tok)
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": "again"}]
    want = tok("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi<|im_end|>\n"
               "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert encode_prompt(tok, messages=messages) == want
    assert parse_chat({"messages": messages}, tok).prompts[0] == want
