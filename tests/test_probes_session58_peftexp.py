"""Session 58: peft's layers_to_transform / layers_pattern and rank_pattern / alpha_pattern on adapters of mixtures of
experts, as peft 0.21 (on transformers 5) applies them, established with peft itself: target_parameters (the stacked
experts) adapt every sparse layer whatever layers_to_transform says, while the modules beside them are filtered;
rank_pattern / alpha_pattern keys match the end of the stacked parameter's path (model.layers.N.mlp.experts.
gate_up_proj) as regexes. transformers 4's per-expert adapters get the rank and scaling peft gives them when it
converts them (gate_up_proj at 2r and 2 x lora_alpha after the adapter's own keys: an alpha_pattern keyed by
gate_proj alone is not used, and refused since session 59), adapt every layer they have weights for, and
are refused, as peft refuses them, where their ranks are not the ones peft gives the stacked parameters. infer's
greedy tokens (served alone and mixed, lora-validate, a merge) are peft's on the same weights."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import LoRAError

from helpers import greedy_each, random_prompts
from lora_helpers import PeftOracle, check_lora_validate_ok, hf_float, save_adapter
from test_probes_session55_moe import build
from test_probes_session57_moelora import EXPERTS, _engine_tokens, _v4_adapter, peft_tokens

STACKED = {  # name -> LoraConfig arguments: target_parameters with layer filters, pattern keys of several forms
    "layers": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS,
                   layers_to_transform=[0], rank_pattern={"v_proj": 2}),
    "pattern": dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS,
                    layers_to_transform=[2], layers_pattern="layers", alpha_pattern={"experts": 3}),
    "short": dict(r=4, lora_alpha=8, target_parameters=EXPERTS, rank_pattern={"gate_up_proj": 2},
                  alpha_pattern={"down_proj": 3}),
    "regex": dict(r=4, lora_alpha=8, target_parameters=EXPERTS,
                  rank_pattern={r"layers\.0\.mlp\.experts\.gate_up_proj": 2, "model.layers.2.mlp.experts.down_proj": 6},
                  alpha_pattern={r".*0.*gate_up_proj": 5, "mlp": 1}),
}


def _saved(path) -> dict:
    """{tensor name without base_model.model.: its shape} of a saved adapter."""
    return {k.removeprefix("base_model.model."): tuple(t.shape) for k, t in
            load_file(path / "adapter_model.safetensors").items()}


def test_target_parameters_with_layer_filters_and_pattern_keys_equal_peft(tmp_path):
    """A Qwen3-MoE with a dense middle layer: peft adapts every sparse layer's experts whatever layers_to_transform
    (and layers_pattern) say, the attention only in the listed layers; rank_pattern / alpha_pattern keys (a bare
    parameter name, a layer's regex, a full path; "experts" and "mlp", which match no path's end, unused) give each
    stacked parameter its own rank and scaling; an adapter without one layer's experts (as a peft that filtered them
    would save it) leaves them as they are. infer's tokens, mixed and alone, are peft's."""
    build(tmp_path / "base", "qwen3_moe", norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])
    hf = hf_float(tmp_path / "base")
    paths = {n: save_adapter(hf, tmp_path / n, seed=i + 1, lora_dropout=0.0, **kw)
             for i, (n, kw) in enumerate(STACKED.items())}
    layers, regex = _saved(paths["layers"]), _saved(paths["regex"])
    ex = "model.layers.{}.mlp.experts.{}lora_A.weight"  # (gate_up_proj nested innermost: experts.base_layer)
    assert layers[ex.format(2, "")] == (4 * 8, 32) and "model.layers.2.self_attn.q_proj.lora_A.weight" not in layers
    assert layers["model.layers.0.self_attn.v_proj.lora_A.weight"] == (2, 64)
    assert _saved(paths["short"])[ex.format(2, "base_layer.")] == (2 * 8, 64)
    assert (regex[ex.format(0, "base_layer.")], regex[ex.format(2, "base_layer.")], regex[ex.format(2, "")]) == \
        ((2 * 8, 64), (4 * 8, 64), (6 * 8, 32))
    # as a peft that applied layers_to_transform to the experts would save it: layer 2's experts left at peft's
    # initial lora_B, zero (peft loads it, warning of the missing keys)
    paths["pruned"] = shutil.copytree(paths["layers"], tmp_path / "pruned")
    tensors = load_file(paths["pruned"] / "adapter_model.safetensors")
    save_file({k: t for k, t in tensors.items() if ".layers.2.mlp.experts." not in k},
              str(paths["pruned"] / "adapter_model.safetensors"))
    prompts = random_prompts(512, (7, 5, 9, 6, 8), seed=11)
    names = list(paths)
    mixed, alone = _engine_tokens(tmp_path / "base", paths, prompts, names)
    want = peft_tokens(hf, paths, prompts, names)
    assert mixed == want and alone == want
    base_tokens = greedy_each(hf, prompts, 6)
    assert all(w != b for w, b in zip(want, base_tokens))
    check_lora_validate_ok(tmp_path / "base", paths["regex"])


def test_qwen2_moe_dense_mlp_and_shared_expert_with_layer_filters_and_patterns_equal_peft(tmp_path):
    """Qwen2-MoE (layer 1 of 3 sparse): layers_to_transform filters the dense layers' MLPs and the shared expert, not
    the experts; rank_pattern / alpha_pattern keys reach the shared expert, a dense layer's MLP and the experts."""
    build(tmp_path / "base", "qwen2_moe", num_hidden_layers=3, decoder_sparse_step=2)
    hf = hf_float(tmp_path / "base")
    paths = {"a": save_adapter(hf, tmp_path / "a", seed=5, lora_dropout=0.0, r=4, lora_alpha=8,
                               target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                               target_parameters=EXPERTS, layers_to_transform=[1, 2],
                               rank_pattern={"shared_expert.down_proj": 2, r"layers\.2\.mlp\.up_proj": 6},
                               alpha_pattern={"gate_proj": 3, "experts.down_proj": 5})}
    saved = _saved(paths["a"])
    assert "model.layers.0.mlp.up_proj.lora_A.weight" not in saved
    assert saved["model.layers.2.mlp.up_proj.lora_A.weight"] == (6, 64)
    assert saved["model.layers.1.mlp.shared_expert.down_proj.lora_A.weight"][0] == 2
    prompts = random_prompts(512, (7, 5), seed=12)
    mixed, alone = _engine_tokens(tmp_path / "base", paths, prompts, ["a", None])
    want = peft_tokens(hf, paths, prompts, ["a", None])
    assert mixed == want and alone == want and want[0] != greedy_each(hf, prompts[:1], 6)[0]


