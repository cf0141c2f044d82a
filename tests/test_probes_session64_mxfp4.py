"""Session 64: gpt-oss's MXFP4 experts kept packed (the hub's gpt-oss-20b / 120b: uint8 blocks of two e2m1 codes a
byte, an e8m0 scale a group of 32), never dequantized at load: models.moe's Mxfp4Stack holds the checkpoint's
tensors as stored, kernels.moe.fused_moe_mxfp4 (Triton) dequantizes them in registers, the CPU's reference one expert
at a time as a call reaches it. The packed layer equals the layer of the experts dequantized (the old load) bit for
bit in float32 and bfloat16; the Triton kernel (interpreted) equals the reference; it compiles for sm_90 and sm_89
once a BLOCK_M and fits their shared memory; the engine's tokens (CPU and the GPU path interpreted) are
transformers' of the same folder (Mxfp4Config(dequantize=True)); the memory plan counts the packed bytes; what does
not match the config refused by name; the bench's MXFP4 entry."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest
import torch

from infer.errors import ModelLoadError
from infer.kernels import reference
from infer.kernels.moe import SM90_SMEM

from helpers import COMPILE_ONLY_PREAMBLE, greedy_each, interpreted_module, nan_filled_empty, random_prompts, \
    run_compile_only
from test_probes_session60_gptoss import build, interpreted, to_mxfp4
from test_probes_session63_rdelta import SM89_SMEM

# test_probes_session60_gptoss's SMALL: 4 layers of 8 experts (top-2), H 64, I 32
E, H, I, LAYERS = 8, 64, 32, 4


def mxfp4_experts(e: int, k: int, n: int, seed: int) -> reference.Mxfp4Experts:
    """Random MXFP4 experts of K inputs and N outputs: every code, scales 2^-6 to 2^1."""
    g = torch.Generator().manual_seed(seed)
    return reference.Mxfp4Experts(torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8),
                                  torch.randint(121, 129, (e, n, k // 32), generator=g, dtype=torch.uint8))


def oai_of(e: int, h: int, inter: int, seed: int, dtype=torch.float32) -> reference.OaiExperts:
    g = torch.Generator().manual_seed(seed)
    return reference.OaiExperts(torch.randn(e, 2 * inter, generator=g).to(dtype),
                                torch.randn(e, h, generator=g).to(dtype), 1.702, 7.0)


def routing(t: int, e: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    logits[:, 0] -= 100  # an expert no token chose
    return torch.topk(logits.softmax(-1), k, -1)


def test_mxfp4_dequantize_is_the_e2m1_table_times_the_power_of_two():
    """Each code's value (transformers' FP4_VALUES), low nibble first, times 2^(scale - 127): a hand-made group."""
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, :8] = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    got = reference.mxfp4_dequantize(blocks, torch.tensor([[[128]]], dtype=torch.uint8), torch.float32)[0, 0]
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert got[:16].tolist() == [2 * v for v in want] and not got[16:].any()


# ------------------------------------------------------------------------------------------------ the layer
@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """(the MXFP4 gpt-oss folder, the same with config.json's quantization_config dropped (the loader's old path:
    the blocks dequantized at load into float experts), transformers' model of it dequantized, float32)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    root = tmp_path_factory.mktemp("mxfp4")
    build(root / "m", seed=2)
    to_mxfp4(root / "m", seed=2)
    shutil.copytree(root / "m", root / "old")
    cfg = json.loads((root / "old" / "config.json").read_text())
    del cfg["quantization_config"]
    (root / "old" / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(root / "m", dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    hf.generation_config.eos_token_id = None
    return root / "m", root / "old", hf


def sparse_blocks(model):
    from infer.models.moe import SparseMoeBlock
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_layer_equals_the_dequantized_one(mxfp4_folder, dtype):
    """A sparse layer of the MXFP4 checkpoint holds the stored blocks and scales as they are (uint8, no float
    experts), and its output on random rows is the output of the same layer loaded the old way (the experts
    dequantized at load into float w13 / w2), bit for bit, in float32 and in bfloat16."""
    from safetensors.torch import load_file

    from infer.models.loader import load_model
    folder, old, _ = mxfp4_folder
    stored = load_file(folder / "model.safetensors")
    packed, _ = load_model(folder, dtype, torch.device("cpu"))
    floats, _ = load_model(old, dtype, torch.device("cpu"))
    for i, (p, f) in enumerate(zip(sparse_blocks(packed), sparse_blocks(floats))):
        ex = p.experts
        assert ex.mxfp4 and ex.w13.numel() == ex.w2.numel() == 0 and not f.experts.mxfp4
        for name, stack in (("gate_up_proj", ex.w13_mxfp4), ("down_proj", ex.w2_mxfp4)):
            assert torch.equal(stack.blocks, stored[f"model.layers.{i}.mlp.experts.{name}_blocks"])
            assert torch.equal(stack.scales, stored[f"model.layers.{i}.mlp.experts.{name}_scales"])
        x = torch.randn(23, H, generator=torch.Generator().manual_seed(i)).to(dtype)
        with torch.no_grad():
            got, want = p(x)[0], f(x)[0]
        assert torch.equal(got, want), (i, (got - want).abs().max())
        assert want.abs().max() > 0.1
    # the experts alone, through the kernels' entry (kernels.fused_moe_mxfp4: the CPU's reference)
    from infer import kernels
    w13, w2 = packed.layers[0].mlp.experts.w13_mxfp4.experts(), packed.layers[0].mlp.experts.w2_mxfp4.experts()
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(9)).to(dtype)
    w, ids = routing(9, E, 2, seed=4)
    oai = packed.layers[0].mlp.oai_experts()
    want = reference.fused_moe(x, w13.dequantize(dtype), w2.dequantize(dtype), w.to(dtype), ids, oai=oai)
    assert torch.equal(kernels.fused_moe_mxfp4(x, w13, w2, w.to(dtype), ids, oai=oai), want)
    # (CUDA's reference without Triton: every expert, fused_moe_dense; the same function)
    torch.testing.assert_close(reference.fused_moe_dense(x, reference._ExpertByExpert(w13, dtype),
                                                         reference._ExpertByExpert(w2, dtype), w.to(dtype), ids,
                                                         oai=oai), want)


# ------------------------------------------------------------------------------------------------ the kernel
@pytest.fixture(scope="module")
def moe_kernels():
    yield from interpreted_module("infer.kernels.moe")


KERNEL_CASES = [  # tokens, experts, top-k, hidden, expert width, gpt-oss's biases and activation
    (1, 3, 1, 64, 32, False),   # decode, k = 1, odd E
    (5, 8, 2, 64, 32, True),
    (19, 5, 3, 96, 64, True),   # K = 96: a K step of 64 half past the end (the gate_up's), N not a tile's multiple
    (70, 4, 2, 32, 96, False),  # a prefill's BLOCK_M of 32; K = 32 (one group a step) for the gate_up
]


@interpreted
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_mxfp4_fused_moe_equals_the_reference(moe_kernels, case):
    """kernels.moe.fused_moe_mxfp4 (interpreted) equals the reference over the experts dequantized (float32 within
    1e-5, 1e-6 of the largest output; the outputs poisoned first), reference.fused_moe_mxfp4 equals that bit for
    bit, and in bfloat16 the MXFP4 kernel equals the bf16 fused MoE over the dequantized experts bit for bit (the
    same tiles and roundings); one code changed in every byte, or every scale, changes the output."""
    t, e, k, h, i, oai = case
    w13, w2 = mxfp4_experts(e, h, 2 * i, seed=t), mxfp4_experts(e, i, h, seed=t + 1)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t + 2))
    w, ids = routing(t, e, k, seed=t + 3)
    extra = {"oai": oai_of(e, h, i, t)} if oai else {}
    want = reference.fused_moe(x, w13.dequantize(x.dtype), w2.dequantize(x.dtype), w, ids, **extra)
    with nan_filled_empty(moe_kernels):
        got = moe_kernels.fused_moe_mxfp4(x, w13, w2, w, ids, **extra)
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)  # (float32's sums)
    assert want.abs().max() > 1.0
    assert torch.equal(reference.fused_moe_mxfp4(x, w13, w2, w, ids, **extra), want)
    xb, wb = x.bfloat16(), w.bfloat16()
    extra = {"oai": oai_of(e, h, i, t, torch.bfloat16)} if oai else {}
    assert torch.equal(moe_kernels.fused_moe_mxfp4(xb, w13, w2, wb, ids, **extra),
                       moe_kernels.fused_moe(xb, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16), wb,
                                             ids, **extra))
    for other in (reference.Mxfp4Experts(w13.blocks ^ 0x10, w13.scales),  # (the high nibble's codes)
                  reference.Mxfp4Experts(w13.blocks, w13.scales + 1)):
        assert (moe_kernels.fused_moe_mxfp4(x, other, w2, w, ids) - want).abs().max() > 1e-2


