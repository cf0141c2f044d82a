"""Session 56: int4 (GPTQ) experts of a mixture of experts on the GPU path: the Triton fused MoE reading stacked
int4 experts (kernels.moe.fused_moe_int4, dequantized in registers) equal to its reference (the experts dequantized,
then the float op) over random routings, sym / asym zeros, group sizes and act-order; the model keeping GPTQ experts
int4 on the GPU path, equal to the CPU path (dequantized at load) token for token."""

from __future__ import annotations

import json

import pytest
import torch

from infer.kernels import packing, reference

from helpers import nan_filled_empty


def int4_experts(e: int, k: int, n: int, group_size: int, act_order: bool, sym: bool, zeros_v1: bool, seed: int):
    """Random int4 experts (reference.Int4Experts) of K inputs and N outputs: act_order shuffles each expert's g_idx
    (read by the kernel, group_size 0); group_size -1 is one group (per channel)."""
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    groups = k // gs
    q = torch.randint(0, 16, (e, k, n), generator=g)
    z = torch.full((e, groups, n), 8) if sym else torch.randint(0, 16, (e, groups, n), generator=g)
    stored = (z - 1) & 15 if zeros_v1 else z
    scales = (torch.rand(e, groups, n, generator=g) * 0.02 + 0.005).half()
    plain = torch.arange(k) // gs
    g_idx = torch.stack([plain[torch.randperm(k, generator=g)] if act_order else plain for _ in range(e)]).int()
    return reference.Int4Experts(torch.stack([packing.pack_rows(q[i], 4) for i in range(e)]),
                                 torch.stack([packing.pack_cols(stored[i], 4) for i in range(e)]), scales, g_idx,
                                 0 if act_order else gs, zeros_v1)


