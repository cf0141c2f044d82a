"""Session 57: LoRA adapters on mixtures of experts' MLPs: a dense layer's MLP (mlp_only_layers /
decoder_sparse_step), Qwen2-MoE's shared expert, and the stacked experts (peft's target_parameters on transformers
5's mlp.experts.gate_up_proj / down_proj, its ParamWrapper: lora_A [E * r, in], lora_B [out, r * E], nested per
parameter), each request with its own adapter in one batch; greedy tokens equal peft's on the same weights, on the
CPU path and on the GPU code path under the Triton interpreter (float and GPTQ int4 experts); transformers 4's
per-expert modules read as peft converts them; what infer does not adapt (the router, shared_expert_gate) and
adapters that do not fit refused clearly; the slots' memory as the plan counts it; a merge equal to serving."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer import LLM, SamplingParams

from helpers import greedy_each, nan_filled_empty, random_prompts
from lora_helpers import PeftOracle, hf_float, save_adapter
from test_probes_session55_moe import build

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _adapters(root, hf, specs: dict) -> dict:
    """Each of `specs` (name -> LoraConfig arguments) saved under root / name, seeds 1, 2, ..."""
    return {n: save_adapter(hf, root / n, seed=i + 1, lora_dropout=0.0, **kw) for i, (n, kw) in
            enumerate(specs.items())}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3-MoE with a dense layer (mlp_only_layers [1] of 3) and three adapters: the experts (r 4), the
    experts named as transformers 4's modules, gate_proj, up_proj and down_proj, which peft turns into the stacked
    parameters (gate_up_proj at r 16, alpha 32: rank_pattern), with the attention (r 8), the experts' down_proj alone
    (rslora, r 6)."""
    root = tmp_path_factory.mktemp("moelora-qwen3")
    build(root / "base", "qwen3_moe", norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])
    hf = hf_float(root / "base")
    paths = _adapters(root, hf, {
        "experts": dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS),
        "mixed": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                      target_parameters=["mlp.experts.gate_up_proj"]),
        "down": dict(r=6, lora_alpha=12, use_rslora=True, target_modules=["o_proj"],
                     target_parameters=["mlp.experts.down_proj"]),
    })
    return root / "base", hf, paths


def peft_tokens(hf, paths: dict, prompts, names, n: int = 6) -> list[list[int]]:
    """peft's greedy tokens of each prompt with its adapter (None: the base), each adapter loaded alone (peft holds
    several adapters with target_parameters only where they target the same parameters)."""
    want = {i: greedy_each(hf, [p], n)[0] for i, (p, a) in enumerate(zip(prompts, names)) if a is None}
    for name in dict.fromkeys(a for a in names if a is not None):
        oracle = PeftOracle(hf, {name: paths[name]})
        try:
            want.update({i: oracle.greedy(name, p, n) for i, (p, a) in enumerate(zip(prompts, names)) if a == name})
        finally:
            oracle.close()
    return [want[i] for i in range(len(prompts))]


def _engine_tokens(base, paths, prompts, names, n=6, **kw):
    with LLM(str(base), loras={k: str(p) for k, p in paths.items()}, max_loras=3, max_lora_rank=16, block_size=4,
             **kw) as llm:
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        mixed = [o.token_ids for o in llm.generate(prompts, params, lora=names)]
        alone = [llm.generate([p], params, lora=a)[0].token_ids for p, a in zip(prompts, names)]
    return mixed, alone


def test_qwen3_moe_expert_adapters_equal_peft_alone_and_mixed(qwen3):
    """Three adapters on the experts (both projections, gate_up only, down only) beside the attention and a dense
    layer's MLP, and a request with none, in one batch and each alone: peft's greedy tokens."""
    base, hf, paths = qwen3
    prompts = random_prompts(512, (7, 5, 11, 6), seed=3)
    names = ["experts", "mixed", None, "down"]
    mixed, alone = _engine_tokens(base, paths, prompts, names)
    want = peft_tokens(hf, paths, prompts, names)
    assert mixed == want and alone == want
    base_tokens = greedy_each(hf, prompts, 6)
    for i in (0, 1, 3):  # each adapter changes its tokens
        assert want[i] != base_tokens[i], names[i]


