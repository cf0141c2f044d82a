"""Multi-LoRA through the whole engine, with peft as the oracle: a batch whose every row uses another adapter (or
none) gives each row peft's greedy tokens; slot eviction under pressure changes nothing; an unknown adapter fails
only its own line of `infer run`; and adapters on a GPTQ int4 base match peft over the dequantized base."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import ALL, hf_float, save_adapter
from quant_helpers import dequantized_float_model, make_gptqmodel_checkpoint, needs_gptqmodel

N = 10
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig arguments: ranks 4..64, rslora, and different target sets
SPECS = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "mlp16rs": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=MLP),
    "ko64": dict(r=64, lora_alpha=32, target_modules=["k_proj", "o_proj", "down_proj"]),
}
EXTRA = {  # four more for the eviction test
    "e4": dict(r=4, lora_alpha=4, target_modules=ALL),
    "e8": dict(r=8, lora_alpha=8, target_modules=["up_proj"]),
    "e12": dict(r=12, lora_alpha=24, target_modules=["q_proj", "down_proj"]),
    "e6": dict(r=6, lora_alpha=3, use_rslora=True, target_modules=["v_proj", "gate_proj"]),
}


def peft_greedy(hf, adapters: dict, rows, n: int = N) -> list[list[int]]:
    """peft's greedy tokens for every (adapter name or None, prompt) row, one row at a time."""
    from peft import PeftModel
    model = None
    for name, path in adapters.items():
        if model is None:
            model = PeftModel.from_pretrained(hf, str(path), adapter_name=name)
        else:
            model.load_adapter(str(path), adapter_name=name)
    outs = []
    try:
        with torch.no_grad():
            for name, prompt in rows:
                ids = torch.tensor([prompt])
                kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=0)
                if name is None:
                    with model.disable_adapter():
                        out = model.generate(input_ids=ids, **kw)
                else:
                    model.set_adapter(name)
                    out = model.generate(input_ids=ids, **kw)
                outs.append(out[0, len(prompt):].tolist())
    finally:
        model.unload()
    return outs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = ensure_builtin("tiny-llama")
    root = tmp_path_factory.mktemp("adapters")
    hf = hf_float(base)
    paths = {name: save_adapter(hf, root / name, seed=i + 1, **kw)
             for i, (name, kw) in enumerate({**SPECS, **EXTRA}.items())}
    return base, hf, paths


def test_mixed_adapter_batch_matches_peft_per_row(setup):
    base, hf, paths = setup
    adapters = {n: paths[n] for n in SPECS}
    llm = LLM(str(base), loras={n: str(p) for n, p in adapters.items()}, max_loras=4, max_lora_rank=64,
              block_size=4, num_kv_blocks=64, max_model_len=128)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 11, 3, 17, 8, 11, 6), seed=5)
    names = [*SPECS, None, None, "all8"]  # every adapter, two base rows, one adapter twice
    rows = list(zip(names, prompts))
    rows.append((None, prompts[1]))  # the same prompt with and without an adapter, in the same batch
    outs = llm.generate([p for _, p in rows], SamplingParams(max_new_tokens=N, ignore_eos=True),
                        lora=[n for n, _ in rows])
    expect = peft_greedy(hf, adapters, rows)
    assert [o.token_ids for o in outs] == expect
    assert [o.lora for o in outs] == [n for n, _ in rows]
    base_of = peft_greedy(hf, adapters, [(None, p) for _, p in rows[:4]])
    assert sum(a != b for a, b in zip(expect[:4], base_of)) >= 3  # the adapters do change the output
    assert llm.engine.lora_manager.swaps == 4


