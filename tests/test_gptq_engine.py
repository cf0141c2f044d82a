"""GPTQ checkpoints through the engine: greedy tokens equal transformers' on the same int4 checkpoint, merged
layers equal F.linear on the dequantized weight, and broken checkpoints give errors that name the tensor."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM, SamplingParams, kernels
from infer.cli.main import app
from infer.engine.config import EngineConfig
from infer.models.layers import MergedLinear
from infer.models.tiny import ensure_builtin
from infer.quant import packing
from infer.quant.config import GPTQConfig
from infer.quant.gptq_linear import GPTQLinearMethod

from helpers import random_prompts
from quant_helpers import int4_kernel_path, make_gptqmodel_checkpoint, needs_gptqmodel

N = 12


def hf_gptq_greedy(path, prompts, n):
    """transformers + GPTQModel's exact torch kernel (its default CPU kernel rounds scales to bf16)."""
    from transformers import AutoModelForCausalLM, GPTQConfig as HFGPTQConfig
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    qc = {k: qc[k] for k in ("bits", "group_size", "desc_act", "sym")}
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu",
                                             quantization_config=HFGPTQConfig(**qc, backend="torch"))
    m.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            outs.append(m.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist())
    return outs


def _check_against_hf(path):
    llm = LLM(str(path), block_size=4)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (4, 9, 17, 26, 33), seed=11)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_gptq_greedy(path, prompts, N)


@pytest.fixture(scope="module")
def infer_quantized(tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "tiny-llama-gptq"
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "-o", str(out), "--group-size", "32",
                                   "--num-samples", "16", "--seq-len", "64"])
    assert res.exit_code == 0, res.output
    return out


@needs_gptqmodel
def test_infer_quantize_checkpoint_matches_transformers(infer_quantized):
    _check_against_hf(infer_quantized)


@needs_gptqmodel
def test_gptqmodel_written_checkpoint_desc_act_asym_qwen2(tmp_path):
    path = make_gptqmodel_checkpoint(ensure_builtin("tiny-qwen2"), tmp_path / "q", bits=4, group_size=32,
                                     desc_act=True, sym=False)
    _check_against_hf(path)


@pytest.mark.parametrize("bits, group, v2", [(4, 32, False), (8, -1, True), (4, 64, True), (8, 128, False)])
def test_merged_gptq_layer_equals_linear_on_dequantized_weight(bits, group, v2):
    g = torch.Generator().manual_seed(bits + group)
    k, sizes = 128, [64, 32, 32]
    cfg = GPTQConfig(bits=bits, group_size=group, checkpoint_format="gptq_v2" if v2 else "gptq")
    layer = MergedLinear(k, sizes, ["q", "k", "v"], True, GPTQLinearMethod(cfg), torch.float32)
    weights = []
    for shard, n in enumerate(sizes):
        w = torch.randn(n, k, generator=g)
        qw, qz, s, gi = packing.quantize_rtn(w, bits, group, sym=False)
        if v2:
            qz = packing.zeros_v1_to_v2(qz, bits)
        for name, t in (("qweight", qw), ("qzeros", qz), ("scales", s), ("g_idx", gi)):
            layer.load_shard(name, shard, t)
        layer.load_shard("bias", shard, torch.randn(n, generator=g))
        weights.append(packing.dequantize(qw, qz, s, gi, bits, zeros_v1=not v2))
    layer.finish_loading()
    x = torch.randn(5, k, generator=g)
    expect = torch.nn.functional.linear(x, torch.cat(weights), layer.bias)
    assert torch.allclose(layer(x), expect, atol=1e-4, rtol=1e-4)
    ref = __import__("infer.kernels.reference", fromlist=["gptq_matmul"])
    y = ref.gptq_matmul(x, layer.qweight, layer.qzeros, layer.scales, layer.g_idx, bits, not v2) + layer.bias
    assert torch.allclose(y, expect, atol=1e-4, rtol=1e-4)


