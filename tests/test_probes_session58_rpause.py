"""Review probes of session 58's pause/resume (vLLM's pause_generation / resume_generation / is_paused): what a probe
found wrong, each with its regression test."""

from __future__ import annotations

import shutil

import pytest

from helpers import hf_greedy
from infer import LLM, SamplingParams
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin

PROMPT = [5, 9, 13, 21]
LONG = SamplingParams(max_tokens=16, ignore_eos=True)


def _new_weights(src, out) -> None:
    """`src`'s model with other weights (its MLPs scaled): another greedy continuation of the same prompt."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    state = load_file(str(out / "model.safetensors"))
    for key in [k for k in state if ".mlp." in k]:
        state[key] = state[key] * 3
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _step(engine, n: int) -> list:
    return [out for _ in range(n) for out in engine.step()]


@pytest.mark.parametrize("mode, overlap", [("keep", False), ("keep", True), ("abort", False), ("abort", True)])
def test_reload_weights_right_after_pause_and_keep_goes_on_with_the_new_weights(tmp_path, mode, overlap):
    """vLLM's RL loop on the engine: pause_generation(), reload_weights(), resume_generation(). The reload was refused
    ("reload_weights() while requests run") while the pause's outputs were not handed out yet: those of the requests
    "abort" ended, and with overlap the step "keep" completed. A frozen request goes on with the new weights: its
    tokens are those it had, then Hugging Face's greedy tokens of the new model given the prompt and those. Not paused,
    the reload is refused, naming pause_generation()."""
    src = ensure_builtin("tiny-llama")
    shutil.copytree(src, tmp_path / "engine")
    _new_weights(src, tmp_path / "new")
    with LLM(str(tmp_path / "engine"), block_size=4, max_model_len=64, overlap=overlap) as llm:
        engine = llm.llm_engine
        engine.add_request("r", PROMPT, LONG)
        outs = _step(engine, 4)
        with pytest.raises(RequestError, match=r"reload_weights\(\) while requests run") as e:
            llm.collective_rpc("reload_weights")  # (not paused: refused, naming the pause)
        assert "pause_generation()" in e.value.hint
        engine.pause_generation(mode=mode)
        kept = list(engine.requests["r"].output_token_ids)  # (with overlap: the step the pause completed, too)
        assert 1 <= len(kept) < 16 and kept == hf_greedy(str(src), PROMPT, len(kept))
        shutil.copy(tmp_path / "new" / "model.safetensors", tmp_path / "engine" / "model.safetensors")
        llm.collective_rpc("reload_weights")
        engine.resume_generation()
        outs += _step(engine, 40)
        assert not engine.has_unfinished_requests()
        (last,) = [o for o in outs if o.finished]
        new = hf_greedy(str(tmp_path / "new"), PROMPT, 16)
        assert new != hf_greedy(str(src), PROMPT, 16)  # (the new weights answer otherwise)
        if mode == "abort":
            assert (last.finish_reason, list(last.token_ids)) == ("abort", kept)
            assert [list(o.outputs[0].token_ids) for o in llm.generate([PROMPT], LONG)] == [new]
        else:  # the tokens it had, then the new model's greedy ones given the prompt and those
            want = kept + hf_greedy(str(tmp_path / "new"), PROMPT + kept, 16 - len(kept))
            assert (last.finish_reason, list(last.token_ids)) == ("length", want) and want[len(kept):] != \
                hf_greedy(str(src), PROMPT, 16)[len(kept):]