def test_mixtral_expert_adapters_equal_peft_alone_and_mixed(tmp_path):
    """Mixtral: an adapter naming transformers 4's w1, w3, w2 (peft turns them into the stacked parameters) and one
    on the stacked parameters with the attention, mixed with a request without adapter."""
    build(tmp_path / "base", "mixtral")
    hf = hf_float(tmp_path / "base")
    paths = _adapters(tmp_path, hf, {
        "w": dict(r=4, lora_alpha=8, target_modules=["w1", "w3", "w2"]),
        "p": dict(r=8, lora_alpha=8, target_modules=["k_proj", "o_proj"], target_parameters=EXPERTS),
    })
    prompts = random_prompts(512, (6, 9, 5), seed=4)
    names = ["w", None, "p"]
    mixed, alone = _engine_tokens(tmp_path / "base", paths, prompts, names)
    want = peft_tokens(hf, paths, prompts, names)
    assert mixed == want and alone == want
    base_tokens = greedy_each(hf, prompts, 6)
    assert want[0] != base_tokens[0] and want[2] != base_tokens[2]


def test_qwen2_moe_shared_expert_dense_mlp_and_experts_equal_peft(tmp_path):
    """Qwen2-MoE with dense layers (decoder_sparse_step 2): target_modules gate_proj, up_proj, down_proj adapt its
    dense layers' MLPs and its shared expert, and peft (>= 0.22: its qwen2_moe conversion) turns them into the stacked
    experts' parameters too; another adapter adapts the stacked experts and the shared expert's down_proj; mixed with
    a request without."""
    build(tmp_path / "base", "qwen2_moe", num_hidden_layers=3, decoder_sparse_step=2)
    hf = hf_float(tmp_path / "base")
    paths = _adapters(tmp_path, hf, {
        "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
        "ex": dict(r=8, lora_alpha=16, target_modules=["q_proj", "shared_expert.down_proj"],
                   target_parameters=EXPERTS),
    })
    tensors = load_file(paths["mlp"] / "adapter_model.safetensors")
    assert any(".mlp.shared_expert.gate_proj." in k for k in tensors) and any(".2.mlp.up_proj." in k for k in tensors)
    assert any(".1.mlp.experts." in k for k in tensors)
    prompts = random_prompts(512, (6, 9, 5, 7), seed=5)
    names = ["mlp", "ex", None, "mlp"]
    mixed, alone = _engine_tokens(tmp_path / "base", paths, prompts, names)
    want = peft_tokens(hf, paths, prompts, names)
    assert mixed == want and alone == want
    base_tokens = greedy_each(hf, prompts, 6)
    assert want[0] != base_tokens[0] and want[1] != base_tokens[1]


def _cpu_and_gpu_path(base, paths, prompts, names, monkeypatch, n=5, **engine):
    """(the CPU path's tokens, the GPU code path's: every op through its Triton kernel, interpreted; decode steps
    through emulated CUDA graphs (a static LoRA batch); prefills in chunks), one mixed batch each; the fused MoE
    was given the experts' adapters on the GPU path. `engine`: more LLM options."""
    from infer.kernels import moe as moe_kernels
    from quant_helpers import int4_kernel_path
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    opts = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=3, max_model_len=32, max_loras=2,
                max_lora_rank=8, loras={k: str(p) for k, p in paths.items()}, **engine)
    with LLM(str(base), **opts) as llm:
        cpu = [o.token_ids for o in llm.generate(prompts, params, lora=names)]
    int4_kernel_path(monkeypatch)
    given = []
    for op in ("fused_moe", "fused_moe_int4"):
        real = getattr(moe_kernels, op)
        monkeypatch.setattr(moe_kernels, op, lambda *a, real=real: given.append(a[-1] is not None) or real(*a))
    with LLM(str(base), cuda_graph_max_tokens=4, **opts) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        gpu = [o.token_ids for o in llm.generate(prompts, params, lora=names)]
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert any(given)
    return cpu, gpu