COMPILED = COMPILE_ONLY_PREAMBLE + textwrap.dedent('''
    from infer.kernels import moe, reference
    shared, arch = {}, [0]
    launch = jit.JITFunction.run
    def record(self, *args, grid, warmup, **kwargs):
        kern = launch(self, *args, grid=grid, warmup=True, **kwargs)
        shared.setdefault(f"{kwargs['BLOCK_M']} {kwargs['ROW_DIV']} sm_{arch[0]}", kern.metadata.shared)
        return kern
    jit.JITFunction.run = record
    class Driver(kernel_sass.CompileOnlyDriver):  # (a device of its own a target: Triton caches kernels by device)
        def get_current_device(self):
            return self.target.arch
    e, h, i, k, u8, bf16 = 32, 2880, 2880, 4, torch.uint8, torch.bfloat16  # gpt-oss-20b's experts
    w13 = reference.Mxfp4Experts(torch.empty(e, 2 * i, h // 32, 16, dtype=u8), torch.empty(e, 2 * i, h // 32, dtype=u8))
    w2 = reference.Mxfp4Experts(torch.empty(e, h, i // 32, 16, dtype=u8), torch.empty(e, h, i // 32, dtype=u8))
    oai = reference.OaiExperts(torch.zeros(e, 2 * i, dtype=bf16), torch.zeros(e, h, dtype=bf16), 1.702, 7.0)
    steps = {}
    for arch[0] in (90, 89):
        triton.runtime.driver.set_active(Driver(arch[0]))
        for t in (1, 3, 200, 1024, 1500):  # BLOCK_M 16, 16, 16, 128, 128
            x = torch.zeros(t, h, dtype=bf16)
            w, ids = torch.topk(torch.randn(t, e).softmax(-1), k, -1)
            before = len(compiled)
            moe.fused_moe_mxfp4(x, w13, w2, w.to(bf16), ids, oai=oai)
            steps[f"{t} sm_{arch[0]}"] = compiled[before:]
    print(json.dumps({"shared": shared, "steps": steps}))
''')


