"""Session 44 review probes: this session's commits read against vLLM's behaviour and against each other (Python API,
server, `infer run` lines, data-parallel paths)."""

from __future__ import annotations

import pytest

from infer import LLM
from infer.errors import ConfigError


def test_llm_max_cpu_loras_alone_lowers_the_default_slots_as_the_commands_do():
    """`infer serve --enable-lora --max-cpu-loras 2` runs with 2 slots, and so does vLLM's LLM(enable_lora=True,
    max_cpu_loras=2) (its default max_loras is 1); LLM(...) refused it as "below --max-loras 4", a value nobody
    gave."""
    opts = dict(enable_lora=True, max_lora_rank=8, max_model_len=64, block_size=4)
    with LLM("tiny-llama", max_cpu_loras=2, **opts) as llm:
        assert (llm.llm_engine.config.max_loras, llm.llm_engine.config.max_cpu_loras) == (2, 2)
    with LLM("tiny-llama", max_cpu_loras=8, **opts) as llm:
        assert (llm.llm_engine.config.max_loras, llm.llm_engine.config.max_cpu_loras) == (4, 8)
    with pytest.raises(ConfigError, match="--max-cpu-loras 2 is below --max-loras 3"):
        LLM("tiny-llama", max_loras=3, max_cpu_loras=2, **opts)  # both given: still refused, as vLLM does


def test_bench_url_takes_seed_which_seeds_the_workload():
    """`infer bench --url URL --seed 3`: the seed draws the random prompts and the Poisson arrivals sent to the
    server (as vllm bench serve's --seed does); it was refused as an in-process engine option ("--seed set the
    in-process engine, which --url does not run"). An engine option proper is still refused."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    base = ["bench", "tiny-llama", "--url", "http://127.0.0.1:9", "-q"]
    res = CliRunner().invoke(app, [*base, "--seed", "3"])
    assert "in-process engine" not in res.output and "cannot reach http://127.0.0.1:9" in res.output, res.output
    res = CliRunner().invoke(app, [*base, "--block-size", "8"])
    assert "--block-size set the in-process engine" in res.output, res.output