V4_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def _v4_specs(names) -> dict:
    """name -> _v4_adapter's arguments: transformers 4 per-expert adapters peft loads on transformers 5."""
    gate, up, down = names
    return {
        "gate-up-rank": dict(ranks={gate: 2, up: 2}, rank_pattern={"gate_up_proj": 4}),  # the stacked name's key
        # gate's and up's keys match no stacked name: keyed by the stacked names too (at twice the gate's alpha for
        # the fused gate_up_proj), as infer's refusal of the per-expert keys alone says (session 59)
        "alpha": dict(alpha_pattern={gate: 3, up: 3, "gate_up_proj": 6, down: 5, "down_proj": 5}),
        "layers": dict(layers=[1], ranks={down: 8}, rank_pattern={"down_proj": 8}),
        "all-layers": dict(layers=[1], expert_layers=[0, 1]),  # peft adapts layer 0's experts too
        "regex-targets": dict(target_modules=rf".*\.(q_proj|{gate}|{up}|{down})"),  # peft resolves it, then fuses
    }


@pytest.fixture(scope="module", params=list(V4_NAMES))
def v4(request, tmp_path_factory):
    """A tiny MoE (two sparse layers) of the parameter's model type and _v4_specs' adapters: (base, hf, paths)."""
    root = tmp_path_factory.mktemp(f"peftexp-{request.param}")
    build(root / "base", request.param, num_hidden_layers=2)
    hf = hf_float(root / "base")
    paths = {n: _v4_adapter(hf, root / n, V4_NAMES[request.param], seed=i + 3, **kw)
             for i, (n, kw) in enumerate(_v4_specs(V4_NAMES[request.param]).items())}
    return root / "base", hf, paths