def test_prefix_cache_is_not_shared_between_adapters(setup):
    """The KV of a prompt computed with one adapter (or none) must not be reused for another adapter later."""
    base, hf, paths = setup
    adapters = {n: paths[n] for n in ("all8", "qv4")}
    llm = LLM(str(base), loras={n: str(p) for n, p in adapters.items()}, max_loras=2, max_lora_rank=64,
              block_size=4, num_kv_blocks=64, max_model_len=128)
    prompt = random_prompts(llm.engine.model_config.vocab_size, (17,), seed=3)[0]
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    order = ["all8", None, "qv4", "all8"]
    got = [llm.generate([prompt], params, lora=name)[0].token_ids for name in order]  # one after the other
    assert got == peft_greedy(hf, adapters, [(name, prompt) for name in order])
    assert llm.engine.block_manager.prefix_hits > 0  # the last run (same adapter as the first) may reuse its KV


def _interleaved(llm, names, prompts):
    rows = [(names[i % len(names)], prompts[i]) for i in range(len(prompts))]
    outs = llm.generate([p for _, p in rows], SamplingParams(max_new_tokens=6, ignore_eos=True),
                        lora=[n for n, _ in rows])
    return [o.token_ids for o in outs], [o.finish_reason for o in outs]


def test_slot_eviction_under_pressure_changes_nothing(setup):
    base, _, paths = setup
    loras = {n: str(p) for n, p in paths.items()}
    names = [*loras, None]
    prompts = random_prompts(512, [3 + (i * 5) % 13 for i in range(18)], seed=9)
    opts = dict(loras=loras, max_lora_rank=64, block_size=4, num_kv_blocks=96, max_model_len=64)
    resident = LLM(str(base), max_loras=8, **opts)
    want, _ = _interleaved(resident, names, prompts)
    assert resident.engine.lora_manager.swaps == 8
    tight = LLM(str(base), max_loras=2, max_cpu_loras=3, **opts)
    got, reasons = _interleaved(tight, names, prompts)
    assert got == want and reasons == ["length"] * len(prompts)
    mgr = tight.engine.lora_manager
    assert mgr.swaps > 8 and mgr.disk_loads > 8  # adapters were evicted from slots and from the CPU cache
    assert all(mgr.pins(n) == 0 for n in loras)  # every acquire was released


def test_unknown_adapter_fails_only_its_line(setup, tmp_path):
    base, _, paths = setup
    inp = tmp_path / "in.jsonl"
    lines = [{"id": "a", "prompt": "hello there", "lora": "qv4"}, {"id": "b", "prompt": "hi", "lora": "nope"},
             {"id": "c", "prompt": "good day"}]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(app, ["run", str(base), str(inp), "-o", str(out), "-q", "--max-new-tokens", "4",
                                   "--max-model-len", "128", "--lora", f"qv4={paths['qv4']}"])
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["b"]["finish_reason"] == "error" and "unknown LoRA adapter 'nope'" in recs["b"]["error"]
    assert "qv4" in recs["b"]["error"]  # the hint lists the registered adapters
    for ok in "ac":
        assert recs[ok]["error"] is None and len(recs[ok]["token_ids"]) == 4


@needs_gptqmodel
def test_adapters_on_gptq_base_match_peft_on_dequantized_base(setup, tmp_path):
    pytest.importorskip("infer.quant.gptq_linear")
    base, _, paths = setup
    qdir = make_gptqmodel_checkpoint(base, tmp_path / "q", bits=4, group_size=32, num_samples=4, seq_len=32)
    adapters = {n: paths[n] for n in ("all8", "mlp16rs", "qv4")}
    llm = LLM(str(qdir), loras={n: str(p) for n, p in adapters.items()}, max_loras=2, max_lora_rank=16,
              block_size=4, num_kv_blocks=64, max_model_len=128)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (6, 13, 4, 9), seed=21)
    rows = list(zip(["all8", "mlp16rs", None, "qv4"], prompts))
    outs = llm.generate([p for _, p in rows], SamplingParams(max_new_tokens=N, ignore_eos=True),
                        lora=[n for n, _ in rows])
    oracle = dequantized_float_model(base, qdir)
    oracle.generation_config.eos_token_id = None
    assert [o.token_ids for o in outs] == peft_greedy(oracle, adapters, rows)