def _edit_checkpoint(src, dst, change):
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@needs_gptqmodel
@pytest.mark.parametrize("what, message", [
    ("missing-scales", "model.layers.0.self_attn.k_proj.scales"),
    ("bad-qweight", "model.layers.1.mlp.down_proj.qweight has shape"),
    ("corrupt", "cannot read weight file"),
])
def test_broken_checkpoints_exit_2_naming_the_tensor(infer_quantized, tmp_path, what, message):
    dst = tmp_path / what
    if what == "missing-scales":
        _edit_checkpoint(infer_quantized, dst, lambda t: t.pop("model.layers.0.self_attn.k_proj.scales"))
    elif what == "bad-qweight":
        def shrink(t):
            name = "model.layers.1.mlp.down_proj.qweight"
            t[name] = t[name][:, :-8].contiguous()
        _edit_checkpoint(infer_quantized, dst, shrink)
    else:
        shutil.copytree(infer_quantized, dst)
        data = (dst / "model.safetensors").read_bytes()
        (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hello"}\n')
    res = CliRunner().invoke(app, ["run", str(dst), str(inp), "-q"])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


@needs_gptqmodel
def test_int4_kernel_path_interpreted_with_emulated_graphs_equals_cpu_path(infer_quantized, monkeypatch):
    """The GPU code path of a GPTQ model on CPU: the kernel's packed layout, every op through its Triton kernel
    (interpreted), decode steps through emulated CUDA graphs; greedy tokens equal the CPU path's (which equal
    transformers', test above)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    prompts = random_prompts(256, (4, 9, 6), seed=3)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    cpu = [o.token_ids for o in LLM(str(infer_quantized), block_size=4, max_num_seqs=4).generate(prompts, params)]
    int4_kernel_path(monkeypatch)
    llm = LLM(str(infer_quantized), block_size=4, max_num_seqs=4, max_model_len=64, cuda_graph_max_tokens=32)
    layer = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert layer.weight is None and layer.qweight is not None  # really the packed int4 path
    assert llm.engine.runner.model.layers[0].mlp.act_in_gate_up  # silu_and_mul in gate_up's epilogue (the default)
    llm.engine.runner.capture_graphs(64, emulate=True)
    gemm = kernels._triton("gptq_gemm")
    launch, gated = gemm._launch, []
    monkeypatch.setattr(gemm, "_launch", lambda *a, **kw: (gated.append(len(a) > 16 and a[16]), launch(*a, **kw))[1])
    assert [o.token_ids for o in llm.generate(prompts, params)] == cpu
    assert any(gated), "no gate_up kernel applied silu_and_mul in its epilogue"
    assert sum(llm.engine.runner.graphs.replays.values()) >= 4
    assert llm.engine.stats()["piecewise_graph_steps"] >= 1  # the 19-token prefill, padded to 32


@needs_gptqmodel
def test_graph_capture_first_reserves_the_dequant_scratch_for_the_largest_layer(infer_quantized, monkeypatch):
    """Before any graph records the int4 dequantize scratch's address, the runner sizes it for the largest GPTQ
    layer (what memory.sizes.dequant_scratch_bytes budgets; 0 on CPU, so it is stood in for here)."""
    from infer.kernels import gptq_dequant
    from infer.memory import sizes
    llm = LLM(str(infer_quantized), block_size=4, max_num_seqs=4, max_model_len=64)
    runner = llm.engine.runner
    largest = max(m.qweight.numel() * 8 for m in runner.model.modules() if getattr(m, "qweight", None) is not None)
    seen = []
    monkeypatch.setattr(sizes, "dequant_scratch_bytes", lambda model, dtype, tokens: (seen.append(tokens),
                                                                                       largest * 4)[1])
    gptq_dequant.release_scratch(torch.device("cpu"))
    runner._reserve_dequant_scratch()
    assert seen == [4096] and gptq_dequant._SCRATCH[(torch.device("cpu"), torch.float32)].numel() == largest
    gptq_dequant.release_scratch(torch.device("cpu"))


@needs_gptqmodel
def test_warmup_estimate_on_cuda_counts_the_dequant_scratch(infer_quantized, monkeypatch):
    """`infer warmup --estimate` (no weights loaded) counts the int4 dequantize scratch an engine start on CUDA
    reserves for steps of more than 256 tokens: the biggest GPTQ layer as the engine merges them (gate/up), from
    the checkpoint's headers. It was left out, so the estimate gave the KV cache memory the engine would not."""
    from infer.cli import warmup_plan
    from infer.memory import checkpoint
    from infer.models.loader import weight_files
    llm = LLM(str(infer_quantized), block_size=4, max_num_seqs=4, max_model_len=64)
    largest = max(m.qweight.numel() * 8 for m in llm.engine.runner.model.modules()
                  if getattr(m, "qweight", None) is not None)
    llm.close()
    assert checkpoint.checkpoint_int4_layer_elements(weight_files(infer_quantized), 4) == largest
    assert largest == 64 * 2 * 128  # tiny-llama's merged gate_up: hidden 64 x (2 x intermediate 128)
    # an estimate for a CUDA device, on this CPU machine: a stand-in GPU of 8 GiB
    parts = warmup_plan._model_parts
    monkeypatch.setattr(warmup_plan, "_model_parts", lambda cfg: (*parts(cfg)[:2], torch.device("cuda"),
                                                                  torch.float16))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 8 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)

    real, without = checkpoint.checkpoint_int4_layer_elements, []
    monkeypatch.setattr(checkpoint, "checkpoint_int4_layer_elements",
                        lambda files, bits: 0 if without else real(files, bits))

    def activations(tokens: int, scratch: bool) -> int:
        without[:] = [] if scratch else [1]
        cfg = EngineConfig(str(infer_quantized), max_num_batched_tokens=tokens, enforce_eager=True)
        return warmup_plan.estimate_plan(cfg, 64, 4)[0].activation_peak_bytes
    assert activations(512, True) - activations(512, False) == largest * 2  # float16
    assert activations(256, True) == activations(256, False)  # steps this short never take the dequantize path


@needs_gptqmodel
def test_asymmetric_zero_points_of_zero_match_transformers(tmp_path):
    """Groups whose weights are all positive get a zero point of 0; GPTQModel's v1 words then borrow from the next
    field. infer read those zeros field by field and gave the neighbouring output columns other weights than
    transformers (and tokens differed)."""
    from safetensors.torch import load_file, save_file
    src = tmp_path / "posrows"
    shutil.copytree(ensure_builtin("tiny-llama"), src)
    weights = load_file(src / "model.safetensors")
    for k in weights:
        if k.endswith(("mlp.down_proj.weight", "self_attn.o_proj.weight")):
            weights[k][::3] = weights[k][::3].abs() + 0.01  # every third output row all positive
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    path = make_gptqmodel_checkpoint(src, tmp_path / "q", bits=4, group_size=32, desc_act=False, sym=False)
    stored = load_file(path / "model.safetensors")["model.layers.0.mlp.down_proj.qzeros"]
    assert (packing.unpack_cols(stored, 4) == 15).any()  # a borrow is there: the check below is not idle
    _check_against_hf(path)
