"""Model families and config variants against transformers 5 (session 40): each test fails without its fix."""

from __future__ import annotations

import json

import pytest

from infer import LLM, SamplingParams
from infer.errors import ConfigError, UnsupportedModelError

from test_model_variants import build
from test_probes_configs_s18 import assert_fills_its_context_as_transformers


def _patch(folder, **fields):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_heads_not_a_multiple_of_the_kv_heads_are_refused_when_loading(tmp_path):
    """num_attention_heads 4 over num_key_value_heads 3 loaded, and every request then ended with finish_reason
    'error' (transformers fails at the first forward too): refused when config.json is read, naming both fields."""
    build(tmp_path, "llama")
    _patch(tmp_path, num_key_value_heads=3, head_dim=16)
    with pytest.raises(UnsupportedModelError, match="num_attention_heads 4.*num_key_value_heads 3"):
        LLM(str(tmp_path), block_size=4)


def test_a_rope_parameter_transformers_cannot_compute_is_refused_naming_the_rope(tmp_path):
    """A linear rope whose factor is the string "2" (transformers only warns when it reads config.json) reached the
    user as a raw TypeError from transformers' rope function: refused now as an UnsupportedModelError naming the
    rope parameters."""
    build(tmp_path, "llama")
    _patch(tmp_path, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": "2"})
    with pytest.raises(UnsupportedModelError, match="linear rope parameters.*'factor': '2'"):
        LLM(str(tmp_path), block_size=4)


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0], "long_factor": [1.0, 2, 4, 8, 16, 24, 32, 48]}


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_longrope_equals_transformers_up_to_original_max_position_embeddings(tmp_path, model_type):
    """rope_type longrope was refused. Up to original_max_position_embeddings transformers rotates with the short
    factors times the attention factor (from max_position_embeddings / original), and past it rotates the whole
    sequence with the long ones (keys already cached included), which a paged KV cache cannot: the context is capped
    at original_max_position_embeddings, and within it the tokens and logprobs are transformers'."""
    build(tmp_path, model_type, rope_parameters=dict(LONGROPE))
    assert_fills_its_context_as_transformers(tmp_path, 64)


def test_a_max_model_len_past_longropes_original_positions_is_refused_naming_the_field(tmp_path):
    build(tmp_path, "llama", rope_parameters=dict(LONGROPE))
    with pytest.raises(ConfigError, match="limit of 64.*original_max_position_embeddings"):
        LLM(str(tmp_path), block_size=4, max_model_len=100)


def test_a_prompt_past_a_sliding_window_cap_is_refused_naming_the_window(tmp_path):
    """A Llama whose sliding_window (40) is below max_position_embeddings (256) has its context capped at the
    window (Mistral's no longer: its attention slides); a longer prompt was refused with "40 tokens is the model's
    limit", a number a user reads as wrong for a model of 256 positions: the hint names sliding_window now, as
    --max-model-len's refusal does."""
    from infer.errors import RequestError
    build(tmp_path, "llama", sliding_window=40)
    llm = LLM(str(tmp_path), block_size=4)
    with pytest.raises(RequestError, match=r"40 tokens is the model's limit \(its sliding_window.*is 256\)"):
        llm.generate([list(range(3, 60))], SamplingParams(max_new_tokens=2))


def test_infer_run_and_warmup_name_the_window_that_caps_the_context(tmp_path):
    """`infer run --strict` checks its lines before the engine loads (parallel.ReplicaView: no reason to give) and
    `warmup --max-length` checks against the model's context: both said only the number for a context capped at
    sliding_window; they name it now, as the engine does."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    build(tmp_path / "m", "llama", sliding_window=40)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt_token_ids": list(range(3, 60))}) + "\n")
    res = CliRunner().invoke(app, ["run", str(tmp_path / "m"), str(tmp_path / "in.jsonl"), "-o",
                                   str(tmp_path / "out.jsonl"), "--block-size", "4", "--strict"])
    assert res.exit_code == 2 and "model's limit (its sliding_window" in res.output, res.output
    res = CliRunner().invoke(app, ["warmup", str(tmp_path / "m"), "--estimate", "--max-length", "64",
                                   "--concurrency", "1"])
    assert res.exit_code == 2 and "context of 40 (its sliding_window" in res.output, res.output


def test_lora_validate_on_a_base_capped_by_its_sliding_window_works_within_it(tmp_path):
    """lora-validate sized its engine at 64 + --steps tokens within max_position_embeddings only: on a base
    whose sliding_window (40) caps the context, every check died with "--max-model-len 72 is above the model's limit
    of 40", an option lora-validate does not have. It now runs within the capped context (a Llama's: Mistral's
    context is no longer capped)."""
    from typer.testing import CliRunner

    from lora_helpers import hf_float, save_adapter

    from infer.cli.main import app
    base = tmp_path / "m"
    build(base, "llama", sliding_window=40)
    save_adapter(hf_float(base), tmp_path / "ad", seed=0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    res = CliRunner().invoke(app, ["lora-validate", str(base), f"a={tmp_path / 'ad'}", "--steps", "4"])
    assert res.exit_code == 0, res.output