def routing(t: int, e: int, k: int, seed: int, empty: int | None = 1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if empty is not None:
        logits[:, empty] -= 100  # an expert no token chose
    return torch.topk(logits.softmax(-1), k, -1)


KERNEL_CASES = [  # tokens, experts, top-k, hidden, expert width, group size, act-order, sym, v1 zeros
    (5, 8, 2, 64, 32, 32, False, True, True),
    (1, 3, 1, 64, 40, -1, False, False, True),
    (19, 5, 3, 128, 24, 64, True, False, True),
    (7, 4, 2, 128, 64, 128, False, False, False),
    (12, 7, 2, 96, 48, 32, True, True, False),
    (9, 5, 2, 96, 24, 48, False, False, True),  # groups of 48 (several in a K step of 64), and of 8 for the down
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_int4_fused_moe_equals_the_reference(case):
    """The int4 fused MoE (interpreted) equals the experts dequantized then the float reference: random routings with
    an expert no token chose, one token, k = 1, odd E, N and K not multiples of the tiles, group sizes 32 / 64 / 128
    and per channel, act-order on and off, sym and asym, v1 and v2 zeros; the outputs poisoned first."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer.kernels import moe
    t, e, k, h, i, gs, act, sym, v1 = case
    w13 = int4_experts(e, h, 2 * i, gs, act, sym, v1, seed=t)
    w2 = int4_experts(e, i, h, gs if gs == -1 or i % gs == 0 else 8, act, sym, v1, seed=t + 1)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t + 2))
    w, ids = routing(t, e, k, seed=t + 3)
    want = reference.fused_moe(x, w13.dequantize(x.dtype), w2.dequantize(x.dtype), w, ids)
    with nan_filled_empty(moe):
        got = moe.fused_moe_int4(x, w13, w2, w, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.allclose(reference.fused_moe_int4(x, w13, w2, w, ids), want, atol=1e-6)
    other = reference.Int4Experts(w13.qweight ^ 1, *w13[1:])  # one bit of every word: other outputs
    assert (moe.fused_moe_int4(x, other, w2, w, ids) - want).abs().max() > 1e-3
    # in float16, the float kernel over the dequantized weights, bit for bit (the same tiles and roundings)
    xh, wh = x.half(), w.half()
    assert torch.equal(moe.fused_moe_int4(xh, w13, w2, wh, ids),
                       moe.fused_moe(xh, w13.dequantize(torch.float16), w2.dequantize(torch.float16), wh, ids))


def test_int4_fused_moe_compiles_for_an_h100_once_whatever_the_step():
    """The int4 fused MoE compiled for sm_90 (the compile side of a driver, no GPU) in bfloat16 and float16, plain
    groups and act-order: its kernels compile on the first step, and no later step's count of tokens compiles a
    variant of its own (one compiled variant for every step: CUDA graphs and warm_kernels rely on it)."""
    import inspect
    import textwrap

    from helpers import COMPILE_ONLY_LAUNCHES, run_compile_only
    pytest.importorskip("triton")
    script = COMPILE_ONLY_LAUNCHES + "from infer.kernels import packing, reference\n" + inspect.getsource(
        int4_experts) + textwrap.dedent('''
        from infer.kernels import moe
        out = {}
        for dtype in (torch.bfloat16, torch.float16):
            for act in (False, True):
                w13 = int4_experts(8, 64, 64, 32, act, False, True, 0)
                w2 = int4_experts(8, 32, 64, 32, act, False, True, 1)
                steps = []
                for t in (9, 1, 16, 41):
                    x = torch.randn(t, 64, dtype=dtype)
                    w, ids = torch.topk(torch.randn(t, 8).softmax(-1), 2, -1)
                    before = len(compiled)
                    moe.fused_moe_int4(x, w13, w2, w.to(dtype), ids)
                    steps.append(compiled[before:])
                out[f"{dtype}-{act}"] = steps
        print(json.dumps(out))
    ''')
    out = run_compile_only(script, 600)
    for name, steps in out.items():
        assert sorted(steps[0]) == ["_moe_gemm_int4", "_moe_gemm_int4", "_silu_and_mul_kernel"] or (
            name.endswith("True") and sorted(steps[0]) == ["_moe_gemm_int4", "_moe_gemm_int4"]), (name, steps)
        assert steps[1:] == [[]] * 3, (name, steps)


# ------------------------------------------------------------------------------------------------ the model
@pytest.fixture(scope="module")
def gptq_moe(tmp_path_factory):
    """A tiny qwen3_moe (one sparse layer, 8 experts, top-2) quantized by GPTQModel: sym with plain groups, and
    asym with act-order (desc_act)."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    pytest.importorskip("gptqmodel")
    from test_probes_session55_moe import build
    root = tmp_path_factory.mktemp("gptq-moe")
    build(root / "base", "qwen3_moe", norm_topk_prob=True, num_hidden_layers=1)
    # in a process of its own: GPTQModel's quantization patches transformers' MoE modules (its experts become a
    # ModuleList), which later tests building transformers' models in this process would see
    tests = Path(__file__).resolve().parent
    script = textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {str(tests)!r})
        from quant_helpers import make_gptqmodel_checkpoint
        base = {str(root / "base")!r}
        make_gptqmodel_checkpoint(base, {str(root / "sym")!r}, bits=4, group_size=32, seq_len=32)
        make_gptqmodel_checkpoint(base, {str(root / "asym")!r}, bits=4, group_size=16, seq_len=32, desc_act=True,
                                  sym=False)
    ''')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"sym": root / "sym", "asym-act": root / "asym"}


@pytest.mark.parametrize("kind", ["sym", "asym-act"])
def test_gpu_path_keeps_gptq_experts_int4_and_equals_the_cpu_path(gptq_moe, monkeypatch, kind):
    """The GPU code path (every op through its Triton kernel, interpreted; decode steps through emulated CUDA
    graphs; prefills in chunks) keeps the GPTQ experts int4, stacked (no float experts), and runs the int4 fused
    MoE: the CPU path's tokens (experts dequantized at load), logprobs close."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from quant_helpers import check_int4_experts_path_equals_cpu
    from helpers import random_prompts

    def check(model):
        experts = model.layers[0].mlp.experts
        assert experts.w13.numel() == 0 and experts.w13_int4.words.dtype == torch.int32
        gs = [experts.w13_int4.group_size, experts.w2_int4.group_size]
        # act-order experts sorted by group at load (session 58): their groups then plain, each row's x column in perm
        assert gs == ([16, 16] if kind == "asym-act" else [32, 32])
        assert (experts.w13_int4.perm is not None) == (kind == "asym-act")
    check_int4_experts_path_equals_cpu(gptq_moe[kind], monkeypatch, random_prompts(512, (5, 14), seed=4), check)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_gpu_model_holds_int4_experts_only_and_refuses_8_bit_ones(tmp_path, bits):
    """Built on a GPU (here on the meta device, on_gpu forced): 4-bit GPTQ experts are held stacked int4, no float
    experts (E * (3 * H * I) int4 weights in int32 words); 8-bit ones are refused up front, naming the projections."""
    import json

    from infer.errors import UnsupportedModelError
    from infer.models import moe
    from infer.models.loader import linear_method_factory, load_config
    from test_probes_session55_moe import build
    build(tmp_path, "qwen3_moe", num_hidden_layers=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": False,
                                  "sym": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf_cfg = load_config(tmp_path)
    with pytest.MonkeyPatch.context() as mp, torch.device("meta"):
        mp.setattr(moe, "on_gpu", lambda t: True)
        build_model = lambda: moe.moe_model_class()(hf_cfg, torch.float16, linear_method_factory(tmp_path, hf_cfg), 8)
        if bits == 8:
            with pytest.raises(UnsupportedModelError, match=r"experts' gate/up projections .* are 8-bit GPTQ: on a "
                               "GPU infer runs GPTQ experts only as 4-bit"):
                build_model()
            return
        experts = build_model().layers[0].mlp.experts
    assert experts.w13.numel() == experts.w2.numel() == 0
    assert experts.w13_int4.words.numel() * 8 + experts.w2_int4.words.numel() * 8 == 8 * 3 * 64 * 32
    assert tuple(experts.w13_int4.scales.shape) == (8, 2, 64) and tuple(experts.w2_int4.g_idx.shape) == (8, 32)


@pytest.mark.parametrize("kind", ["sym", "asym-act"])
def test_the_estimate_counts_the_experts_as_the_engine_holds_them(gptq_moe, monkeypatch, kind):
    """`warmup --estimate`'s count of a GPTQ MoE checkpoint's weights is what the engine holds: on the GPU path the
    experts' int4 tensors as stored (their g_idx, and with act-order their int32 perm), and no dequantization scratch
    for them; on the CPU the float experts dequantized at load (never prepacked), their int tensors dropped."""
    from infer.memory.checkpoint import checkpoint_int4_layer_elements, checkpoint_weights_bytes
    from infer.memory.sizes import weights_bytes
    from infer.models.loader import load_model, weight_files
    from quant_helpers import int4_kernel_path
    path = gptq_moe[kind]
    files = weight_files(path)
    model, cfg = load_model(path, torch.float32, torch.device("cpu"))

    def held(model):  # without the rope tables (not weights)
        return weights_bytes(model) - sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                                          if n.endswith("cos_sin"))
    act = kind == "asym-act"
    assert checkpoint_weights_bytes(files, cfg, torch.float32, torch.device("cpu"), 4, act) == held(model)
    int4_kernel_path(monkeypatch)
    model, cfg = load_model(path, torch.float32, torch.device("cpu"))
    prepacked = sum(b.numel() * b.element_size() for n, b in model.named_buffers()  # (the CPU's prepacked copies)
                    if n.endswith(("packed_weight", "packed_head")))
    assert checkpoint_weights_bytes(files, cfg, torch.float32, torch.device("cuda"), 4, act) == held(model) - prepacked
    # the biggest layer an int4 prefill dequantizes into its scratch: attention's q/k/v (64 in, 4 * 32 + 2 * 2 * 32
    # out), not an expert's
    assert checkpoint_int4_layer_elements(files, 4) == 64 * (4 * 32 + 2 * 2 * 32)


def test_inf_scales_of_int4_experts_are_refused_on_a_gpu(gptq_moe, monkeypatch):
    """A GPU load checks the stacked experts' scales (Int4Stack.scales) for inf or NaN as every GPTQ layer's, naming
    the buffer."""
    from infer.errors import ModelLoadError
    from infer.models import loader
    from quant_helpers import int4_kernel_path
    int4_kernel_path(monkeypatch)
    model, _ = loader.load_model(gptq_moe["sym"], torch.float32, torch.device("cpu"))
    loader._check_finite_on_device(model, torch.float32)
    model.layers[0].mlp.experts.w2_int4.scales[3, 0, 5] = float("inf")
    with pytest.raises(ModelLoadError, match=r"layers\.0\.mlp\.experts\.w2_int4\.scales has non-finite values"):
        loader._check_finite_on_device(model, torch.float32)


# ------------------------------------------------------------------------------------------------ AWQ experts
@pytest.fixture(scope="module")
def awq_moe(tmp_path_factory):
    """A tiny qwen3_moe as an AWQ "gemm" checkpoint (every attention and expert projection; the router float),
    quantized and packed by session 53's reference AWQ packer (zero points of 0 included), and the float checkpoint
    of its dequantized weights (the oracle)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from test_probes_session53_awq import awq_dequantize, awq_pack, awq_quantize
    from test_probes_session55_moe import build
    root = tmp_path_factory.mktemp("awq-moe")
    build(root / "base", "qwen3_moe", norm_topk_prob=True, num_hidden_layers=1)
    awq, deq = {}, {}
    for name, t in load_file(root / "base" / "model.safetensors").items():
        if not name.endswith("proj.weight"):
            awq[name] = deq[name] = t
            continue
        w = t.clone()
        w[:8, :32] = w[:8, :32].abs() + 0.01  # the first group's first columns positive: zero points of 0
        q, z, s = awq_quantize(w)
        module = name.removesuffix(".weight")
        awq.update({f"{module}.qweight": awq_pack(q), f"{module}.qzeros": awq_pack(z), f"{module}.scales": s})
        deq[name] = awq_dequantize(q, z, s).float()
    for name, tensors in (("awq", awq), ("deq", deq)):
        shutil.copytree(root / "base", root / name)
        save_file(tensors, str(root / name / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((root / "awq" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                  "version": "gemm"}
    (root / "awq" / "config.json").write_text(json.dumps(cfg))
    return root


def test_awq_experts_equal_their_dequantized_weights_on_the_cpu_and_the_gpu_path(awq_moe, monkeypatch):
    """AWQ experts (repacked into GPTQ's layout as read): the CPU path (dequantized at load) gives the tokens of the
    float checkpoint of the same dequantized weights; the GPU path (interpreted, emulated graphs) keeps them int4
    (the int4 fused MoE) and gives the same tokens, logprobs close."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer import LLM, SamplingParams
    from helpers import random_prompts
    from quant_helpers import int4_kernel_path
    prompts = random_prompts(512, (5, 14), seed=4)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=1)
    opts = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=32)
    with LLM(str(awq_moe / "deq"), **opts) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(str(awq_moe / "awq"), **opts) as llm:
        cpu = llm.generate(prompts, params)
    assert [o.token_ids for o in cpu] == want
    int4_kernel_path(monkeypatch)
    with LLM(str(awq_moe / "awq"), cuda_graph_max_tokens=4, **opts) as llm:
        experts = llm.engine.runner.model.layers[0].mlp.experts
        assert experts.w13.numel() == 0 and experts.w13_int4.group_size == experts.w2_int4.group_size == 32
        llm.engine.runner.capture_graphs(64, emulate=True)
        gpu = llm.generate(prompts, params)
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert [o.token_ids for o in gpu] == want
    for a, b in zip(gpu, cpu):
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert abs(ra["logprob"] - rb["logprob"]) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_fused_moe_at_qwen3_30b_sizes_on_a_gpu(act_order):
    """On a GPU, Qwen3-30B-A3B's experts' shapes (E = 128, k = 8, H = 2048, I = 768, groups of 128) in bfloat16 and
    float16: the int4 fused MoE close to the reference (the experts dequantized, then the float op in float32) and
    to the float fused MoE over the dequantized weights at 1, 37 and 512 tokens; a CUDA graph of it replayed with
    another routing equals the eager call."""
    from infer.kernels import moe
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    e, k, h, i = 128, 8, 2048, 768

    def stack(kk: int, n: int) -> reference.Int4Experts:
        words = torch.randint(-2**31, 2**31 - 1, (e, kk // 8, n), generator=g, device=dev, dtype=torch.int32)
        zeros = torch.randint(-2**31, 2**31 - 1, (e, kk // 128, n // 8), generator=g, device=dev, dtype=torch.int32)
        scales = (torch.rand(e, kk // 128, n, generator=g, device=dev) * 0.004 + 0.001).half()
        plain = (torch.arange(kk, device=dev) // 128).int()
        g_idx = torch.stack([plain[torch.randperm(kk, generator=g, device=dev)] if act_order else plain
                             for _ in range(e)])
        return reference.Int4Experts(words, zeros, scales, g_idx, 0 if act_order else 128, True)
    w13, w2 = stack(h, 2 * i), stack(i, h)
    for dtype in (torch.bfloat16, torch.float16):
        f13, f2 = w13.dequantize(dtype), w2.dequantize(dtype)
        for t in (1, 37, 512):
            x = torch.randn(t, h, generator=g, device=dev).to(dtype)
            w, ids = torch.topk(torch.randn(t, e, generator=g, device=dev).softmax(-1), k, -1)
            w = w.to(dtype)
            want = reference.fused_moe(x.float(), f13.float(), f2.float(), w.float(), ids)
            got = moe.fused_moe_int4(x, w13, w2, w, ids).float()
            assert (got - want).abs().max() <= 0.05 * want.abs().max(), (dtype, t, (got - want).abs().max())
            # the float kernel over the dequantized weights: the same tiles and roundings
            same = moe.fused_moe(x, f13, f2, w, ids).float()
            assert (got - same).abs().max() <= 1e-3 * want.abs().max(), (dtype, t, (got - same).abs().max())
    x = torch.randn(4, h, generator=g, device=dev).bfloat16()
    w, ids = torch.topk(torch.randn(4, e, generator=g, device=dev).softmax(-1), k, -1)
    w = w.bfloat16()
    moe.fused_moe_int4(x, w13, w2, w, ids)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe_int4(x, w13, w2, w, ids)
    other = torch.topk(torch.randn(4, e, generator=g, device=dev).softmax(-1), k, -1)
    w.copy_(other[0].bfloat16())
    ids.copy_(other[1])
    graph.replay()
    assert torch.equal(out, moe.fused_moe_int4(x, w13, w2, w, ids))


@pytest.mark.parametrize("gpu_path", [False, True])
def test_a_missing_gptq_expert_is_named_by_its_qweight(gptq_moe, tmp_path, monkeypatch, gpu_path):
    """A GPTQ checkpoint without one expert's projection (none of its qweight, qzeros, scales) is refused naming the
    qweight it lacks, on the CPU and on the GPU path."""
    import shutil

    from safetensors.torch import load_file, save_file

    from infer.errors import ModelLoadError
    from infer.models.loader import load_model
    from quant_helpers import int4_kernel_path
    shutil.copytree(gptq_moe["sym"], tmp_path / "q")
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        tensors.pop(f"model.layers.0.mlp.experts.6.up_proj.{name}", None)
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"), metadata={"format": "pt"})
    if gpu_path:
        int4_kernel_path(monkeypatch)
    with pytest.raises(ModelLoadError, match=r"no tensor model\.layers\.0\.mlp\.experts\.6\.up_proj\.qweight"):
        load_model(tmp_path / "q", torch.float32, torch.device("cpu"))


def test_gptqmodels_defuser_patches_are_undone_after_each_test():
    """GPTQModel (quantize or load of an MoE) replaces transformers' Qwen3-MoE/Mixtral/Qwen2-MoE sparse blocks and
    its checkpoint conversion mapping process-wide: a later test in the same pytest worker would build transformers'
    reference model defused (per-expert ModuleLists, renamed weights). conftest's fixture puts them back."""
    pytest.importorskip("defuser")
    import defuser
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qwen3_moe
    from conftest import defuser_originals, restore_originals
    originals = defuser_originals()
    block = qwen3_moe.Qwen3MoeSparseMoeBlock
    try:
        defuser.replace_fused_blocks("qwen3_moe")
        assert qwen3_moe.Qwen3MoeSparseMoeBlock is not block
    finally:
        restore_originals(originals)
    assert qwen3_moe.Qwen3MoeSparseMoeBlock is block


def test_the_moe_bench_counts_the_experts_bytes_and_refuses_without_a_gpu(monkeypatch, capsys):
    """`python -m infer.bench.moe` times the int4 and the bf16 fused MoE on a GPU against the bytes of the experts a
    step chooses: its int4 bytes are the stacks' own (words, float16 scales, packed zeros; g_idx is not read by
    plain groups), its random act-order experts' groups a permutation of the plain ones; without a GPU it says so."""
    from infer.bench import moe as bench
    w = bench.random_experts(3, 256, 64, 128, False, 0, device="cpu")
    stored = w.qweight.numel() * 4 + w.scales.numel() * 2 + w.qzeros.numel() * 4
    assert bench.int4_bytes(3, 256, 64, 128) == stored
    a = bench.random_experts(3, 256, 64, 128, True, 0, device="cpu")
    assert a.group_size == 0 and torch.equal(a.g_idx.sort(-1).values, w.g_idx)
    assert not torch.equal(a.g_idx, w.g_idx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--tokens", "1"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("gpu_path", [False, True])
def test_warmup_estimate_of_a_gptq_moe_checks_its_weights_on_the_meta_device(gptq_moe, monkeypatch, gpu_path):
    """`infer warmup CKPT --estimate` runs the loader's checks on the meta device: each GPTQ expert's own layer was
    built on the CPU, and loading a meta tensor into it failed (NotImplementedError: Cannot copy out of meta tensor)
    for every GPTQ MoE checkpoint, `infer quantize`'s and GPTQModel's alike. The layer is built on the experts'
    device now: the estimate exits 0 with its plan."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from quant_helpers import int4_kernel_path
    if gpu_path:
        int4_kernel_path(monkeypatch)
    res = CliRunner().invoke(app, ["warmup", str(gptq_moe["asym-act"]), "--estimate", "--max-length", "256",
                                   "--concurrency", "2", "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert json.loads(res.stdout.strip().splitlines()[-1])["weights_bytes"] > 0
