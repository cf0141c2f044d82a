"""LoRA adapters probed against peft (probe session 39): each test fails without its fix.

- an adapter saved in float8_e4m3fn: reading it crashed (torch has no isfinite for it); it is now read as peft reads
  it; an adapter whose weights are not floats (int8, bool, complex) is refused by name instead of cast silently;
- an adapter whose weights are beyond float16's range, on a float16 base: refused at load (they were cast to inf);
- tensors of another model's layers (a vision tower's layers.N.self_attn.q_proj) were read as the base's layer N,
  replacing its weights; two tensors for one module (with and without base_model.model., or .default.) silently
  one over the other: both refused by name;
- an adapter_model.bin that unpickles to something else than named tensors: a traceback, now named;
- a rank_pattern / alpha_pattern key that is not a regex: re.error traceback; a layers_pattern that is not one was
  reported as every module left out; both now named as peft's refusal;
- a folder where peft saved the adapter in a subfolder (adapter_name not "default"): the error names the subfolder;
- r / lora_alpha / a rank_pattern value too large for a float: OverflowError traceback, now an invalid value;
- use_bdlora's target_modules_bd_a / _b not a list of names: a TypeError traceback, or a string matched by character;
- lora-validate's numeric check gave its engine a device slot per adapter checked (they run one at a time);
- warmup --estimate checked the adapters without the engine's dtype (the float16 range refusal came only at start).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.errors import LoRAError
from infer.lora import adapter_problems, load_adapter

from test_lora_adapter import ALL, make_adapter, tiny_config, tiny_llama
from test_probes_lora_s18 import _infer_logits, _peft_logits

X = torch.tensor([[3, 17, 42, 99, 5, 64]])


def _retype(path, dtype):
    f = path / "adapter_model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(str(f)).items()}, str(f))
    return path


def test_float8_adapter_is_read_as_peft_reads_it(tmp_path):
    path = _retype(make_adapter(tmp_path, "f8", target_modules=ALL), torch.float8_e4m3fn)
    assert adapter_problems("f8", path, tiny_config()) == []
    ad = load_adapter("f8", path, tiny_config(), dtype=torch.float32)
    assert torch.allclose(_infer_logits(ad, X), _peft_logits(path, X), atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.complex64])
def test_adapter_weights_that_are_not_floats_are_refused(tmp_path, dtype):
    path = _retype(make_adapter(tmp_path, "q", target_modules=["q_proj"]), dtype)
    with pytest.raises(LoRAError, match=f"lora_A holds {str(dtype).removeprefix('torch.')} values, not floating"):
        load_adapter("q", path, tiny_config())


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory):
    from pathlib import Path

    from infer.models.tiny import ensure_builtin
    from lora_helpers import THREE, hf_float, save_adapter
    base = Path(ensure_builtin("tiny-llama"))
    hf = hf_float(base)
    root = tmp_path_factory.mktemp("s39")
    return base, {n: save_adapter(hf, root / n, seed=39 + i, **kw) for i, (n, kw) in enumerate(THREE.items())}


def test_lora_validate_numeric_check_takes_one_slot_whatever_the_adapter_count(tiny_adapters):
    """The check's engine had a device slot per adapter checked (float32, --max-lora-rank on every layer): 30 rank-64
    adapters on a 7B base asked for ~19 GB of slots and failed naming --max-loras, which lora-validate has not."""
    from infer.cli.lora_check import engine_for, numeric_checks
    base, paths = tiny_adapters
    one = engine_for(base, {"a": paths["a"]}, 8, 4, "cpu")
    three = engine_for(base, paths, 8, 4, "cpu")
    assert three.engine.lora_manager.device_bytes() == one.engine.lora_manager.device_bytes()
    checks = numeric_checks(base, False, paths, 8, steps=4, device="cpu")  # swapped in one after the other
    assert all(c.ok and c.adapter_effect > 0 for c in checks.values()), checks


def test_weights_beyond_float16_are_refused_at_load_not_served_as_nan(tmp_path):
    """A float32 adapter whose lora_A holds 1e6-sized values (B as small: the product is the same) fits a float32 or
    bfloat16 base; cast to a float16 base's dtype they were inf and every request of the adapter ended in NaN."""
    path = make_adapter(tmp_path, "big", target_modules=["q_proj"])
    f = path / "adapter_model.safetensors"
    save_file({k: v * (1e6 if "lora_A" in k else 1e-6) for k, v in load_file(str(f)).items()}, str(f))
    for dtype in (torch.float32, torch.bfloat16):
        ad = load_adapter("big", path, tiny_config(), dtype=dtype)
        assert all(torch.isfinite(m.lora_a).all() for m in ad.modules.values())
    with pytest.raises(LoRAError, match=r"lora_A holds values up to .* beyond float16's range \(65504\)") as e:
        load_adapter("big", path, tiny_config(), dtype=torch.float16)
    assert "--dtype bfloat16 or float32" in e.value.hint


