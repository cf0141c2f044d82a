"""Session 51 probes of LoRA adapter configs against peft (the oracle) on the same base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer import LLM, SamplingParams
from infer.lora.adapter import adapter_problems
from infer.models.tiny import ensure_builtin

from lora_helpers import PeftOracle, hf_float, save_adapter

pytest.importorskip("peft")

PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 200, 17]]
N = 6


@pytest.fixture(scope="module")
def hf():
    return hf_float(Path(ensure_builtin("tiny-llama")))


def _edit(folder: Path, **changes) -> Path:
    file = folder / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))
    return folder


def _check_matches_peft(hf, adapters: dict, rows) -> None:
    from transformers import AutoConfig
    base = ensure_builtin("tiny-llama")
    for name, path in adapters.items():
        assert adapter_problems(name, path, AutoConfig.from_pretrained(base)) == [], name
    llm = LLM("tiny-llama", max_model_len=128, enable_lora=True, max_loras=len(adapters), max_lora_rank=16,
              loras={n: str(p) for n, p in adapters.items()})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for _, p in rows],
                            SamplingParams(max_new_tokens=N, ignore_eos=True, temperature=0),
                            lora=[n for n, _ in rows])
    finally:
        llm.close()
    oracle = PeftOracle(hf, adapters)
    try:
        assert [list(o.outputs[0].token_ids) for o in outs] == [oracle.greedy(n, p, N) for n, p in rows]
    finally:
        oracle.close()


def test_all_linear_in_another_case_is_peft_s_all_linear(hf, tmp_path):
    """peft reads target_modules "all-linear" in any case (target_modules.lower() == "all-linear"): an adapter whose
    config says "ALL-Linear" runs on peft with every projection adapted. infer matched it as a regex, found no
    module, and refused the adapter ('which its adapter_config.json does not adapt ... peft would leave them out')."""
    folder = save_adapter(hf, tmp_path / "al", seed=511, r=4, lora_alpha=8, target_modules="all-linear")
    _edit(folder, target_modules="ALL-Linear")  # peft saved the expanded list; a hand-written config keeps the word
    _check_matches_peft(hf, {"al": folder}, [("al", p) for p in PROMPTS])


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_merging_a_lora_on_a_tied_embedding_changes_only_the_module_it_adapts(tmp_path, target):
    """infer refuses a LoRA on lm_head / embed_tokens with "merge it into the base model (infer convert
    --merge-lora)". On a base with tie_word_embeddings (tiny-llama3, Llama 3.2, Qwen2.5 small) lm_head and
    embed_tokens are one tensor: merged into it, the delta changed both, where peft's forward changes only the module
    the adapter targets; the merged model's greedy tokens were not peft's."""
    base = Path(ensure_builtin("tiny-llama3"))
    assert json.loads((base / "config.json").read_text())["tie_word_embeddings"] is True
    hf = hf_float(base)
    folder = save_adapter(hf, tmp_path / "a", seed=512, r=4, lora_alpha=8, target_modules=[target, "q_proj"])
    out = tmp_path / "merged"
    _merge_and_compare(base, folder, out)


def test_merging_an_adapter_that_adapts_neither_keeps_the_embeddings_tied(tmp_path):
    """The merge unties lm_head only for as long as it needs: an adapter on the projections alone leaves a tied
    model tied (one tensor on disk, tie_word_embeddings kept)."""
    from safetensors import safe_open
    from typer.testing import CliRunner

    from infer.cli.main import app
    base = Path(ensure_builtin("tiny-llama3"))
    folder = save_adapter(hf_float(base), tmp_path / "a", seed=513, r=4, lora_alpha=8, target_modules=["q_proj"])
    out = tmp_path / "merged"
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(out), "--merge-lora", str(folder)])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    names = {k for f in out.glob("*.safetensors") for k in safe_open(str(f), "pt").keys()}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


@pytest.mark.parametrize("rename", ["no-prefix", "adapter-name"])
def test_merging_tensors_peft_does_not_read_is_refused_not_a_copy_of_the_base(hf, tmp_path, rename):
    """Tensors named without peft's base_model.model. prefix (or with the adapter's name, lora_A.default.weight):
    `--lora` serves them, peft loads none of them (a warning). `infer convert --merge-lora` said "Wrote ... (merged
    ...)" and wrote the base model unchanged."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from infer.cli.main import app
    folder = save_adapter(hf, tmp_path / "a", seed=514, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    file = folder / "adapter_model.safetensors"
    weights = load_file(str(file))
    if rename == "no-prefix":
        weights = {k.removeprefix("base_model.model."): v for k, v in weights.items()}
    else:
        weights = {k.replace(".weight", ".default.weight"): v for k, v in weights.items()}
    save_file(weights, str(file))
    out = tmp_path / "merged"
    res = CliRunner().invoke(app, ["convert", "tiny-llama", "-o", str(out), "--merge-lora", str(folder)])
    assert res.exit_code != 0 and not (out / "config.json").exists(), res.output
    text = " ".join(res.output.split())
    assert "peft does not read " in text and "model.layers.0.self_attn.q_proj.lora_A" in text, res.output


def test_layer_replication_is_refused_without_pointing_at_a_merge_peft_refuses(tmp_path):
    """An adapter with layer_replication (peft stacks copies of the base's layers, each copy with its own LoRA) was
    refused with the hint "merge the adapter into the base model", which `infer convert --merge-lora` refused in
    turn with the same hint (peft: "Cannot merge LORA layers when base model layers are replicated"), and with a
    second problem that the modules of its extra layers meant "another base model"."""
    from transformers import AutoConfig
    hf = hf_float(Path(ensure_builtin("tiny-llama")))  # its own: peft's replication leaves the copied layers in it
    folder = save_adapter(hf, tmp_path / "rep", seed=515, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                          layer_replication=[[0, 2], [1, 2]])
    problems = adapter_problems("rep", folder, AutoConfig.from_pretrained(ensure_builtin("tiny-llama")))
    assert len(problems) == 1, problems
    assert "replicates layers" in problems[0].message and "layer_replication" in problems[0].message
    assert "peft cannot merge it" in problems[0].hint and "without layer_replication" in problems[0].hint


def test_merging_an_adapter_spelled_peft_type_lora_names_the_field_not_a_misfit(hf, tmp_path):
    """`--lora` reads "peft_type": "lora"; peft, which `infer convert --merge-lora` merges with, knows only "LORA"
    (KeyError: 'lora'). The merge said "the adapter ... does not fit the model: 'lora'" with the hint to pass an
    adapter trained on this base, instead of naming the field to fix (as `infer lora-validate` does)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    folder = _edit(save_adapter(hf, tmp_path / "lc", seed=516, r=4, lora_alpha=8, target_modules=["q_proj"]),
                   peft_type="lora")
    res = CliRunner().invoke(app, ["convert", "tiny-llama", "-o", str(tmp_path / "m"), "--merge-lora", str(folder)])
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "does not fit the model" not in text, res.output
    assert 'peft_type is "lora"' in text and 'write "peft_type": "LORA" in adapter_config.json' in text, res.output


def _merge_and_compare(base: Path, folder: Path, out: Path) -> None:
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(out), "--merge-lora", str(folder)])
    assert res.exit_code == 0, res.output
    llm = LLM(str(out), max_model_len=128)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_new_tokens=N, ignore_eos=True, temperature=0))
    finally:
        llm.close()
    oracle = PeftOracle(hf_float(base), {"a": folder})
    try:
        assert [list(o.outputs[0].token_ids) for o in outs] == [oracle.greedy("a", p, N) for p in PROMPTS]
    finally:
        oracle.close()


def test_an_ensure_weight_tying_adapter_merges_into_the_tied_model_peft_saved_it_for(tmp_path):
    """ensure_weight_tying (peft keeps the adapter's embedding and head tied as the base's are): untied before the
    merge, peft read none of the adapter's lm_head tensors; modules_to_save on lm_head merges as peft computes."""
    base = Path(ensure_builtin("tiny-llama3"))
    folder = tmp_path / "a"
    import torch
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(hf_float(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                      modules_to_save=["lm_head"], ensure_weight_tying=True))
    g = torch.Generator().manual_seed(517)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(str(folder))
    _merge_and_compare(base, folder, tmp_path / "m")


def test_a_tied_lora_with_ensure_weight_tying_is_refused_not_merged_wrong(tmp_path):
    """A LoRA on lm_head with ensure_weight_tying on a tied base: peft's merge into the shared tensor gave other
    tokens than peft computes, and infer wrote it as merged."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    base = Path(ensure_builtin("tiny-llama3"))
    folder = save_adapter(hf_float(base), tmp_path / "a", seed=518, r=4, lora_alpha=8,
                          target_modules=["lm_head", "q_proj"], ensure_weight_tying=True)
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(tmp_path / "m"), "--merge-lora", str(folder)])
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "ensure_weight_tying" in text, res.output
    assert not (tmp_path / "m" / "config.json").exists()
