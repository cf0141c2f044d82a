"""Session 64's review of gpt-oss's packed MXFP4 experts: reload_weights between an MXFP4 and a float checkpoint of
the same gpt-oss names the experts' kind (not "another number of layers")."""

from __future__ import annotations

import shutil

import pytest

from infer import LLM, SamplingParams
from infer.errors import ModelLoadError

from test_probes_session60_gptoss import build, to_mxfp4

PROMPTS = [[5, 9, 13, 21, 40], [7, 3, 2, 8, 11, 40, 77]]


@pytest.fixture(scope="module")
def gptoss_pair(tmp_path_factory):
    """(a float gpt-oss folder, the same gpt-oss with MXFP4 experts)."""
    root = tmp_path_factory.mktemp("rmx")
    build(root / "float", seed=3)
    shutil.copytree(root / "float", root / "mxfp4")
    to_mxfp4(root / "mxfp4", seed=3)
    return root / "float", root / "mxfp4"


@pytest.mark.parametrize("loaded,new", [("mxfp4", "float"), ("float", "mxfp4")])
def test_reload_weights_between_mxfp4_and_float_experts_names_the_experts_kind(gptoss_pair, tmp_path, loaded, new):
    """reload_weights of a float gpt-oss over an MXFP4 one (or the reverse): refused before anything is freed, naming
    a sparse layer's experts and their kind in each checkpoint (it said "another number of layers?"); the engine
    runs on as before."""
    folders = dict(zip(("float", "mxfp4"), gptoss_pair))
    shutil.copytree(folders[loaded], tmp_path / "engine")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path / "engine"), block_size=4, max_model_len=32) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
        for f in ("model.safetensors", "config.json"):
            shutil.copy(folders[new] / f, tmp_path / "engine" / f)
        with pytest.raises(ModelLoadError) as e:
            llm.collective_rpc("reload_weights")
        kinds = {"float": "float", "mxfp4": "MXFP4"}
        assert "layers.0.mlp.experts" in e.value.message, e.value.message
        assert f"{kinds[new]} in the new checkpoint, {kinds[loaded]} in the loaded one" in e.value.message
        assert "another number of layers" not in e.value.message and "start a new engine" in e.value.hint
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)] == want
