"""Session 63's hostile inputs to what session 62 built: hybrid (Gated DeltaNet) configs the layers cannot run,
..."""

import pytest
from typer.testing import CliRunner

from helpers import tiny_llama_with_json
from infer.cli.main import app


@pytest.mark.parametrize("base, changes, message", [
    ("tiny-qwen3_5", {"linear_num_value_heads": 3},
     "qwen3_5_text with linear_num_value_heads 3 not a multiple of linear_num_key_heads 2 is not supported"),
    ("tiny-qwen3-next", {"linear_num_value_heads": 1},
     "qwen3_next with linear_num_value_heads 1 not a multiple of linear_num_key_heads 2"),
    ("tiny-qwen3_5", {"linear_num_key_heads": 0}, "qwen3_5_text with linear_num_key_heads 0 is not supported"),
    ("tiny-qwen3_5", {"linear_conv_kernel_dim": 1}, "qwen3_5_text with linear_conv_kernel_dim 1 is not supported"),
    ("tiny-qwen3_5", {"layer_types": ["sliding_attention", "linear_attention", "linear_attention",
                                      "full_attention"]},
     "qwen3_5_text layer_types ['sliding_attention'] are not supported"),
])
def test_hybrid_config_its_layers_cannot_run_refused_before_start(tmp_path, base, changes, message):
    """(They failed every request of the run with an internal engine error at the first step, or named a missing
    self_attn tensor.)"""
    folder = tiny_llama_with_json(tmp_path / "m", "config.json", base, **changes)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["run", str(folder), str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output
