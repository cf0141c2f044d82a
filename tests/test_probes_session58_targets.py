"""Session 58: --lora-target-modules (vLLM's LoRAConfig.target_modules): adapter slots only on the named modules
(peft's names or infer's fused qkv_proj / gate_up_proj, a mixture of experts' `experts` and Qwen2-MoE's
`shared_expert`); the slots the engine allocates are what the memory plan and `warmup --estimate` count, less the
left-out layers' bytes exactly; an adapter on the allowed modules gives peft's tokens; an adapter with weights
elsewhere, and a name the model has no layer of, are refused naming the modules and the flag."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app
from infer.cli.warmup_plan import estimate_plan
from infer.engine.config import EngineConfig
from infer.errors import ConfigError, LoRAError
from infer.memory.sizes import lora_slot_bytes
from infer.models.layers import MergedLinear
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import base_and_adapters, check_mixed_adapters_equal_peft, hf_float, save_adapters, three_adapters
from test_probes_session53_phi3 import ADAPTERS as PHI3_ADAPTERS
from test_probes_session53_phi3 import build as build_phi3
from test_probes_session55_moe import build
from test_probes_session57_moelora import EXPERTS, _cpu_and_gpu_path, _engine_tokens, peft_tokens

ATTN_AND_DOWN = ["q_proj", "k_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """tiny-llama, its transformers model and adapters: b (q_proj, v_proj, down_proj), d (down_proj), a (every
    projection)."""
    root = tmp_path_factory.mktemp("targets")
    hf, paths = three_adapters(root, seed=11, names="ab")
    paths.update(save_adapters(hf, root, {"d": dict(r=4, lora_alpha=8, target_modules=["down_proj"])}))
    return ensure_builtin("tiny-llama"), hf, paths


def _slot_engine(targets, **kw):
    return LLM("tiny-llama", enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, device="cpu",
               lora_target_modules=targets, **kw)


def test_adapters_on_the_named_modules_equal_peft_mixed_and_alone(llama):
    """With slots on q/k/v (named as peft names them) and down_proj only, two adapters within them and a request
    without one, in one batch and each alone: peft's greedy tokens."""
    base, hf, paths = llama
    prompts = random_prompts(512, (7, 5, 9), seed=4)
    check_mixed_adapters_equal_peft(base, hf, {k: paths[k] for k in "bd"}, prompts, ["b", None, "d"],
                                    lora_target_modules=ATTN_AND_DOWN)


def _layer_bytes(linear: MergedLinear, slots: int, rank: int) -> int:
    """One merged layer's adapter slots from its own shapes: A [slots, shards * rank, in], B [slots, out, rank]."""
    return slots * rank * (len(linear.out_sizes) * linear.in_features + sum(linear.out_sizes)) * 4


@pytest.mark.parametrize("targets,left_out", [
    (["o_proj"], ("qkv_proj", "gate_up_proj", "down_proj")),
    (["qkv_proj", "gate_proj", "up_proj"], ("o_proj", "down_proj")),
    (ATTN_AND_DOWN, ("o_proj", "gate_up_proj")),
])
def test_the_slots_shrink_by_the_left_out_layers_bytes_as_plan_and_estimate_count(targets, left_out):
    """The slots allocated are the plan's and `warmup --estimate`'s count (memory.sizes.lora_slot_bytes), byte for
    byte, and every slot of every layer less exactly the left-out layers' (from their shapes), which get no slots."""
    with _slot_engine(None) as llm:
        every = llm.engine.lora_manager.device_bytes()
        model = llm.engine.runner.model
        gone = [m for n, m in model.named_modules() if isinstance(m, MergedLinear) and n.endswith(left_out)]
        assert gone and all(m.lora is not None for m in gone)
        gone_bytes = sum(_layer_bytes(m, 2, 4) for m in gone)
    with _slot_engine(targets) as llm:
        got = llm.engine.lora_manager.device_bytes()
        assert got == every - gone_bytes
        assert llm.engine.memory_plan.lora_bytes == got == lora_slot_bytes(llm.engine.runner.model.config, 2, 4,
                                                                            torch.float32, targets)
        model = llm.engine.runner.model
        assert all(m.lora is None for n, m in model.named_modules() if isinstance(m, MergedLinear)
                   and n.endswith(left_out))
    config = EngineConfig("tiny-llama", enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, device="cpu",
                          lora_target_modules=targets, max_model_len=64)
    assert estimate_plan(config, 64, 1)[0].lora_bytes == got


