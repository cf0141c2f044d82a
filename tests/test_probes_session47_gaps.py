"""Probes of the forty-seventh session (known gaps): an adapter trained on the model a GPTQ checkpoint was quantized
from, and iteration_tokens_total when a stop ends a request inside its accepted drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quant_helpers import needs_gptqmodel

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


def _spec_run(prompt: list[int], drafts: list[int] | None = None, **params):
    """(the request's output tokens, the tokens each step handed it, the sum of the steps' last_step_tokens) on a
    fresh speculative engine (no prefix cache to carry over between runs) whose proposer drafts `drafts` (the
    continuation of the output so far), none when None."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.engine.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=2, max_num_batched_tokens=1024,
                                    enable_prefix_caching=False, speculative_config=SPEC))
    try:
        engine.add_request("r", prompt, SamplingParams(temperature=0.0, ignore_eos=True, **params))
        steps, counted, last = [], 0, None
        while engine.has_unfinished_requests():
            outs = engine.step()
            counted += engine.last_step_tokens
            for o in outs:
                steps.append(list(o.new_token_ids))
                last = o
        return list(last.token_ids), steps, counted
    finally:
        engine.close()


def test_iteration_tokens_leave_out_accepted_drafts_after_a_stop_token(monkeypatch):
    """A stop token among a step's accepted drafts ends the request there: the drafts accepted after it were never
    handed out, and vLLM's iteration_tokens_total counts only the tokens a request got. infer still counted them."""
    from infer.engine import llm_engine
    prompt = [5, 6, 7, 8, 9]
    monkeypatch.setattr(llm_engine, "propose_for", lambda seq, k, n_min, n_max: [])
    greedy, steps, counted = _spec_run(prompt, max_tokens=9)
    assert counted == len(prompt) + len(greedy) - 1
    # the proposer drafts the greedy continuation: the target accepts every draft (steps of 1 + 3 tokens)
    monkeypatch.setattr(llm_engine, "propose_for",
                        lambda seq, k, n_min, n_max: greedy[len(seq.output_token_ids):][:k])
    tokens, steps, counted = _spec_run(prompt, max_tokens=9)
    assert tokens == greedy and [len(s) for s in steps] == [1, 4, 4]
    assert counted == len(prompt) + len(tokens) - 1
    j = next(j for j in (1, 2) if greedy[j] not in greedy[:j])  # a first appearance, not the last of its step
    cut, steps, counted = _spec_run(prompt, max_tokens=9, stop_token_ids=[greedy[j]])
    assert cut == greedy[:j + 1] and steps == [greedy[:1], greedy[1:j + 1]]
    assert counted == len(prompt) + len(cut) - 1  # the drafts accepted after the stop are no tokens of the step


# ---- an adapter trained on the model a GPTQ checkpoint was quantized from ----

