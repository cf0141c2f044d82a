"""Session 42 probes of memory planning and admission when adapters, long prompts and many requests compete, with
peft as the oracle."""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine

from lora_helpers import PeftOracle, finish_all, three_adapters

PROMPT = list(range(5, 25))
N = 6


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return three_adapters(tmp_path_factory.mktemp("s42-memlora"), seed=420)


@pytest.fixture(scope="module")
def oracle(paths):
    hf, adapters = paths
    return PeftOracle(hf, adapters)


def test_requests_without_an_adapter_do_not_wait_behind_one_that_waits_for_a_slot(paths, oracle):
    """vLLM admits the requests behind one whose adapter cannot get a slot (every slot held by running requests);
    infer stopped admitting at it, so base-model requests waited for the slot's requests to finish. A request of the
    adapter in the slot still waits its turn behind it (admitting it would keep the slot pinned for ever)."""
    _, adapters = paths
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128, loras={k: str(v) for k, v in adapters.items()},
                                    max_loras=1, max_lora_rank=8, max_num_seqs=8))
    try:
        params = SamplingParams(max_tokens=N, ignore_eos=True)
        engine.add_request("a1", PROMPT, params, lora="a")
        engine.add_request("b1", PROMPT, params, lora="b")  # every slot is pinned by a1
        engine.add_request("base", PROMPT, params)
        engine.add_request("a2", PROMPT, params, lora="a")  # behind b1: waits for it
        engine.add_request("base2", PROMPT[:7], params)
        engine.step()
        running = [s.request_id for s in engine.scheduler.running]
        assert running == ["a1", "base", "base2"]  # was ["a1"]
        assert [s.request_id for s in engine.scheduler.waiting] == ["b1", "a2"]  # their order kept
        done = finish_all(engine)
        for rid, lora, prompt in [("a1", "a", PROMPT), ("b1", "b", PROMPT), ("base", None, PROMPT),
                                  ("a2", "a", PROMPT), ("base2", None, PROMPT[:7])]:
            assert done[rid] == oracle.greedy(lora, prompt, N), rid
        assert engine.stats()["lora_swaps"] == 3  # a, b, a again: a2 did not pass b1
    finally:
        engine.close()


@pytest.mark.parametrize("option, args, word", [
    ("--lora-dtype", ["auto"], "--dtype"), ("--fully-sharded-loras", [], "one GPU"),
    ("--preemption-mode", ["recompute"], "recomputing"),
    ("--long-prefill-token-threshold", ["256"], "--max-num-batched-tokens"),
    ("--max-num-partial-prefills", ["2"], "--max-num-batched-tokens")])
def test_vllms_adapter_and_scheduling_options_say_what_infer_does_instead(option, args, word):
    """vLLM's --lora-dtype was "No such option (Possible options: --dtype, --lora)", and its scheduling options
    (--preemption-mode recompute, vLLM's default among them) "No such option" with only "see --help"."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", option, *args])
    assert res.exit_code == 2 and f"{option} is vLLM's option" in res.output and word in res.output, res.output


def test_on_a_cpu_the_plan_counts_the_adapters_cpu_copies_within_the_memory_limit(paths):
    """On a CPU --memory-limit is the process's memory, and the adapters' CPU copies (the CPU LRU's, up to
    --max-cpu-loras) live in it beside the slots; the plan counted the slots only, so the KV cache took the copies'
    bytes past the budget (16 rank-16 adapters of llama-100m: 179 MB). Warmup --estimate counts what an engine
    start does."""
    from infer.cli.warmup_plan import estimate_plan
    _, adapters = paths
    config = EngineConfig("tiny-llama", max_model_len=64, loras={k: str(v) for k, v in adapters.items()},
                          max_loras=1, max_cpu_loras=2, max_lora_rank=8, memory_limit="40MB", device="cpu")
    engine = LLMEngine(config)
    try:
        manager, plan = engine.lora_manager, engine.memory_plan
        copies = [sum(t.numel() * t.element_size() for m in manager.cpu_adapter(n).modules.values()
                      for t in (m.lora_a, m.lora_b)) for n in ("b", "c")]  # the two the LRU keeps
        assert manager.cpu_resident() == ["b", "c"] and min(copies) > 0
        assert plan.lora_bytes == manager.device_bytes() + sum(copies)  # was device_bytes() alone
        assert estimate_plan(config, 64, 1)[0].lora_bytes == plan.lora_bytes
    finally:
        engine.close()