def test_mxfp4_fused_moe_compiles_for_sm90_and_sm89_once_a_block_m_and_fits_their_shared_memory():
    """The MXFP4 fused MoE at gpt-oss-20b's experts (E 32, top-4, H = I = 2880, bfloat16, its biases and
    activation) compiled for sm_90 (H100) and sm_89 (Ada: 99 KiB a program) through the real launcher: both matmuls
    compile at the first step of a BLOCK_M and no later step's count of tokens compiles another variant (CUDA
    graphs and warm_kernels rely on it); each takes no more shared memory than a program may have there."""
    pytest.importorskip("triton")
    out = run_compile_only(COMPILED, 600)
    for a in (90, 89):
        assert out["steps"][f"1 sm_{a}"] == ["_moe_gemm_mxfp4"] * 2, out["steps"]
        assert out["steps"][f"1024 sm_{a}"] == ["_moe_gemm_mxfp4"] * 2, out["steps"]
        assert all(out["steps"][f"{t} sm_{a}"] == [] for t in (3, 200, 1500)), out["steps"]
    assert sorted(out["shared"]) == sorted(f"{m} {r} sm_{a}" for m in (16, 128) for r in (True, False)
                                           for a in (90, 89)), out["shared"]
    for key, used in out["shared"].items():
        assert 0 < used <= (SM90_SMEM if key.endswith("sm_90") else SM89_SMEM), (key, used)


