"""Session 74: the CPU's fused MoE without adapters in a fixed number of torch ops (kernels.reference.
fused_moe_grouped: the token-expert pairs sorted by expert, one grouped_mm per projection) in place of a loop over
the chosen experts, bit for bit the loop's result (reference.fused_moe) on every kind of experts the CPU path holds:
SwiGLU (float32, bfloat16, float16; routing weights float32 or the model's dtype), experts without gate (Nemotron 3's
relu²), gpt-oss's biases and clamped activation, one token and none, experts no token chose; the engine's tokens
with it are transformers' (the MoE families' own tests), and a step with adapters on the experts keeps the loop.

And `infer demo` on the mixtures of experts it refused: DeepSeek-V3/V2 (its adapters now target the latent
attention's own projections), gpt-oss and Llama 4 (lora-validate's oracle now stacks their GPTQ experts as
transformers stores them)."""

from __future__ import annotations

import pytest
import torch

from infer import kernels
from infer.kernels import reference as R

from quant_helpers import check_lora_validate_quantized, needs_gptqmodel


def _case(t, e, h, inter, k, dtype, wdtype, gated=True, seed=0, skip=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter if gated else inter, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter ** 0.5).to(dtype)
    logits = torch.randn(t, e, generator=g)
    logits[:, list(skip)] = -1e9  # (experts no token chooses)
    weights, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    return x, w13, w2, weights.to(wdtype), ids


CASES = {
    "decode-float32": (16, 8, 64, 32, 2, torch.float32, torch.float32, True, ()),
    "prefill-bfloat16-float32-weights": (300, 8, 64, 32, 2, torch.bfloat16, torch.float32, True, ()),
    "float16-top8-of-64": (40, 64, 128, 48, 8, torch.float16, torch.float16, True, ()),
    "top4-three-experts-unchosen": (33, 12, 64, 32, 4, torch.float32, torch.float32, True, (0, 5, 11)),
    "one-token-top1": (1, 16, 64, 32, 1, torch.bfloat16, torch.bfloat16, True, ()),
    "no-gate-relu2": (24, 8, 64, 32, 2, torch.float32, torch.float32, False, ()),
}


@pytest.mark.parametrize("case", CASES)
def test_grouped_equals_the_loop_over_experts_bit_for_bit(case, monkeypatch):
    t, e, h, inter, k, dtype, wdtype, gated, skip = CASES[case]
    x, w13, w2, weights, ids = _case(t, e, h, inter, k, dtype, wdtype, gated, skip=skip)
    assert R.grouped_moe(x, w13, w2, None) == (t > 1)  # (one token: the loop's k calls)
    got = R.fused_moe_grouped(x, w13, w2, weights, ids)
    want = R.fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == x.dtype and torch.equal(got, want), (got.float() - want.float()).abs().max()
    # and the dispatcher takes it on the CPU (beyond one token: the loop's k calls there)
    if t > 1:
        monkeypatch.setattr(R, "fused_moe", lambda *a, **k: pytest.fail("the per-expert loop ran"))
    assert torch.equal(kernels.fused_moe(x, w13, w2, weights, ids), want)


