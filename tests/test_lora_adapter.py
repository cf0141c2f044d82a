"""PEFT adapter loading and validation: what peft writes is read back exactly; what infer cannot serve is refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.errors import LoRAError
from infer.lora import adapter_problems, load_adapter, read_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_config(layers: int = 2, hidden: int = 64):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def tiny_llama(seed: int = 0, **kw):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**kw)).eval()


def make_adapter(tmp_path, name: str, seed: int = 1, base=None, safe: bool = True, **lora_kw):
    """Save a peft LoRA adapter with random (non-zero) A and B for a tiny Llama; returns its folder."""
    from peft import LoraConfig, get_peft_model
    base = base if base is not None else tiny_llama()
    lora_kw.setdefault("r", 8)
    lora_kw.setdefault("lora_alpha", 16)
    lora_kw.setdefault("target_modules", ["q_proj", "v_proj"])
    model = get_peft_model(base, LoraConfig(**lora_kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    path = tmp_path / name
    model.save_pretrained(str(path), safe_serialization=safe)
    model.unload()  # give the base model its plain Linear layers back
    return path


def test_reads_what_peft_wrote(tmp_path):
    path = make_adapter(tmp_path, "a", r=8, lora_alpha=16, target_modules=ALL)
    ad = load_adapter("a", path, tiny_config())
    assert ad.rank == 8 and len(ad.modules) == 2 * len(ALL)
    saved = load_file(str(path / "adapter_model.safetensors"))
    m = ad.modules["model.layers.1.mlp.down_proj"]
    assert (m.layer, m.proj, m.scaling) == (1, "down_proj", 2.0)
    assert torch.equal(m.lora_a, saved["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"])
    assert torch.equal(m.lora_b, saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"])
    assert m.lora_a.shape == (8, 128) and m.lora_b.shape == (64, 8)
    assert ad.modules["model.layers.0.self_attn.k_proj"].lora_b.shape == (32, 8)  # GQA: 2 kv heads of 16


def test_scaling_rslora_and_patterns(tmp_path):
    rs = load_adapter("rs", make_adapter(tmp_path, "rs", r=16, lora_alpha=8, use_rslora=True), tiny_config())
    assert all(math.isclose(m.scaling, 8 / math.sqrt(16)) for m in rs.modules.values())
    pat = make_adapter(tmp_path, "pat", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                       rank_pattern={"v_proj": 12}, alpha_pattern={"layers.1.mlp.down_proj": 3})
    ad = load_adapter("pat", pat, tiny_config())
    assert ad.modules["model.layers.0.self_attn.q_proj"].scaling == 2.0
    v = ad.modules["model.layers.1.self_attn.v_proj"]
    assert v.rank == 12 and math.isclose(v.scaling, 8 / 12)
    assert ad.modules["model.layers.0.mlp.down_proj"].scaling == 2.0
    assert ad.modules["model.layers.1.mlp.down_proj"].scaling == 3 / 4
    assert ad.rank == 12


def test_bin_format_and_regex_targets(tmp_path):
    path = make_adapter(tmp_path, "bin", safe=False, target_modules=r".*\.(gate|up)_proj")
    assert (path / "adapter_model.bin").is_file()
    ad = load_adapter("bin", path, tiny_config())
    assert sorted({m.proj for m in ad.modules.values()}) == ["gate_proj", "up_proj"]


def _expect_error(path, name="bad", config=None, max_rank=None, match=None):
    with pytest.raises(LoRAError) as e:
        load_adapter(name, path, config or tiny_config(), max_rank)
    assert repr(name) in str(e.value) and e.value.hint
    if match:
        assert match in str(e.value), str(e.value)
    problems = adapter_problems(name, path, config or tiny_config(), max_rank)
    assert problems and problems[0].message in str(e.value)
    return e.value


@pytest.mark.parametrize("kw,match", [
    (dict(use_dora=True), "DoRA"),
    (dict(lora_bias=True), "LoRA bias"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
])
def test_unsupported_features(tmp_path, kw, match):
    _expect_error(make_adapter(tmp_path, "x", **kw), "x", match=match)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_trained_base_biases_are_refused_only_where_the_base_has_them(tmp_path, bias):
    """peft's bias="all" saves the base's biases it trained: refused. On a base without biases (Llama) nothing but
    LoRA is saved and peft serves it as plain LoRA: so does infer (it refused the config's word)."""
    from transformers import LlamaForCausalLM
    plain = load_adapter("p", make_adapter(tmp_path, "p", bias=bias), tiny_config())
    assert len(plain.modules) == 4
    torch.manual_seed(0)
    biased = LlamaForCausalLM(tiny_config().__class__(**{**tiny_config().to_dict(), "attention_bias": True})).eval()
    _expect_error(make_adapter(tmp_path, "b", base=biased, bias=bias), "b", match="trains the base model's biases")


def test_rank_above_max(tmp_path):
    err = _expect_error(make_adapter(tmp_path, "big", r=64), "big", max_rank=16, match="rank 64")
    assert "--max-lora-rank" in err.hint


def test_missing_or_bad_files(tmp_path):
    _expect_error(tmp_path / "nowhere", "gone", match="not found")
    path = make_adapter(tmp_path, "cfg")
    (path / "adapter_config.json").unlink()
    _expect_error(path, "cfg", match="adapter_config.json is missing")
    path = make_adapter(tmp_path, "json")
    (path / "adapter_config.json").write_text("{not json")
    _expect_error(path, "json", match="not valid JSON")
    path = make_adapter(tmp_path, "nor")
    cfg = json.loads((path / "adapter_config.json").read_text())
    del cfg["r"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    _expect_error(path, "nor", match="'r'")
    path = make_adapter(tmp_path, "now")
    (path / "adapter_model.safetensors").unlink()
    _expect_error(path, "now", match="no weights")
    path = make_adapter(tmp_path, "trunc")
    (path / "adapter_model.safetensors").write_bytes(b"\x00\x01garbage")
    _expect_error(path, "trunc", match="cannot read")


def _rewrite(path, edit):
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def test_bad_tensors(tmp_path):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    path = make_adapter(tmp_path, "rank")
    _rewrite(path, lambda t: t.__setitem__(key.format("B"), torch.randn(64, 4)))
    _expect_error(path, "rank", match="do not share a rank")
    path = make_adapter(tmp_path, "half")
    _rewrite(path, lambda t: t.pop(key.format("B")))
    _expect_error(path, "half", match="lora_B missing")
    path = make_adapter(tmp_path, "nan")
    _rewrite(path, lambda t: t[key.format("A")].__setitem__((0, 0), float("nan")))
    _expect_error(path, "nan", match="non-finite")
    path = make_adapter(tmp_path, "bias")
    _rewrite(path, lambda t: t.__setitem__(key.format("B").replace("weight", "bias"), torch.ones(64)))
    _expect_error(path, "bias", match="LoRA bias")
    path = make_adapter(tmp_path, "odd")
    _rewrite(path, lambda t: [t.__setitem__(k.replace("q_proj", "qq_proj"), t.pop(k)) for k in list(t) if "q_" in k])
    _expect_error(path, "odd", match="qq_proj")


def test_does_not_fit_base(tmp_path):
    deep = make_adapter(tmp_path, "deep", base=tiny_llama(layers=3))
    _expect_error(deep, "deep", match="layer 2")
    wide = make_adapter(tmp_path, "wide", base=tiny_llama(hidden=32))
    err = _expect_error(wide, "wide", match="maps 32 -> 32")
    assert "more problems" in str(err)  # every adapted module is reported
    ad = read_adapter("wide", wide)
    assert len(ad.validate_against(tiny_config())) == 4  # q and v in 2 layers
    assert ad.validate_against(tiny_config(hidden=32)) == []


def test_pattern_keys_match_as_peft():
    """rank_pattern / alpha_pattern keys select modules exactly as peft's get_pattern_key does (a key matches a whole
    trailing part of the module path, as a regex), over a 12-layer model where layers.1 must not match layers.10."""
    from peft.utils.other import get_pattern_key
    from infer.lora.adapter import pattern_value
    modules = [f"model.layers.{i}.{parent}.{proj}" for i in range(12) for proj, parent in
               (("q_proj", "self_attn"), ("o_proj", "self_attn"), ("down_proj", "mlp"))]
    keys = ["layers.1.self_attn.q_proj", "layers.1", "self_attn", r"layers\.1\d\.mlp\.down_proj", "proj",
            "model.layers.0.self_attn.o_proj", "o_proj", r"layers\.[2-4]\.self_attn\.q_proj"]
    patterns = {k: i + 100 for i, k in enumerate(keys)}
    for module in modules:
        want = patterns.get(get_pattern_key(list(patterns), module), 7)
        assert pattern_value(patterns, module, 7) == want, module


def test_qwen3_o_proj_reads_heads_times_head_dim(tmp_path):
    """Qwen3's o_proj maps num_heads * head_dim (here 128) to hidden (64): an adapter peft trained on it fits."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from infer.models.tiny import ensure_builtin
    cfg = AutoConfig.from_pretrained(ensure_builtin("tiny-qwen3"))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg).eval()
    path = make_adapter(tmp_path, "q3", base=base, target_modules=["q_proj", "k_proj", "o_proj"])
    ad = load_adapter("q3", path, cfg)
    o = ad.modules["model.layers.1.self_attn.o_proj"]
    assert o.lora_a.shape == (8, 128) and o.lora_b.shape == (64, 8)
    assert ad.modules["model.layers.0.self_attn.k_proj"].lora_b.shape == (64, 8)  # 2 kv heads of 32


def test_rank_equal_to_max_is_accepted(tmp_path):
    ad = load_adapter("r16", make_adapter(tmp_path, "r16", r=16), tiny_config(), max_rank=16)
    assert ad.rank == 16


def test_weights_of_another_rank_than_the_config_are_refused_as_peft_does(tmp_path):
    from peft import PeftModel
    path = make_adapter(tmp_path, "r8", r=8)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["r"] = cfg["lora_alpha"] = 4  # same scaling, other rank
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="size mismatch"):
        PeftModel.from_pretrained(tiny_llama(), str(path))
    _expect_error(path, "r8", match="rank 8 but adapter_config.json gives r=4")


@pytest.mark.parametrize("edit, why", [
    ({"target_modules": ["q_proj"]}, "target_modules"),
    ({"layers_to_transform": [1]}, "layers_to_transform"),
    ({"exclude_modules": ["v_proj"]}, "exclude_modules"),
    ({"target_modules": r".*\.q_proj"}, "target_modules"),
])
def test_weights_the_config_does_not_adapt_are_refused(tmp_path, edit, why):
    """peft builds only the layers its config selects and leaves other weights out; infer applied every weight in
    the file, so a config edited after saving gave other tokens than peft. Now such a folder is refused."""
    path = make_adapter(tmp_path, "qv", target_modules=["q_proj", "v_proj"])
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    err = _expect_error(path, "qv", match=why)
    assert "peft would leave them out" in str(err)


@pytest.mark.parametrize("edit", [{"target_modules": "all-linear"}, {"layers_to_transform": [0, 1]},
                                  {"exclude_modules": ["o_proj"]}, {"target_modules": r".*\.(q|v)_proj"},
                                  {"layers_to_transform": 1, "target_modules": ["q_proj", "v_proj"]}])
def test_weights_the_config_adapts_are_served(tmp_path, edit):
    path = make_adapter(tmp_path, "qv", target_modules=["q_proj", "v_proj"],
                        **({"layers_to_transform": 1} if edit.get("layers_to_transform") == 1 else {}))
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    ad = load_adapter("qv", path, tiny_config())
    assert len(ad.modules) == (2 if edit.get("layers_to_transform") == 1 else 4)


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga", "astra"])
def test_inits_that_change_the_base_are_refused(tmp_path, init):
    """A PiSSA/OLoRA/... adapter saved without peft's conversion needs the residual base peft rebuilds at load;
    served on the plain base it gave other tokens."""
    path = make_adapter(tmp_path, "p")
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, "init_lora_weights": init}))
    err = _expect_error(path, "p", match=init)
    assert "path_initial_model_for_weight_conversion" in err.hint


@pytest.mark.parametrize("edit, match", [
    ({"target_modules": 5}, 'has target_modules 5 (an integer), but peft\'s LoraConfig takes a string (a regex) or a '
                            "list of module names"),
    ({"target_modules": ["q_proj", 5]}, "has target_modules [\"q_proj\", 5] (a list holding an integer)"),
    ({"exclude_modules": 5}, "has exclude_modules 5 (an integer)"),
    ({"exclude_modules": {"a": 1}}, "has exclude_modules {\"a\": 1} (an object)"),
    ({"layers_pattern": 5, "layers_to_transform": [0]}, "has layers_pattern 5 (an integer), but peft's LoraConfig "
                                                         "takes a string or a list of strings"),
    ({"layers_to_transform": "0"}, "has layers_to_transform \"0\" (a string), but peft's LoraConfig takes an integer "
                                   "or a list of integers"),
    ({"layers_to_transform": [0, True]}, "(a list holding a boolean)"),
])
def test_config_fields_of_the_wrong_type_are_named(tmp_path, edit, match):
    """They used to crash every command that reads adapters with TypeError: 'int' object is not iterable."""
    path = make_adapter(tmp_path, "t")
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    err = _expect_error(path, "t", match=match)
    assert "adapter_config.json" in str(err)


def test_a_config_without_peft_type_is_refused_by_name(tmp_path):
    """peft cannot load it (a bare KeyError: 'peft_type' in lora-validate and convert --merge-lora)."""
    path = make_adapter(tmp_path, "np")
    cfg = json.loads((path / "adapter_config.json").read_text())
    del cfg["peft_type"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    err = _expect_error(path, "np", match='adapter_config.json has no peft_type (expected "LORA")')
    assert '"peft_type": "LORA"' in err.hint


def test_weights_whose_product_overflows_are_refused_at_load(tmp_path):
    """Every weight finite, but lora_B @ lora_A (x scaling) beyond float32: the outputs were NaN, and `infer run`
    answered token 0 after token 0 without an error."""
    path = make_adapter(tmp_path, "big")
    weights = path / "adapter_model.safetensors"
    save_file({k: v * 1e20 for k, v in load_file(str(weights)).items()}, str(weights))
    _expect_error(path, "big", match="lora_B @ lora_A x scaling 2 overflows float32")
    save_file({k: v * 1e-18 for k, v in load_file(str(weights)).items()}, str(weights))  # x100: large, but finite
    assert len(load_adapter("big", path, tiny_config()).modules) == 4
