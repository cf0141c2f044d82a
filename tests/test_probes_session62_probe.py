"""Hostile inputs to what session 61 built (multimodal checkpoints served as their text model, the new dense
families, the qwen3_coder / seed_oss / openai tool parsers, classification and scoring, the benchmarks' new flags):
each a crash, a 500 or a wrong result found by a probe, now a clear error or the right answer."""

from __future__ import annotations

import pytest

from infer import LLM
from infer.errors import UnsupportedModelError

from helpers import tiny_llama_with_json


@pytest.mark.parametrize("eos", ["2", True, [2, "x"], 2.0])
def test_a_multimodal_top_level_eos_token_id_of_another_type_is_refused(tmp_path, eos):
    """A multimodal config.json's top-level eos_token_id that is no token id ("2", true, a list holding text) was set
    on the text config, whose typed field raised huggingface_hub's validation error: a traceback out of `infer run`.
    It is now refused naming config.json's field, as a text model's config.json of that value is."""
    folder = tiny_llama_with_json(tmp_path / "mm", "config.json", "tiny-gemma3-mm", eos_token_id=eos)
    with pytest.raises(UnsupportedModelError, match="config.json's eos_token_id .* is not a value "
                                                    "Gemma3ForConditionalGeneration's text model takes"):
        LLM(str(folder), block_size=4)
