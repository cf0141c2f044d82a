"""Session 55: gaps closed (warmup --estimate refusing what a load refuses, float32 GPTQ scales below float16's
normal range, Gemma 2's soft-capped attention in the estimate, counters across sleep, checkpoint name prefixes, a
draft model's decode attention warmed, bench's details off or cold)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from infer.cli.main import app

QUANTIZE = ["--group-size", "32", "--num-samples", "8", "--seq-len", "32"]


@pytest.fixture(scope="module")
def gptq(tmp_path_factory):
    """tiny-llama quantized by infer (4-bit, group size 32)."""
    out = tmp_path_factory.mktemp("q") / "tiny-llama-gptq"
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "-o", str(out), *QUANTIZE])
    assert res.exit_code == 0, res.output
    return out


def _copy(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _dynamic(cfg):
    cfg["quantization_config"]["dynamic"] = {r"+:.*q_proj": {"bits": 8}}


def _no_qzeros(state):
    del state["model.layers.1.mlp.down_proj.qzeros"]


def _extra(state):
    state["model.layers.0.mlp.extra.weight"] = state["model.norm.weight"].clone()


# --------------------------------------------------------------------------- 1. warmup --estimate refuses as a load
@pytest.mark.parametrize("case, edit, message", [
    ("dynamic", dict(config=_dynamic), r"dynamic quantizes model\.layers\.0\.self_attn\.q_proj and "
                                       r"model\.layers\.0\.self_attn\.k_proj with different settings"),
    ("missing", dict(tensors=_no_qzeros), r"no tensor model\.layers\.1\.mlp\.down_proj\.qzeros"),
    ("extra", dict(tensors=_extra), r"tensors config\.json has no place for: model\.layers\.0\.mlp\.extra\.weight")])
def test_warmup_estimate_refuses_a_checkpoint_the_loader_refuses_with_the_same_error(gptq, tmp_path, case, edit,
                                                                                     message):
    """`infer warmup --estimate` read sizes from the headers and printed a plan (exit 0) for a GPTQ checkpoint whose
    `dynamic` rules quantize q_proj and k_proj apart (one matmul in infer), or that lacks a layer's qzeros, or holds
    a tensor config.json has no place for: every load refuses them. It now runs the loader's checks on the meta
    device first: the same error, the same exit code, as the measured warmup."""
    import re
    path = _copy(gptq, tmp_path / case, **edit)
    measured = CliRunner().invoke(app, ["warmup", str(path), "--max-length", "64", "--concurrency", "2"])
    estimate = CliRunner().invoke(app, ["warmup", str(path), "--estimate", "--max-length", "64", "--concurrency",
                                        "2"])
    assert measured.exit_code not in (0, 1), measured.output
    assert re.search(message, " ".join(measured.output.split())), measured.output
    assert estimate.exit_code == measured.exit_code, estimate.output
    assert " ".join(estimate.output.split()) == " ".join(measured.output.split())
    ok = CliRunner().invoke(app, ["warmup", str(gptq), "--estimate", "--max-length", "64", "--concurrency", "2"])
    assert ok.exit_code == 0, ok.output