@pytest.mark.parametrize("targets,words", [
    (["q_proj"], ["names q_proj but not k_proj, v_proj", "one fused layer (qkv_proj)", "or qkv_proj"]),
    (["gate_up_proj", "up_proj"], None),  # (accepted: up_proj is gate_up_proj's)
    (["o_proj", "fc1"], ["--lora-target-modules fc1: unknown module name", "llama has adapter slots for q_proj, "
                         "k_proj, v_proj, qkv_proj, o_proj, gate_proj, up_proj, gate_up_proj, down_proj)"]),
    (["experts"], ["--lora-target-modules experts: no layer of this model"]),
    ([], ["--lora-target-modules names no module"]),
    (" , ", ["--lora-target-modules names no module"]),
])
def test_names_the_model_has_no_layer_of_are_refused_with_its_valid_names(targets, words):
    if words is None:
        with _slot_engine(targets) as llm:
            linears = llm.engine.lora_manager.linears  # gate_up of both layers, nothing else
            assert [m.names[-1].split(".", 3)[-1] for m in linears] == ["mlp.up_proj"] * 2
        return
    with pytest.raises(ConfigError) as e:
        _slot_engine(targets)
    text = f"{e.value.message} ({e.value.hint})"
    assert all(w in text for w in words), text


def test_an_adapter_outside_the_modules_is_refused_at_start_and_when_added(llama):
    """Served without its weights on the left-out layers it would give other tokens than peft: refused at start
    (--lora) and by add_lora, naming its modules, the flag and what to add; the engine stays usable."""
    _, _, paths = llama
    with pytest.raises(LoRAError) as e:
        LLM("tiny-llama", loras={"a": str(paths["a"])}, max_lora_rank=8, device="cpu",
            lora_target_modules=ATTN_AND_DOWN)
    assert e.value.message.startswith("LoRA adapter 'a' has weights on o_proj, gate_proj, up_proj (6 module(s), "), \
        e.value.message
    assert "--lora-target-modules q_proj,k_proj,v_proj,down_proj leaves without adapter slots" in e.value.message
    assert "add o_proj, gate_up_proj to --lora-target-modules" in e.value.hint
    with _slot_engine(["o_proj"], max_cpu_loras=2) as llm:
        with pytest.raises(LoRAError, match=r"'d' has weights on down_proj \(2 module\(s\), e\.g\. model\.layers\.0"
                                            r"\.mlp\.down_proj\), which --lora-target-modules o_proj leaves"):
            llm.add_lora("d", str(paths["d"]))
        assert llm.engine.lora_manager.names() == []


