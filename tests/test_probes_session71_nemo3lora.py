"""Session 71: adapters of Nemotron 3's shared experts (mixer.shared_experts.up_proj / down_proj, a relu² MLP without
gate inside each moe block) and of its routed experts (target_parameters mixer.experts.up_proj / down_proj, stacked
without gate), which infer refused: peft's target_modules up_proj and down_proj reach the shared experts as well as
the dense MLP layers', so an adapter of Nemotron 3's MLPs (say q, k, v, o, up, down and the Mamba-2 in_proj, what
peft takes there: its all-linear refuses the mixers' out_proj) could not be served. They now get slots (the
experts' up rows alone, on Super's latent) and are served mixed with the base in one batch, equal to peft on the CPU
and (interpreted) GPU path (where every Nemotron-H's o_proj and MLP down_proj deltas were lost); the memory plan
counts their slots and their temporaries at their width; adapters of Super's latent projections stay refused."""

from __future__ import annotations

import pytest
import torch

from infer import LLM

from helpers import random_prompts

NAME = "tiny-nemotron-h-moe"
# (weights at 0.3's scale: 0.15's deltas leave the tiny model's tokens as the base's)
ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                                             "down_proj", "in_proj"]),
            "qv4": dict(r=4, lora_alpha=4, target_modules=["up_proj", "down_proj"])}


@pytest.fixture(scope="module")
def nemotron3(tmp_path_factory):
    """(base folder, transformers' model, {name: adapter}) of ADAPTERS (peft's) on tiny-nemotron-h-moe."""
    from lora_helpers import builtin_and_adapters
    return builtin_and_adapters(tmp_path_factory.mktemp("nemo3_lora"), NAME, ADAPTERS, scale=0.3)


def test_shared_expert_adapters_mixed_with_the_base_equal_peft(nemotron3):
    """"all8", the base and "qv4" (the MLPs and shared experts alone) in one batch and each alone: peft's tokens;
    each adapter holds every moe layer's shared experts."""
    from infer.lora.adapter import read_adapter
    from lora_helpers import check_mixed_adapters_equal_peft
    base, hf, paths = nemotron3
    moe = [i for i, kind in enumerate(hf.config.layers_block_type) if kind == "moe"]
    assert moe
    for name in paths:
        modules = read_adapter(name, paths[name]).modules
        assert {f"model.layers.{i}.mixer.shared_experts.{p}" for i in moe for p in ("up_proj", "down_proj")} \
            <= set(modules)
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (7, 12, 5), seed=2), ["all8", None, "qv4"],
                                    n=5)


def test_the_gpu_path_equals_peft(nemotron3, monkeypatch):
    """Every op through its Triton kernel (interpreted), the shared experts' adapters included, decodes through
    emulated CUDA graphs: peft's tokens. (It found that a GPU step dropped the attention's o_proj and the MLP
    blocks' down_proj deltas on every Nemotron-H: left to the next block's norm, which its blocks never passed.)"""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from lora_helpers import check_mixed_adapters_gpu_path_equal_peft
    base, hf, paths = nemotron3

    def check(model):
        assert any(block.mixer.shared_experts.up.lora is not None for block in model.layers
                   if getattr(block.mixer, "shared_experts", None) is not None)
    check_mixed_adapters_gpu_path_equal_peft(base, hf, paths, monkeypatch, check)


@pytest.mark.parametrize("targets", [None, ["up_proj"], ["down_proj", "qkv_proj"]])
def test_the_shared_experts_slots_are_the_plans(targets):
    """The slots (the shared experts' too, under the up_proj/down_proj selection as peft's suffix match) are what
    the memory plan and memory.sizes.lora_slot_bytes count, byte for byte."""
    from infer.memory.sizes import lora_slot_bytes
    with LLM(NAME, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, lora_target_modules=targets) as llm:
        manager = llm.engine.lora_manager
        shared = [n for m in manager.linears for n in m.names if ".shared_experts." in n]
        assert bool(shared) == (targets is None or "up_proj" in targets or "down_proj" in targets)
        assert llm.engine.memory_plan.lora_bytes == manager.device_bytes() == \
            lora_slot_bytes(llm.engine.runner.model.config, 2, 4, torch.float32, targets)


