"""Session 63 (p63rparse): review of the new reasoning parsers (olmo3, ernie45, glm45, apertus, cohere_command,
granite) against vLLM's and the real models' templates; the new refusals of history tool-call arguments."""

from __future__ import annotations

import pytest

from infer.serve.reasoning import ReasoningRequest, prompt_ends_reasoning, reasoning_request, split

from helpers import check_stream_adds_up, forced_chat_body, joined_deltas, streamed_chat_choices
from test_probes_session63_parse import engine  # noqa: F401  (the served tiny model with their special tokens)

# special tokens of the real tokenizers: GLM-4.5's roles, Hunyuan's answer tags, Magistral's turns and think tags
GLM_SPECIAL = ["<|user|>", "<|assistant|>", "<answer>", "</answer>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]",
               "[/INST]", "[THINK]", "[/THINK]"]


@pytest.fixture(scope="module")
def glm_tokenizer(tmp_path_factory):
    """tiny-llama's tokenizer with GLM_SPECIAL added as special tokens."""
    from infer.engine.setup import load_tokenizer
    from infer.models.tiny import ensure_builtin
    tok = load_tokenizer(str(ensure_builtin("tiny-llama")))
    tok.add_special_tokens({"additional_special_tokens": GLM_SPECIAL})
    return tok


@pytest.mark.parametrize("parser,text,want", [
    ("glm45", "\n<think>abc</think>\nxyz", ("abc", "\nxyz")),  # GLM-4.5 writes "\n<think>" after <|assistant|>
    ("glm45", " \n<think>abc", ("abc", None)),
    ("glm45", "\n", (None, "\n")),
    ("deepseek_r1", "\n<think>abc</think>xyz", ("abc", "xyz")),  # vLLM's whole reply drops what precedes <think>
    ("apertus", "\n<|inner_prefix|>abc<|inner_suffix|>xyz", ("abc", "xyz")),
])
def test_whitespace_before_the_opening_tag_still_opens_the_block(parser, text, want):
    """GLM-4.5's template ends its prompt with <|assistant|> and its earlier turns with "<|assistant|>\\n<think>":
    the reply starts "\\n<think>", which was all content, tags and all (vLLM's glm45 finds the tag's token anywhere)."""
    assert split(ReasoningRequest(parser), text) == want
    check_stream_adds_up(ReasoningRequest(parser), text)


def test_an_earlier_turns_closed_block_does_not_end_the_replys(glm_tokenizer):
    """GLM-4.5's template writes "<think></think>" in each earlier assistant turn: a short last user message left it
    in the prompt's last tokens, which read as thinking off, and the reply's reasoning became content. vLLM's glm45
    reads back to the last <|assistant|>; the last turn is what follows the last special token."""
    tok = glm_tokenizer
    earlier = "<|user|>hi<|assistant|>\n<think></think>\nHello.<|user|>and?<|assistant|>"
    ids = tok.encode(earlier)
    assert not prompt_ends_reasoning(ids, tok, "glm45")
    req = reasoning_request("glm45", {}, ids, tok)
    assert split(req, "\n<think>abc</think>\nxyz") == ("abc", "\nxyz")
    off = tok.encode(earlier + "\n<think></think>")  # thinking off: the template closes the block in this turn
    assert prompt_ends_reasoning(off, tok, "glm45") and reasoning_request("glm45", {}, off, tok).ended
    # Magistral's system prompt shows its format, "[THINK]...[/THINK]Here, provide a self-contained response.": a
    # short question left its [/THINK] in the prompt's last tokens, and the reply's reasoning became content
    magistral = tok.encode("[SYSTEM_PROMPT]Think:[THINK]draft[/THINK]Answer.[/SYSTEM_PROMPT][INST]hi[/INST]")
    assert not reasoning_request("mistral", {}, magistral, tok).ended
    hunyuan = tok.encode("<|user|>hi<|assistant|><think>\n\n</think>\n<answer>\n")  # its no-think prompt
    assert prompt_ends_reasoning(hunyuan, tok, "hunyuan_a13b")  # (<answer>: its reply's tag, no turn's boundary)
    r1 = tok.encode("<|user|>hi<|assistant|><think>\n\n</think>\n\nHello.<|user|>and?<|assistant|><think>\n")
    assert not prompt_ends_reasoning(r1, tok, "deepseek_r1")


CONTINUED = [{"role": "user", "content": "think, then answer"}]


@pytest.mark.parametrize("parser,written,reply,want", [
    ("glm45", "<think>ab", "c</think>xyz", ("c", "xyz")),
    ("cohere_command", "<|START_THINKING|>ab", "c<|END_THINKING|><|START_RESPONSE|>xyz<|END_RESPONSE|>", ("c", "xyz")),
    ("apertus", "<|inner_prefix|>ab", "c<|inner_suffix|>xyz", ("c", "xyz")),
    ("glm45", "<think>ab</think>x", "yz", (None, "yz")),  # the block closed: the continuation is answer
])
def test_a_continued_message_whose_block_is_open_continues_as_reasoning(glm_tokenizer, parser, written, reply, want):
    """continue_final_message on an assistant message that opened its block (glm45, apertus, cohere_command: the
    parsers whose reply must open it): the continuation was all content, the closing tag and the answer's wrapper
    in it; it is reasoning up to the closing tag, as deepseek_r1's (whose template opens the block)."""
    body = {"messages": [*CONTINUED, {"role": "assistant", "content": written}], "continue_final_message": True,
            "add_generation_prompt": False}
    ids = glm_tokenizer.encode("<|user|>think, then answer<|assistant|>")  # (the prompt's end: no tag)
    req = reasoning_request(parser, body, ids, glm_tokenizer)
    assert split(req, reply) == want
    check_stream_adds_up(req, reply)
    assert not reasoning_request(parser, {**body, "continue_final_message": False}, ids, glm_tokenizer).opened


def test_a_prompt_that_opens_the_block_makes_the_reply_reasoning(glm_tokenizer):
    """A template that ends the prompt with the opening tag (the reply then never writes it) splits the reply as
    deepseek_r1's; a prompt that opens none leaves glm45's rule (no <think>: all content)."""
    opened = glm_tokenizer.encode("<|user|>hi<|assistant|>\n<think>")
    req = reasoning_request("glm45", {}, opened, glm_tokenizer)
    assert req.opened and split(req, "abc</think>xyz") == ("abc", "xyz")
    plain = reasoning_request("glm45", {}, glm_tokenizer.encode("<|user|>hi<|assistant|>"), glm_tokenizer)
    assert not plain.opened and split(plain, "abc</think>xyz") == (None, "abc</think>xyz")


def test_a_server_continues_an_open_block_as_reasoning_whole_and_streamed(engine):
    """cohere_command on the chat endpoint: an assistant message "<|START_THINKING|>ab" continued; the reply's
    reasoning and answer, whole and streamed (its special tokens kept for the split)."""
    httpx = pytest.importorskip("httpx")
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    messages = [*CONTINUED, {"role": "assistant", "content": "<|START_THINKING|>ab"}]
    body = forced_chat_body(messages, "c<|END_THINKING|><|START_RESPONSE|>xyz<|END_RESPONSE|>", 60,
                            continue_final_message=True, add_generation_prompt=False)
    with serve_in_thread(Server(AsyncEngine(engine), "tiny", reasoning_parser="cohere_command")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("c", "xyz")
        deltas = streamed_chat_choices(base, body)
        assert (joined_deltas(deltas, "reasoning"), joined_deltas(deltas, "content")) == ("c", "xyz")
