"""Session 56: `infer quantize` of a mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE), once refused. GPTQModel
quantizes every expert's gate/up/down (and Qwen2-MoE's shared expert), leaving the router and the shared expert's
gate float; infer loads the checkpoint with greedy tokens equal to GPTQModel's own load of it (CPU). A Mixtral
checkpoint is written with Mixtral's own names (block_sparse_moe.experts.N.w1/w3/w2), which infer and vLLM read;
experts that calibration routes too few tokens to (GPTQModel's round-to-nearest fallback) are named in the summary.
One quantize per model, shared by module-scoped fixtures (tiny models, a short calibration)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.errors import ConfigError
from infer.models.tiny import ensure_builtin

from helpers import norms_drawn, random_prompts, save_random_model
from quant_helpers import gptqmodel_greedy

pytest.importorskip("gptqmodel")

QUICK = ["--group-size", "32", "--num-samples", "1", "--seq-len", "16"]
QWEN2_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0,
                 tie_word_embeddings=False, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                 num_experts_per_tok=2, shared_expert_intermediate_size=64)


def cli(*args):
    from infer.cli.main import app
    return CliRunner().invoke(app, [str(a) for a in args])


def infer_tokens(path, prompts, n: int = 6):
    with LLM(str(path), block_size=4) as llm:
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))]


def tensors(path):
    return load_file(path / "model.safetensors")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """`infer quantize tiny-qwen3-moe` (the CLI): 1 calibration window of 16 tokens: none for some experts."""
    out = tmp_path_factory.mktemp("qwen3") / "q"
    res = cli("quantize", "tiny-qwen3-moe", "-o", out, *QUICK)
    return out, res


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from infer.models.loader import check_weights
    from infer.quant.quantize import QuantizeOptions, quantize_model
    out = tmp_path_factory.mktemp("mixtral") / "q"
    result = quantize_model(ensure_builtin("tiny-mixtral"), out, QuantizeOptions(group_size=32, num_samples=4,
                                                                                 seq_len=64),
                            check_weights=check_weights)
    return out, result


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A local random Qwen2-MoE (a shared expert and its sigmoid gate) quantized with the CLI."""
    base = tmp_path_factory.mktemp("qwen2")
    save_random_model(base / "src", "qwen2_moe", "Qwen2MoeForCausalLM", QWEN2_MOE, 0, norms_drawn(1.0))
    res = cli("quantize", base / "src", "-o", base / "q", "--group-size", "32", "--num-samples", "4",
              "--seq-len", "64")
    return base, res


def test_qwen3_moe_quantizes_with_the_cli_and_loads_as_gptqmodel_loads_it(qwen3):
    out, res = qwen3
    assert res.exit_code == 0, res.output
    qc = json.loads((out / "quantize_config.json").read_text())
    assert (qc["quant_method"], qc["bits"], qc["group_size"]) == ("gptq", 4, 32)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    state = tensors(out)
    for layer in range(2):
        assert state[f"model.layers.{layer}.mlp.gate.weight"].is_floating_point()  # the router stays float
        for e in range(8):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert state[f"model.layers.{layer}.mlp.experts.{e}.{proj}.qweight"].dtype == torch.int32
    assert not [k for k in state if k.endswith(".weight") and ".experts." in k]
    prompts = random_prompts(512, (6, 15), seed=11)
    got = infer_tokens(out, prompts)
    assert got == gptqmodel_greedy(out, prompts, 6, every_float=True)
    assert got != infer_tokens(ensure_builtin("tiny-qwen3-moe"), prompts)  # the int4 weights change the tokens
    text = " ".join(res.output.split())
    assert "transformers does not read GPTQ experts" in text


def test_experts_calibration_starves_are_named_as_rounded_to_nearest(qwen3):
    """GPTQModel quantizes an expert that fewer than 0.5% of the calibration tokens reach (none here) by
    round-to-nearest (its fallback, no Hessian): its report row has no loss, and the summary counts and names them."""
    import pandas as pd
    out, res = qwen3
    assert res.exit_code == 0, res.output
    report = pd.read_csv(out / "quantization_report.csv")
    starved = report[report["loss"].isna()]
    assert len(starved) and (starved["samples"] == 0).all() and starved["module"].str.contains("experts").all()
    text = " ".join(res.output.split())
    m = re.search(r"calibration routed fewer than 0\.5% of its tokens to (\d+) modules \((\d+) got none\)", text)
    assert m and int(m.group(1)) == int(m.group(2)) == len(starved), text
    first = starved.iloc[0]
    assert f"layer {first.layer} {first.module}" in text and "--num-samples, --seq-len, --calibration" in text