def test_lora_validate_fails_an_adapter_outside_the_modules_and_refuses_unknown_names(llama):
    _, _, paths = llama
    res = CliRunner().invoke(app, ["lora-validate", "tiny-llama", f"b={paths['b']}", f"d={paths['d']}", "--json",
                                   "--steps", "0", "--lora-target-modules", "qkv_proj,o_proj"])
    assert res.exit_code == 1, res.output
    rows = {r["name"]: r for r in map(json.loads, res.stdout.strip().splitlines()[-2:])}
    assert not rows["b"]["ok"] and not rows["d"]["ok"]
    assert rows["b"]["problems"] == [
        "has weights on down_proj (2 module(s), e.g. model.layers.0.mlp.down_proj), which --lora-target-modules "
        "qkv_proj,o_proj leaves without adapter slots (add down_proj to --lora-target-modules, or serve an adapter "
        "trained on those modules only)"]
    res = CliRunner().invoke(app, ["lora-validate", "tiny-llama", str(paths["b"]), "--steps", "2",
                                   "--lora-target-modules", "q_proj,v_proj,k_proj", "--lora-target-modules",
                                   "down_proj", "--device", "cpu", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout.strip().splitlines()[-1])["ok"], res.output
    res = CliRunner().invoke(app, ["lora-validate", "tiny-llama", str(paths["b"]), "--lora-target-modules", "qkv"])
    assert res.exit_code == 2 and "--lora-target-modules qkv: unknown module name" in res.output, res.output


def test_the_command_line_takes_the_modules_and_the_estimate_counts_them(monkeypatch, tmp_path):
    """`warmup --estimate` with the option repeated counts what an engine of those modules allocates."""
    monkeypatch.setenv("COLUMNS", "250")
    res = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", "--enable-lora", "--max-lora-rank", "4",
                                   "--max-loras", "2", "--device", "cpu", "--json", "--lora-target-modules", "o_proj",
                                   "--lora-target-modules", "down_proj"])
    assert res.exit_code == 0, res.output
    with _slot_engine(["o_proj", "down_proj"]) as llm:
        assert json.loads(res.stdout[res.stdout.index("{"):])["lora_bytes"] == llm.engine.lora_manager.device_bytes()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(prompts), "--enable-lora", "--device", "cpu",
                                   "--lora-target-modules", "w1"])
    assert res.exit_code != 0 and "--lora-target-modules w1: unknown module name" in res.output, res.output


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3-MoE (3 layers, the middle one dense) and adapters: q_proj + the experts, q_proj alone."""
    root = tmp_path_factory.mktemp("targets-qwen3")
    build(root / "base", "qwen3_moe", norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])
    hf = hf_float(root / "base")
    paths = save_adapters(hf, root, {"experts": dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                     target_parameters=EXPERTS),
                                     "q": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"])})
    return root / "base", hf, paths


def test_moe_expert_slots_are_absent_unless_experts_is_named(qwen3):
    """Without `experts` no sparse layer gets expert slots (the plan and lora_slot_bytes count none); the difference
    is every sparse layer's E x r x (H + 2I + I + H) a slot; an adapter on the experts is refused naming `experts`."""
    base, hf, paths = qwen3
    kw = dict(enable_lora=True, max_loras=3, max_lora_rank=4, block_size=4, device="cpu")
    with LLM(str(base), lora_target_modules=["qkv_proj", "experts"], **kw) as llm:
        with_experts = llm.engine.lora_manager.device_bytes()
        assert len(llm.engine.lora_manager.expert_layers) == 2
    with LLM(str(base), lora_target_modules=["qkv_proj"], **kw) as llm:
        manager, cfg = llm.engine.lora_manager, llm.engine.runner.model.config
        assert manager.expert_layers == [] and all(b.lora is None for b in llm.engine.runner.model.modules()
                                                   if hasattr(b, "experts"))
        got = manager.device_bytes()
        assert llm.engine.memory_plan.lora_bytes == got == lora_slot_bytes(cfg, 3, 4, torch.float32, ["qkv_proj"])
        assert with_experts - got == 2 * 3 * 4 * 8 * (64 + 2 * 32 + 32 + 64) * 4
        llm.add_lora("q", str(paths["q"]))
        with pytest.raises(LoRAError) as e:
            llm.add_lora("experts", str(paths["experts"]))
    assert "has weights on experts.gate_up_proj, experts.down_proj (4 module(s), e.g. model.layers.0.mlp.experts." \
        in e.value.message and "), which --lora-target-modules qkv_proj leaves" in e.value.message
    assert "add experts to --lora-target-modules" in e.value.hint
    with pytest.raises(ConfigError, match="--lora-target-modules shared_expert: no layer of this model"):
        LLM(str(base), lora_target_modules=["shared_expert"], **kw)