def test_the_shared_experts_adapter_temporaries_are_within_the_plans(tmp_path):
    """Nemotron 3's shared expert wider than intermediate_size (Nano's 3,712 beside its 1,856; here 256 beside
    128) through its adapter's torch path on 64 tokens: the tensors it keeps alive at once, with its input, are
    within memory.sizes.lora_cpu_token_bytes a token and a step's few bytes (which sized them at intermediate_size),
    and not over twice them."""
    import json
    import types

    from helpers import save_random_model
    from lora_helpers import save_adapters
    from test_probes_session63_gaps import _LiveBytes

    from infer.lora.targets import check_target_modules
    from infer.memory.sizes import lora_cpu_token_bytes
    from infer.models.tiny import BUILTIN_MODELS
    config = {**BUILTIN_MODELS[NAME].config, "moe_shared_expert_intermediate_size": 256}
    hf = save_random_model(tmp_path / "base", "nemotron_h", "NemotronHForCausalLM", config, seed=3)
    assert json.loads((tmp_path / "base" / "config.json").read_text())["intermediate_size"] == 128
    targets, tokens = ["up_proj", "down_proj"], 64
    paths = save_adapters(hf, tmp_path, {"a": dict(r=8, lora_alpha=16, target_modules=targets)})
    with LLM(str(tmp_path / "base"), loras={"a": str(paths["a"])}, max_lora_rank=8,
             lora_target_modules=targets) as llm:
        manager = llm.engine.lora_manager
        batch = manager.make_batch(torch.full((tokens,), manager.acquire("a")))
        model = llm.engine.runner.model
        shared = next(layer.mixer.shared_experts for layer in model.layers if layer.kind == "moe")
        x = torch.randn(tokens, model.config.hidden_size)
        with _LiveBytes() as meter:
            shared(x, types.SimpleNamespace(lora=batch))
    held = meter.peak + x.nbytes
    formula = tokens * lora_cpu_token_bytes(model.config, torch.float32, 8, check_target_modules(targets,
                                                                                                 model.config))
    assert held <= formula + 256 and formula <= 2 * held, (held, formula)  # (+256: a step's few bytes, not a token's)


EXPERTS = ["mixer.experts.up_proj", "mixer.experts.down_proj"]
# "ex": q, the MLPs and shared experts, and the experts (both stacks); "up": the experts' up_proj alone
EXPERT_ADAPTERS = {"ex": dict(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj", "down_proj"],
                              target_parameters=EXPERTS),
                   "up": dict(r=8, lora_alpha=16, target_parameters=EXPERTS[:1])}


@pytest.fixture(scope="module")
def expert_adapters(tmp_path_factory):
    """(base folder, transformers' model, {name: adapter}) of EXPERT_ADAPTERS (peft's, at 0.5's scale) on
    tiny-nemotron-h-moe."""
    from lora_helpers import builtin_and_adapters
    return builtin_and_adapters(tmp_path_factory.mktemp("nemo3_experts"), NAME, EXPERT_ADAPTERS, scale=0.5)


def test_expert_adapters_equal_peft_alone_and_mixed(expert_adapters):
    """"ex", the base and "up" in one batch and each alone: peft's tokens (each adapter loaded alone in peft); each
    adapter changes its request's tokens; the experts' A and B read per expert ([E, r, in], [E, out, r])."""
    from infer.lora.adapter import read_adapter
    from lora_helpers import check_expert_adapters_equal_peft
    base, hf, paths = expert_adapters
    up = read_adapter("up", paths["up"]).modules["model.layers.1.mlp.experts.up_proj"]
    assert tuple(up.lora_a.shape) == (8, 8, 64) and tuple(up.lora_b.shape) == (8, 32, 8)
    check_expert_adapters_equal_peft(base, hf, paths, ["ex", None, "up"], random_prompts(512, (7, 5, 11), seed=3))


def test_expert_adapters_on_the_gpu_path_equal_the_cpu_path(expert_adapters, monkeypatch):
    """The fused MoE (Triton, interpreted) given the experts' adapters, relu(up + delta)² between its matmuls, decodes
    through emulated CUDA graphs: the CPU path's tokens."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    from test_probes_session57_moelora import _cpu_and_gpu_path
    base, _, paths = expert_adapters
    cpu, gpu = _cpu_and_gpu_path(base, paths, random_prompts(512, (6, 3, 5), seed=7), ["ex", None, "up"],
                                 monkeypatch, n=4)
    assert gpu == cpu


@pytest.mark.parametrize("targets", [None, ["experts"], ["up_proj", "experts"]])
def test_the_experts_slots_are_the_plans(targets):
    """--lora-target-modules experts gives every moe layer's experts slots (up rows alone), what the memory plan and
    lora_slot_bytes count, byte for byte."""
    from infer.memory.sizes import lora_slot_bytes
    with LLM(NAME, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, lora_target_modules=targets) as llm:
        manager = llm.engine.lora_manager
        assert len(manager.expert_layers) == 2 and manager.expert_layers[0].b13.shape[-2] == 32
        assert llm.engine.memory_plan.lora_bytes == manager.device_bytes() == \
            lora_slot_bytes(llm.engine.runner.model.config, 2, 4, torch.float32, targets)


def test_super_latent_expert_adapters_equal_peft(tmp_path):
    """Nemotron 3 Super's experts in their latent (test_probes_session69_nemo3super's model: 24 dims): adapters of
    the experts' stacks ([E, r, 24] A of up) and the shared experts mixed with the base: peft's tokens."""
    from lora_helpers import save_adapters
    from test_probes_session57_moelora import _engine_tokens, peft_tokens
    from test_probes_session69_nemo3super import _build
    hf = _build(tmp_path / "m")
    hf.generation_config.eos_token_id = None
    paths = save_adapters(hf, tmp_path, {"ex": EXPERT_ADAPTERS["ex"]}, scale=0.5)
    prompts = random_prompts(512, (7, 5), seed=3)
    mixed, alone = _engine_tokens(tmp_path / "m", paths, prompts, ["ex", None])
    assert mixed == alone == peft_tokens(hf, paths, prompts, ["ex", None])
    from helpers import greedy_each
    assert mixed[0] != greedy_each(hf, prompts[:1], 6)[0]
