"""GPTQ export and import details the other quantization tests leave open: a gptq_v2 copy of an exported
checkpoint (zero points stored as they are, named by `checkpoint_format` or by GPTQModel's older `format` key) gives
the same tokens as the v1 original; the round-to-nearest quantizer's symmetric zero points are GPTQ's 2^(bits-1)
(what GPTQModel writes, and what sym kernels assume); and the export check refuses a checkpoint in another format."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer.errors import InferError
from infer.quant.packing import quantize_rtn

from quant_helpers import needs_gptqmodel, unpack_int32


def _pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] small ints -> int32 [rows, cols * bits / 32], lowest bits first (the GPTQ layout)."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, per)
    words = sum(v[:, :, j] << (bits * j) for j in range(per))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from typer.testing import CliRunner

    from infer.cli.main import app
    out = tmp_path_factory.mktemp("export") / "v1"
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "-o", str(out), "--group-size", "32", "--no-sym",
                                   "--num-samples", "4", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    return out


def _greedy(path) -> list[list[int]]:
    from infer import LLM, SamplingParams
    llm = LLM(str(path), block_size=4)
    prompts = [[5, 17, 99, 230, 41], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]


@needs_gptqmodel
@pytest.mark.parametrize("key", ["checkpoint_format", "format"])
def test_a_v2_copy_gives_the_v1_checkpoints_tokens(exported, tmp_path, key):
    from safetensors.torch import load_file, save_file
    cfg = json.loads((exported / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc.get("checkpoint_format", qc.get("format")) == "gptq"
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (4, 32, False, False)
    v2 = tmp_path / "v2"
    shutil.copytree(exported, v2)
    (v2 / "quantize_config.json").unlink()
    tensors = load_file(exported / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith(".qzeros"):  # v1 stores zero - 1; v2 the zero itself
            tensors[name] = _pack_cols((unpack_int32(t, 4, dim=1) + 1) & 15, 4)
    save_file(tensors, v2 / "model.safetensors", metadata={"format": "pt"})
    qc = {k: v for k, v in qc.items() if k not in ("checkpoint_format", "format")}
    cfg["quantization_config"] = {**qc, key: "gptq_v2"}
    (v2 / "config.json").write_text(json.dumps(cfg))
    assert _greedy(v2) == _greedy(exported)


@pytest.mark.parametrize("bits", [4, 8])
def test_rtn_symmetric_zero_point_is_two_to_the_bits_minus_one(bits):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    qweight, qzeros, scales, g_idx = quantize_rtn(w, bits, 32, sym=True)
    stored = unpack_int32(qzeros, bits, dim=1)
    assert torch.equal(stored, torch.full_like(stored, 2 ** (bits - 1) - 1))  # v1: zero - 1, as GPTQModel writes
    q = unpack_int32(qweight, bits, dim=0)
    step = scales.float()[g_idx.long()]
    w_hat = (q - 2 ** (bits - 1)).float() * step  # dequantized with the sym zero the kernels assume
    assert ((w_hat - w.t()).abs() <= 0.6 * step).all()  # round to nearest (half a step, plus fp16 scales)


def test_export_check_refuses_another_format(tmp_path):
    from infer.quant.quantize import _check_saved
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    (tmp_path / "quantize_config.json").write_text(json.dumps(qc))
    for fmt in ("gptq", None):
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {**qc, "checkpoint_format": fmt}
                                                          if fmt else qc}))
        _check_saved(tmp_path)
    for key in ("checkpoint_format", "format"):
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {**qc, key: "gptq_v2"}}))
        with pytest.raises(InferError, match="gptq_v2"):
            _check_saved(tmp_path)
