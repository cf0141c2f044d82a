"""Test helpers for GPTQ checkpoints: one written by GPTQModel directly (not through infer), and an independent
numpy-free dequantizer of the v1 "gptq" format used as an oracle."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")  # skip a 30 s C++ build; tiny models pack fast in Python
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(min(2, os.cpu_count() or 1)))


def has_gptqmodel() -> bool:
    try:
        import gptqmodel  # noqa: F401
    except Exception:
        return False
    return True


needs_gptqmodel = pytest.mark.skipif(not has_gptqmodel(), reason="needs the quantize extra (gptqmodel)")


def make_gptqmodel_checkpoint(src_dir, out_dir, bits: int = 4, group_size: int = 32, desc_act: bool = False,
                              sym: bool = True, num_samples: int = 8, seq_len: int = 64, seed: int = 0,
                              **extra) -> Path:
    """Quantize the float model in `src_dir` with GPTQModel's own API into `out_dir` (format "gptq", v1 zero
    points), calibrating on random token ids; `extra`: more QuantizeConfig fields (lm_head, dynamic). Returns
    `out_dir`."""
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.looper import loop_processor
    from gptqmodel.quantization.config import FORMAT
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(src_dir).get_text_config().vocab_size  # (a multimodal one: its text model)
    g = torch.Generator().manual_seed(seed)
    calib = [{"input_ids": torch.randint(3, vocab, (seq_len,), generator=g).tolist(), "attention_mask": [1] * seq_len}
             for _ in range(num_samples)]
    qcfg = QuantizeConfig(bits=bits, group_size=group_size, desc_act=desc_act, sym=sym, format=FORMAT.GPTQ,
                          act_group_aware=False if desc_act else None, **extra)
    with tempfile.TemporaryDirectory() as work:
        old, loop_processor._PROJECT_LOG_DIR = loop_processor._PROJECT_LOG_DIR, Path(work) / "logs"
        try:
            model = GPTQModel.load(str(src_dir), qcfg)
            model.quantize(calib, batch_size=1)
            model.save(str(out_dir))
        finally:
            loop_processor._PROJECT_LOG_DIR = old
    return Path(out_dir)


def unpack_int32(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split each int32 into 32/bits values, lowest bits first, along `dim` (0: rows, 1: columns)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        return ((x.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask).reshape(-1, x.shape[1])
    return ((x.unsqueeze(2) >> shifts.view(1, 1, -1)) & mask).reshape(x.shape[0], -1)


def dequantize_v1(tensors: dict, prefix: str, bits: int) -> torch.Tensor:
    """The float weight [out, in] of a v1 GPTQ linear: W[o, i] = (q[i, o] - (z[g, o] + 1)) * s[g, o], g = g_idx[i]."""
    q = unpack_int32(tensors[prefix + ".qweight"], bits, 0).float()
    z = unpack_int32(tensors[prefix + ".qzeros"], bits, 1).float() + 1
    s = tensors[prefix + ".scales"].float()
    g = tensors[prefix + ".g_idx"].long()
    return ((q - z[g]) * s[g]).t().contiguous()


def dequantized_float_model(float_dir, gptq_dir):
    """The float model of `float_dir` with every GPTQ linear of `gptq_dir` replaced by its dequantized weight (a
    mixture of experts' per-expert projections into transformers 5's stacked experts)."""
    import json

    from safetensors.torch import load_file
    bits = json.loads((Path(gptq_dir) / "quantize_config.json").read_text())["bits"]
    tensors = {}
    for f in sorted(Path(gptq_dir).glob("*.safetensors")):
        tensors.update(load_file(f))
    from helpers import _auto_class  # (a multimodal model's class: Llama 4's Llama4ForConditionalGeneration)
    model = _auto_class(json.loads((Path(float_dir) / "config.json").read_text())).from_pretrained(
        float_dir, dtype=torch.float32)
    state = model.state_dict()
    # (Llama 4's stacks x @ W: gate_up_proj [E, H, 2I], down_proj [E, I, H])
    xw = model.config.get_text_config().model_type == "llama4_text"
    with torch.no_grad():
        for name, t in tensors.items():
            if name.endswith(".qweight"):
                prefix = name[: -len(".qweight")]
                # each layer's own width (GPTQModel's dynamic rules, its 8-bit lm_head): rows = in_features*bits/32
                width = 32 * t.shape[0] // tensors[prefix + ".g_idx"].numel() if prefix + ".g_idx" in tensors else bits
                w = dequantize_v1(tensors, prefix, width)
                expert = re.fullmatch(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)", prefix)
                if expert is None:
                    state[prefix + ".weight"].copy_(w)
                    continue
                # a mixture of experts' expert: its rows of transformers 5's stacked gate_up_proj (gate, then up)
                # or its down_proj
                stack, index, proj = expert[1], int(expert[2]), expert[3]
                if f"{stack}.down_proj" not in state:  # (MiniMax-M2's block_sparse_moe: transformers 5's mlp)
                    stack = stack.replace(".block_sparse_moe.", ".mlp.")
                if xw:
                    w, start = w.t(), 0 if proj in ("gate_proj", "down_proj") else w.shape[0]
                    stacked = state[f"{stack}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][index]
                    stacked[:, start:start + w.shape[1]].copy_(w)
                elif proj in ("down_proj", "w2"):
                    state[f"{stack}.down_proj"][index].copy_(w)
                elif f"{stack}.gate_up_proj" not in state:  # (Nemotron 3's experts: no gate, up_proj stacked alone)
                    state[f"{stack}.{proj}"][index].copy_(w)
                else:
                    half = w.shape[0]
                    start = 0 if proj in ("gate_proj", "w1") else half
                    state[f"{stack}.gate_up_proj"][index, start:start + half].copy_(w)
            elif name in state:
                state[name].copy_(t.float())
    return model.eval()


def gptqmodel_greedy(path, prompts, n: int, every_float: bool = False) -> list[list[int]]:
    """Greedy tokens (EOS ignored) of GPTQModel's own load of the GPTQ checkpoint `path`, its torch kernel computing
    in float32 (loaded in float16, the kernel's dtypes, then cast) with the checkpoint's float32 tensors put back
    exactly (`every_float`: every floating tensor but the scales, in float32: bfloat16 ones too)."""
    from gptqmodel import BACKEND, GPTQModel
    from safetensors.torch import load_file

    from helpers import greedy_each
    model = GPTQModel.load(str(path), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16).model.float().eval()
    for module in model.modules():  # GPTQModel's own weight cache: each linear dequantized at its first forward,
        if hasattr(module, "enable_weight_cache"):  # then reused (the same values; without it every forward
            module.enable_weight_cache(True)  # dequantizes every layer again: most of this oracle's time)
    floats = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        floats.update({k: v.float() for k, v in load_file(f).items() if v.dtype == torch.float32
                       or every_float and v.is_floating_point() and not k.endswith(".scales")})
    assert not model.load_state_dict(floats, strict=False).unexpected_keys
    model.generation_config.eos_token_id = None
    return greedy_each(model, prompts, n)


def int4_kernel_path(monkeypatch) -> None:
    """Every LLM built after this call runs its GPU code path on CPU: GPTQ layers in the kernel layout (packed int4,
    interleaved rows) and every op through its Triton kernel (interpreted without a GPU)."""
    from infer import kernels
    from infer.quant.gptq_linear import GPTQLinearMethod
    real = GPTQLinearMethod.finish_loading

    def kernel_layout(self, layer):
        self.use_kernel = True
        real(self, layer)
    monkeypatch.setattr(GPTQLinearMethod, "finish_loading", kernel_layout)
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)


def check_int4_kernels_with_mixed_adapters(base, paths: dict, tmp_path, monkeypatch, names: list,
                                           act_in_gate_up: bool) -> None:
    """A 4-bit GPTQModel checkpoint of `base` with the adapters `paths` mixed as `names` (None: the base alone) gives
    through the Triton kernels (interpreted) and emulated decode graphs the CPU path's tokens; the fused qkv holds
    no float weight and the int4 gate_up kernel's epilogue applies the activation iff `act_in_gate_up`."""
    from helpers import random_prompts
    from infer import LLM, SamplingParams
    qdir = make_gptqmodel_checkpoint(base, tmp_path / "q", bits=4, group_size=32, seq_len=32)
    opts = dict(loras={n: str(p) for n, p in paths.items()}, max_loras=2, max_lora_rank=8, block_size=4,
                max_model_len=32, max_num_seqs=4)
    prompts = random_prompts(512, (5, 3, 7), seed=9)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(str(qdir), **opts) as llm:
        cpu = [o.token_ids for o in llm.generate(prompts, params, lora=names)]
    int4_kernel_path(monkeypatch)
    with LLM(str(qdir), cuda_graph_max_tokens=4, **opts) as llm:
        model = llm.engine.runner.model
        assert model.layers[0].self_attn.qkv_proj.weight is None
        assert getattr(model.layers[0].mlp, "act_in_gate_up", False) == act_in_gate_up  # (StarCoder2's MLP: none)
        llm.engine.runner.capture_graphs(8, emulate=True)
        assert [o.token_ids for o in llm.generate(prompts, params, lora=names)] == cpu
        assert sum(llm.engine.runner.graphs.replays.values()) > 0


def check_kernel_path_equals_cpu(folder, monkeypatch) -> None:
    """The model in `folder` gives two random prompts the same greedy tokens (4 each) through every op's Triton kernel
    (int4_kernel_path: interpreted on CPU) as on the CPU path."""
    from helpers import random_prompts
    from infer import LLM, SamplingParams
    prompts = random_prompts(512, (5, 9), seed=4)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(str(folder), block_size=4) as llm:
        cpu = [o.token_ids for o in llm.generate(prompts, params)]
    int4_kernel_path(monkeypatch)
    with LLM(str(folder), block_size=4, max_model_len=32) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == cpu


def check_gpu_path_interpreted(folder, monkeypatch, prompts, want) -> dict:
    """The model in `folder` through every op's Triton kernel (int4_kernel_path: interpreted on CPU), decodes through
    emulated CUDA graphs and the other steps (of up to 12 tokens) through emulated piecewise graphs, whose start
    checked the model's pieces against its forward: greedy tokens `want` (6 of each prompt), some decodes replayed.
    Returns the engine's stats."""
    from infer import LLM, SamplingParams
    int4_kernel_path(monkeypatch)
    with LLM(str(folder), block_size=4, max_model_len=32, max_num_batched_tokens=12, max_num_seqs=2,
             cuda_graph_max_tokens=16) as llm:
        llm.engine.runner.capture_graphs(32, emulate=True)
        assert llm.engine.runner.pieces is not None and llm.engine.runner.pieces_check < 1e-5
        assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))] == want
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
        return llm.engine.stats()


