"""Session 42 probes of long contexts and position handling: every rope type infer runs, sliding windows, prompts and
generations up to the context, against transformers on the same tiny random weights."""

from __future__ import annotations

import json
import shutil

import pytest

from infer.errors import ConfigError
from infer.quant import quantize as quantize_mod
from infer.quant.quantize import QuantizeOptions, quantize_model


class _Calibrating(Exception):
    pass


def _tiny_llama_with(tmp_path, **fields):
    from infer.models.resolve import resolve_model
    src = tmp_path / "src"
    src.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(resolve_model("tiny-llama"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(fields)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    return src


def _calibrating():
    raise _Calibrating()


@pytest.mark.parametrize("in_rope", [None, 1024])
def test_quantize_reads_a_top_level_original_max_position_embeddings_of_longrope(tmp_path, monkeypatch, in_rope):
    """Phi-3 writes original_max_position_embeddings beside rope_scaling, not in it; transformers moves it into the
    rope parameters (over one they hold), and the engine caps the context there. quantize read only the rope dict's:
    a --seq-len past the context infer serves was calibrated with transformers' long factors."""
    from infer.models.loader import load_config
    from infer.engine.setup import context_limit
    monkeypatch.setattr(quantize_mod, "require_gptqmodel", _calibrating)
    rope = {"type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
    if in_rope:
        rope["original_max_position_embeddings"] = in_rope
    src = _tiny_llama_with(tmp_path, rope_scaling=rope, original_max_position_embeddings=256)
    assert context_limit(load_config(src))[0] == 256  # what infer serves it at
    with pytest.raises(ConfigError, match="original_max_position_embeddings") as e:
        quantize_model(src, tmp_path / "q", QuantizeOptions(group_size=32, num_samples=2, seq_len=300))
    assert "256" in e.value.hint
    with pytest.raises(_Calibrating):
        quantize_model(src, tmp_path / "q", QuantizeOptions(group_size=32, num_samples=2, seq_len=256))


@pytest.mark.parametrize("max_model_len,hint", [
    (None, "lower them: 4096 tokens is the model's limit"),
    ("256", "lower them, or raise --max-model-len (up to 4096, the model's limit)"),
])
def test_bench_random_too_long_says_whether_max_model_len_can_grow(tmp_path, monkeypatch, max_model_len, hint):
    """At the model's own limit (no --max-model-len) the hint said "raise --max-model-len (up to the model's limit)",
    which the engine then refuses: it names the limit instead, and the cap below it where there is one."""
    from typer.testing import CliRunner
    import infer.bench.plan as plan
    from infer.cli.main import app
    monkeypatch.setattr(plan, "_Target", None)  # refused before any model loads
    args = ["bench", "tiny-llama", "--input-len", "4000", "--output-len", "200", "-q", "--out", str(tmp_path / "o")]
    res = CliRunner().invoke(app, args + (["--max-model-len", max_model_len] if max_model_len else []))
    assert res.exit_code == 2, res.output
    assert hint in " ".join(res.output.split()), res.output


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 0.0},
                                  {"rope_type": "default", "rope_theta": -10.0},
                                  {"rope_type": "linear", "rope_theta": 10000.0, "factor": 0.0}])
def test_a_rope_of_frequencies_not_finite_is_refused_when_the_config_is_read(tmp_path, rope):
    """rope_theta 0 (or below) or a linear factor of 0 rotates every position past 0 by NaN: the engine ran, and a
    prompt's first token ended in "the model overflowed (run it in bfloat16 or float32)", which no dtype cures. The
    config is refused when it is read, naming the rope parameters, as one transformers cannot compute is."""
    from infer.errors import UnsupportedModelError
    from infer.models.loader import load_config
    src = _tiny_llama_with(tmp_path, rope_parameters=rope)
    with pytest.raises(UnsupportedModelError, match="not finite") as e:
        load_config(src)
    assert rope["rope_type"] in str(e.value) and "rope_theta" in e.value.hint


def test_finite_unusual_rope_parameters_still_load(tmp_path):
    """A dynamic factor of 0 is unscaled below max_position_embeddings and a huge rope_theta is finite: both run."""
    from infer.models.loader import load_config
    for rope in ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 0.0},
                 {"rope_type": "default", "rope_theta": 1e30}):
        load_config(_tiny_llama_with(tmp_path / rope["rope_type"], rope_parameters=rope))
