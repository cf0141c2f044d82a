"""`infer lora-validate`: good adapters pass with a table (rank, alpha, scaling, numeric check against peft); every
kind of broken adapter exits 1 naming its reason; a bad BASE exits 2; a GPTQ base is checked against peft on the
dequantized int4 weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from infer.cli.main import app
from infer.lora import adapter as adapter_module
from infer.models.tiny import ensure_builtin

from lora_helpers import save_adapter
from quant_helpers import make_gptqmodel_checkpoint, needs_gptqmodel

WEIGHTS = "adapter_model.safetensors"
Q0_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    base = ensure_builtin("tiny-llama")
    root = tmp_path_factory.mktemp("adapters")
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    paths = {
        "qv": save_adapter(hf, root / "qv", 1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "mlp": save_adapter(hf, root / "mlp", 2, r=16, lora_alpha=8, use_rslora=True,
                            target_modules=["gate_proj", "up_proj", "down_proj"]),
    }
    wide = LlamaForCausalLM(LlamaConfig(**{**hf.config.to_dict(), "hidden_size": 128, "intermediate_size": 256}))
    paths["wide"] = save_adapter(wide, root / "wide", 3, r=4, lora_alpha=4, target_modules=["q_proj", "o_proj"])
    return base, paths


def invoke(*args):
    return CliRunner().invoke(app, ["lora-validate", *map(str, args)])


def test_good_adapters_pass_with_table(setup):
    base, paths = setup
    res = invoke(base, f"support={paths['qv']}", paths["mlp"])
    assert res.exit_code == 0, res.output
    for word in ("rank", "alpha", "scaling", "rslora", "max |Δlogit|", "support", "mlp", "q,v", "gate,up,down",
                 "agree", "float"):
        assert word in res.output, word
    assert "FAIL" not in res.output


def test_json_report_numbers(setup):
    base, paths = setup
    res = invoke(base, paths["qv"], f"m={paths['mlp']}", "--json", "--steps", "4")
    assert res.exit_code == 0, res.output
    reports = {r["name"]: r for r in map(json.loads, res.stdout.splitlines())}
    qv, m = reports["qv"], reports["m"]
    assert (qv["rank"], qv["alpha"], qv["scaling"], qv["rslora"], qv["shapes"]) == (8, 16, "2", False, "ok")
    assert (m["rank"], m["scaling"], m["rslora"], m["targets"]) == (16, "2", True, ["gate_proj", "up_proj",
                                                                                   "down_proj"])
    for r in (qv, m):
        n = r["numeric"]
        assert r["ok"] and n["tokens_agree"] and n["max_abs_diff"] <= n["tolerance"] <= 0.1
        assert n["adapter_effect"] > 100 * n["max_abs_diff"]  # the check could have seen a wrong adapter
        assert r["base_quantization"] is None


def test_numeric_check_catches_a_wrong_scaling(setup, monkeypatch):
    """If infer applied an adapter differently from peft (here: rslora ignored), the numeric check fails it."""
    base, paths = setup
    real = adapter_module.module_scaling

    def ignores_rslora(config, module):
        r, _ = real(config, module)
        return r, config["lora_alpha"] / r

    monkeypatch.setattr(adapter_module, "module_scaling", ignores_rslora)
    res = invoke(base, paths["qv"], paths["mlp"])
    assert res.exit_code == 1, res.output
    assert "adapter 'mlp'" in res.output and "differ from peft" in res.output
    assert "adapter 'qv'" not in res.output  # plain LoRA scaling is unaffected


def _copy(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        t = load_file(dst / WEIGHTS)
        edit_tensors(t)
        save_file(t, dst / WEIGHTS)
    if edit_config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        edit_config(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def _nan(t):
    t[Q0_B] = t[Q0_B].clone()
    t[Q0_B][0, 0] = float("nan")


def _rank(t):
    t[Q0_B] = t[Q0_B][:, :-1].contiguous()


def _unknown_target(t):
    t["base_model.model.model.layers.0.self_attn.x_proj.lora_A.weight"] = torch.zeros(8, 64)
    t["base_model.model.model.layers.0.self_attn.x_proj.lora_B.weight"] = torch.zeros(64, 8)


@pytest.mark.parametrize("kind, reason", [
    ("rank-mismatch", "do not share a rank"),
    ("unknown-target", "x_proj, which the base model does not have"),
    ("unknown-target-config", "which the base model does not have"),
    ("hidden-size", "r=4 adapter expects hidden 128, base has 64 (4 modules)"),
    ("missing-config", "adapter_config.json is missing"),
    ("bad-config", "adapter_config.json is not valid JSON"),
    ("no-rank", "has no valid 'r'"),
    ("alpha-nan", "has no valid 'lora_alpha' (got nan)"),
    ("alpha-inf", "has no valid 'lora_alpha' (got inf)"),
    ("alpha-huge", "has no valid 'lora_alpha' (got 1e+300)"),
    ("alpha-pattern-nan", "has invalid alpha_pattern values {'q_proj': nan}"),
    ("non-finite", "non-finite"),
    ("rank-limit", "rank 8 is larger than --max-lora-rank 4"),
    ("no-folder", "folder not found"),
])
def test_each_failure_exits_1_naming_the_reason(setup, tmp_path, kind, reason):
    base, paths = setup
    qv, bad = paths["qv"], tmp_path / kind
    extra = []
    if kind == "rank-mismatch":
        _copy(qv, bad, _rank)
    elif kind == "unknown-target":
        _copy(qv, bad, _unknown_target)
    elif kind == "unknown-target-config":
        _copy(qv, bad, edit_config=lambda c: c.update(target_modules=["q_proj", "v_proj", "foo_proj"]))
    elif kind == "hidden-size":
        bad = paths["wide"]
    elif kind == "missing-config":
        _copy(qv, bad)
        (bad / "adapter_config.json").unlink()
    elif kind == "bad-config":
        _copy(qv, bad)
        (bad / "adapter_config.json").write_text("{not json")
    elif kind == "no-rank":
        _copy(qv, bad, edit_config=lambda c: c.pop("r"))
    elif kind in ("alpha-nan", "alpha-inf", "alpha-huge"):  # a NaN or overflowing scaling turns outputs into NaN
        alpha = {"alpha-nan": float("nan"), "alpha-inf": float("inf"), "alpha-huge": 1e300}[kind]
        _copy(qv, bad, edit_config=lambda c: c.update(lora_alpha=alpha))
    elif kind == "alpha-pattern-nan":
        _copy(qv, bad, edit_config=lambda c: c.update(alpha_pattern={"q_proj": float("nan")}))
    elif kind == "non-finite":
        _copy(qv, bad, _nan)
    elif kind == "rank-limit":
        bad, extra = qv, ["--max-lora-rank", "4"]
    res = invoke(base, f"bad={bad}", *extra, "--steps", "0")
    assert res.exit_code == 1, res.output
    assert "FAIL" in res.output and "adapter 'bad'" in res.output and reason in res.output
    assert "Traceback" not in res.output


def test_one_bad_adapter_does_not_hide_the_good_ones(setup):
    base, paths = setup
    res = invoke(base, paths["qv"], paths["wide"], "--json")
    assert res.exit_code == 1
    reports = {r["name"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert reports["qv"]["ok"] and reports["qv"]["numeric"]["tokens_agree"]
    assert not reports["wide"]["ok"] and reports["wide"]["numeric"] is None  # static problems: no numeric check
    assert reports["wide"]["shapes"] in ("q_proj 128->64, base 64->64", "o_proj 64->128, base 64->64")


@pytest.mark.parametrize("kind", ["missing", "no-config", "float-with-quantized"])
def test_bad_base_exits_2(setup, tmp_path, kind):
    base, paths = setup
    args = [tmp_path / "nowhere"]
    if kind == "no-config":
        (tmp_path / "empty").mkdir()
        args = [tmp_path / "empty"]
    elif kind == "float-with-quantized":
        args = [base, "--quantized"]
    res = invoke(args[0], paths["qv"], *args[1:])
    assert res.exit_code == 2, res.output
    assert {"missing": "neither a local model folder", "no-config": "no config.json",
            "float-with-quantized": "is a float model"}[kind] in res.output


@needs_gptqmodel
def test_gptq_base_checked_against_dequantized_int4(setup, tmp_path):
    pytest.importorskip("infer.quant.gptq_linear")
    base, paths = setup
    qdir = make_gptqmodel_checkpoint(base, tmp_path / "q", bits=4, group_size=32, num_samples=4, seq_len=32)
    res = invoke(qdir, paths["qv"], paths["mlp"], "--quantized", "--json", "--steps", "4")
    assert res.exit_code == 0, res.output
    for line in res.stdout.splitlines():
        r = json.loads(line)
        assert r["ok"] and r["base_quantization"] == "GPTQ 4-bit, group 32"
        assert r["numeric"]["oracle"] == "peft on the dequantized int4 base" and r["numeric"]["tokens_agree"]
    table = invoke(qdir, paths["qv"], "--steps", "2")
    assert table.exit_code == 0 and "GPTQ" in table.output


def test_size_mismatch_is_one_line_per_adapter_and_verbose_lists_every_module(setup):
    base, paths = setup
    short = invoke(base, f"wide={paths['wide']}", "--steps", "0")
    assert short.exit_code == 1
    errors = [line for line in short.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: adapter 'wide' ({paths['wide']}): r=4 adapter expects hidden 128, base has 64 "
                      f"(4 modules): it was made for another base model (--verbose lists every module)"]
    full = invoke(base, f"wide={paths['wide']}", "--steps", "0", "--verbose")
    assert full.exit_code == 1
    modules = [line for line in full.output.splitlines() if line.startswith("error:") and " maps " in line]
    assert len(modules) == 4  # q_proj and o_proj in each of the 2 layers
    assert any("layers.1.self_attn.o_proj maps 64 -> 128 features" in line for line in modules)
    js = [json.loads(line) for line in invoke(base, paths["wide"], "--steps", "0", "--json").stdout.splitlines()]
    assert len(js[0]["problems"]) == 4 and js[0]["size_mismatch"].startswith("r=4 adapter expects hidden 128")


def test_other_intermediate_size_is_named_in_the_summary(setup, tmp_path):
    """An adapter from a base with another MLP width (same hidden size) is summarised by that width, read from
    up_proj's output or down_proj's input (down_proj's output is the hidden size)."""
    from transformers import AutoConfig, LlamaForCausalLM
    base, _ = setup
    cfg = AutoConfig.from_pretrained(base).to_dict()
    wider = LlamaForCausalLM(type(AutoConfig.from_pretrained(base))(**{**cfg, "intermediate_size": 256}))
    for targets in (["down_proj"], ["up_proj", "down_proj"]):
        path = save_adapter(wider, tmp_path / "-".join(targets), 4, r=4, lora_alpha=4, target_modules=targets)
        res = invoke(base, f"wider={path}", "--steps", "0")
        assert res.exit_code == 1
        assert "adapter expects intermediate 256, base has 128 (" in res.output, res.output
        assert "hidden" not in res.output.split("adapter expects")[1].split("(")[0]


def test_deeper_adapter_summarised_with_its_layers(setup, tmp_path):
    base, paths = setup
    deep = _copy(paths["qv"], tmp_path / "deep", lambda t: t.update({
        k.replace("layers.0.", "layers.5."): v.clone() for k, v in list(t.items()) if "layers.0." in k}))
    res = invoke(base, f"deep={deep}", "--steps", "0")
    assert res.exit_code == 1
    assert "adapter expects 6 layers, base has 2 (2 modules)" in res.output


@pytest.mark.parametrize("named, warns", [
    ("meta-llama/Llama-2-7b-hf", True),
    ("someone/tiny-llama-GPTQ", False),  # the same model under a quantized name
    ("someone/tiny-llama-GPTQ-4bit", False),  # two suffixes
    (None, False),
])
def test_adapter_naming_another_base_warns_but_passes(setup, tmp_path, named, warns):
    base, paths = setup
    other = _copy(paths["qv"], tmp_path / "other", edit_config=lambda c: c.update(base_model_name_or_path=named))
    res = invoke(base, f"other={other}", "--steps", "0")
    assert res.exit_code == 0, res.output
    assert ("warning: adapter 'other' was trained on" in res.output) == warns, res.output
    if warns:
        assert f"warning: adapter 'other' was trained on '{named}', not on " in res.output


def test_the_library_check_does_not_import_the_engine(setup):
    import subprocess
    import sys
    base, paths = setup
    code = ("import sys; from infer.lora.validate import static_reports; "
            f"info, reports, _ = static_reports({str(base)!r}, [{str(paths['qv'])!r}]); assert reports[0].static_ok; "
            "print(sorted(m for m in sys.modules if m.startswith('infer.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_adapter_peft_cannot_load_fails_its_row_and_the_others_are_checked(setup, tmp_path):
    """A target_modules string is a regex to peft: "(q_proj" does not compile, so peft refuses the adapter, and so
    does infer's static check (`infer run --lora` served it before). Its row FAILs naming the regex (no numbers),
    the adapters after it are still checked, exit 1. "q_proj|v_proj" matches no full module name: infer itself
    refuses the weights it does not select, as peft would leave them out."""
    base, paths = setup
    regex = _copy(paths["qv"], tmp_path / "regex", edit_config=lambda c: c.update(target_modules="(q_proj"))
    res = invoke(base, f"re={regex}", paths["qv"], paths["mlp"], "--json", "--steps", "2")
    assert res.exit_code == 1, res.output
    assert isinstance(res.exception, SystemExit), res.exception
    reports = {r["name"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert set(reports) == {"re", "qv", "mlp"}
    bad = reports["re"]
    assert not bad["ok"] and bad["numeric"] is None
    assert bad["reasons"][0].startswith('target_modules "(q_proj" is not a valid regular expression')
    for name in ("qv", "mlp"):
        assert reports[name]["ok"] and reports[name]["numeric"]["tokens_agree"], reports[name]
    table = invoke(base, f"re={regex}", paths["qv"], "--steps", "2")
    assert table.exit_code == 1 and isinstance(table.exception, SystemExit), table.output
    assert "FAIL" in table.output and "1 of 2 adapters failed" in table.output
    assert f"error: adapter 're' ({regex}): target_modules \"(q_proj\" is not a valid regular" in table.output
    none = _copy(paths["qv"], tmp_path / "none", edit_config=lambda c: c.update(target_modules="q_proj|v_proj"))
    res = invoke(base, f"none={none}", "--json", "--steps", "2")
    bad = json.loads(res.stdout.splitlines()[0])
    assert res.exit_code == 1 and not bad["ok"] and "does not adapt (target_modules" in bad["reasons"][0]


def test_peft_failure_after_injection_leaves_the_oracle_plain(setup, monkeypatch):
    """peft can fail after wrapping the oracle's layers (reading the weights): the wrappers are removed, so the next
    adapter's check runs on the plain base."""
    import peft.peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoModelForCausalLM

    from infer.cli.lora_check import peft_check
    from infer.errors import LoRAError
    base, paths = setup
    oracle = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()

    def unreadable(*args, **kwargs):
        raise RuntimeError("weights unreadable\nsecond line")

    monkeypatch.setattr(peft.peft_model, "load_peft_weights", unreadable)
    with pytest.raises(LoRAError) as err:
        peft_check(oracle, "qv", paths["qv"], [], 1e-3, "peft on the float base")
    assert err.value.message == "peft cannot load it: weights unreadable"
    assert not any(isinstance(m, BaseTunerLayer) for m in oracle.modules())
    assert not hasattr(oracle, "peft_config")


def test_rank_column_is_the_rank_the_limit_checks(setup, tmp_path):
    """rank_pattern can raise a module's rank above r: the rank shown is the largest, the one --max-lora-rank must
    hold (the table said r=4 while failing "rank 17 is larger than --max-lora-rank 16")."""
    from transformers import AutoModelForCausalLM
    base, _ = setup
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    path = save_adapter(hf, tmp_path / "kv", 4, r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"],
                        rank_pattern={"v_proj": 17})
    res = invoke(base, f"kv={path}", "--json", "--steps", "0", "--max-lora-rank", "16")
    report = json.loads(res.stdout.splitlines()[0])
    assert res.exit_code == 1 and report["rank"] == 17 and "rank 17" in " ".join(report["reasons"])
    res = invoke(base, f"kv={path}", "--json", "--steps", "0", "--max-lora-rank", "32")
    assert res.exit_code == 0 and json.loads(res.stdout.splitlines()[0])["rank"] == 17


def test_weights_peft_does_not_read_are_named_as_the_reason(setup, tmp_path):
    """Tensors named without peft's prefix: infer applies them, peft reads none of them (its logits stay the base's).
    The verdict says that peft loaded no weights, not only that infer differs from peft."""
    from safetensors.torch import load_file, save_file
    base, paths = setup
    path = _copy(paths["qv"], tmp_path / "renamed")
    weights = load_file(path / "adapter_model.safetensors")
    save_file({k.removeprefix("base_model.model."): v for k, v in weights.items()}, path / "adapter_model.safetensors")
    res = invoke(base, f"renamed={path}", "--json", "--steps", "2")
    report = json.loads(res.stdout.splitlines()[0])
    assert res.exit_code == 1 and report["numeric"]["adapter_effect"] == 0.0
    assert report["reasons"][0].startswith("peft loaded none of its weights")


@pytest.mark.parametrize("kind, reason", [
    ("target-int", "adapter_config.json has target_modules 5 (an integer), but peft's LoraConfig takes"),
    ("exclude-int", "adapter_config.json has exclude_modules 5 (an integer)"),
    ("pattern-int", "adapter_config.json has layers_pattern 5 (an integer)"),
    ("no-peft-type", 'adapter_config.json has no peft_type (expected "LORA")'),
    ("overflow", "lora_B @ lora_A x scaling 2 overflows float32"),
])
def test_config_and_overflow_failures_keep_the_other_adapters_report(setup, tmp_path, kind, reason):
    """A wrong-typed field used to raise TypeError out of the command (every other adapter's report lost), a missing
    peft_type to fail as "peft cannot load it: 'peft_type'", and weights x1e30 (each finite) to pass with a max
    |Δlogit| of 0 while peft's logits were all NaN."""
    base, paths = setup
    edits = {"target-int": dict(target_modules=5), "exclude-int": dict(exclude_modules=5),
             "pattern-int": dict(layers_pattern=5, layers_to_transform=[0])}
    bad = tmp_path / kind
    if kind == "overflow":
        _copy(paths["qv"], bad, lambda t: t.update({k: v * 1e30 for k, v in t.items()}))
    else:
        _copy(paths["qv"], bad, edit_config=lambda c: c.pop("peft_type") if kind == "no-peft-type" else
              c.update(edits[kind]))
    res = invoke(base, f"bad={bad}", paths["qv"], "--json", "--steps", "2")
    assert res.exit_code == 1, res.output
    reports = {r["name"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert reports["qv"]["ok"] and reports["qv"]["numeric"]["tokens_agree"]
    assert not reports["bad"]["ok"] and any(reason in p for p in reports["bad"]["problems"]), reports["bad"]
    assert "Traceback" not in res.output


def test_non_finite_logits_fail_the_numeric_check(setup, tmp_path, monkeypatch):
    """Logits that are NaN (here: an overflow the load-time bound is told to miss) compared as 0 and "agree"."""
    base, paths = setup
    bad = _copy(paths["qv"], tmp_path / "big", lambda t: t.update({k: v * 1e30 for k, v in t.items()}))
    monkeypatch.setattr(adapter_module, "_delta_bound", lambda a, b, scaling: 0.0)
    res = invoke(base, f"big={bad}", "--steps", "2")
    assert res.exit_code == 1, res.output
    assert "infer's and peft's logits with the adapter are not finite (NaN/inf)" in res.output, res.output
    assert "NaN/inf" in res.output and "0.00e+00" not in res.output and "Traceback" not in res.output
