"""Session 40 probes of `infer quantize` / `infer convert` across the model families and config variants infer runs
(tied embeddings, llama3 rope, sliding windows, qkv bias, q/k norm, longrope, bf16 and sharded checkpoints)."""

from __future__ import annotations

import json
import shutil

import pytest

from infer.errors import ConfigError
from infer.quant import quantize as quantize_mod
from infer.quant.quantize import QuantizeOptions, quantize_model


class _Calibrating(Exception):
    pass


def _longrope_source(tmp_path, original: int = 256):
    """tiny-llama with a longrope rope (short factors up to `original` positions, max_position_embeddings 4096)."""
    from infer.models.resolve import resolve_model
    src = tmp_path / "src"
    shutil.copytree(resolve_model("tiny-llama"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                              "long_factor": [4.0] * 8, "original_max_position_embeddings": original}
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    return src


@pytest.mark.parametrize("seq_len,refused", [(300, True), (256, False)])
def test_quantize_caps_seq_len_of_a_longrope_model_at_its_original_context(tmp_path, monkeypatch, seq_len, refused):
    """infer serves a longrope model up to original_max_position_embeddings (its context limit); a calibration window
    past it runs transformers' long factors over the whole window, a rope infer never serves: refused up front, as a
    --seq-len beyond max_position_embeddings is."""
    def calibrating():
        raise _Calibrating()
    monkeypatch.setattr(quantize_mod, "require_gptqmodel", calibrating)
    src = _longrope_source(tmp_path)
    opts = QuantizeOptions(group_size=32, num_samples=2, seq_len=seq_len)
    if refused:
        with pytest.raises(ConfigError, match="original_max_position_embeddings") as e:
            quantize_model(src, tmp_path / "q", opts)
        assert "256" in e.value.hint
    else:
        with pytest.raises(_Calibrating):
            quantize_model(src, tmp_path / "q", opts)


@pytest.mark.parametrize("damp", [0.0, 1.0])
def test_damp_at_either_end_is_refused_as_outside_the_open_interval(damp):
    """--damp 0 was refused with "must lie between 0 and 1", which 0 does: the message says the ends are excluded
    (GPTQModel refuses them too)."""
    with pytest.raises(ConfigError, match="above 0 and below 1"):
        QuantizeOptions(damp_percent=damp).validate()