def test_moe_notes_count_fallback_rows_only():
    from infer.quant.quantize import moe_notes
    log = {"gptq": [{"layer": 0, "module": "mlp.experts.3.up_proj", "loss": "fallback(rtn): 0.01", "samples": 1},
                    {"layer": 1, "module": "mlp.experts.0.gate_proj", "loss": 0.002, "samples": 40}]}
    notes = moe_notes({"model_type": "mixtral"}, log, 2)
    assert len(notes) == 2 and "to 1 module (0 got none)" in notes[1] and "layer 0 mlp.experts.3.up_proj" in notes[1]
    assert moe_notes({"model_type": "llama"}, log, 2) == []


def test_mixtral_is_written_with_mixtrals_names_and_equals_gptqmodels_load(mixtral, tmp_path):
    """GPTQModel saves Mixtral's experts as mlp.experts.N.gate_proj/up_proj/down_proj (its unfused names, which infer
    and vLLM do not read): infer writes Mixtral's block_sparse_moe.experts.N.w1/w3/w2 and block_sparse_moe.gate, the
    same tensors. GPTQModel.load reads only its own names: the same checkpoint renamed back loads there with infer's
    tokens."""
    out, result = mixtral
    state = tensors(out)
    assert "model.layers.1.block_sparse_moe.experts.7.w2.qweight" in state
    assert state["model.layers.0.block_sparse_moe.gate.weight"].is_floating_point()
    assert not [k for k in state if ".mlp." in k]
    assert any("block_sparse_moe.experts.N.w1" in n and "GPTQModel.load" in n for n in result.notes)
    back = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    shutil.copytree(out, tmp_path / "g")
    save_file({re.sub(r"\.block_sparse_moe\.experts\.(\d+)\.(w\d)\.", lambda m: f".mlp.experts.{m[1]}.{back[m[2]]}.",
                      k).replace(".block_sparse_moe.gate.", ".mlp.gate."): v for k, v in state.items()},
              str(tmp_path / "g" / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts(512, (6, 15), seed=11)
    got = infer_tokens(out, prompts)
    assert got == gptqmodel_greedy(tmp_path / "g", prompts, 6, every_float=True)
    assert got != infer_tokens(ensure_builtin("tiny-mixtral"), prompts)


def test_qwen2_moe_shared_expert_quantized_its_gate_float(qwen2):
    base, res = qwen2
    assert res.exit_code == 0, res.output
    state = tensors(base / "q")
    assert state["model.layers.0.mlp.shared_expert.down_proj.qweight"].dtype == torch.int32
    assert state["model.layers.0.mlp.shared_expert_gate.weight"].is_floating_point()
    assert state["model.layers.0.mlp.experts.5.up_proj.qweight"].dtype == torch.int32
    prompts = random_prompts(512, (6, 15), seed=11)
    assert infer_tokens(base / "q", prompts) == gptqmodel_greedy(base / "q", prompts, 6, every_float=True)


def test_convert_and_warmup_accept_the_checkpoint(qwen3, tmp_path):
    out, res = qwen3
    assert res.exit_code == 0, res.output
    conv = cli("convert", out, "-o", tmp_path / "c")
    assert conv.exit_code == 0, conv.output
    assert tensors(tmp_path / "c").keys() == tensors(out).keys()
    warm = cli("warmup", out, "--max-length", "64")
    assert warm.exit_code == 0, warm.output


def test_an_expert_width_no_group_divides_is_refused_before_calibration(tmp_path):
    """Qwen's experts have a width of their own (moe_intermediate_size): a --group-size that does not divide it is
    refused up front, naming it, as a dense model's intermediate_size is."""
    from infer.quant import quantize as q
    save_random_model(tmp_path / "src", "qwen2_moe", "Qwen2MoeForCausalLM", {**QWEN2_MOE, "moe_intermediate_size": 48},
                      0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(q, "require_gptqmodel", lambda: pytest.fail("calibration reached"))
        with pytest.raises(ConfigError, match=r"--group-size 32 does not divide the model's moe_intermediate_size "
                                              r"\(48\).*use --group-size -1"):
            q.quantize_model(tmp_path / "src", tmp_path / "q", q.QuantizeOptions(group_size=32))


def test_the_cli_quantizes_a_mixtral_too(tmp_path, monkeypatch):
    """No refusal before calibration: the CLI hands a Mixtral to the quantization (stubbed here: the fixture above
    quantizes one)."""
    import infer.cli.quantize as cq
    reached = []

    def stub(src, *args, **kwargs):
        reached.append(src)
        raise SystemExit(3)
    monkeypatch.setattr(cq, "run_quantization", stub)
    res = cli("quantize", "tiny-mixtral", "-o", tmp_path / "q")
    assert reached == [ensure_builtin("tiny-mixtral")], res.output
