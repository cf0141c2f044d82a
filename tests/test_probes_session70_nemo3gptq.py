"""Session 70: GPTQ experts of Nemotron 3 (refused before). `infer quantize` of a Nemotron 3 quantizes its routed
experts too (quant.quantize._nemotron_h_view: the experts in GPTQModel's tree, counted by n_routed_experts; Super's
experts between its latent projections); infer loads them (each expert's up_proj and down_proj apart, no gate): on the
CPU dequantized into the float experts, on the GPU path held int4 in their stacks (w13_int4 of I columns) and run by
the int4 fused MoE with relu²; greedy tokens equal GPTQModel's own load and transformers on the dequantized weights,
the GPU path's the CPU path's; `warmup --estimate` counts the weights as held; the hub's Super fits one 80 GB GPU in
int4."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from helpers import random_prompts
from quant_helpers import check_int4_experts_path_equals_cpu, check_quantized_moe_equals_references, needs_gptqmodel

pytestmark = needs_gptqmodel

PROMPTS = random_prompts(512, (4, 11, 23), seed=11)


def _quantize(src, out, *extra: str) -> tuple:
    """`infer quantize` of `src` into `out` (groups of 32, 8 random samples of 32 tokens; `extra` options): (out, its
    output, words joined by single spaces)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["quantize", str(src), "-o", str(out), "--group-size", "32", "--num-samples", "8",
                                   "--seq-len", "32", *extra])
    assert res.exit_code == 0, res.output
    return out, " ".join(res.output.split())


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """{kind: (the float model, its GPTQ checkpoint, quantize's output)}: Nemotron 3 (tiny-nemotron-h-moe, and with
    --desc-act --no-sym) and Nemotron 3 Super (a latent of 24, biases)."""
    from infer.models.tiny import ensure_builtin
    from test_probes_session69_nemo3super import _build
    root = tmp_path_factory.mktemp("nemo3-gptq")
    _build(root / "super", mlp_bias=True)
    nano = ensure_builtin("tiny-nemotron-h-moe")
    return {"nano": (nano, *_quantize(nano, root / "nano")),
            "nano-act": (nano, *_quantize(nano, root / "nano-act", "--desc-act", "--no-sym")),
            "super": (root / "super", *_quantize(root / "super", root / "super-q"))}


@pytest.mark.parametrize("kind", ["nano", "nano-act", "super"])
def test_every_routed_expert_is_int4_and_the_tokens_are_gptqmodels(quantized, kind):
    """Every routed expert's up_proj and down_proj in both sparse layers written int4 (the router float); infer's
    greedy tokens equal GPTQModel's own load of the checkpoint (given infer's view of the layers) and transformers'
    on the float model with every GPTQ layer's dequantized weight; --estimate's weights are the loaded model's; the
    notes say transformers does not read the experts."""
    from infer.quant.quantize import _nemotron_h_view
    src, out, output = quantized[kind]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    experts = {f"model.layers.{i}.mixer.experts.{e}.{p}.qweight" for i in (1, 5) for e in range(8)
               for p in ("up_proj", "down_proj")}
    assert experts <= names, sorted(experts - names)
    assert not any(".experts." in n and n.endswith(".weight") for n in names)
    assert "model.layers.1.mixer.gate.weight" in names and "model.layers.1.mixer.gate.qweight" not in names
    assert "transformers does not read GPTQ experts: its Nemotron 3 experts stay float layers" in output
    assert "infer read them" in output
    check_quantized_moe_equals_references(src, out, PROMPTS, _nemotron_h_view)


@pytest.mark.parametrize("kind", ["nano-act", "super"])
def test_the_gpu_path_holds_the_experts_int4_and_gives_the_cpu_paths_tokens(quantized, monkeypatch, kind):
    """The GPU code path (every op through its Triton kernel, interpreted; decode steps through emulated CUDA graphs;
    prefills in chunks) keeps the experts int4 in their stacks, the up projections alone (I columns, no gate), sorted
    by group where act-order, and runs the int4 fused MoE: the CPU path's tokens, logprobs close."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    _, out, _ = quantized[kind]
    latent = 24 if kind == "super" else 64

    def check(model):
        experts = model.layers[5].mixer.experts
        assert experts.w13.numel() == experts.w2.numel() == 0
        assert tuple(experts.w13_int4.words.shape) == (8, latent // 8, 32)
        assert tuple(experts.w13_int4.scales.shape) == (8, -(-latent // 32), 32)  # (groups of 32)
        assert tuple(experts.w2_int4.words.shape) == (8, 32 // 8, latent)
        assert (experts.w13_int4.perm is not None) == (kind == "nano-act")
    assert set(check_int4_experts_path_equals_cpu(out, monkeypatch, PROMPTS[:2], check)) == {32}


@pytest.mark.parametrize("kind", ["nano-act", "super"])
def test_the_estimate_counts_the_experts_as_each_path_holds_them(quantized, monkeypatch, kind):
    """`warmup --estimate`'s count of the checkpoint's weights is what the engine holds: on the GPU path the experts'
    int4 tensors as stored (their g_idx, and with act-order their perm); on the CPU the float experts (their up rows
    alone, of the latent's width in Super)."""
    from infer.memory.checkpoint import checkpoint_weights_bytes
    from infer.memory.sizes import weights_bytes
    from infer.models.loader import load_model, weight_files
    from quant_helpers import int4_kernel_path
    _, out, _ = quantized[kind]
    files = weight_files(out)
    act = kind == "nano-act"

    def held(model, *without: str):  # without the rope tables (not weights) and the buffers named `without`
        return weights_bytes(model) - sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                                          if n.endswith(("cos_sin", *without)))
    model, cfg = load_model(out, torch.float32, torch.device("cpu"))
    assert model.layers[1].mixer.experts.w13.shape == (8, 32, 24 if kind == "super" else 64)  # (up rows alone)
    assert checkpoint_weights_bytes(files, cfg, torch.float32, torch.device("cpu"), 4, act) == held(model)
    int4_kernel_path(monkeypatch)
    model, cfg = load_model(out, torch.float32, torch.device("cpu"))
    assert model.layers[1].mixer.experts.w13.numel() == 0
    # (the CPU's prepacked copies of the other layers: no GPU holds them)
    assert checkpoint_weights_bytes(files, cfg, torch.float32, torch.device("cuda"), 4, act) == \
        held(model, "packed_weight", "packed_head")


