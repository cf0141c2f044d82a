"""Session 57 fixes: adapters with lora_dropout on a mixture of experts' stacked parameters (peft's ParamWrapper
refuses any dropout but 0, which does nothing at inference) pass `infer lora-validate` and merge with `infer convert
--merge-lora`; a later sleep while a sleep(mode="keep") holds paused requests: "abort" ends them, "wait" is refused."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import SleepModeError
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import hf_float, save_adapter
from test_probes_session55_moe import build
from test_probes_session57_moelora import EXPERTS, _v4_adapter

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


def _with_dropout(path, out, dropout: float = 0.05):
    """A copy of the adapter at `path` in `out` whose adapter_config.json says lora_dropout `dropout` (as trained)."""
    shutil.copytree(path, out)
    config = json.loads((out / "adapter_config.json").read_text())
    config["lora_dropout"] = dropout
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3-MoE and two adapters with lora_dropout 0.05: on the stacked experts (target_parameters) and on
    transformers 4's per-expert modules (peft converts them into the stacked parameters)."""
    root = tmp_path_factory.mktemp("fix-moelora")
    build(root / "base", "qwen3_moe", norm_topk_prob=True, num_hidden_layers=2)
    hf = hf_float(root / "base")
    stacked = save_adapter(hf, root / "stacked0", seed=1, lora_dropout=0.0, r=4, lora_alpha=8,
                           target_modules=["q_proj"], target_parameters=EXPERTS)
    v4 = _v4_adapter(hf, root / "v40", ("gate_proj", "up_proj", "down_proj"), seed=3)
    return root / "base", {"stacked": _with_dropout(stacked, root / "stacked"), "v4": _with_dropout(v4, root / "v4")}


def _files(path) -> dict:
    return {p.name: p.read_bytes() for p in path.iterdir()}


@pytest.mark.parametrize("kind", ["stacked", "v4"])
def test_lora_validate_passes_an_expert_adapter_trained_with_dropout(qwen3, kind):
    """peft refused to load it ("lora.ParamWrapper does not work with lora_dropout != 0"), so lora-validate failed
    it: now peft loads it with dropout 0 and infer's greedy tokens agree with peft's; the folder is left as it was."""
    base, paths = qwen3
    before = _files(paths[kind])
    res = CliRunner().invoke(app, ["lora-validate", str(base), str(paths[kind]), "--json", "--steps", "3"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    n = report["numeric"]
    assert report["ok"] and n["tokens_agree"] and n["max_abs_diff"] <= n["tolerance"], report
    assert n["adapter_effect"] > 100 * n["max_abs_diff"]  # (the check could have seen a wrong adapter)
    assert _files(paths[kind]) == before


def _tokens(path, prompts, lora=None, loras=None):
    with LLM(str(path), loras=loras, max_lora_rank=8, block_size=4) as llm:
        return [o.token_ids for o in llm.generate(prompts, PARAMS, lora=lora)]


@pytest.mark.parametrize("kind", ["stacked", "v4"])
def test_merging_an_expert_adapter_trained_with_dropout_gives_what_serving_it_gives(qwen3, tmp_path, kind):
    """`infer convert --merge-lora` refused it ("peft cannot load it"): now it merges, and the merged model's greedy
    tokens are the adapter's served on the base (which differ from the base's)."""
    base, paths = qwen3
    before = _files(paths[kind])
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(tmp_path / "m"), "--merge-lora", str(paths[kind])])
    assert res.exit_code == 0, res.output
    assert _files(paths[kind]) == before
    prompts = random_prompts(512, (6, 9), seed=1)
    merged = _tokens(tmp_path / "m", prompts)
    served = _tokens(base, prompts, ["x", "x"], {"x": str(paths[kind])})
    assert merged == served != _tokens(base, prompts)


