"""Session 63 (p63rparse): review of the new reasoning parsers (olmo3, ernie45, glm45, apertus, cohere_command,
granite) against vLLM's and the real models' templates; the new refusals of history tool-call arguments."""

from __future__ import annotations

import pytest

from infer.serve.reasoning import ReasoningRequest, prompt_ends_reasoning, reasoning_request, split

from helpers import check_stream_adds_up

GLM_SPECIAL = ["<|user|>", "<|assistant|>"]  # GLM-4.5's role tokens: special tokens of its tokenizer


@pytest.fixture(scope="module")
def glm_tokenizer(tmp_path_factory):
    """tiny-llama's tokenizer with GLM-4.5's role tokens added as special tokens."""
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
    r1 = tok.encode("<|user|>hi<|assistant|><think>\n\n</think>\n\nHello.<|user|>and?<|assistant|><think>\n")
    assert not prompt_ends_reasoning(r1, tok, "deepseek_r1")
