"""Probes of the fifty-eighth session (a hostile user's model folders): config.json values no model has (a head count
of 0, a negative size, an rms_norm_eps below 0, a quantization_config that is not an object, a rope_theta that is
not a number) are refused when the config is read, in one `error:` line naming the field, by every command that
reads it; before, they were tracebacks, "integer modulo by zero", or advice such as "use --max-model-len -5".
An adapter_config.json flag that is not true or false ("use_rslora": "false") is refused rather than read by truth;
a generation_config.json that cannot be read is ignored with a warning, not in silence."""

from __future__ import annotations

import json

import pytest
from test_convert import _clean_error, _with_config, run_infer
from test_lora_adapter import _expect_error, make_adapter, tiny_config

from infer.errors import ModelLoadError
from infer.lora.adapter import load_adapter
from infer.models.loader import load_config
from infer.models.resolve import resolve_model
from infer.quant.convert import CONFIG_HINT



@pytest.fixture(scope="module")
def tiny_llama():
    return resolve_model("tiny-llama")


@pytest.mark.parametrize("field, value, least", [
    ("num_attention_heads", 0, 1),     # transformers: "integer modulo by zero"
    ("num_attention_heads", -4, 1),    # a traceback building the layers
    ("hidden_size", 0, 1),
    ("vocab_size", 0, 1),
    ("intermediate_size", 2.5, 1),
    ("head_dim", -16, 0),              # a traceback computing the rope
    ("num_key_value_heads", -2, 0),
    ("max_position_embeddings", -5, 1),  # "--max-model-len 32 is above the model's limit of -5"
    ("sliding_window", -3, 0),
])
def test_a_size_no_model_has_is_refused_naming_the_field(tiny_llama, tmp_path, field, value, least):
    src = _with_config(tiny_llama, tmp_path / "m", **{field: value})
    with pytest.raises(ModelLoadError) as e:
        load_config(src)
    assert e.value.message == f"config.json has {field} {value!r}: it must be a whole number of at least {least}"
    assert e.value.hint == CONFIG_HINT


def test_sizes_a_config_may_leave_unset_still_load(tiny_llama, tmp_path):
    """0 (or null) head_dim, KV heads and sliding_window read as unset, as transformers' `or` reads them; a whole
    float sliding_window, which transformers' Llama takes, is left to it."""
    cfg = load_config(_with_config(tiny_llama, tmp_path / "m", head_dim=0, num_key_value_heads=0, sliding_window=0))
    assert cfg.num_attention_heads == 4
    load_config(_with_config(tiny_llama, tmp_path / "f", sliding_window=4096.0))


@pytest.mark.parametrize("changes, words", [
    (dict(rms_norm_eps=-1.0), "config.json has rms_norm_eps -1.0: it must be a number of at least 0"),  # (NaN logits)
    (dict(quantization_config="gptq"), "config.json's quantization_config must be an object, got str"),
    (dict(quantization_config=[1]), "config.json's quantization_config must be an object, got list"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "x"}),
     "config.json's default rope parameters {'rope_type': 'default', 'rope_theta': 'x'} cannot be computed"),
])
def test_other_values_no_model_has_are_refused_naming_them(tiny_llama, tmp_path, changes, words):
    """rms_norm_eps -1 ran, and every request ended in "the model overflowed"; a quantization_config "gptq" was
    "'str' object has no attribute 'to_dict'"; a rope_theta "x" a TypeError traceback."""
    src = _with_config(tiny_llama, tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError) as e:
        load_config(src)
    assert words in e.value.message


@pytest.mark.parametrize("command", [["run", "{src}", "{inp}", "-o", "{out}", "-q"], ["warmup", "{src}"],
                                     ["lora-validate", "{src}", "{src}"], ["convert", "{src}", "-o", "{out}"]])
def test_every_command_says_it_in_one_line_with_a_hint(tiny_llama, tmp_path, command):
    """The CLI's one `error:` line, exit 2, no traceback; a config transformers refuses (a tie_word_embeddings "yes")
    gets a hint that says what to do rather than "see `infer run --help`"."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "hi", "max_new_tokens": 2}) + "\n")
    for name, changes, words in [("heads", dict(num_attention_heads=0), "num_attention_heads 0"),
                                 ("typed", dict(tie_word_embeddings="yes"), "'tie_word_embeddings'")]:
        src = _with_config(tiny_llama, tmp_path / name, **changes)
        args = [a.format(src=src, inp=inp, out=tmp_path / f"{name}.jsonl") for a in command]
        _clean_error(run_infer(*args), 2, words, CONFIG_HINT)
        assert not (tmp_path / f"{name}.jsonl").exists()


@pytest.mark.parametrize("changes, words", [
    (dict(hidden_act="frob"), "hidden_act 'frob' is not supported"),  # transformers: "cannot load ...: 'frob'"
    (dict(rope_parameters={"rope_type": "frob", "rope_theta": 1.0}), "rope type 'frob' is not supported"),
])
def test_convert_names_what_transformers_cannot_load_either(tiny_llama, tmp_path, changes, words):
    """A float model infer does not run is left to transformers (convert copies what transformers loads); when
    transformers fails too, its words were a bare KeyError ("transformers cannot load M: 'frob'", "check that the
    folder is complete"): infer's refusal, which names the field, is said instead."""
    src = _with_config(tiny_llama, tmp_path / "m", **changes)
    _clean_error(run_infer("convert", src, "-o", tmp_path / "out"), 2, words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value, kind", [("use_rslora", "false", "a string"), ("use_rslora", 1, "an integer"),
                                              ("use_dora", "no", "a string"), ("lora_bias", 0, "an integer")])
def test_an_adapter_flag_that_is_not_a_boolean_is_refused(tmp_path, key, value, kind):
    """peft reads the flags by truth: "use_rslora": "false" scaled every module by alpha/sqrt(r), silently, in both;
    "use_dora": "no" was refused as "uses DoRA"."""
    path = make_adapter(tmp_path, "t")
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, key: value}))
    err = _expect_error(path, "t", match=f"adapter_config.json has {key} {json.dumps(value)} ({kind}), but peft's "
                                         "LoraConfig takes true or false")
    assert f"write {key}: true or false" in err.hint


def test_adapter_flags_true_false_or_null_still_load(tmp_path):
    path = make_adapter(tmp_path, "t")
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": None, "lora_bias": False}))
    load_adapter("t", path, tiny_config(), None)


@pytest.mark.parametrize("content, why", [('{"temperature": 0.6,', "it cannot be read (Expecting"),
                                          ("[0.6]", "it is not a JSON object")])
def test_a_generation_config_that_cannot_be_read_is_ignored_with_a_warning(tiny_llama, tmp_path, caplog, content,
                                                                           why):
    """A truncated generation_config.json left the server and `infer run`'s batch lines on infer's own sampling
    defaults without a word (a value in it that is not valid was already ignored with a warning)."""
    from infer.engine.inputs import openai_sampling_defaults
    src = _with_config(tiny_llama, tmp_path / "m")
    (src / "generation_config.json").write_text(content)
    with caplog.at_level("WARNING", logger="infer"):
        got = openai_sampling_defaults(src)
    assert got == openai_sampling_defaults(tmp_path)  # (a folder without the file: infer's defaults)
    assert f"ignoring {src / 'generation_config.json'}: {why}" in caplog.text
    assert "its sampling defaults are not used (fix the file, or copy it again with the model)" in caplog.text
