"""Session 61 (rfamb): a review of InternLM3, Helium, Hunyuan dense and Granite SWA (session 61's famb) against
transformers' code: Granite SWA's rotating layers of one layer_rope_theta base other than rope_theta (transformers
rotates them by that base) run as transformers runs them; sliding layers without a sliding_window (transformers fails
masking them) refused up front; reload_weights refuses a config.json of other Granite scalars or layer_rope_theta
(read when the layers are built); a LoRA target_modules regex selecting Granite SWA's rotary embeddings refused as
peft refuses it."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app
from infer.errors import UnsupportedModelError
from infer.lora.adapter import adapter_problems

from helpers import check_greedy_and_logprobs_equal_transformers, check_reload_refuses_a_changed_config_field
from lora_helpers import family_base_and_adapters
from test_probes_session61_famb import build


def test_granite_swa_layers_of_one_base_other_than_rope_theta_equal_transformers(tmp_path):
    """layer_rope_theta of one non-zero base (500) beside rope_theta 10000: transformers' GraniteSWAModel rotates
    those layers by 500 (rope_theta unread); infer refused the config. Its tokens and logprobs: transformers'."""
    hf = build(tmp_path, "granite_swa", layer_rope_theta=[0, 500.0, 500.0, 500.0])
    assert hf.config.rope_parameters["rope_theta"] == 10000.0

    def check_model(model):
        assert model.nope == [True, False, False, False]

    check_greedy_and_logprobs_equal_transformers(tmp_path, hf, "granite_swa-layer-base-500", check_model)


def test_granite_swa_sliding_layers_without_a_window_are_refused(tmp_path):
    """sliding_attention layers with sliding_window null (transformers fails building their mask; infer ran them
    as full attention): refused by the engine and `infer warmup --estimate`, naming sliding_window."""
    build(tmp_path, "granite_swa")
    config = json.loads((tmp_path / "config.json").read_text())
    assert "sliding_attention" in config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    with pytest.raises(UnsupportedModelError, match="sliding_attention layers and sliding_window null") as e:
        LLM(str(tmp_path))
    assert "full_attention in layer_types" in e.value.hint
    res = CliRunner().invoke(app, ["warmup", str(tmp_path), "--estimate"])
    assert res.exit_code != 0 and "sliding_window null" in res.output


@pytest.mark.parametrize("key,value", [("layer_rope_theta", [10000.0, 0, 10000.0, 10000.0]),
                                       ("embedding_multiplier", 6.0), ("logits_scaling", 2.0)])
def test_reload_weights_refuses_other_granite_swa_scalars_or_bases(tmp_path, key, value):
    """Granite's scalars and Granite SWA's layer_rope_theta are read when the layers are built: a reload_weights
    whose config.json changed them kept the old ones (tokens of neither model). Refused naming the field; the engine
    runs on."""
    check_reload_refuses_a_changed_config_field(tmp_path, "tiny-granite-swa", key, value)


@pytest.mark.parametrize("family, regex, module", [
    ("hunyuan", r".*\.(v_proj|query_layernorm)", "model.layers.0.self_attn.query_layernorm"),
    ("granite_swa", r".*(v_proj|rotary_embs\.0)", "model.rotary_embs.0")])
def test_a_regex_selecting_a_module_that_is_not_linear_is_refused_as_peft_refuses_it(tmp_path_factory, family,
                                                                                     regex, module):
    """A target_modules regex that selects Hunyuan's query_layernorm or Granite SWA's rotary embedding of a
    layer_rope_theta base (model.rotary_embs.0): peft refuses the adapter (not a supported module), and so does
    lora-validate's check, naming it."""
    _, base, hf, paths = family_base_and_adapters(tmp_path_factory, build, family)
    with pytest.raises(ValueError, match="is not supported"):
        get_peft_model(hf, LoraConfig(r=4, target_modules=regex))
    cfg = json.loads((paths["qv4"] / "adapter_config.json").read_text())
    (paths["qv4"] / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": regex}))
    problems = [p.message for p in adapter_problems("a", paths["qv4"], AutoConfig.from_pretrained(base))]
    assert any(f"selects {module}, which is not a Linear layer" in m for m in problems), problems
