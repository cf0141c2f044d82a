"""Newcomer probes of the sixty-fourth session: bad inputs across the CLI and the server."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app
from infer.models.tiny import ensure_builtin


@pytest.mark.parametrize("model, targets, named", [
    ("tiny-granite4", ["input_linear", "out_proj", "+conv1d"], "infer's adapters of granitemoehybrid"),
    ("tiny-nemotron-h", ["in_proj", "up_proj", "+out_proj"], "infer's adapters of nemotron_h"),
    ("tiny-qwen3_5-moe", ["in_proj_qkvz", "out_proj", "q_proj"], "linear-attention (Gated DeltaNet) layers")])
def test_adapter_of_a_hybrids_unadapted_layers_is_refused_once(tmp_path, monkeypatch, model, targets, named):
    """`infer lora-validate` of an adapter of a hybrid's layers infer does not adapt (Granite 4.0's conv1d,
    Nemotron-H's Mamba-2 out_proj, Qwen3.5's linear attention) names them once, as layers infer does not adapt: not
    again as modules "which the base model does not have" (the base has them), whose hint listed every other
    architecture's projections. (A "+" target is added to adapter_config.json after peft made the adapter: peft
    refuses Nemotron-H's out_proj, an adapter made elsewhere may name it.)"""
    import json

    from lora_helpers import hf_float, save_adapters
    monkeypatch.setenv("COLUMNS", "250")
    made = [t for t in targets if not t.startswith("+")]
    paths = save_adapters(hf_float(ensure_builtin(model)), tmp_path, {"a": dict(r=4, lora_alpha=8,
                                                                                target_modules=made)})
    config = json.loads((paths["a"] / "adapter_config.json").read_text())
    (paths["a"] / "adapter_config.json").write_text(json.dumps({**config, "target_modules": [t.lstrip("+")
                                                                                             for t in targets]}))
    res = CliRunner().invoke(app, ["lora-validate", model, str(paths["a"])])
    assert res.exit_code == 1, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], res.output
    assert "which the base model does not have" not in res.output, res.output


def test_a_batch_line_with_stream_options_but_no_stream_is_refused(tmp_path):
    """stream_options in a batch line (no stream, or stream: false) ran as if absent, while infer serve and vllm
    run-batch refuse a request's stream options without stream: true: the line is refused naming the field."""
    from helpers import infer_run_records

    def line(custom_id, **body):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                "body": {"prompt": "hi", "max_tokens": 2, **body}}
    records, output = infer_run_records(tmp_path, [line("so", stream_options={"include_usage": True}),
                                                   line("sf", stream=False, stream_options={"include_usage": False}),
                                                   line("ok", stream_options=None)],
                                        "--output-format", "openai", key="custom_id")
    for custom_id in ("so", "sf"):
        assert records[custom_id]["response"]["status_code"] == 400, output
        assert "body.stream_options: a batch line's reply is written whole" in records[custom_id]["error"]["message"]
    assert records["ok"]["response"]["status_code"] == 200 and records["ok"]["error"] is None, records["ok"]
