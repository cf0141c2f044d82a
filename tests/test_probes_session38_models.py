"""Model probes of the thirty-eighth session (random configs of the Llama family against transformers), each test
failing without its fix."""

from __future__ import annotations

import pytest
import torch

from infer.errors import ModelLoadError

from quant_helpers import needs_gptqmodel
from test_probes_gptq_s19 import hf_greedy, infer_greedy, rtn_checkpoint


def _with_extra_biases(path, value: float = 0.0):
    """`path`'s GPTQ checkpoint with a float16 bias beside every quantized projection, as older AutoGPTQ versions wrote
    one for every layer they quantized (a Llama has none: config.json declares none)."""
    from safetensors.torch import load_file, save_file
    weights = load_file(path / "model.safetensors")
    for name, t in list(weights.items()):
        if name.endswith(".qweight"):
            weights[name[: -len("qweight")] + "bias"] = torch.full((t.shape[1],), value, dtype=torch.float16)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def autogptq_style(tmp_path_factory):
    """(a GPTQ tiny-llama, its copy with AutoGPTQ's zero biases)."""
    plain = rtn_checkpoint(tmp_path_factory.mktemp("plain") / "m")
    return plain, _with_extra_biases(rtn_checkpoint(tmp_path_factory.mktemp("biased") / "m"))


def test_autogptq_zero_biases_are_skipped_as_transformers_and_vllm_skip_them(autogptq_style):
    """A GPTQ Llama whose every projection has an all-zero `.bias` (TheBloke-era AutoGPTQ checkpoints): transformers
    drops them (unexpected keys) and vLLM skips them ("extra bias for GPTQ models"); infer refused the checkpoint
    ("unexpected bias model.layers.0.mlp.down_proj.bias"). A zero bias adds nothing: the tokens are the plain one's."""
    plain, biased = autogptq_style
    assert infer_greedy(biased) == infer_greedy(plain)


@needs_gptqmodel
def test_autogptq_zero_biases_equal_transformers(autogptq_style):
    _, biased = autogptq_style
    assert infer_greedy(biased) == hf_greedy(biased)


def test_a_nonzero_bias_config_json_does_not_declare_is_still_refused(tmp_path):
    path = _with_extra_biases(rtn_checkpoint(tmp_path / "m"), value=0.5)
    with pytest.raises(ModelLoadError, match=r"unexpected bias model\.layers\.0\..*\.bias"):
        infer_greedy(path)


@pytest.mark.parametrize("model, rope", [
    ("tiny-llama3", None),  # llama3 rope (Llama 3.1 / 3.2)
    ("tiny-llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    ("tiny-llama", {"rope_type": "linear", "factor": 2.0}),
])
def test_a_scaled_rope_builds_on_a_device_other_than_the_cpu(tmp_path, model, rope):
    """Every scaled rope's table (transformers' rope functions) was computed on the default device the model is built
    on, where those functions copy to "cpu": `infer convert` and `infer quantize` of a Llama 3.1 (their checks build
    the model on the meta device) died with a traceback, "NotImplementedError: Cannot copy out of meta tensor"; on a
    GPU the table's positions (cuda) met the functions' inv_freq (cpu) in one product. The table is now the same
    wherever it is built."""
    import json
    import shutil

    from infer.models.loader import check_weights, load_config
    from infer.models.rope import build_cos_sin_cache
    from infer.models.tiny import ensure_builtin
    path = tmp_path / "m"
    shutil.copytree(ensure_builtin(model), path)
    if rope:
        cfg = json.loads((path / "config.json").read_text())
        cfg["rope_parameters"] = {**rope, "rope_theta": 10000.0}
        (path / "config.json").write_text(json.dumps(cfg))
    check_weights(path)  # what convert and quantize run before transformers loads the model
    cfg = load_config(path)
    with torch.device("meta"):
        table = build_cos_sin_cache(cfg, 48)
    assert table.is_meta and table.shape == (48, 16)
    assert torch.equal(build_cos_sin_cache(cfg, 48), build_cos_sin_cache(cfg, 100)[:48])


def test_convert_a_llama3_rope_model(tmp_path):
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["convert", "tiny-llama3", "-o", str(tmp_path / "out")])
    assert res.exit_code == 0 and "Wrote" in res.output, res.output


@pytest.mark.parametrize("field, value, message", [
    ("rope_parameters", {"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
     "rope type 'mrope' is not supported"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
])
def test_warmup_estimate_refuses_a_model_the_engine_refuses(tmp_path, field, value, message):
    """`infer warmup --estimate` (which never builds the model) said "fits" for a longrope or gelu Llama that `infer
    run` and the measured warmup refuse when they build it; the config's checks now run when it is read."""
    import json
    import shutil

    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.models.tiny import ensure_builtin
    path = tmp_path / "m"
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["warmup", str(path), "--estimate", "--max-length", "64", "--concurrency", "1"])
    assert res.exit_code == 2 and message in res.output, res.output