def check_gpu_path_equals_transformers(folder, monkeypatch, hf) -> None:
    """check_gpu_path_interpreted of the model in `folder` on prompts of 5 and 13 tokens: transformers' (`hf`'s)
    greedy tokens, some steps through the piecewise graphs."""
    from helpers import greedy_each, random_prompts
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    assert check_gpu_path_interpreted(folder, monkeypatch, prompts, want)["piecewise_graph_steps"] > 0


def infer_quantize(src, out):
    """`infer quantize` of the model `src` (a folder or a built-in's name) into `out`: groups of 32, 8 random
    samples of 32 tokens. Returns `out`."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["quantize", str(src), "-o", str(out), "--group-size", "32", "--num-samples", "8",
                                   "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    return out


def check_infer_quantize_and_convert(src, tmp_path, mlp: str = "gate_proj", gptqmodel_view=None, also=None) -> dict:
    """`infer quantize` of the float model in `src` (groups of 32, 8 samples of 32 tokens) into tmp_path/q writes
    layer 0's mlp.`mlp` and layer 1's o_proj quantized; infer runs it with int4 weights in the fused qkv and gives
    GPTQModel's own load's greedy tokens (8 of 3 prompts; of `gptqmodel_view(out)`, GPTQModel's layout of it, where
    given); `also(out, prompts, got)` checks more of those tokens; `infer convert`'s output (tmp_path/c) gives them too.
    Returns the checkpoint's tensors."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from helpers import greedy_tokens, random_prompts
    from infer import LLM
    from infer.cli.main import app
    out = infer_quantize(src, tmp_path / "q")
    tensors = load_file(out / "model.safetensors")
    assert f"model.layers.0.mlp.{mlp}.qweight" in tensors and "model.layers.1.self_attn.o_proj.qweight" in tensors
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.qweight is not None
        got = greedy_tokens(llm, prompts, 8)
    if also is not None:
        also(out, prompts, got)
    want = gptqmodel_greedy(gptqmodel_view(out) if gptqmodel_view else out, prompts, 8)
    if got != want:  # (a near-tie GPTQModel's float16 products break the other way: decided by infer's margin)
        with LLM(str(out), block_size=4) as llm:
            check_greedy_equal_but_near_ties(llm, prompts, got, want)
    res = CliRunner().invoke(app, ["convert", str(out), "-o", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    with LLM(str(tmp_path / "c"), block_size=4) as llm:
        assert greedy_tokens(llm, prompts, 8) == got
    return tensors


def split_gate_up(src, dst):
    """A copy of GPTQ checkpoint `src` (sharded or not) in one file, with each mlp.gate_up_proj stored as GPTQModel
    writes and reads a Phi-3's (or GLM-4's) MLP: gate_proj and up_proj apart (the halves along the output; g_idx
    each)."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = {}
    for f in sorted(dst.glob("*.safetensors")):
        tensors.update(load_file(f))
    for f in dst.glob("model*.safetensors*"):  # (the shards' index too)
        f.unlink()
    for key in [k for k in tensors if ".mlp.gate_up_proj." in k]:
        t = tensors.pop(key)
        gate, up = (t, t.clone()) if key.endswith("g_idx") else t.chunk(2, dim=-1)
        tensors[key.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
        tensors[key.replace("gate_up_proj", "up_proj")] = up.contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def int4_merged_linear(in_features: int, widths: list, names: list, seed: int = 64):
    """A MergedLinear of int4 GPTQ shards (kernel layout, groups of 128, float16) of random weights, loaded."""
    from infer.models.layers import MergedLinear
    from infer.quant import packing
    from infer.quant.config import GPTQConfig
    from infer.quant.gptq_linear import GPTQLinearMethod
    cfg = GPTQConfig(bits=4, group_size=128, desc_act=False, sym=True)
    layer = MergedLinear(in_features, widths, names, False, GPTQLinearMethod(cfg, True), torch.float16)
    g = torch.Generator().manual_seed(seed)
    for j, width in enumerate(widths):
        for name, t in zip(("qweight", "qzeros", "scales", "g_idx"),
                           packing.quantize_rtn(torch.randn(width, in_features, generator=g), 4, 128, True)):
            layer.load_shard(name, j, t)
    layer.finish_loading()
    return layer


def rtn_gptq_pair(root, build) -> tuple[Path, Path]:
    """(float folder root / "f" that `build` writes, a GPTQ checkpoint of it at root / "q" in GPTQModel's layout:
    every attention, dense MLP, shared expert and expert projection 4-bit by round to nearest, group 32, each
    expert's projections apart, the routers float; quantize_config.json beside it as GPTQModel writes it too)."""
    import json

    from test_probes_session56_review_moeq import rtn_gptq
    build(root / "f")
    rtn_gptq(root / "f", root / "q")
    qc = json.loads((root / "q" / "config.json").read_text())["quantization_config"]
    (root / "q" / "quantize_config.json").write_text(json.dumps(qc))
    return root / "f", root / "q"


def check_gptq_moe_equals_dequantized(src, out, int4_layer=lambda layer: layer.mlp.shared_experts.down_proj) -> None:
    """The GPTQ checkpoint `out` of the MoE model in `src` (rtn_gptq_pair) on infer's CPU path gives transformers'
    greedy tokens of the same weights dequantized in float32 (dequantized_float_model), varied; warmup --estimate
    counts the weights as loaded; layer 1's `int4_layer` (by default its shared experts' down_proj) loaded int4 and
    its MoE quantized."""
    from helpers import estimated_plan, greedy_each, random_prompts
    from infer import LLM, SamplingParams
    from infer.memory.sizes import weights_bytes
    hf = dequantized_float_model(src, out)
    hf.generation_config.eos_token_id = None
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    plan = estimated_plan(str(out), "--dtype", "float32")
    with LLM(str(out), block_size=4, dtype="float32") as llm:
        model = llm.engine.runner.model
        assert plan["weights_bytes"] == weights_bytes(model)
        assert int4_layer(model.layers[1]).qweight is not None and model.layers[1].mlp.method_for
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))]
    assert got == greedy_each(hf, prompts, 8)
    assert len({t for tokens in got for t in tokens}) > 6  # (varied tokens: the comparison means something)


