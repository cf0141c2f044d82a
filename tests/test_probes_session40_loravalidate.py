"""Session 40 probes of `infer lora-validate` and adapter loading: a full model passed as an adapter is named as
such, one problem per kind of refused tensor (not one line per layer), and the warning about weights beyond float16
names its adapter."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from infer.cli.main import app
from infer.errors import LoRAError
from infer.lora.adapter import read_adapter
from infer.models.tiny import ensure_builtin

from lora_helpers import ALL, hf_float, save_adapter

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    base = ensure_builtin("tiny-llama")
    hf, root = hf_float(base), tmp_path_factory.mktemp("s40lval")
    paths = {
        "good": save_adapter(hf, root / "good", 1, r=4, lora_alpha=8, target_modules=ALL),
        "dora": save_adapter(hf, root / "dora", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             use_dora=True),
    }
    huge = root / "huge"
    shutil.copytree(paths["good"], huge)
    tensors = load_file(huge / WEIGHTS)
    key = next(k for k in tensors if "down_proj.lora_A" in k)
    tensors[key] = tensors[key] * 1e6  # beyond float16, within float32: a warning, not a failure
    save_file(tensors, huge / WEIGHTS)
    paths["huge"] = huge
    return base, paths


def invoke(*args):
    return CliRunner().invoke(app, ["lora-validate", *map(str, args)])


def test_full_model_folder_passed_as_adapter_is_named(adapters, tmp_path):
    """A model folder (e.g. one `infer convert --merge-lora` wrote) given as an adapter said only "adapter_config.json
    is missing"; it is now called a full model, with what to do."""
    base, _ = adapters
    model = tmp_path / "merged"
    shutil.copytree(base, model)
    with pytest.raises(LoRAError, match="is a full model .*not a PEFT LoRA adapter") as e:
        read_adapter("merged", model)
    assert "as the base model" in e.value.hint
    res = invoke(base, model, "--steps", "0")
    assert res.exit_code == 1 and "'merged'" in res.output and "is a full model" in res.output, res.output


def test_tensor_problems_of_one_kind_are_one_line(adapters):
    """A DoRA adapter gave one error line per magnitude tensor (two per layer here, 224 on a 32-layer model with
    seven targets); now one line names the first tensor and counts the others."""
    base, paths = adapters
    res = invoke(base, paths["dora"], "--steps", "0", "--json")
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    magnitude = [p for p in report["problems"] if "DoRA magnitude" in p]
    assert len(magnitude) == 1, report["problems"]
    assert "and 3 more like it" in magnitude[0], magnitude[0]
    assert any("use_dora" in p for p in report["problems"])


def test_float16_range_warning_names_its_adapter(adapters):
    """Among several adapters, the warning about weights beyond float16 began with the module path alone: which
    adapter it was about could not be told."""
    base, paths = adapters
    res = invoke(base, paths["good"], paths["huge"], "--steps", "0")
    assert res.exit_code == 0, res.output
    warnings = [line for line in res.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: adapter 'huge': "), warnings


def test_weights_the_config_leaves_out_are_one_line(adapters, tmp_path):
    """An adapter whose layers_to_transform selects no layer it has weights for gave one error per module (14 here,
    224 on a 32-layer model); now one line names the first module and counts the others."""
    base, paths = adapters
    bad = tmp_path / "layer5"
    shutil.copytree(paths["good"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config["layers_to_transform"] = [5]
    (bad / "adapter_config.json").write_text(json.dumps(config))
    res = invoke(base, bad, "--steps", "0", "--json")
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    assert len(report["problems"]) == 1, report["problems"]
    assert "and 13 more modules, which its adapter_config.json does not adapt (layers_to_transform [5])" in \
        report["problems"][0], report["problems"][0]


def test_adapter_folder_given_as_the_base_is_named(adapters):
    """BASE and ADAPTER swapped (or `infer run ./adapter`): "model folder ... has no config.json" did not say that the
    folder is a LoRA adapter nor which model it was trained on."""
    from infer.errors import ModelLoadError
    from infer.models.resolve import resolve_model
    base, paths = adapters
    with pytest.raises(ModelLoadError, match="is a PEFT LoRA adapter .*not a model: it was trained on") as e:
        resolve_model(paths["good"])
    assert str(base) in e.value.message and "--lora" in e.value.hint
    res = invoke(paths["good"], base, "--steps", "0")
    assert res.exit_code == 2 and "is a PEFT LoRA adapter" in res.output, res.output


def test_peft_type_in_lower_case_is_named_even_without_the_numeric_check(adapters, tmp_path):
    """peft_type "lora": infer reads it, peft does not (a KeyError). lora-validate passed it with --steps 0 and said
    only "peft cannot load it: 'lora'" with the numeric check."""
    base, paths = adapters
    lower = tmp_path / "lower"
    shutil.copytree(paths["good"], lower)
    config = json.loads((lower / "adapter_config.json").read_text())
    config["peft_type"] = "lora"
    (lower / "adapter_config.json").write_text(json.dumps(config))
    res = invoke(base, lower, paths["good"], "--steps", "0", "--json")
    assert res.exit_code == 1, res.output
    reports = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["ok"] for r in reports] == [False, True], reports
    assert reports[0]["problems"] == ['peft_type is "lora": peft reads only "LORA" and cannot load it (write '
                                      '"peft_type": "LORA" in adapter_config.json)'], reports[0]


@pytest.mark.parametrize("kind, expected", [
    ("gpt2", "adapts transformer.h.0.mlp.down_proj (and 13 more modules), which the base model does not have"),
    ("rank", "model.layers.0.mlp.down_proj (and 13 more modules) has rank 4 but adapter_config.json gives r=8"),
], ids=["gpt2", "rank"])
def test_one_problem_in_every_module_is_one_line(adapters, tmp_path, kind, expected):
    """An adapter for another architecture (GPT-2's transformer.h.N) or whose config gives another r than its weights
    gave one error per module (hundreds on a 7B model); now one line names the first module and counts the rest."""
    base, paths = adapters
    bad = tmp_path / kind
    shutil.copytree(paths["good"], bad)
    if kind == "gpt2":
        tensors = load_file(bad / WEIGHTS)
        save_file({k.replace("model.model.layers.", "model.transformer.h."): v for k, v in tensors.items()},
                  bad / WEIGHTS)
    else:
        config = json.loads((bad / "adapter_config.json").read_text())
        config["r"] = 8
        (bad / "adapter_config.json").write_text(json.dumps(config))
    res = invoke(base, bad, "--steps", "0", "--json")
    assert res.exit_code == 1, res.output
    problems = json.loads(res.stdout)["problems"]
    assert len(problems) == 1 and problems[0].startswith(expected), problems