def test_moe_adapters_within_the_named_modules_equal_peft(qwen3):
    """Slots on the attention's q/k/v and the experts only (no o_proj, no dense MLP): peft's greedy tokens."""
    base, hf, paths = qwen3
    prompts = random_prompts(512, (7, 5, 6), seed=5)
    names = ["experts", None, "q"]
    mixed, alone = _engine_tokens(base, paths, prompts, names, lora_target_modules=["qkv_proj", "experts"],
                                  device="cpu")
    want = peft_tokens(hf, paths, prompts, names)
    assert mixed == want and alone == want


def test_qwen2_moe_shared_expert_alone_gets_slots(tmp_path):
    """`shared_expert` gives the shared expert's gate_up and down slots and nothing else (plan == allocation)."""
    build(tmp_path, "qwen2_moe", decoder_sparse_step=2, num_hidden_layers=3)
    with LLM(str(tmp_path), enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, device="cpu",
             lora_target_modules="shared_expert") as llm:
        manager = llm.engine.lora_manager
        names = sorted(n for m in manager.linears for n in dict.fromkeys(m.names))
        assert names == [f"model.layers.1.mlp.shared_expert.{p}" for p in ("down_proj", "gate_proj", "up_proj")]
        assert manager.expert_layers == []
        assert llm.engine.memory_plan.lora_bytes == manager.device_bytes() == \
            lora_slot_bytes(llm.engine.runner.model.config, 2, 4, torch.float32, ["shared_expert"])


def test_gpu_code_path_interpreted_with_slots_on_o_proj_and_the_experts_only(tmp_path, monkeypatch):
    """The Triton kernels (interpreted) and emulated CUDA graphs with LoRA on o_proj (its expand left to the next
    rms_norm) and the experts only, the qkv layer without slots: the CPU path's tokens, which are peft's."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1, norm_topk_prob=True)
    hf = hf_float(tmp_path / "base")
    paths = save_adapters(hf, tmp_path, {"a": dict(r=4, lora_alpha=8, target_parameters=EXPERTS),
                                         "b": dict(r=8, lora_alpha=8, target_modules=["o_proj"],
                                                   target_parameters=["mlp.experts.down_proj"])})
    prompts = random_prompts(512, (5, 12, 7), seed=6)
    names = ["a", None, "b"]
    cpu, gpu = _cpu_and_gpu_path(tmp_path / "base", paths, prompts, names, monkeypatch,
                                 lora_target_modules=["o_proj", "experts"])
    assert gpu == cpu
    assert cpu == peft_tokens(hf, paths, prompts, names, 5)


def test_phi3_fused_checkpoint_modules_take_peft_names_too(tmp_path):
    """Phi-3 stores q|k|v as one qkv_proj and gate|up as one gate_up_proj: q_proj,k_proj,v_proj,gate_up_proj name
    those layers; an adapter on them gives peft's tokens, one on o_proj and down_proj too is refused naming them."""
    build_phi3(tmp_path / "base")
    base, hf, paths = base_and_adapters(tmp_path, PHI3_ADAPTERS)
    targets = ["q_proj", "k_proj", "v_proj", "gate_up_proj"]
    check_mixed_adapters_equal_peft(base, hf, {"qkv4": paths["qkv4"]}, random_prompts(512, (5, 9), seed=2),
                                    ["qkv4", None], lora_target_modules=targets)
    with pytest.raises(LoRAError, match=r"'all8' has weights on o_proj, down_proj \(4 module\(s\), .*add o_proj, "
                                        r"down_proj to --lora-target-modules"):
        LLM(str(base), loras={"all8": str(paths["all8"])}, max_lora_rank=8, device="cpu", lora_target_modules=targets)