def test_a_missing_expert_tensor_is_named(quantized, tmp_path, monkeypatch):
    """A checkpoint without one expert's up_proj.qweight is refused naming that tensor, on the CPU and the GPU path."""
    import shutil

    from safetensors.torch import load_file, save_file

    from infer.errors import ModelLoadError
    from infer.models.loader import load_model
    from quant_helpers import int4_kernel_path
    _, out, _ = quantized["nano"]
    shutil.copytree(out, tmp_path / "q")
    state = load_file(str(out / "model.safetensors"))
    del state["model.layers.5.mixer.experts.6.up_proj.qweight"]
    save_file(state, str(tmp_path / "q" / "model.safetensors"), metadata={"format": "pt"})
    for gpu in (False, True):
        if gpu:
            int4_kernel_path(monkeypatch)
        with pytest.raises(ModelLoadError, match=r"model\.layers\.5\.mixer\.experts\.6\.up_proj\.qweight"):
            load_model(tmp_path / "q", torch.float32, torch.device("cpu"))


def test_the_hubs_super_in_int4_fits_one_80_gb_gpu(tmp_path, monkeypatch):
    """A 4-bit GPTQ NVIDIA-Nemotron-3-Super-120B-A12B of the hub's config and shapes (groups of 128: every
    projection's, each expert's apart, in the layout `infer quantize` writes): built as a GPU builds it, every sparse
    layer's experts int4 (no float experts); the weights a GPU holds (memory.checkpoint), about 225 GiB in bfloat16,
    come to about 0.54 bytes a parameter (65 GB), and `warmup --estimate` on an 80 GiB GPU fits three sequences of
    131,072 tokens (the KV of its 8 attention layers beside the Mamba-2 layers' state slots)."""
    import json

    from typer.testing import CliRunner

    from helpers import hub_shaped_folder
    from infer.cli.main import app
    from infer.memory.checkpoint import checkpoint_load_bytes
    from infer.models import moe
    from infer.models.loader import linear_method_factory, load_config
    from infer.models.registry import model_class
    from test_probes_session67_llama4b import on_an_80_gb_gpu
    from test_probes_session69_nemo3super import SUPER_120B
    params = hub_shaped_folder(tmp_path, "nemotron_h", "NemotronHForCausalLM", SUPER_120B, gptq_group=128)
    cfg = load_config(tmp_path)
    with moe.meta_as_gpu(), torch.device("meta"):
        model = model_class(cfg)(cfg, torch.bfloat16, linear_method_factory(tmp_path, cfg))
    blocks = [m for m in model.modules() if isinstance(m, moe.SparseMoeBlock)]
    assert len(blocks) == 40 and all(b.experts.w13.numel() == 0 and b.int4 is not None for b in blocks)
    assert tuple(blocks[0].experts.w13_int4.words.shape) == (512, 1024 // 8, 2688)
    weights = checkpoint_load_bytes(tmp_path, cfg, torch.bfloat16, torch.device("cuda"))
    assert 0.5 * params < weights < 0.56 * params, (weights, params)
    on_an_80_gb_gpu(monkeypatch)
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate", "--json", "--device", "cuda",
                                   "--max-length", "131072", "--concurrency", "3"])
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.exit_code == 0 and plan["fits"], res.output
    assert weights <= plan["weights_bytes"] < weights + 2 ** 27  # (with the tables of positions, 65 MiB)


