"""Session 62's review of the mixture-of-experts families merged this session (GLM-4.5 / 4.6, OLMoE, Granite MoE):
what test_probes_session62_moe.py left unexercised. A GPTQ checkpoint whose experts are stored in float while its
quantization_config quantizes every module (as GPTQModel 7.6 on transformers 5 writes a Granite MoE: `infer quantize`
of one) runs on the GPU path with float experts beside the int4 attention (it was refused there: "a float expert's
weight in a checkpoint whose config.json quantizes the experts"). `warmup --estimate` of a bfloat16 model on a CPU
counts its rotary table in bfloat16, as the model builds it since this session (it counted float32)."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM, SamplingParams

from helpers import greedy_each, random_prompts
from quant_helpers import dequantized_float_model, int4_kernel_path
from test_probes_session56_review_moeq import rtn_gptq
from test_probes_session62_moe import build_granite


def _per_expert(folder) -> None:
    """Granite MoE's stacked experts (input_linear [E, 2I, H], output_linear [E, H, I]) rewritten apart, as GPTQModel
    saves the float experts it leaves: block_sparse_moe.experts.N.gate_proj / up_proj / down_proj.weight."""
    from safetensors.torch import load_file, save_file
    tensors = {}
    for name, t in load_file(folder / "model.safetensors").items():
        head, sep, tail = name.partition(".block_sparse_moe.")
        if tail not in ("input_linear.weight", "output_linear.weight"):
            tensors[name] = t
            continue
        for e in range(t.shape[0]):
            at = f"{head}{sep}experts.{e}."
            if tail == "output_linear.weight":
                tensors[at + "down_proj.weight"] = t[e].clone()
            else:
                gate, up = t[e].chunk(2)
                tensors.update({at + "gate_proj.weight": gate.clone(), at + "up_proj.weight": up.clone()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["stacked-hub-names", "per-expert"])
def test_gptq_granitemoe_with_float_experts_runs_on_the_gpu_path(tmp_path, monkeypatch, layout):
    """The attention 4-bit (round to nearest), the experts float, quantization_config with no rule leaving them
    float: the CPU path and the GPU code path (every op's Triton kernel, interpreted) give transformers' greedy tokens
    of the dequantized weights; on the GPU path the experts stay float (no int4 stacks) and the meta check of a GPU
    load (`warmup --estimate --device cuda`) passes."""
    from infer.models.loader import check_weights
    build_granite(tmp_path / "f")
    rtn_gptq(tmp_path / "f", tmp_path / "q")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    (tmp_path / "q" / "quantize_config.json").write_text(json.dumps(qc))  # (as GPTQModel writes it too)
    if layout == "per-expert":
        _per_expert(tmp_path / "q")
    hf = dequantized_float_model(tmp_path / "f", tmp_path / "q")
    hf.generation_config.eos_token_id = None
    prompts = random_prompts(512, (5, 9), seed=4)
    want = greedy_each(hf, prompts, 4)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path / "q"), block_size=4) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert check_weights(tmp_path / "q", torch.device("cuda")).layers[0].mlp.int4 is None
    int4_kernel_path(monkeypatch)
    with LLM(str(tmp_path / "q"), block_size=4, max_model_len=32) as llm:
        model = llm.engine.runner.model
        assert model.layers[0].self_attn.qkv_proj.qweight is not None and model.layers[0].mlp.int4 is None
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert len({t for tokens in want for t in tokens}) > 3  # (varied tokens: the comparison means something)


@pytest.mark.parametrize("name", ["tiny-olmoe", "tiny-granitemoe", "tiny-glm4-moe", "tiny-olmo2"])
def test_a_bfloat16_estimate_on_a_cpu_counts_the_rotary_table_as_loaded(name):
    """`infer warmup --estimate --dtype bfloat16` on a CPU: the weights' bytes are the loaded engine's, its rotary
    table counted in bfloat16 as a bfloat16 model's table on a CPU is built (float32 where the family rotates in
    float32: OLMo 2's); it counted float32 tables, above the engine by the table's half."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.memory.sizes import weights_bytes
    res = CliRunner().invoke(app, ["warmup", name, "--estimate", "--json", "--max-length", "256", "--dtype",
                                   "bfloat16"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    with LLM(name, max_model_len=256, dtype="bfloat16") as llm:
        model = llm.engine.runner.model
        assert model.cos_sin.dtype == (torch.float32 if name == "tiny-olmo2" else torch.bfloat16)
        assert plan["weights_bytes"] == weights_bytes(model)
