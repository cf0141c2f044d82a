"""Session 57, a newcomer's first minutes with this session's features: what a user meets trying them as the README
shows, where it was wrong or unclear."""

from __future__ import annotations

import pytest

from infer import LLM

from lora_helpers import hf_float, save_adapter
from test_probes_session55_moe import build


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_router_adapter_is_one_problem_naming_the_router(tmp_path, model_type):
    """peft's LoraConfig(target_modules=["q_proj", "gate"]) on a transformers 5 mixture of experts adapts the router
    (its tensors under mlp.gate, its config target_parameters ["gate.weight"]): the engine and `infer lora-validate`
    refuse it with the one problem that names the router, not also as a module the base model does not have (it has
    one) nor as a second, parameter problem."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.errors import LoRAError
    build(tmp_path / "base", model_type, num_hidden_layers=2)
    hf = hf_float(tmp_path / "base")
    bad = save_adapter(hf, tmp_path / "router", seed=1, r=4, lora_alpha=8, lora_dropout=0.0,
                       target_modules=["q_proj", "gate"])
    router = "adapts model.layers.0.mlp.gate (and 1 more modules): infer adapts a mixture of experts' attention"
    with pytest.raises(LoRAError) as err:
        LLM(str(tmp_path / "base"), loras={"x": str(bad)}, max_loras=1, max_lora_rank=8, block_size=4)
    said = str(err.value)
    assert router in said and "more problems" not in said and "does not have" not in said, said
    res = CliRunner().invoke(app, ["lora-validate", str(tmp_path / "base"), str(bad), "--steps", "0"])
    out = " ".join(res.output.split())
    assert res.exit_code != 0 and out.count("error:") == 1 and router in out, res.output
    assert "does not have" not in out and "gate.weight" not in out and "per-expert" not in out, res.output
