"""Second round of hostile-user probes (session 5): adapters whose folder disappears after registration, the
Python API from two threads or with an abandoned stream, and other inputs found while probing; peft and
transformers are the oracles."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.models.tiny import ensure_builtin

from lora_helpers import ALL, PeftOracle, hf_float, save_adapter

runner = CliRunner()
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def base():
    return ensure_builtin("tiny-llama")


@pytest.fixture()
def adapters(base, tmp_path):
    """Two adapters with different target sets, in folders the test may delete; peft's oracle over both."""
    hf = hf_float(base)
    paths = {"a": save_adapter(hf, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules=ALL),
             "b": save_adapter(hf, tmp_path / "b", seed=2, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"])}
    oracle = PeftOracle(hf, paths)
    yield paths, oracle
    oracle.close()


def _tight_llm(base, paths):
    """One device slot and one CPU copy: every other adapter is read from its folder again when it is used."""
    return LLM(str(base), loras={n: str(p) for n, p in paths.items()}, max_loras=1, max_cpu_loras=1,
               max_lora_rank=8, block_size=4, num_kv_blocks=64, max_model_len=64)


def test_an_adapter_folder_deleted_after_start_fails_only_its_requests(base, adapters):
    """The adapter was re-read from its (deleted) folder inside the scheduler: the LoRAError escaped step(), the
    whole generate() raised, the other requests' outputs were lost and the failed one's KV blocks leaked."""
    paths, oracle = adapters
    llm = _tight_llm(base, paths)
    free = llm.engine.block_manager.num_free_blocks
    shutil.rmtree(paths["a"])
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    outs = llm.generate(prompts, GREEDY, lora=["a", None, "b"])
    assert outs[0].finish_reason == "error" and "folder not found" in outs[0].error and "'a'" in outs[0].error
    assert outs[1].token_ids == oracle.greedy(None, prompts[1], 4)
    assert outs[2].token_ids == oracle.greedy("b", prompts[2], 4)
    assert llm.engine.block_manager.num_free_blocks == free
    assert not llm.engine.has_unfinished_requests() and llm.engine.lora_manager.pins("b") == 0
    assert llm.generate([prompts[2]], GREEDY, lora="b")[0].token_ids == outs[2].token_ids  # still serving


def test_run_with_an_adapter_folder_deleted_mid_run_writes_an_error_record_for_its_lines(base, adapters,
                                                                                         tmp_path, monkeypatch):
    """`infer run` failed the wrong requests (those running) and lost the line whose adapter could not be read."""
    from infer.lora.manager import LoRAManager
    paths, oracle = adapters
    real = LoRAManager.register

    def register(self, name, path):  # the folder goes away right after the engine read it
        adapter = real(self, name, path)
        if name == "a":
            shutil.rmtree(path)
        return adapter
    monkeypatch.setattr(LoRAManager, "register", register)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [("x", [5, 6, 7], "b"), ("y", [8, 9, 10], "a"), ("z", [12, 13], None), ("w", [3, 4, 5], "b")]
    inp.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p, "lora": lo, "ignore_eos": True}) + "\n"
                           for i, p, lo in rows))
    args = ["run", str(base), str(inp), "-o", str(out), "--max-new-tokens", "4", "--max-num-seqs", "2",
            "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", "8", "--max-model-len", "64",
            *(x for n, p in paths.items() for x in ("--lora", f"{n}={p}"))]
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "3 ok, 1 failed" in res.output, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == ["w", "x", "y", "z"]
    assert recs["y"]["finish_reason"] == "error" and "folder not found" in recs["y"]["error"]
    for rid, prompt, lora in rows:
        if rid != "y":
            assert recs[rid]["token_ids"] == oracle.greedy(lora, prompt, 4), rid