def _add_tensors(path, rename):
    """Save the adapter with, beside each of its tensors, a copy (other values) under rename(name)."""
    f = path / "adapter_model.safetensors"
    weights = load_file(str(f))
    save_file({**weights, **{rename(k): v * 3 + 1 for k, v in weights.items()}}, str(f))
    return path


def test_tensors_of_another_models_layers_are_not_taken_for_the_bases(tmp_path):
    """Tensors of a module path the base has not (a VLM's vision tower, language_model. ...) that ends in
    layers.N.self_attn.q_proj were read as the base's module, the last one in the file replacing the real weights:
    logits 0.4 away from peft's, which ignores them, and nothing said."""
    path = _add_tensors(make_adapter(tmp_path, "v", target_modules=["q_proj"]),
                        lambda k: k.replace("base_model.model.", "base_model.model.vision_tower."))
    problems = [str(p) for p in adapter_problems("v", path, tiny_config())]
    assert problems and all("adapts vision_tower.model.layers." in p for p in problems), problems
    assert "its layers sit under vision_tower: it was made for another model" in problems[0]


def test_two_tensors_for_one_module_are_refused(tmp_path):
    """base_model.model.X.lora_A.weight and X.lora_A.weight (or X.lora_A.default.weight) are one module to infer:
    the later one in the file replaced the other silently."""
    path = _add_tensors(make_adapter(tmp_path, "d", target_modules=["q_proj"]),
                        lambda k: k.replace("lora_A.weight", "lora_A.default.weight").replace(
                            "lora_B.weight", "lora_B.default.weight"))
    with pytest.raises(LoRAError, match=r"has two lora_A tensors for model.layers.0.self_attn.q_proj \("):
        load_adapter("d", path, tiny_config())
    bare = _add_tensors(make_adapter(tmp_path, "b", target_modules=["q_proj"]),
                        lambda k: k.removeprefix("base_model.model.model."))
    assert any("has two lora_A tensors for model.layers.1.self_attn.q_proj" in str(p)
               for p in adapter_problems("b", bare, tiny_config()))


@pytest.mark.parametrize("kind", ["tensor", "list", "numbers", "int-key", "none"])
def test_bin_file_that_is_not_a_state_dict_is_named(tmp_path, kind):
    """adapter_model.bin unpickled to a tensor, a list, None or a dict of numbers: AttributeError/TypeError
    tracebacks out of --lora, lora-validate and the server's load route (a 500)."""
    path = make_adapter(tmp_path, "bin", safe=False, target_modules=["q_proj"])
    weights = torch.load(path / "adapter_model.bin")
    obj = {"tensor": torch.zeros(3), "list": [1, 2], "numbers": {k: 1 for k in weights},
           "int-key": {1: torch.zeros(2)}, "none": None}[kind]
    torch.save(obj, path / "adapter_model.bin")
    with pytest.raises(LoRAError, match="adapter_model.bin is not a state dict of named tensors"):
        load_adapter("bin", path, tiny_config())
    assert "not a state dict" in str(adapter_problems("bin", path, tiny_config())[0])


def _edit(path, **changes):
    import json
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("key", ["rank_pattern", "alpha_pattern"])
def test_pattern_key_that_is_not_a_regex_is_named(tmp_path, key):
    """peft matches each rank_pattern / alpha_pattern key as a regex: one that does not compile raised re.error out
    of --lora, lora-validate and the server's load route (500). peft refuses the adapter too."""
    path = _edit(make_adapter(tmp_path, "p", target_modules=["q_proj"]), **{key: {"q_proj(": 4}})
    with pytest.raises(Exception, match="missing \\)"):
        _peft_logits(path, X)
    with pytest.raises(LoRAError, match=f'has the {key} key "q_proj\\(", not a valid regular expression'):
        load_adapter("p", path, tiny_config())
    assert "not a valid regular expression" in str(adapter_problems("p", path, tiny_config())[0])


