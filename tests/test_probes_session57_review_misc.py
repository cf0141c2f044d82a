"""Review probes of session 57's sleep modes, reload_weights of another layout and KV layer groups with speculative
decoding: what a probe found wrong, each with its regression test."""

from __future__ import annotations

import json
import shutil

import pytest

from infer import LLM, SamplingParams
from infer.errors import ModelLoadError
from infer.models.tiny import ensure_builtin

PROMPTS = [[5, 9, 13, 21, 40], [7, 3, 2, 8, 11, 40, 77]]


def _with_layers(src, out, layers: int) -> None:
    """`src`'s checkpoint with `layers` decoder layers (its last ones dropped, or its first one repeated)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    kept = {}
    for key, value in load_file(str(src / "model.safetensors")).items():
        if ".layers." not in key:
            kept[key] = value
            continue
        i = int(key.split(".layers.")[1].split(".")[0])
        if i == 0:
            for j in range(1, layers):
                kept.setdefault(key.replace(".layers.0.", f".layers.{j}."), value.clone())
        if i < layers:
            kept[key] = value
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))


@pytest.mark.parametrize("delta", [-1, 1])
def test_reload_weights_refuses_another_number_of_layers_before_freeing_anything(tmp_path, delta):
    """reload_weights of a checkpoint with fewer decoder layers was taken (the layer it lacks left freed: a crash, or
    garbage on the GPU), and one with more layers too (the extra ones never loaded): refused naming the layer, before
    anything is freed, and the engine runs on as before."""
    src = ensure_builtin("tiny-llama")
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    _with_layers(src, tmp_path / "new", layers + delta)
    shutil.copytree(src, tmp_path / "engine")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path / "engine"), block_size=4, max_model_len=32) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
        for f in ("model.safetensors", "config.json"):
            shutil.copy(tmp_path / "new" / f, tmp_path / "engine" / f)
        with pytest.raises(ModelLoadError) as e:
            llm.collective_rpc("reload_weights")
        layer = f"layers.{layers - 1}" if delta < 0 else f"layers.{layers}"
        assert f"the new checkpoint has {'no ' if delta < 0 else ''}{layer} " in e.value.message
        assert "another number of layers" in e.value.message and "start a new engine" in e.value.hint
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)] == want


def _tied(src, out, head_differs: bool) -> None:
    """`src`'s checkpoint with tie_word_embeddings true in config.json, its stored lm_head.weight another matrix than
    the embeddings (a load unties it, as transformers does) or the embeddings' own."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    if not head_differs:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))


@pytest.mark.parametrize("old,new", [("untied", "untied"), ("tied", "untied"), ("untied", "tied")])
def test_reload_weights_takes_the_new_loads_head_of_a_tied_config(tmp_path, monkeypatch, old, new):
    """A tied config whose checkpoint stores another lm_head is untied by the load (transformers'); whether it is
    depends on the tensors, not the headers: reload_weights of the same checkpoint is taken, and a reload that unties
    the head where the old load had not (or the reverse) takes the new load's head, as a fresh engine (the old one
    kept the embeddings as its head, or a head whose memory was freed). The CPU's prepacked head off: the head read
    as the model holds it, as on the GPU."""
    import infer.kernels.cpu_gemm as cpu_gemm
    monkeypatch.setattr(cpu_gemm, "prepack", lambda *a, **k: None)
    src = ensure_builtin("tiny-llama")
    for name in {old, new}:
        _tied(src, tmp_path / name, head_differs=name == "untied")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(str(tmp_path / new), block_size=4, max_model_len=32) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    shutil.copytree(tmp_path / old, tmp_path / "engine")
    with LLM(str(tmp_path / "engine"), block_size=4, max_model_len=32) as llm:
        for f in ("model.safetensors", "config.json"):
            shutil.copy(tmp_path / new / f, tmp_path / "engine" / f)
        llm.collective_rpc("reload_weights")
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)] == want


@pytest.mark.parametrize("key,value", [("rope_parameters", {"rope_theta": 500.0, "rope_type": "default"}),
                                       ("rms_norm_eps", 0.25)])
def test_reload_weights_refuses_another_config_the_layers_were_built_from(tmp_path, key, value):
    """A checkpoint whose config.json changes what the layers computed at build (the rope table's theta, the norms'
    eps) was taken with the old values kept: tokens neither model's. Refused naming the field, the engine runs on."""
    src = ensure_builtin("tiny-llama")
    shutil.copytree(src, tmp_path / "engine")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path / "engine"), block_size=4, max_model_len=32) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
        cfg = json.loads((src / "config.json").read_text())
        assert cfg.get(key) != value
        (tmp_path / "engine" / "config.json").write_text(json.dumps({**cfg, key: value}))
        shown = "500.0" if key == "rope_parameters" else "0.25"
        with pytest.raises(ModelLoadError, match=f"config.json's {key} is [^,]*{shown}.* in the new checkpoint") as e:
            llm.collective_rpc("reload_weights")
        assert "start a new engine" in e.value.hint
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)] == want
