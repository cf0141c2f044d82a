"""A newcomer's pass over README's account of session 53's additions (AWQ, Phi-3, prompt tokens details,
max_logprobs, vLLM API parity), run for real: what the commands and their help texts say."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infer.cli.main import app


def _help(*cmd: str) -> str:
    res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "300"}, terminal_width=300)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def test_convert_help_names_awq_models():
    """convert reads AWQ checkpoints (--to gptq rewrites them): its MODEL help named only float and GPTQ."""
    assert "float, GPTQ or AWQ" in _help("convert")


def test_quantize_refusing_an_awq_config_names_convert_to_gptq(tmp_path):
    """README: `infer quantize` refuses an AWQ input, naming `infer convert --to gptq`. An AWQ config.json
    (quant_method awq) got only "quantize the float model it came from"."""
    src = tmp_path / "awq"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}}))
    res = CliRunner().invoke(app, ["quantize", str(src), "-o", str(tmp_path / "out"), "--group-size", "32"])
    assert res.exit_code == 2 and "already quantized (quant_method 'awq')" in res.output, res.output
    assert f"infer convert {src} -o OUT --to gptq" in " ".join(res.output.split()), res.output
    assert not (tmp_path / "out").exists()
