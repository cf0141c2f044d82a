"""`infer quantize` of Granite 4.0, Nemotron-H and Bamba (refused before: GPTQModel 7.6's definitions fail on
transformers 5, and it has none of Bamba) through GPTQModel with infer's views of them (quant.quantize._granite_view:
without the patch of the Mamba-2 mixer's forward, each expert in its tree (session 70); _nemotron_h_view: the layers
under model.layers, the shared experts, the routed experts (session 70) and Nemotron 3 Super's latent projections
in its tree; _bamba_view: a definition of its layers): which layers are int4, infer's greedy tokens equal
GPTQModel's own load of the checkpoint, and `infer warmup --estimate` counts its weights as loaded."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from infer import LLM

from helpers import estimated_plan, greedy_tokens, random_prompts
from quant_helpers import check_greedy_equal_but_near_ties, gptqmodel_greedy, infer_quantize, needs_gptqmodel

pytestmark = needs_gptqmodel


def _quantized(src, tmp_path, view, int4: list[str], float_: list[str]) -> list[list[int]]:
    """`infer quantize` of `src`: the `int4` modules' qweight written and the `float_` tensors kept float; infer runs
    it with those layers int4 and gives GPTQModel's own load's (under `view`) greedy tokens; --estimate's weights are
    the loaded model's. Returns those tokens."""
    from infer.memory.sizes import weights_bytes
    out = infer_quantize(src, tmp_path / "q")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"{m}.qweight" for m in int4} <= names, sorted({f"{m}.qweight" for m in int4} - names)
    assert set(float_) <= names, sorted(set(float_) - names)
    plan = estimated_plan(str(out), "--max-length", "256")
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4, max_model_len=256) as llm:
        model = llm.engine.runner.model
        kinds = {type(m.method).__name__ for m in model.modules() if hasattr(m, "method")}
        assert "GPTQLinearMethod" in kinds
        assert plan["weights_bytes"] == weights_bytes(model)
        got = greedy_tokens(llm, prompts, 8)
    with view(out):
        want = gptqmodel_greedy(out, prompts, 8, every_float=True)
    with LLM(str(out), block_size=4, max_model_len=256) as llm:  # (a near-tie: decided by infer's margin)
        check_greedy_equal_but_near_ties(llm, prompts, got, want)
    return got


@pytest.mark.parametrize("name", ["tiny-granite4", "tiny-granite4-dense"])
def test_granite4_quantizes_its_mamba_attention_and_shared_mlp(tmp_path, name):
    """Granite 4.0 (Mamba-2 layers, attention, shared MLP and experts; and the attention-only micro shape, whose
    first layer's mixer GPTQModel's patch took for None): the mixers' in_proj and out_proj, q, k, v, o and the shared
    MLP int4, and (session 70) each expert's gate_proj, up_proj and down_proj."""
    from infer.quant.quantize import _granite_view
    if name == "tiny-granite4":
        int4 = ["model.layers.0.mamba.in_proj", "model.layers.0.mamba.out_proj", "model.layers.2.self_attn.q_proj",
                "model.layers.2.self_attn.o_proj", "model.layers.3.shared_mlp.input_linear",
                "model.layers.3.shared_mlp.output_linear", "model.layers.1.block_sparse_moe.experts.7.down_proj",
                "model.layers.1.block_sparse_moe.experts.0.gate_proj"]
        float_ = ["model.layers.1.block_sparse_moe.router.weight"]
    else:
        int4 = ["model.layers.0.self_attn.q_proj", "model.layers.1.shared_mlp.output_linear"]
        float_ = []
    _quantized(name, tmp_path, _granite_view, int4, float_)


@pytest.mark.parametrize("name", ["tiny-nemotron-h", "tiny-nemotron-h-moe"])
def test_nemotron_h_quantizes_every_mixer_and_the_shared_experts(tmp_path, name):
    """Nemotron-H (Mamba-2, MLP, attention blocks) and Nemotron 3 (experts): every block's mixer projections, the
    shared experts and (session 70) the routed experts int4, the router float."""
    from infer.quant.quantize import _nemotron_h_view
    if name == "tiny-nemotron-h":  # (M-*M-)
        int4 = ["model.layers.0.mixer.in_proj", "model.layers.0.mixer.out_proj", "model.layers.1.mixer.up_proj",
                "model.layers.2.mixer.q_proj", "model.layers.2.mixer.o_proj", "model.layers.4.mixer.down_proj"]
        float_ = []
    else:  # (ME*M-E)
        int4 = ["model.layers.1.mixer.shared_experts.up_proj", "model.layers.5.mixer.shared_experts.down_proj",
                "model.layers.2.mixer.v_proj", "model.layers.4.mixer.up_proj", "model.layers.1.mixer.experts.0.up_proj"]
        float_ = ["model.layers.1.mixer.gate.weight"]
    _quantized(name, tmp_path, _nemotron_h_view, int4, float_)


def test_nemotron3_super_quantizes_its_latent_projections(tmp_path):
    """Nemotron 3 Super (moe_latent_size, mlp_bias): fc1_latent_proj and fc2_latent_proj int4 with their biases, as
    the shared experts and (session 70) the routed experts."""
    from infer.quant.quantize import _nemotron_h_view
    from test_probes_session69_nemo3super import _build
    _build(tmp_path / "m", mlp_bias=True)
    _quantized(tmp_path / "m", tmp_path, _nemotron_h_view,
               ["model.layers.1.mixer.fc1_latent_proj", "model.layers.1.mixer.fc2_latent_proj",
                "model.layers.1.mixer.shared_experts.up_proj", "model.layers.5.mixer.experts.3.down_proj"],
               ["model.layers.1.mixer.fc1_latent_proj.bias"])


def test_bamba_quantizes_its_mamba_attention_and_feed_forward(tmp_path):
    """Bamba (GPTQModel 7.6 has no definition: its fallback quantized the feed_forward alone): the mixers' in_proj and
    out_proj, q, k, v, o and the feed_forward int4, the conv float; the notes say GPTQModel.load needs infer's
    definition (without it, its tokens are all 0)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.quant.quantize import BAMBA_NOTE, _bamba_view
    int4 = ["model.layers.0.mamba.in_proj", "model.layers.0.mamba.out_proj", "model.layers.2.self_attn.k_proj",
            "model.layers.2.self_attn.o_proj", "model.layers.3.feed_forward.gate_proj",
            "model.layers.1.feed_forward.down_proj"]
    got = _quantized("tiny-bamba", tmp_path, _bamba_view, int4, ["model.layers.3.mamba.conv1d.weight"])
    assert len({t for tokens in got for t in tokens}) > 6
    res = CliRunner().invoke(app, ["quantize", "tiny-bamba", "-o", str(tmp_path / "q2"), "--group-size", "32",
                                   "--num-samples", "2", "--seq-len", "16"])
    assert res.exit_code == 0, res.output
    assert BAMBA_NOTE.split(":")[0] in " ".join(res.output.split())