def quantize_refusal(src, out) -> str:
    """`infer quantize SRC -o OUT` refused: it fails and writes no OUT; returns its output, white space folded."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["quantize", str(src), "-o", str(out)], env={"COLUMNS": "250"})
    assert res.exit_code != 0 and not Path(out).exists(), res.output
    return " ".join(res.output.split())


def check_int4_experts_path_equals_cpu(path, monkeypatch, prompts, check_model) -> list[int]:
    """The GPU code path (every op through its Triton kernel, interpreted; decode steps through emulated CUDA graphs;
    prefills in chunks) of the GPTQ mixture of experts in `path`: `check_model(model)` passes on the model it built
    (its experts held int4), the int4 fused MoE ran, and the CPU path's tokens (5 of each prompt) and logprobs
    (within 1e-3) come out. Returns the w13 widths (out_features) the fused MoE was given."""
    from infer import LLM, SamplingParams
    from infer.kernels import moe as moe_kernels
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=1)
    opts = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=64)
    with LLM(str(path), **opts) as llm:
        cpu = llm.generate(prompts, params)
    int4_kernel_path(monkeypatch)
    widths = []
    real = moe_kernels.fused_moe_int4
    monkeypatch.setattr(moe_kernels, "fused_moe_int4", lambda *a: widths.append(a[1].out_features) or real(*a))
    with LLM(str(path), cuda_graph_max_tokens=4, **opts) as llm:
        check_model(llm.engine.runner.model)
        llm.engine.runner.capture_graphs(64, emulate=True)
        gpu = llm.generate(prompts, params)
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert widths
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    for a, b in zip(gpu, cpu):
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert abs(ra["logprob"] - rb["logprob"]) < 1e-3
    return widths


def check_quantized_moe_equals_references(src, out, prompts, gptqmodel_view=None, gptqmodel_layout=None):
    """infer's greedy tokens (8 of each prompt, float32) of the GPTQ checkpoint `out` of the float model `src`: varied,
    equal to transformers' on `src` with every GPTQ layer's dequantized weight and to GPTQModel's own load of it
    (given `gptqmodel_view(checkpoint)` where GPTQModel needs infer's view of the model; of `gptqmodel_layout`, a copy
    under GPTQModel's names, where given); `warmup --estimate`'s weights are the loaded model's. Returns the tokens."""
    import contextlib

    from helpers import estimated_plan, greedy_each, greedy_tokens
    from infer import LLM
    from infer.memory.sizes import weights_bytes
    plan = estimated_plan(str(out), "--max-length", "256", "--dtype", "float32")
    with LLM(str(out), block_size=4, max_model_len=256, dtype="float32") as llm:
        assert plan["weights_bytes"] == weights_bytes(llm.engine.runner.model)
        got = greedy_tokens(llm, prompts, 8)
    assert len({t for tokens in got for t in tokens}) > 6
    hf = dequantized_float_model(src, out)
    hf.generation_config.eos_token_id = None  # (never stop: greedy_tokens ignores EOS)
    references = [greedy_each(hf, prompts, 8)]
    layout = gptqmodel_layout or out
    with (gptqmodel_view or (lambda _: contextlib.nullcontext()))(layout):
        references.append(gptqmodel_greedy(layout, prompts, 8, every_float=True))
    if any(want != got for want in references):  # (a near-tie a reference breaks the other way: infer's margin)
        with LLM(str(out), block_size=4, max_model_len=256, dtype="float32") as llm:
            for want in references:
                check_greedy_equal_but_near_ties(llm, prompts, got, want)
    return got


def quantized_builtins(root, names) -> dict:
    """{built-in name: (its GPTQ checkpoint under `root`, `infer quantize`'s output, words joined by single spaces)}
    of each of `names` (groups of 32, 8 random samples of 32 tokens)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    done = {}
    for name in names:
        res = CliRunner().invoke(app, ["quantize", name, "-o", str(root / name), "--group-size", "32",
                                       "--num-samples", "8", "--seq-len", "32"])
        assert res.exit_code == 0, res.output
        done[name] = root / name, " ".join(res.output.split())
    return done


def check_greedy_equal_but_near_ties(llm, prompts, got, want, eps: float = 1e-2) -> None:
    """infer's greedy tokens `got` (of `llm`, `prompts`) equal another runtime's `want`, or part where infer's own top
    two log-probabilities are within `eps` at the first token they differ, and are those two tokens:
    a near-tie that the other runtime's rounding breaks the other way, after which the two continue from different
    tokens. At least one prompt must agree whole. (The tiny random models' distributions are flat, their top tokens
    around -3.6 with many within 0.1; on an AMD EPYC the references moved the top two by 1.6e-3 to 5e-3: GPTQModel's
    float16 products, transformers' other reduction order in a mixture of experts' routing.)"""
    from infer import SamplingParams
    whole = 0
    for p, g, w in zip(prompts, got, want):
        at = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if at is None:
            assert len(g) == len(w)
            whole += 1
            continue
        # (infer alone, the prompt's tokens up to there forced: in bfloat16 its batched run may break the tie too)
        [out] = llm.generate([p + g[:at]], SamplingParams(max_new_tokens=1, ignore_eos=True, logprobs=2))
        top = out.logprobs[0]["top_logprobs"]
        assert {top[0]["token_id"], top[1]["token_id"]} == {g[at], w[at]}, (at, g, w, top)
        assert top[0]["logprob"] - top[1]["logprob"] < eps, (at, g, w, top)
    assert whole, (got, want)


def check_lora_validate_quantized(gptq, adapter, ratio: float = 100.0) -> dict:
    """`infer lora-validate GPTQ a=ADAPTER --quantized --steps 3 --json` passes against peft on the dequantized int4
    base: tokens agree, and the adapter moves the logits over `ratio` times the two's largest difference. Returns the
    report."""
    import json
    from typer.testing import CliRunner
    from infer.cli.main import app
    res = CliRunner().invoke(app, ["lora-validate", str(gptq), f"a={adapter}", "--quantized", "--steps", "3",
                                   "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output[res.output.index('{"name"'):].splitlines()[0])
    assert report["ok"] and report["numeric"]["tokens_agree"], report
    assert report["numeric"]["oracle"] == "peft on the dequantized int4 base"
    assert report["numeric"]["adapter_effect"] > ratio * report["numeric"]["max_abs_diff"], report
    return report