# ------------------------------------------------------------------------------------------------ the engine
def test_the_engine_on_the_cpu_gives_transformers_tokens_with_packed_experts(mxfp4_folder):
    """`LLM` of the MXFP4 folder on the CPU: transformers' greedy tokens (its MXFP4 experts dequantized); the
    engine's model holds the experts packed (no float experts)."""
    from infer import LLM, SamplingParams
    folder, _, hf = mxfp4_folder
    prompts = random_prompts(512, (5, 13), seed=4)
    with LLM(str(folder), block_size=4, dtype="float32") as llm:
        blocks = sparse_blocks(llm.engine.runner.model)
        assert len(blocks) == LAYERS and all(b.experts.w13.numel() == 0 and b.experts.mxfp4 for b in blocks)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == greedy_each(hf, prompts, 6)


@interpreted
def test_the_gpu_code_path_interpreted_gives_transformers_tokens(mxfp4_folder, monkeypatch):
    """Every op through its Triton kernel (interpreted): the MXFP4 experts through kernels.moe.fused_moe_mxfp4,
    decodes through emulated CUDA graphs, the other steps through emulated piecewise graphs: transformers' tokens."""
    from infer import kernels
    from quant_helpers import check_gpu_path_interpreted
    folder, _, hf = mxfp4_folder
    prompts = random_prompts(512, (5, 13), seed=4)
    want = greedy_each(hf, prompts, 6)
    calls = []
    moe = kernels._triton("moe")
    real = moe.fused_moe_mxfp4
    monkeypatch.setattr(moe, "fused_moe_mxfp4", lambda x, *a, **k: (calls.append(x.shape[0]), real(x, *a, **k))[1])
    assert check_gpu_path_interpreted(folder, monkeypatch, prompts, want)["piecewise_graph_steps"] > 0
    assert 1 in calls and max(calls) > 1  # (the Triton MXFP4 fused MoE ran the decodes and the prefills)


def test_the_tuner_leaves_mxfp4_experts_to_the_heuristics_and_the_start_compiles_them(mxfp4_folder, monkeypatch):
    """kernels.moe_tune at an engine start: the MXFP4 layers' key is a kind of its own ("mxfp4-"), never tuned (no
    candidate timed, nothing saved), and the start's parallel compile has both matmuls of each launch config."""
    from infer.kernels import moe, moe_tune
    from infer.models.loader import load_model
    model, _ = load_model(mxfp4_folder[0], torch.bfloat16, torch.device("cpu"))
    layers = moe_tune.moe_layers(model)
    assert list(layers) == [f"{E},{H},{I},2,mxfp4-bfloat16"]
    monkeypatch.setattr(moe_tune, "tune_layer", lambda *a, **k: pytest.fail("MXFP4 experts tuned"))
    assert moe_tune.tune_model(model, 64, torch.device("cpu"), name="test-gpu")[0] == 0
    compiled = []
    monkeypatch.setattr(moe, "_gemm_mxfp4", lambda *a: compiled.append(isinstance(a[1], reference.Mxfp4Experts)
                                                                         and a[-1] is True))  # (compile_only)
    calls = moe_tune.compile_calls(model, 64)
    for c in calls:
        c()
    steps = moe.config_steps(64, 2, E, next(iter(layers)), torch.device("cpu"))
    assert len(calls) == len(compiled) == 2 * len(steps) and all(compiled)


# ------------------------------------------------------------------------------------------------ memory
def packed_bytes(layers: int, e: int, h: int, inter: int) -> int:
    """The MXFP4 experts' bytes of `layers` layers: half a byte a weight and a byte a group of 32, both matmuls."""
    return layers * e * 3 * h * inter * 17 // 32  # (1/2 + 1/32 of a byte a weight)