@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """(the float source folder 'acme-base', infer's GPTQ copy of it 'deploy-q4', a q/v adapter trained on it)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.models.tiny import ensure_builtin
    from lora_helpers import save_adapter
    root = tmp_path_factory.mktemp("deploy")
    src = Path(shutil.copytree(ensure_builtin("tiny-llama"), root / "acme-base"))
    out = root / "deploy-q4"
    res = CliRunner().invoke(app, ["quantize", str(src), "-o", str(out), "--group-size", "32", "--num-samples", "8",
                                   "--seq-len", "64"])
    assert res.exit_code == 0, (res.output, res.exception)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    adapter = save_adapter(hf, root / "adapter", 1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return src, out, adapter


def _named(adapter: Path, folder: Path, named: str) -> Path:
    import shutil
    shutil.copytree(adapter, folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": named}))
    return folder


def _validate(base: Path, adapter: Path) -> str:
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["lora-validate", str(base), f"a={adapter}", "--steps", "0"])
    assert res.exit_code == 0, res.output
    return res.output


@needs_gptqmodel
@pytest.mark.parametrize("named, warns", [("SOURCE", False), ("acme/acme-base", False), ("acme/other-model", True)])
def test_adapter_trained_on_the_quantized_source_gets_no_base_warning(deployed, tmp_path, named, warns):
    """`infer quantize BASE -o OUT` wrote no record of BASE in OUT (transformers 5 drops config.json's
    _name_or_path): an adapter trained on BASE, deployed on OUT, was warned it "was trained on BASE, not on OUT".
    OUT's config.json now records the source (_name_or_path, as GPTQModel and AutoGPTQ wrote it under transformers
    4), which the check accepts; another model is still warned about."""
    src, out, adapter = deployed
    assert json.loads((out / "config.json").read_text())["_name_or_path"] == str(src.resolve())
    named = str(src) if named == "SOURCE" else named
    output = _validate(out, _named(adapter, tmp_path / "a", named))
    assert ("warning: adapter 'a' was trained on" in output) == warns, output


@needs_gptqmodel
def test_adapter_added_to_an_engine_on_the_quantized_copy_is_warned_only_for_another_base(deployed, tmp_path, caplog):
    """The same check when an adapter is loaded (LLM.add_lora, --lora): none for the source, one for another model."""
    import logging

    from infer import LLM
    src, out, adapter = deployed
    mine, theirs = _named(adapter, tmp_path / "mine", "acme/acme-base"), _named(adapter, tmp_path / "t", "x/other")
    with LLM(str(out), enable_lora=True, max_lora_rank=8, max_model_len=64) as llm:
        with caplog.at_level(logging.WARNING, logger="infer"):
            llm.add_lora("mine", str(mine))
            llm.add_lora("theirs", str(theirs))
    msgs = [r.getMessage() for r in caplog.records if "trained on" in r.getMessage()]
    assert len(msgs) == 1 and "adapter 'theirs' was trained on 'x/other'" in msgs[0], msgs


@needs_gptqmodel
def test_convert_keeps_the_quantized_source_and_a_float_copy_records_its_own(deployed, tmp_path):
    """`infer convert` of the GPTQ checkpoint keeps the source it records (the copy's adapters are the source's);
    a float copy records the folder it copied (config.json's _name_or_path, in place of one the source had from
    the model it was fine-tuned from); a merged model records none (its weights are no model's an adapter was
    trained on)."""
    import shutil

    from typer.testing import CliRunner

    from infer.cli.main import app
    src, out, adapter = deployed

    def convert(model, dest, *more):
        res = CliRunner().invoke(app, ["convert", str(model), "-o", str(dest), *map(str, more)])
        assert res.exit_code == 0, (res.output, res.exception)
        return json.loads((dest / "config.json").read_text()).get("_name_or_path")
    assert convert(out, tmp_path / "copy-q4") == str(src.resolve())
    output = _validate(tmp_path / "copy-q4", _named(adapter, tmp_path / "a", "acme/acme-base"))
    assert "trained on" not in output, output
    tuned = Path(shutil.copytree(src, tmp_path / "tuned"))
    cfg = json.loads((tuned / "config.json").read_text())
    (tuned / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "acme/parent"}))
    assert convert(tuned, tmp_path / "f16", "--dtype", "float16") == str(tuned.resolve())
    assert convert(tuned, tmp_path / "merged", "--merge-lora", adapter) is None


def test_a_float_bases_name_or_path_is_not_taken_for_its_weights(tmp_path):
    """A float model's config.json _name_or_path (transformers 4 saved a fine-tune with the model it was loaded from)
    may name its parent: an adapter trained on that parent is still warned about."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from infer.models.tiny import ensure_builtin
    from lora_helpers import save_adapter
    tuned = Path(shutil.copytree(ensure_builtin("tiny-llama"), tmp_path / "acme-chat"))
    cfg = json.loads((tuned / "config.json").read_text())
    (tuned / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "acme/parent"}))
    hf = AutoModelForCausalLM.from_pretrained(tuned, dtype=torch.float32)
    adapter = save_adapter(hf, tmp_path / "ad", 1, r=4, lora_alpha=8, target_modules=["q_proj"])
    output = _validate(tuned, _named(adapter, tmp_path / "a", "acme/parent"))
    assert "warning: adapter 'a' was trained on 'acme/parent'" in output, output


@needs_gptqmodel
def test_a_builtin_or_hub_name_is_recorded_as_given(tmp_path):
    """MODEL given by name (a built-in model, a hub id from the local cache) is recorded as the name, not as the cache
    folder it resolves to (a hub snapshot's folder is a commit hash, which no adapter names)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.models.resolve import source_name
    assert source_name("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    assert source_name(tmp_path) == str(tmp_path.resolve())
    for cmd, more in (("quantize", ["--group-size", "32", "--num-samples", "4", "--seq-len", "32"]), ("convert", [])):
        out = tmp_path / cmd
        res = CliRunner().invoke(app, [cmd, "tiny-llama", "-o", str(out), *more])
        assert res.exit_code == 0, (res.output, res.exception)
        assert json.loads((out / "config.json").read_text())["_name_or_path"] == "tiny-llama", cmd