def test_the_transformers_note_is_for_a_nemotron_with_experts_alone():
    """quantize's note that transformers does not read GPTQ experts: for a Nemotron 3 (its layers_block_type's "moe"
    layers as transformers 5 writes it, or the hub's hybrid_override_pattern's "E"), naming infer alone as its
    reader (GPTQModel.load needs infer's view of its layers); none for a Nemotron-H without experts."""
    from infer.quant.quantize import moe_notes
    for config in ({"layers_block_type": ["mamba", "moe", "attention"]}, {"hybrid_override_pattern": "ME*"}):
        notes = moe_notes({"model_type": "nemotron_h", **config}, {}, 3)
        assert len(notes) == 1 and "its Nemotron 3 experts stay float" in notes[0]
        assert notes[0].endswith("; infer read them")
    for config in ({"layers_block_type": ["mamba", "mlp", "attention"]}, {"hybrid_override_pattern": "M-*"}):
        assert moe_notes({"model_type": "nemotron_h", **config}, {}, 3) == []
    assert moe_notes({"model_type": "qwen3_moe"}, {}, 3)[0].endswith("infer, GPTQModel.load and vLLM read them")
    assert moe_notes({"model_type": "mixtral"}, {}, 3)[0].endswith("; infer and vLLM read them")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
def test_the_moe_bench_times_experts_without_gate(monkeypatch, capsys):
    """`python -m infer.bench.moe --ungated`'s measuring code (interpreted, a wall-clock timer, tiny experts): the
    int4 experts' w13 of I columns (the kernels' relu(up)²), their floors two projections' bytes an expert, not
    three; --ungated with --oai or --mxfp4 is refused by name."""
    from infer.bench import moe as bench
    from infer.kernels import gptq_tune
    from infer.kernels import moe as kernels_moe
    from test_probes_session61_epi import counted_clock
    monkeypatch.setattr(gptq_tune, "time_graph", counted_clock)
    widths = []
    real = kernels_moe.fused_moe_int4
    monkeypatch.setattr(kernels_moe, "fused_moe_int4", lambda x, w13, w2, *a, **k: widths.append(
        (w13.out_features, w2.in_features)) or real(x, w13, w2, *a, **k))
    rows = {u: bench.measure([3], 4, 2, 64, 32, 32, False, 1e12, device="cpu", ungated=u)[0] for u in (False, True)}
    assert set(widths) == {(64, 32), (32, 32)}
    for ungated, projections in ((False, 3), (True, 2)):
        r = rows[ungated]
        q = bench.int4_bytes(r["experts_chosen"], 64, (projections - 1) * 32, 32) + bench.int4_bytes(
            r["experts_chosen"], 32, 64, 32)
        assert r["ungated"] == ungated and r["int4_floor_us"] == round(q / 1e12 * 1e6, 2)
        assert r["bf16_floor_us"] == round(r["experts_chosen"] * projections * 64 * 32 * 2 / 1e12 * 1e6, 2)
    for other in ("--oai", "--mxfp4"):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--ungated", other])
        assert exc.value.code == 2 and f"{other} times gpt-oss's gated ones" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")
@pytest.mark.parametrize("act_order", [False, True])
def test_ungated_int4_experts_with_a_partial_last_group_equal_the_reference(act_order):
    """Nemotron 3 Nano's experts in groups of 128 (its down projection's 1856 inputs: 14 groups and a half), in
    small: the int4 fused MoE without gate (interpreted; w13 of I columns, relu(up)²) over a down projection of 48
    inputs in groups of 32 equals the experts dequantized then the float reference; the MoE bench builds and counts
    such experts (a partial last group's scale and zeros)."""
    from infer.bench import moe as bench
    from infer.kernels import moe, reference
    from helpers import nan_filled_empty
    w13 = bench.random_experts(4, 64, 48, 32, act_order, 0, device="cpu").sorted_by_group(32)
    w2 = bench.random_experts(4, 48, 64, 32, act_order, 1, device="cpu").sorted_by_group(32)
    assert tuple(w2.scales.shape) == (4, 2, 64) and bench.int4_bytes(4, 48, 64, 32) == 4 * (48 * 64 / 2 + 2 * 64 * 2.5)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    w, ids = torch.topk(torch.randn(7, 4, generator=torch.Generator().manual_seed(4)).softmax(-1), 2, -1)
    want = reference.fused_moe(x, w13.dequantize(x.dtype), w2.dequantize(x.dtype), w, ids)
    with nan_filled_empty(moe):
        got = moe.fused_moe_int4(x, w13, w2, w, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_the_moe_bench_accepts_a_partial_last_group(monkeypatch, capsys):
    """`python -m infer.bench.moe --intermediate 1856` (Nemotron 3 Nano's experts, groups of 128 by default) gets
    past the shape checks to the GPU check (it was refused as no multiple of the group size); a width that int4
    cannot pack (no multiple of 8) is still refused by name."""
    from infer.bench import moe as bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--ungated", "--experts", "128", "--top-k", "6", "--hidden", "2688", "--intermediate",
                       "1856", "--tokens", "1"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench.main(["--intermediate", "1852"])
    assert exc.value.code == 2 and "--intermediate 1852 is no multiple of 8" in capsys.readouterr().err