def test_gpu_code_path_interpreted_equals_the_cpu_path_with_expert_adapters(tmp_path, monkeypatch):
    """Float experts: two expert adapters and a request without one through the Triton fused MoE (interpreted) and
    emulated CUDA graphs give the CPU path's tokens, which are peft's."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1, norm_topk_prob=True)
    hf = hf_float(tmp_path / "base")
    paths = _adapters(tmp_path, hf, {"a": dict(r=4, lora_alpha=8, target_parameters=EXPERTS),
                                     "b": dict(r=8, lora_alpha=8, target_modules=["o_proj"],
                                               target_parameters=["mlp.experts.down_proj"])})
    prompts = random_prompts(512, (5, 12, 7), seed=6)
    names = ["a", None, "b"]
    cpu, gpu = _cpu_and_gpu_path(tmp_path / "base", paths, prompts, names, monkeypatch)
    assert gpu == cpu
    assert cpu == peft_tokens(hf, paths, prompts, names, 5)


import test_probes_session56_moeq  # noqa: E402

gptq_moe = test_probes_session56_moeq.gptq_moe  # (its GPTQModel checkpoints of a tiny Qwen3-MoE)


def test_gptq_experts_with_adapters_equal_peft_on_the_dequantized_weights_on_both_paths(gptq_moe, monkeypatch):
    """A GPTQModel checkpoint of a tiny Qwen3-MoE (act-order, asym): expert adapters and a request without one give
    peft's tokens on the dequantized float weights on the CPU path, and the same on the GPU code path, whose int4
    fused MoE keeps the experts int4."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from quant_helpers import dequantized_float_model
    path = gptq_moe["asym-act"]
    hf = dequantized_float_model(path.parent / "base", path)
    hf.generation_config.eos_token_id = None
    paths = _adapters(path.parent / "adapters", hf, {
        "a": dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS),
        "b": dict(r=8, lora_alpha=16, target_parameters=["mlp.experts.gate_up_proj"])})
    prompts = random_prompts(512, (6, 10, 5), seed=7)
    names = ["a", None, "b"]
    cpu, gpu = _cpu_and_gpu_path(path, paths, prompts, names, monkeypatch)
    assert cpu == peft_tokens(hf, paths, prompts, names, 5)
    assert gpu == cpu
    base_tokens = greedy_each(hf, prompts, 5)
    assert cpu[0] != base_tokens[0] and cpu[2] != base_tokens[2]


