"""`infer demo --model tiny-granite4-dense` was refused as "a mixture of experts" (granitemoehybrid is among the MoE
model types), though the dense Granite 4.0 has none: the demo names it a Granite 4.0 and says why."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app


@pytest.mark.parametrize("model", ["tiny-granite4-dense", "tiny-granite4"])
def test_the_demo_refuses_granite4_naming_it(tmp_path, monkeypatch, model):
    from infer.cli import demo as demo_module
    monkeypatch.setattr(demo_module, "_model_steps", lambda *a, **k: pytest.fail("a step ran"))
    res = CliRunner().invoke(app, ["demo", "--model", model, "--out", str(tmp_path / "d")])
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())
    assert f"--model {model} is a Granite 4.0 (granitemoehybrid: the demo's chain is not checked on it yet)" in said
    assert "mixture of experts" not in res.output and f"infer run {model} examples/prompts.jsonl" in res.output
    assert not (tmp_path / "d").exists()
