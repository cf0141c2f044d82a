"""Session 52 probes of chat templates as real models ship them (Qwen3, DeepSeek-R1...), through the entry points
that render one, compared with transformers' apply_chat_template."""

from __future__ import annotations

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
