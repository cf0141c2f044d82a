"""Session 63 review of the MoE families merged this session (GraniteMoeShared, Qwen3.5 MoE, ERNIE 4.5 MoE): what
the hub's checkpoints and configs hold beyond the tiny models of test_probes_session63_moe35."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app

from helpers import greedy_each, greedy_tokens, random_prompts
from test_probes_session63_moe35 import build_ernie


def check_skipped_and_equal_transformers(folder, hf, extra: dict) -> None:
    """`extra` (multi-token-prediction tensors) added to `folder`'s model.safetensors: infer loads the folder
    skipping them, warmup --estimate does not count them, and infer's greedy tokens are transformers' (`hf`)."""
    from safetensors.torch import load_file, save_file

    from infer.memory.sizes import weights_bytes
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, **extra}, folder / "model.safetensors", metadata={"format": "pt"})
    res = CliRunner().invoke(app, ["warmup", str(folder), "--estimate", "--json", "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    with LLM(str(folder), block_size=4, dtype="bfloat16") as llm:
        assert plan["weights_bytes"] == weights_bytes(llm.engine.runner.model)  # (the MTP layer not counted)
    prompts = random_prompts(512, (7, 12), seed=5)
    with LLM(str(folder), block_size=4) as llm:
        assert greedy_tokens(llm, prompts, 6) == greedy_each(hf, prompts, 6)


def test_ernie_the_hubs_multi_token_prediction_layer_is_skipped(tmp_path):
    """ERNIE-4.5-21B-A3B-PT stores its MTP layer (num_nextn_predict_layers 1) as model.mtp_block.0 (a decoder
    layer), mtp_emb_norm.0, mtp_hidden_norm.0 and mtp_linear_proj.0, which transformers ignores ("mtp" keys): infer
    skips them, loads and equals transformers, and warmup --estimate does not count them."""
    from safetensors.torch import load_file
    hf = build_ernie(tmp_path, num_nextn_predict_layers=1)
    h = hf.config.hidden_size
    extra = {k.replace("model.layers.1.", "model.mtp_block.0."): v.clone()
             for k, v in load_file(tmp_path / "model.safetensors").items() if k.startswith("model.layers.1.")}
    extra |= {"model.mtp_emb_norm.0.weight": torch.ones(h), "model.mtp_hidden_norm.0.weight": torch.ones(h),
              "model.mtp_linear_proj.0.weight": torch.randn(h, 2 * h)}
    check_skipped_and_equal_transformers(tmp_path, hf, extra)


@pytest.mark.parametrize("name", ["tiny-qwen3_5-moe", "tiny-qwen3_5"])
def test_qwen3_5_text_checkpoints_multi_token_prediction_layer_is_skipped(tmp_path, name):
    """Qwen3.5's and Qwen3.5 MoE's (and Qwen3-Next's) checkpoints store their MTP layer as mtp.* (mtp.fc,
    mtp.layers.0, mtp.norm ...), which transformers ignores (r"^mtp.*") for the text model as for the multimodal
    one: a text checkpoint that keeps them loads, equals transformers, and warmup --estimate does not count them."""
    import shutil

    from safetensors.torch import load_file

    from helpers import hf_model
    from infer.models.tiny import ensure_builtin
    shutil.copytree(ensure_builtin(name), tmp_path, dirs_exist_ok=True)
    stored = load_file(tmp_path / "model.safetensors")
    extra = {k.replace("model.layers.3.", "mtp.layers.0."): v.clone() for k, v in stored.items()
             if k.startswith("model.layers.3.")}
    h = stored["model.norm.weight"].shape[0]
    extra |= {"mtp.fc.weight": torch.randn(h, 2 * h), "mtp.norm.weight": torch.ones(h)}
    check_skipped_and_equal_transformers(tmp_path, hf_model(str(tmp_path)), extra)


def test_qwen3_5_moe_every_layer_sparse_whatever_mlp_only_layers_says(tmp_path):
    """transformers' Qwen3.5 MoE has the experts on every layer (its config has neither mlp_only_layers nor
    decoder_sparse_step, nor a dense intermediate_size): a config.json that carries Qwen3-Next's fields is served as
    transformers runs it, every layer sparse, with its tokens."""
    import shutil

    from helpers import hf_model
    from infer.models.moe import SparseMoeBlock
    from infer.models.tiny import ensure_builtin
    src = ensure_builtin("tiny-qwen3_5-moe")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0], "decoder_sparse_step": 2}))
    prompts = random_prompts(512, (7, 12), seed=5)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in llm.engine.runner.model.layers)
        assert greedy_tokens(llm, prompts, 6) == greedy_each(hf_model(str(tmp_path)), prompts, 6)


def test_ernie_a_top_k_past_the_experts_is_refused_naming_its_own_fields(tmp_path):
    """ERNIE 4.5 MoE's config.json names k and E moe_k and moe_num_experts (transformers maps num_experts_per_tok
    and num_experts to them): a moe_k past moe_num_experts is refused by warmup --estimate naming those fields."""
    from transformers import AutoConfig

    from test_probes_session63_moe35 import ERNIE
    cfg = AutoConfig.for_model("ernie4_5_moe", **{**ERNIE, "moe_k": 9})
    cfg.architectures = ["Ernie4_5_MoeForCausalLM"]
    cfg.save_pretrained(tmp_path)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"], env={"COLUMNS": "250"})
    assert res.exit_code != 0, res.output
    text = " ".join(res.output.split())
    assert "config.json has moe_k 9 with moe_num_experts 8" in text, text
    assert "each token is routed to between 1 and moe_num_experts experts" in text, text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
def test_qwen3_5_moe_int4_experts_through_the_kernels_equal_the_cpu_path(tmp_path, monkeypatch):
    """A GPTQ checkpoint of tiny-qwen3_5-moe in GPTQModel's layout (each expert's and the shared expert's
    projections, the attention's and the DeltaNet's out_proj 4-bit, group 16; the router and its shared_expert_gate
    float) on the GPU code path (the experts stacked int4, the int4 fused MoE with Qwen3.5 MoE's renormalised
    routing weights and the gated shared expert, interpreted): the CPU path's tokens."""
    from infer.models.tiny import ensure_builtin

    from quant_helpers import check_kernel_path_equals_cpu
    from test_probes_session56_review_moeq import rtn_gptq
    rtn_gptq(ensure_builtin("tiny-qwen3_5-moe"), tmp_path / "q", group_size=16)  # (the shared expert: I 48)
    config = json.loads((tmp_path / "q" / "config.json").read_text())  # (in_proj_qkv and in_proj_z left float)
    config["quantization_config"]["dynamic"] = {r"-:.*linear_attn\.in_proj_(qkv|z)$": {}}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    check_kernel_path_equals_cpu(tmp_path / "q", monkeypatch)
