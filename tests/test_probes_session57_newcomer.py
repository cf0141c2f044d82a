"""Session 57, a newcomer's first minutes with this session's features: what a user meets trying them as the README
shows, where it was wrong or unclear."""

from __future__ import annotations

import pytest

from infer import LLM

from lora_helpers import hf_float, save_adapter
from test_probes_session55_moe import build


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_router_adapter_is_one_problem_naming_the_router(tmp_path, model_type):
    """peft's LoraConfig(target_modules=["q_proj", "gate"]) on a transformers 5 mixture of experts adapts the router
    (its tensors under mlp.gate, its config target_parameters ["gate.weight"]): the engine and `infer lora-validate`
    refuse it with the one problem that names the router, not also as a module the base model does not have (it has
    one) nor as a second, parameter problem."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.errors import LoRAError
    build(tmp_path / "base", model_type, num_hidden_layers=2)
    hf = hf_float(tmp_path / "base")
    bad = save_adapter(hf, tmp_path / "router", seed=1, r=4, lora_alpha=8, lora_dropout=0.0,
                       target_modules=["q_proj", "gate"])
    router = "adapts model.layers.0.mlp.gate (and 1 more modules): infer adapts a mixture of experts' attention"
    with pytest.raises(LoRAError) as err:
        LLM(str(tmp_path / "base"), loras={"x": str(bad)}, max_loras=1, max_lora_rank=8, block_size=4)
    said = str(err.value)
    assert router in said and "more problems" not in said and "does not have" not in said, said
    res = CliRunner().invoke(app, ["lora-validate", str(tmp_path / "base"), str(bad), "--steps", "0"])
    out = " ".join(res.output.split())
    assert res.exit_code != 0 and out.count("error:") == 1 and router in out, res.output
    assert "does not have" not in out and "gate.weight" not in out and "per-expert" not in out, res.output


def test_generate_after_a_level_2_sleep_names_the_calls_that_load_new_weights():
    """After llm.sleep(level=2) the weights are gone: generate() names the README's three calls (wake_up(tags=
    ["weights"]), collective_rpc("reload_weights"), wake_up()), not wake_up() alone, which would only lead to a
    second refusal (the weights were discarded); after level 1, wake_up() is all it takes."""
    from infer import SamplingParams
    from infer.errors import SleepModeError
    with LLM("tiny-llama", enable_sleep_mode=True, block_size=4, max_model_len=64, max_num_seqs=2) as llm:
        params = SamplingParams(max_new_tokens=2)
        llm.sleep(level=1)
        with pytest.raises(SleepModeError) as err:
            llm.generate([[5, 9, 13]], params)
        assert "wake_up()" in str(err.value) and "reload_weights" not in str(err.value)
        llm.wake_up()
        llm.sleep(level=2)
        with pytest.raises(SleepModeError) as err:
            llm.generate([[5, 9, 13]], params)
        said = str(err.value)
        assert 'wake_up(tags=["weights"]), collective_rpc("reload_weights"), then wake_up()' in said, said
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up()
        assert len(llm.generate([[5, 9, 13]], params)[0].token_ids) == 2