def _v4_adapter(hf, out, names: tuple[str, str, str], seed: int, r: int = 4, ranks: dict | None = None,
                layers: list[int] | None = None, expert_layers: list[int] | None = None, **config_kw):
    """An adapter as peft saved it on transformers 4, whose experts were modules of their own: q_proj's (peft's)
    and every sparse layer's experts.N.<gate>, <up>, <down> (`names`) with random A and B, targeted by name; `ranks`
    (name -> rank) other ranks than r, `layers` its layers_to_transform (q_proj's and the experts' weights only in
    those layers, or in `expert_layers` where given), `config_kw` more adapter_config.json entries."""
    path = save_adapter(hf, out, seed=seed, r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=["q_proj"],
                        layers_to_transform=layers)
    tensors = load_file(path / "adapter_model.safetensors")
    g = torch.Generator().manual_seed(seed)
    cfg = hf.config
    expert_layers = layers if expert_layers is None else expert_layers
    for i, layer in enumerate(hf.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None or (expert_layers is not None and i not in expert_layers):
            continue
        e, two_i, h = experts.gate_up_proj.shape
        for x in range(e):
            for name, (n_in, n_out) in zip(names, ((h, two_i // 2), (h, two_i // 2), (two_i // 2, h))):
                key = f"base_model.model.model.layers.{i}.mlp.experts.{x}.{name}"
                rank = (ranks or {}).get(name, r)
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.15
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.15
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", *names]
    config.update(config_kw)
    (path / "adapter_config.json").write_text(json.dumps(config))
    assert cfg.num_hidden_layers
    return path


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_per_expert_adapters_of_transformers_4_equal_peft(tmp_path, model_type):
    """An adapter trained on transformers 4 (each expert's gate_proj, up_proj, down_proj; Mixtral's w1, w3, w2, as
    modules of their own), which peft converts when it loads it on transformers 5's stacked experts (gate and up one
    rank-2r gate_up_proj): peft's tokens, mixed with a target_parameters adapter and a request without one."""
    build(tmp_path / "base", model_type)
    hf = hf_float(tmp_path / "base")
    names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    paths = {"v4": _v4_adapter(hf, tmp_path / "v4", names, seed=3),
             **_adapters(tmp_path, hf, {"p": dict(r=4, lora_alpha=4, target_parameters=EXPERTS)})}
    prompts = random_prompts(512, (6, 9, 5), seed=8)
    order = ["v4", None, "p"]
    mixed, alone = _engine_tokens(tmp_path / "base", paths, prompts, order)
    want = peft_tokens(hf, paths, prompts, order)
    assert mixed == want and alone == want
    assert want[0] != greedy_each(hf, prompts[:1], 6)[0]


@pytest.mark.parametrize("model_type,config", [("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
                                               ("mixtral", {}), ("qwen2_moe", dict(decoder_sparse_step=2)),
                                               ("qwen2_moe", dict(shared_expert_intermediate_size=0))])
def test_the_memory_plan_counts_the_experts_adapter_slots(tmp_path, model_type, config):
    """The adapter slots of a mixture of experts (--max-loras x --max-lora-rank: the attention's, a dense layer's MLP,
    the shared expert's and every expert's A and B) are what the memory plan and `warmup --estimate`'s formula
    (memory.sizes.lora_slot_bytes) count, byte for byte; the experts' take E x r x (H + 2I + I + H) a slot and layer."""
    from infer.memory.sizes import lora_slot_bytes
    from infer.models.moe import is_sparse
    build(tmp_path, model_type, **config)
    with LLM(str(tmp_path), enable_lora=True, max_loras=3, max_lora_rank=4, block_size=4) as llm:
        manager, cfg = llm.engine.lora_manager, llm.engine.runner.model.config
        got = manager.device_bytes()
        assert llm.engine.memory_plan.lora_bytes == got == lora_slot_bytes(cfg, 3, 4, torch.float32)
        experts = sum(t.numel() for layer in manager.expert_layers for t in layer.tensors())
        sparse = sum(is_sparse(cfg, i) for i in range(cfg.num_hidden_layers))
        assert experts == sparse * 3 * 4 * 8 * (64 + 2 * 32 + 32 + 64)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2-MoE (3 layers, the middle one sparse: decoder_sparse_step 2) and an adapter on its experts and
    attention (r 4)."""
    root = tmp_path_factory.mktemp("moelora-qwen2")
    build(root / "base", "qwen2_moe", num_hidden_layers=3, decoder_sparse_step=2)
    hf = hf_float(root / "base")
    path = save_adapter(hf, root / "ok", seed=1, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"],
                        target_parameters=EXPERTS)
    return root / "base", hf, path


def _edited(path, dest, tensors=None, config=None):
    """A copy of the adapter at `path` with its tensors and config changed by the given functions."""
    shutil.copytree(path, dest)
    if tensors:
        t = load_file(dest / "adapter_model.safetensors")
        tensors(t)
        save_file(t, str(dest / "adapter_model.safetensors"))
    if config:
        c = json.loads((dest / "adapter_config.json").read_text())
        config(c)
        (dest / "adapter_config.json").write_text(json.dumps(c))
    return dest


EXPERT_KEY = "base_model.model.model.layers.1.mlp.experts"


def _drop_experts(t):  # the last two experts' A rows and B columns (ParamWrapper: B's columns are j * E + e)
    t[f"{EXPERT_KEY}.lora_A.weight"] = t[f"{EXPERT_KEY}.lora_A.weight"][:4 * 6].clone()
    t[f"{EXPERT_KEY}.lora_B.weight"] = t[f"{EXPERT_KEY}.lora_B.weight"].reshape(64, 4, 8)[:, :, :6].reshape(64, 24)


def _wide_gate_up(t):
    t[f"{EXPERT_KEY}.base_layer.lora_B.weight"] = torch.randn(96, 32)


def _shared_gate(t):
    t["base_model.model.model.layers.1.mlp.shared_expert_gate.lora_A.weight"] = torch.randn(4, 64)
    t["base_model.model.model.layers.1.mlp.shared_expert_gate.lora_B.weight"] = torch.randn(1, 4)


def _dense_up(t):  # (the dense layer 0's up_proj)
    t["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"] = torch.randn(4, 64)
    t["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"] = torch.randn(96, 4)


def _dense_in_sparse(t):
    t["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"] = torch.randn(4, 96)
    t["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"] = torch.randn(64, 4)


BAD = {  # name -> (tensors edit, config edit, what the refusal says[, what lora-validate says])
    "router-parameter": (None, lambda c: c.update(target_parameters=[*EXPERTS, "mlp.gate.weight"]),
                         "targets parameters ['mlp.gate.weight']: infer adapts a mixture of experts' stacked experts"),
    "shared-expert-gate": (_shared_gate, lambda c: c.update(target_modules=["q_proj", "shared_expert_gate"]),
                           "adapts model.layers.1.mlp.shared_expert_gate: infer adapts a mixture of experts' "
                           "attention, dense layers' MLPs, shared expert and stacked experts, not its router (gate), "
                           "shared_expert_gate"),
    "expert-count": (_drop_experts, None, "model.layers.1.mlp.experts.down_proj holds LoRA weights for 6 experts but "
                                          "the base model's layers have 8"),
    # (lora-validate sums up modules of other sizes in one line: "expects other projection sizes (...)")
    "expert-width": (_wide_gate_up, None, "model.layers.1.mlp.experts.gate_up_proj maps 64 -> 96 features but the "
                                          "base model's experts.gate_up_proj maps 64 -> 64",
                     "expects other projection sizes (experts.gate_up_proj 64->96, base 64->64)"),
    # (down_proj: peft >= 0.22 refuses an up_proj without gate_proj on Qwen2-MoE, whose experts hold both)
    "dense-mlp-in-a-sparse-layer": (_dense_in_sparse, lambda c: c.update(target_modules=["q_proj", "down_proj"]),
                                    "model.layers.1.mlp.down_proj is in layer 1, which in the base model is a sparse "
                                    "layer (its MLP is the experts): it has no down_proj"),
    # (peft >= 0.22 turns Qwen2-MoE's up_proj into the experts' gate_up_proj too, and refuses it without gate_proj)
    "up-without-gate": (_dense_up, lambda c: c.update(target_modules=["q_proj", "up_proj"]),
                        "targets up_proj without gate_proj: peft cannot load it on transformers 5, whose qwen2_moe "
                        "experts hold both in one gate_up_proj"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_expert_adapters_are_refused_by_the_engine_and_lora_validate(qwen2, tmp_path, case):
    """What infer does not adapt (the router's parameter, Qwen2-MoE's 1-output shared_expert_gate) and expert
    adapters that do not fit the base (another number of experts, other widths, a dense MLP's module in a sparse
    layer) are refused when added, naming the module, and by `infer lora-validate`."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.errors import LoRAError
    base, _, path = qwen2
    edit_tensors, edit_config, said, *cli = BAD[case]
    bad = _edited(path, tmp_path / "a", edit_tensors, edit_config)
    with pytest.raises(LoRAError) as err:
        LLM(str(base), loras={"x": str(bad)}, max_loras=1, max_lora_rank=8, block_size=4)
    assert said in str(err.value)
    res = CliRunner().invoke(app, ["lora-validate", str(base), str(bad), "--steps", "0"])
    assert res.exit_code != 0 and (cli or [said])[0] in " ".join(res.output.split()), res.output


def test_target_parameters_on_a_base_without_experts_are_refused(tmp_path):
    """An adapter with target_parameters on a dense base is refused (infer adapts parameters only as the stacked
    experts of a mixture of experts)."""
    from infer.errors import LoRAError
    from infer.models.tiny import ensure_builtin
    base = ensure_builtin("tiny-llama")
    path = save_adapter(hf_float(base), tmp_path / "a", seed=1, r=4, lora_alpha=8, lora_dropout=0.0,
                        target_modules=["q_proj"], target_parameters=["mlp.down_proj.weight"])
    with pytest.raises(LoRAError, match="targets parameters, not modules"):
        LLM(str(base), loras={"x": str(path)}, max_loras=1, max_lora_rank=8, block_size=4)


LORA_CASES = [  # tokens, experts, top-k, hidden, expert width, slots, rank
    (5, 8, 2, 32, 16, 3, 4), (19, 6, 3, 48, 24, 2, 8), (1, 4, 1, 16, 16, 1, 16), (12, 5, 2, 64, 32, 4, 16)]


@pytest.mark.parametrize("case", LORA_CASES)
def test_triton_fused_moe_with_expert_adapters_equals_the_reference(case):
    """The Triton fused MoE (interpreted) with the experts' adapters (their shrink and expand grouped matmuls over
    the pairs aligned by slot and expert), float and int4 experts, and the graph-safe dense form equal the reference
    over random routings and slots (tokens without adapter among them); outputs poisoned first; the adapters change
    the outputs."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from infer.kernels import moe, reference
    from test_probes_session56_moeq import int4_experts, routing
    t, e, k, h, i, s, r = case
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g)
    w13, w2 = int4_experts(e, h, 2 * i, 16, False, False, True, seed=t), int4_experts(e, i, h, 8, True, True, False,
                                                                                       seed=t + 1)
    f13, f2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)
    w, ids = routing(t, e, k, seed=t + 2)
    slots = torch.randint(-1, s, (t,), generator=g)
    slots[0] = -1 if t > 1 else 0
    lora = reference.MoELoRA(*(torch.randn(*shape, generator=g) * 0.3 for shape in
                               ((s, e, r, h), (s, e, 2 * i, r), (s, e, r, i), (s, e, h, r))), slots)
    want = reference.fused_moe(x, f13, f2, w, ids, lora)
    assert (want - reference.fused_moe(x, f13, f2, w, ids)).abs().max() > 1e-2
    with nan_filled_empty(moe):
        for got in (moe.fused_moe(x, f13, f2, w, ids, lora), moe.fused_moe_int4(x, w13, w2, w, ids, lora)):
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert torch.allclose(reference.fused_moe_dense(x, f13, f2, w, ids, lora), want, atol=1e-4, rtol=1e-4)
    if t > 1:  # a token without adapter: its output is the base's
        assert torch.allclose(want[0], reference.fused_moe(x, f13, f2, w, ids)[0], atol=1e-6)


def test_lora_validate_passes_an_expert_adapter_and_checks_it_against_peft(qwen2, monkeypatch):
    """`infer lora-validate` reads an adapter on the experts (its targets, its shapes against the base) and its
    numeric check (infer's engine against peft, float32) agrees."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    base, _, path = qwen2
    monkeypatch.setenv("COLUMNS", "250")
    res = CliRunner().invoke(app, ["lora-validate", str(base), str(path)])
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if "│ ok " in line or line.rstrip().endswith("ok     │"))
    assert "q,experts.down,experts.gate_up" in row and "agree" in row, res.output


def test_peft_adapts_a_dense_layers_mlp_beside_the_experts_and_so_does_infer(qwen3):
    """peft (>= 0.22) on transformers 5 turns target_modules gate_proj / up_proj / down_proj of a Qwen3-MoE into the
    experts' parameters and keeps them on the Linear layers they name too: "mixed" holds the dense layer's (1) MLP
    and the sparse layers' (0, 2) experts, and lora-validate finds nothing wrong with it (its tokens equal peft's:
    test_qwen3_moe_expert_adapters_equal_peft_alone_and_mixed)."""
    from transformers import AutoConfig

    from infer.lora.adapter import adapter_problems, read_adapter
    base, _, paths = qwen3
    modules = set(read_adapter("mixed", paths["mixed"]).modules)
    assert {f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")} <= modules, modules
    assert {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 2) for p in ("gate_up_proj", "down_proj")} <= modules
    assert not [p for p in modules if p.startswith("model.layers.1.mlp.experts")]
    assert adapter_problems("mixed", paths["mixed"], AutoConfig.from_pretrained(base)) == []


def test_merging_an_expert_adapter_gives_what_serving_it_gives(qwen2, tmp_path):
    """`infer convert --merge-lora` of an adapter on the experts (peft's merge_and_unload of its ParamWrapper into
    the stacked experts): the merged model's greedy tokens are the adapter's served on the base."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    base, _, path = qwen2
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(tmp_path / "merged"), "--merge-lora", str(path)])
    assert res.exit_code == 0, res.output
    prompts, params = random_prompts(512, (6, 9), seed=1), SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(str(tmp_path / "merged"), block_size=4) as llm:
        merged = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(str(base), loras={"x": str(path)}, max_lora_rank=8, block_size=4) as llm:
        served = [o.token_ids for o in llm.generate(prompts, params, lora=["x", "x"])]
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    assert merged == served != plain