def test_a_dense_adapter_trained_with_dropout_still_validates_and_merges(tmp_path):
    """On a dense base (no ParamWrapper: peft always loaded it), a dropout adapter passes lora-validate and its
    merge is what serving it gives, as before."""
    base = ensure_builtin("tiny-llama")
    path = save_adapter(hf_float(base), tmp_path / "a", seed=1, lora_dropout=0.1, r=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj", "down_proj"])
    res = CliRunner().invoke(app, ["lora-validate", str(base), str(path), "--json", "--steps", "2"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["numeric"]["tokens_agree"], report
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(tmp_path / "m"), "--merge-lora", str(path)])
    assert res.exit_code == 0, res.output
    prompts = random_prompts(256, (6, 9), seed=1)
    assert _tokens(tmp_path / "m", prompts) == _tokens(base, prompts, ["a", "a"], {"a": str(path)}) \
        != _tokens(base, prompts)


# ------------------------------------------------------------------ a later sleep over a sleep(mode="keep")
PROMPTS = [[5, 9, 13, 21], [7, 3, 2, 8, 11, 40]]
LONG = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return str(ensure_builtin("tiny-llama"))


def _paused(llm):
    """Two requests stepped three times, then paused by sleep(1, mode="keep"): (the engine, their outputs)."""
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[0], LONG)
    engine.add_request("b", PROMPTS[1], LONG)
    outs = []
    for _ in range(3):
        outs += engine.step()
    engine.sleep(1, mode="keep")
    outs += engine.step()  # (with overlap: the outputs of the step settled as it fell asleep)
    assert engine.is_paused() and engine.has_unfinished_requests()
    return engine, outs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("level", [1, 2])
def test_a_later_abort_sleep_ends_the_requests_a_keep_sleep_paused(tiny, overlap, level):
    """sleep(mode="keep"), then sleep(mode="abort") (at level 1, or 2): the paused requests end with finish_reason
    "abort", handed out by the next step (they stayed paused before); the engine stays asleep, and once awake it
    serves new requests."""
    with LLM(tiny, block_size=4, max_model_len=64, enable_sleep_mode=True, overlap=overlap) as llm:
        engine, outs = _paused(llm)
        assert not [o for o in outs if o.finished]
        assert engine.sleep(level, mode="abort") == 0  # (asleep already: nothing more freed)
        assert engine.is_sleeping() and not engine.is_paused()
        ends = [o for o in engine.step() if o.finished]
        assert sorted((o.request_id, o.finish_reason) for o in ends) == [("a", "abort"), ("b", "abort")]
        assert all(len(o.token_ids) >= 1 for o in ends)  # (what they had made is handed out)
        assert not engine.has_unfinished_requests() and not engine.step()
        engine.wake_up()
        assert [len(o.token_ids) for o in llm.generate(PROMPTS[:1], LONG)] == [20]


def test_a_later_wait_sleep_is_refused_and_a_later_keep_sleep_leaves_them_paused(tiny):
    """sleep(mode="wait") cannot run the paused requests to their end while the engine is asleep: refused clearly
    (naming wake_up and mode "abort"), nothing changed; sleep(mode="keep") again leaves them paused. After wake_up
    they go on to their end."""
    with LLM(tiny, block_size=4, max_model_len=64, enable_sleep_mode=True) as llm:
        engine, _ = _paused(llm)
        with pytest.raises(SleepModeError, match="cannot run to their end while it sleeps") as e:
            llm.sleep(1, mode="wait")
        assert "wake_up()" in e.value.hint and "mode=\"abort\"" in e.value.hint
        engine.sleep(1, mode="keep")
        assert engine.is_paused() and not [o for o in engine.step() if o.finished]
        engine.wake_up()
        ends = {}
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            ends.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
        assert ends == {"a": "length", "b": "length"}
        llm.sleep(1, mode="wait")  # (nothing paused: asleep at once, as ever)
        assert engine.is_sleeping()


def test_async_llm_a_later_abort_sleep_ends_a_paused_generate(tiny):
    """AsyncLLM: a generate paused by sleep(mode="keep") stays paused through a refused sleep(mode="wait") (refused
    before anything waits: it would wait forever) and ends, finish_reason "abort", at a later sleep(mode="abort")."""
    import asyncio

    from infer import AsyncLLM

    async def main(llm):
        outs = []

        async def run():
            async for out in llm.generate(PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True), "a"):
                outs.append(out)
                if len(outs) == 1:
                    await llm.sleep(1, mode="keep")
                    with pytest.raises(SleepModeError, match="cannot run to their end"):
                        await asyncio.wait_for(llm.sleep(1, mode="wait"), 30)
                    await asyncio.sleep(0.05)  # (the engine loop's chance to step, were the generate not paused)
                    assert len(outs) == 1
                    await asyncio.wait_for(llm.sleep(1, mode="abort"), 30)

        await asyncio.wait_for(run(), 60)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert await llm.is_sleeping()

    llm = AsyncLLM(tiny, block_size=4, max_model_len=64, enable_sleep_mode=True)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()