def test_the_warmup_plan_counts_the_packed_experts(mxfp4_folder):
    """`warmup --estimate` of the MXFP4 folder (bfloat16) counts the experts as the engine holds them: the stored
    blocks and scales (a quarter of bf16's bytes and a byte a group), what the loaded model's tensors take; the
    old load's float experts (the folder without quantization_config) took 2 bytes a weight, the difference."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.memory.sizes import weights_bytes
    from infer.models.loader import load_model
    folder, old, _ = mxfp4_folder
    plans = {}
    for name, path in (("packed", folder), ("float", old)):
        res = CliRunner().invoke(app, ["warmup", str(path), "--estimate", "--json", "--dtype", "bfloat16",
                                       "--max-length", "64", "--concurrency", "2"])
        assert res.exit_code == 0, res.output
        plans[name] = json.loads(res.stdout.strip().splitlines()[-1])["weights_bytes"]
    floats = LAYERS * E * 3 * H * I * 2
    assert plans["float"] - plans["packed"] == floats - packed_bytes(LAYERS, E, H, I)
    model, _ = load_model(folder, torch.bfloat16, torch.device("cpu"))
    held = sum(b.numel() for blk in sparse_blocks(model) for s in (blk.experts.w13_mxfp4, blk.experts.w2_mxfp4)
               for b in (s.blocks, s.scales))
    assert held == packed_bytes(LAYERS, E, H, I)
    from infer.memory.checkpoint import checkpoint_weights_bytes
    from infer.models.loader import load_config, weight_files
    rope = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("cos_sin"))
    assert checkpoint_weights_bytes(weight_files(folder), load_config(folder), torch.bfloat16,
                                    torch.device("cpu")) == weights_bytes(model) - rope


def test_the_cpu_references_peak_is_within_the_plans_mxfp4_term():
    """The CPU's reference over MXFP4 experts (a decode's token, bfloat16; every tensor its ops create counted
    while alive: session 50's LiveBytes, the experts and inputs excluded) stays within what activation_bytes adds
    for them (memory.sizes.mxfp4_cpu_bytes: one expert's gate_up dequantized and a chunk of rows' temporaries)
    and the token's share of the sparse layer; the term is not slack (under 1.5 times the peak), 0 for a float
    gpt-oss."""
    from transformers import AutoConfig

    from infer.memory.sizes import moe_token_bytes, mxfp4_cpu_bytes
    from test_probes_session50_memplan import LiveBytes
    e, h, inter, bf16 = 4, 512, 512, torch.bfloat16
    cfg = AutoConfig.for_model("gpt_oss", hidden_size=h, intermediate_size=inter, num_local_experts=e,
                               num_experts_per_tok=2, quantization_config={"quant_method": "mxfp4"})
    w13, w2 = mxfp4_experts(e, h, 2 * inter, 0), mxfp4_experts(e, inter, h, 1)
    oai = oai_of(e, h, inter, 0, bf16)
    x = torch.randn(1, h).to(bf16)
    w, ids = routing(1, e, 2, seed=0)
    w = w.to(bf16)
    with LiveBytes(exclude=(x, w, ids, *w13, *w2, oai.b13, oai.b2)) as meter:
        reference.fused_moe_mxfp4(x, w13, w2, w, ids, oai=oai)
    term = mxfp4_cpu_bytes(cfg, bf16)
    assert meter.peak <= term + moe_token_bytes(cfg, bf16), (meter.peak, term, meter.at)
    assert term < 1.5 * meter.peak, (meter.peak, term)
    del cfg.quantization_config
    assert mxfp4_cpu_bytes(cfg, bf16) == 0


# ------------------------------------------------------------------------------------------------ refusals
def _rewrite(folder, edit) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


REFUSED = {
    "missing-scales": (lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"),
                       "has no tensor model.layers.1.mlp.experts.down_proj_scales"),
    "float-blocks": (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_blocks":
                                         t["model.layers.0.mlp.experts.gate_up_proj_blocks"].float()}),
                     "model.layers.0.mlp.experts.gate_up_proj_blocks is float32 (8, 64, 2, 16), config.json implies "
                     "MXFP4's uint8 (8, 64, 2, 16)"),
    "float-experts": (lambda t: t.update({"model.layers.2.mlp.experts.down_proj": torch.zeros(E, I, H)}),
                      "model.layers.2.mlp.experts.down_proj is a float expert's weight in a checkpoint whose "
                      "config.json quantizes the experts as MXFP4"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_does_not_match_mxfp4_is_refused_by_name(mxfp4_folder, tmp_path, case):
    """An MXFP4 folder missing an expert tensor, with float blocks, or with float experts beside its MXFP4
    quantization_config: a ModelLoadError naming the tensor (no tensor silently left as torch.empty's bytes)."""
    from infer.models.loader import load_model
    edit, message = REFUSED[case]
    shutil.copytree(mxfp4_folder[0], tmp_path / "m")
    _rewrite(tmp_path / "m", edit)
    with pytest.raises(ModelLoadError) as err:
        load_model(tmp_path / "m", torch.float32, torch.device("cpu"))
    assert message in str(err.value)


def test_an_mxfp4_config_of_sizes_not_in_groups_of_32_is_refused(tmp_path):
    """config.json quantizing the experts as MXFP4 with an intermediate_size not a multiple of 32 (MXFP4's group):
    refused up front naming both sizes."""
    from infer.errors import UnsupportedModelError
    from infer.models.loader import load_model
    build(tmp_path, intermediate_size=48, num_hidden_layers=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="hidden_size 64 and intermediate_size 48"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


# ------------------------------------------------------------------------------------------------ the bench
def test_the_moe_bench_counts_mxfp4_bytes_and_refuses_what_it_cannot_time(monkeypatch, capsys):
    """`python -m infer.bench.moe --mxfp4`: its bytes are the random experts' stored ones; the int4 experts'
    options and sizes not in groups of 32 refused by name before the GPU; without a GPU it says so."""
    from infer.bench import moe as bench
    w = bench.random_mxfp4(3, 64, 96, 0, device="cpu")
    assert bench.mxfp4_bytes(3, 64, 96) == w.blocks.numel() + w.scales.numel()
    for argv, message in ((["--mxfp4", "--tune"], "--tune is the int4 experts' option"),
                          (["--mxfp4", "--hidden", "2000"], "--hidden 2000 and --intermediate 768 must be multiples "
                                                            "of 32")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--mxfp4", "--tokens", "1"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@interpreted
def test_the_moe_bench_times_mxfp4_beside_bf16(moe_kernels, monkeypatch):
    """`python -m infer.bench.moe --mxfp4`'s measuring code (interpreted, a wall-clock timer, tiny experts): a row
    a count of tokens with the MXFP4 and the bf16 times, their ratio and each one's floor (times not asserted)."""
    from infer.bench import moe as bench
    from infer.kernels import gptq_tune
    from test_probes_session61_epi import counted_clock
    monkeypatch.setattr(gptq_tune, "time_graph", counted_clock)
    rows = bench.measure_mxfp4([1, 5], 4, 2, 64, 32, 1e12, device="cpu")
    assert [r["tokens"] for r in rows] == [1, 5]
    for r in rows:
        assert r["mxfp4_us"] > 0 and r["mxfp4_vs_bf16"] == round(r["bf16_us"] / r["mxfp4_us"], 3), r
        chosen = r["experts_chosen"]
        assert r["mxfp4_floor_us"] == round((bench.mxfp4_bytes(chosen, 64, 64) + bench.mxfp4_bytes(chosen, 32, 64))
                                            / 1e12 * 1e6, 2)


@pytest.mark.gpu
def test_the_moe_bench_times_gpt_oss_20b_mxfp4_experts_on_a_gpu(tmp_path):
    """On a GPU: `python -m infer.bench.moe --mxfp4` at gpt-oss-20b's experts writes a row a count of tokens (times
    not asserted), and the kernel's outputs are the bf16 fused MoE's over the dequantized experts there too."""
    import csv

    from infer.bench import moe as bench
    from infer.kernels import moe
    assert bench.main(["--mxfp4", "--experts", "32", "--top-k", "4", "--hidden", "2880", "--intermediate", "2880",
                       "--tokens", "1", "64", "1024", "--out", str(tmp_path / "m.csv")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "m.csv")))
    assert len(rows) == 3 and all(float(r["mxfp4_us"]) > 0 for r in rows), rows
    w13 = bench.random_mxfp4(32, 2880, 5760, 0)
    w2 = bench.random_mxfp4(32, 2880, 2880, 1)
    oai = bench.oai_experts(32, 2880, 2880)
    for t in (1, 64, 1024):
        x = torch.randn(t, 2880, device="cuda").bfloat16()
        w, ids = torch.topk(torch.randn(t, 32, device="cuda").softmax(-1), 4, -1)
        got = moe.fused_moe_mxfp4(x, w13, w2, w.bfloat16(), ids, oai=oai)
        want = moe.fused_moe(x, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16), w.bfloat16(), ids,
                             oai=oai)
        assert (got - want).abs().max() <= 1e-2 * want.abs().max(), t  # (bf16 outputs: the tensor cores' sums)
