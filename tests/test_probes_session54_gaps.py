"""Session 54: gaps left from the Phi-3 and AWQ work (Phi-3 adapters without target_modules, the demo's adapter
summary on tiny-phi3, split gate/up GPTQ checkpoints with `dynamic` rules naming one half, AWQ/GPTQ scales that do not
fit float16, ...), each against what peft, GPTQModel or transformers do."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from infer import LLM
from infer.cli import demo as demo_module
from infer.errors import LoRAError
from infer.lora.adapter import adapter_problems

from lora_helpers import hf_float, save_adapter
from test_probes_session53_phi3 import PHI3_ALL, build


# --------------------------------------------------------------------------- a Phi-3 adapter without target_modules
def test_a_phi3_adapter_without_target_modules_is_refused_naming_phi3s_modules_as_peft_refuses_it(tmp_path):
    """peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING has no phi3 entry: PeftModel.from_pretrained refuses
    a config without target_modules on a Phi-3 ("Please specify `target_modules`"). infer said peft adapts its
    default q_proj, v_proj (Llama's, which a Phi-3 does not have)."""
    build(tmp_path / "base", num_hidden_layers=1)
    path = save_adapter(hf_float(tmp_path / "base"), tmp_path / "a", seed=1, lora_dropout=0.0, r=4, lora_alpha=8,
                        target_modules=PHI3_ALL)
    cfg = json.loads((path / "adapter_config.json").read_text())
    del cfg["target_modules"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    problems = adapter_problems("a", path, AutoConfig.from_pretrained(tmp_path / "base"))
    assert len(problems) == 1, problems
    text = str(problems[0])
    assert "no target_modules" in text and "Please specify `target_modules`" in text
    assert "qkv_proj, o_proj, gate_up_proj, down_proj" in text and "q_proj" not in text.replace("qkv_proj", "")
    with pytest.raises(LoRAError, match="peft has no default for a phi3 base"):
        LLM(str(tmp_path / "base"), loras={"a": str(path)})


# --------------------------------------------------------------------------- the demo's adapter summary
class _Steps:
    def __init__(self):
        self.ran = []

    def run(self, title, args, summary, module="infer.cli"):
        self.ran.append((title, args, summary))


def test_the_demo_names_the_modules_its_adapters_target_on_tiny_phi3(tmp_path, capsys):
    """On tiny-phi3 the support adapter targets the fused qkv_proj (base_targets), not q/v."""
    for model, folder, want in (("tiny-phi3", "tiny-phi3-adapters", "support (rank 8, qkv_proj)"),
                                ("tiny-llama", "adapters", "support (rank 8, q/v)")):
        out = tmp_path / model
        for name in demo_module.ADAPTERS:
            (out / folder / name).mkdir(parents=True)
            (out / folder / name / "adapter_config.json").write_text("{}")
        demo_module._model_steps(_Steps(), out, model, demo_module.SIZES[True])
        err = capsys.readouterr().err
        assert f"adapters: reusing {want} and legal (rank 16, all projections)" in err, err
        (out / folder / "support" / "adapter_config.json").unlink()
        steps = _Steps()
        demo_module._model_steps(steps, out, model, demo_module.SIZES[True])
        summary = dict((t, s) for t, _, s in steps.ran)["adapters"]
        assert summary("").startswith(want), summary("")
