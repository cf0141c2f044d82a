"""Session 53 review of the AWQ and sampling work: what an AWQ checkpoint must get wherever a GPTQ one does."""

from __future__ import annotations

import json
from pathlib import Path

AWQ_QC = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def _awq_config_dir(path: Path, **extra) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": AWQ_QC, **extra}))
    return path


def test_an_awq_base_records_the_model_an_adapter_was_trained_on(tmp_path):
    """AutoAWQ (under transformers 4) records the float model in config.json's _name_or_path, as GPTQ tools do: an
    adapter trained on that model is not warned about as trained for another one (as on its `convert --to gptq`)."""
    from infer.lora.validate import BaseInfo, base_name_warning
    from infer.quant.convert import recorded_source
    base = _awq_config_dir(tmp_path / "served-int4", _name_or_path="org/Some-Float-Model")
    assert recorded_source(base) == "org/Some-Float-Model"
    cfg = {"base_model_name_or_path": "org/Some-Float-Model"}
    assert base_name_warning("a", cfg, BaseInfo(base, None, "AWQ 4-bit, group 32"), str(base)) is None
    # a float folder's _name_or_path (the model it was fine-tuned from) is still not taken for its source
    flt = tmp_path / "float"
    flt.mkdir()
    (flt / "config.json").write_text(json.dumps({"model_type": "llama", "_name_or_path": "org/Some-Float-Model"}))
    assert recorded_source(flt) is None