def test_layers_pattern_that_is_not_a_regex_says_so(tmp_path):
    """It was reported as every module 'not adapted (layers_pattern ...)': peft fails on the regex itself."""
    path = _edit(make_adapter(tmp_path, "l", target_modules=["q_proj"], layers_to_transform=[0]),
                 layers_pattern="lay(ers")
    with pytest.raises(Exception, match="missing \\)"):
        _peft_logits(path, X)
    problems = [str(p) for p in adapter_problems("l", path, tiny_config())]
    assert problems[0].startswith('layers_pattern "lay(ers" is not a valid regular expression (missing ), '
                                  "unterminated subpattern at position 3)"), problems


def test_folder_whose_adapter_peft_saved_in_a_subfolder_names_it(tmp_path):
    """save_pretrained of an adapter named other than "default" writes OUT/NAME/adapter_config.json: passing OUT
    said only "adapter_config.json is missing"."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"]), adapter_name="sql")
    model.save_pretrained(str(tmp_path / "out"))
    with pytest.raises(LoRAError, match="adapter_config.json is missing; the subfolder sql holds one") as e:
        load_adapter("s", tmp_path / "out", tiny_config())
    assert str(tmp_path / "out" / "sql") in e.value.hint
    assert load_adapter("s", tmp_path / "out" / "sql", tiny_config()).rank == 4


def test_warmup_estimate_refuses_weights_beyond_float16_as_the_engine_start_does(tiny_adapters, tmp_path):
    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.config import EngineConfig
    base, paths = tiny_adapters
    import shutil
    big = shutil.copytree(paths["a"], tmp_path / "big")
    f = big / "adapter_model.safetensors"
    save_file({k: v * (1e6 if "lora_A" in k else 1e-6) for k, v in load_file(str(f)).items()}, str(f))
    config = EngineConfig(str(base), dtype="float16", loras={"big": str(big)}, max_lora_rank=8)
    with pytest.raises(LoRAError, match="beyond float16's range"):
        estimate_plan(config, 32, 1)
    estimate_plan(EngineConfig(str(base), dtype="float32", loras={"big": str(big)}, max_lora_rank=8), 32, 1)


@pytest.mark.parametrize("key", ["r", "lora_alpha", "rank_pattern"])
def test_integer_too_large_for_a_float_is_an_invalid_value(tmp_path, key):
    """JSON integers have no size limit: r, lora_alpha or a rank_pattern value of 10**400 raised OverflowError out of
    --lora, lora-validate and the server's load route (a 500)."""
    huge = 10 ** 400
    path = _edit(make_adapter(tmp_path, "h", target_modules=["q_proj"]),
                 **{key: {"q_proj": huge} if key == "rank_pattern" else huge})
    with pytest.raises(LoRAError, match=f"has (no valid '{key}'|invalid {key} values)"):
        load_adapter("h", path, tiny_config())


@pytest.mark.parametrize("patterns", [[1], "q_proj"])
def test_bdlora_patterns_that_are_not_a_list_of_names_are_named(tmp_path, patterns):
    """use_bdlora's target_modules_bd_a of [1] raised TypeError ('in <string>' requires string); a string was
    matched character by character (every module has a "q" or "_"): both refused as a use_bdlora infer cannot read."""
    path = _edit(make_adapter(tmp_path, "bd", target_modules=["q_proj"]),
                 use_bdlora={"nblocks": 2, "target_modules_bd_a": patterns})
    assert "has a use_bdlora infer cannot read" in str(adapter_problems("bd", path, tiny_config())[0])


def test_lora_validate_warns_of_weights_beyond_the_dtype_a_gpu_serves_the_base_in(tiny_adapters, tmp_path):
    """lora-validate's numeric check runs in float32, so an adapter whose weights are beyond float16's range passed
    it, and `--lora` on a GPU (float16 for a float32 or float16 checkpoint with --dtype auto) then refused it."""
    import shutil

    from infer.lora.validate import static_reports
    base, paths = tiny_adapters
    big = shutil.copytree(paths["a"], tmp_path / "big")
    f = big / "adapter_model.safetensors"
    save_file({k: v * (1e6 if "lora_A" in k else 1e-6) for k, v in load_file(str(f)).items()}, str(f))
    _, reports, _ = static_reports(str(base), [f"big={big}", f"a={paths['a']}"])
    by_name = {r.name: r for r in reports}
    assert by_name["big"].static_ok and by_name["a"].warnings == []
    warned = [w for w in by_name["big"].warnings if "beyond float16's range (65504)" in w]
    assert warned and "--dtype bfloat16 or float32" in warned[0], by_name["big"].warnings