def test_per_expert_adapters_of_transformers_4_with_patterns_and_layers_equal_peft(v4):
    """transformers 4's per-expert adapters with a rank_pattern keyed by the stacked gate_up_proj, an alpha_pattern
    keyed by their own names and the stacked ones, a rank_pattern on down_proj, layers_to_transform (weights in the
    listed layer only, or in every layer) and target_modules a regex: peft's tokens, mixed and alone."""
    base, hf, paths = v4
    prompts = random_prompts(512, (7, 5, 9, 6, 8), seed=13)
    names = list(paths)
    mixed, alone = _engine_tokens(base, paths, prompts, names)
    want = peft_tokens(hf, paths, prompts, names)
    assert mixed == want and alone == want
    assert all(w != b for w, b in zip(want, greedy_each(hf, prompts, 6)))


def test_merging_a_per_expert_adapter_with_alpha_pattern_gives_what_serving_it_gives(v4, tmp_path):
    """`infer convert --merge-lora` (peft's merge) of the per-expert adapter with an alpha_pattern keyed by its own
    names and the stacked ones (peft uses the latter): the merged model's tokens are the adapter's served,
    which are peft's; lora-validate passes it."""
    base, hf, paths = v4
    path = paths["alpha"]
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(tmp_path / "merged"), "--merge-lora", str(path)])
    assert res.exit_code == 0, res.output
    prompts, params = random_prompts(512, (6, 9), seed=14), SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(str(tmp_path / "merged"), block_size=4) as llm:
        merged = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(str(base), loras={"x": str(path)}, max_lora_rank=8, block_size=4) as llm:
        served = [o.token_ids for o in llm.generate(prompts, params, lora=["x", "x"])]
    assert merged == served == peft_tokens(hf, {"x": path}, prompts, ["x", "x"])
    check_lora_validate_ok(base, path)


REFUSED = {  # name -> (model type, _v4_adapter's arguments, what infer says)
    "gate-up-keys": ("qwen3_moe", dict(ranks={"gate_proj": 2, "up_proj": 2}, rank_pattern={"gate_proj": 2,
                                                                                           "up_proj": 2}),
                     "model.layers.0.mlp.experts.gate_up_proj: expert 0's gate and up projections have LoRA rank 4, "
                     "but peft (on transformers 5) adapts the experts' stacked parameter at rank 8 (rank_pattern key "
                     '".*\\\\.gate_up_proj"): peft cannot load this adapter'),
    "w2-key": ("mixtral", dict(ranks={"w2": 8}, rank_pattern={"w2": 8}),
               "model.layers.0.mlp.experts.down_proj: expert 0's down projection has LoRA rank 8, but peft (on "
               "transformers 5) adapts the experts' stacked parameter at rank 4 (r=4: no rank_pattern key matches "
               "it): peft cannot load this adapter"),
    "one-expert-key": ("qwen3_moe", dict(ranks={"down_proj": 8}, rank_pattern={"experts.0.down_proj": 8}),
                       "model.layers.0.mlp.experts.down_proj: expert 0's down projection has LoRA rank 8"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_per_expert_ranks_peft_cannot_load_are_refused(tmp_path, case):
    """A transformers 4 adapter whose rank_pattern keys name its per-expert modules (peft matches them against the
    stacked parameters' names, so the ranks it gives are not the weights'): peft fails on the sizes; infer refuses it
    when added, in lora-validate and in a merge, naming the rank peft expects and the key that gave it."""
    model_type, kw, said = REFUSED[case]
    build(tmp_path / "base", model_type, num_hidden_layers=1)
    hf = hf_float(tmp_path / "base")
    path = _v4_adapter(hf, tmp_path / "a", V4_NAMES[model_type], seed=3, **kw)
    with pytest.raises(RuntimeError, match="size mismatch"):
        PeftOracle(hf, {"a": path})
    with pytest.raises(LoRAError) as err:
        LLM(str(tmp_path / "base"), loras={"a": str(path)}, max_loras=1, max_lora_rank=16, block_size=4)
    assert said in str(err.value) and "key the ranks so" in str(err.value)
    res = CliRunner().invoke(app, ["lora-validate", str(tmp_path / "base"), str(path), "--steps", "0"])
    assert res.exit_code != 0 and said in " ".join(res.output.split()), res.output
    res = CliRunner().invoke(app, ["convert", str(tmp_path / "base"), "-o", str(tmp_path / "merged"),
                                   "--merge-lora", str(path)])
    assert res.exit_code != 0 and said in " ".join(res.output.split()), res.output
    assert not (tmp_path / "merged").exists()