def test_grouped_equals_the_loop_with_gpt_oss_biases_and_activation():
    x, w13, w2, weights, ids = _case(20, 8, 64, 32, 4, torch.bfloat16, torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(4)
    oai = R.OaiExperts(torch.randn(8, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16(),
                       1.702, 7.0)
    want = R.fused_moe(x, w13, w2, weights, ids, oai=oai)
    assert torch.equal(R.fused_moe_grouped(x, w13, w2, weights, ids, oai), want)
    assert not torch.equal(R.fused_moe_grouped(x, w13, w2, weights, ids), want)  # (the biases count)


def test_no_tokens_and_adapters_and_expert_by_expert_weights_keep_the_loop():
    x, w13, w2, weights, ids = _case(0, 8, 64, 32, 2, torch.float32, torch.float32)
    assert R.fused_moe_grouped(x, w13, w2, weights, ids).shape == (0, 64)
    x, w13, w2, weights, ids = _case(4, 8, 64, 32, 2, torch.float32, torch.float32)
    lora = R.MoELoRA(torch.zeros(1, 8, 2, 64), torch.zeros(1, 8, 64, 2), torch.zeros(1, 8, 2, 32),
                     torch.zeros(1, 8, 64, 2), torch.zeros(4, dtype=torch.int64))
    assert not R.grouped_moe(x, w13, w2, lora)
    assert not R.grouped_moe(x, R._ExpertByExpert(None, torch.float32), w2, None)
    # rows of H or I values no multiple of 16 bytes (grouped_mm's strides): the loop, whose result is the same
    for h, inter, dtype in ((20, 12, torch.bfloat16), (64, 12, torch.bfloat16), (18, 8, torch.float32)):
        x, w13, w2, weights, ids = _case(5, 6, h, inter, 2, dtype, dtype)
        assert not R.grouped_moe(x, w13, w2, None)
        assert torch.equal(kernels.fused_moe(x, w13, w2, weights, ids), R.fused_moe(x, w13, w2, weights, ids))


def test_bench_moe_cpu_times_infer_beside_the_loop_and_transformers(tmp_path, capsys):
    """`python -m infer.bench.moe --cpu`: a row per --tokens with infer's, the loop's and transformers' (grouped_mm
    and eager) times, their ratios and the bit-for-bit check, in the table and the CSV; odd widths taken (float
    experts, no int4 packing); GPU-only options with --cpu, and --cpu's own without it, refused naming the flag."""
    import csv
    from infer.bench.moe import main
    out = tmp_path / "moe.csv"
    assert main(["--cpu", "--experts", "6", "--top-k", "2", "--hidden", "24", "--intermediate", "16", "--tokens", "1",
                 "7", "--repeats", "2", "--dtype", "bfloat16", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["tokens"] for r in rows] == ["1", "7"] and all(r["equal_loop"] == "True" for r in rows)
    assert all(float(r[k]) > 0 for r in rows for k in ("grouped_us", "loop_us", "hf_grouped_us", "hf_eager_us"))
    assert "E=6 k=2 H=24 I=16 bfloat16" in capsys.readouterr().out
    for argv, flag in ((["--cpu", "--oai"], "--oai"), (["--cpu", "--repeats", "0"], "--repeats 0"),
                       (["--cpu", "--hidden", "20"], "--hidden 20 is no multiple of 8 (--cpu times torch's grouped_mm"),
                       (["--dtype", "bfloat16"], "--dtype and --repeats are options of --cpu")):
        with pytest.raises(SystemExit):
            main(argv)
        assert flag in capsys.readouterr().err


# ------------------------------------------------------------------------------------- the demo on DeepSeek
def test_deepseeks_adapter_targets_are_its_latent_attentions_projections():
    """The demo's adapters on DeepSeek (lora.adapter.base_targets): q_a_proj and q_b_proj for q (q_proj where
    q_lora_rank is null: DeepSeek-V2-Lite), kv_a_proj_with_mqa for k and v, never kv_b_proj (absorbed); the summary
    names them and does not say "all projections"."""
    from infer.cli.demo import ALL_PROJECTIONS, adapters_described
    from infer.lora.adapter import base_targets
    assert base_targets("deepseek_v3", ["q_proj", "v_proj"]) == ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"]
    assert base_targets("deepseek_v2", ALL_PROJECTIONS, q_lora=False) == [
        "q_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert adapters_described("tiny-deepseek-v2") == (
        "support (rank 8, q_proj, kv_a_proj_with_mqa) and legal (rank 16, q_proj, kv_a_proj_with_mqa, o_proj, "
        "gate_proj, up_proj, down_proj)")
    assert "support (rank 8, q_a_proj, q_b_proj, kv_a_proj_with_mqa)" in adapters_described("tiny-deepseek-v3")


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-deepseek-v2"])
def test_lora_validate_quantized_on_gptq_deepseek_agrees_with_peft(tmp_path, name):
    """The demo's adapter of every projection on a GPTQ DeepSeek (its latent attention's q_a/q_b or q, kv_a, o, the
    dense first layer's and the shared experts' MLPs, the routed experts through peft's conversion) is checked by
    `infer lora-validate --quantized` against peft on the dequantized int4 base, and agrees; the adapter moves the
    logits far more than the two differ."""
    from safetensors import safe_open
    from infer.cli import demo as demo_module
    from infer.models.tiny import ensure_builtin
    from test_probes_session56_review_moeq import rtn_gptq
    rtn_gptq(ensure_builtin(name), tmp_path / "q", group_size=16)  # (V3's q_b_proj reads a q_lora_rank of 48)
    demo_module.make_random_adapter(ensure_builtin(name), tmp_path / "a", 8, demo_module.ALL_PROJECTIONS, seed=1)
    held = set(safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt").keys())
    assert any("kv_a_proj_with_mqa" in k for k in held) and not any("kv_b_proj" in k for k in held), held
    check_lora_validate_quantized(tmp_path / "q", tmp_path / "a")


@needs_gptqmodel
@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-llama4"])
def test_lora_validate_quantized_on_gptq_gpt_oss_and_llama4_agrees_with_peft(tmp_path, name):
    """`infer lora-validate --quantized` stopped with "transformers has no weight for ...experts.gate_up_proj" on
    GPTQ gpt-oss and Llama 4 (their experts transformers reads stacked alone; GPTQModel writes them one by one): the
    oracle now stacks them as transformers stores them (lora_check._stack_experts: Llama 4's gate columns then up;
    gpt-oss's GPTQ gate_proj and up_proj, the halves of its interleaved columns, concatenated back, with their
    biases). The demo's adapter of every projection (gpt-oss's attention alone: its MLP is its experts) agrees with
    peft on the dequantized int4 base made by `infer quantize`, within 1e-5 of the adapter's effect."""
    from typer.testing import CliRunner
    from infer.cli import demo as demo_module
    from infer.cli.main import app
    from infer.models.tiny import ensure_builtin
    res = CliRunner().invoke(app, ["quantize", name, "-o", str(tmp_path / "q"), "--bits", "4", "--group-size", "32",
                                   "--num-samples", "8", "--seq-len", "64"])
    assert res.exit_code == 0, res.output
    demo_module.make_random_adapter(ensure_builtin(name), tmp_path / "a", 8, demo_module.ALL_PROJECTIONS, seed=1)
    report = check_lora_validate_quantized(tmp_path / "q", tmp_path / "a", ratio=1e5)
    assert ("gate_proj" in report["targets"]) == (name == "tiny-llama4"), report["targets"]
