"""Probes of the thirty-ninth session: the engine's memory options on the device they do not apply to. The budget is
--gpu-memory-utilization of the GPU's memory on CUDA and --memory-limit on a CPU (memory.plan.budget_bytes); the
other one, given, was silently ignored. It is not refused (one command line with both serves --device auto on either
machine): the engine warns once at start, naming the option that applies."""

from __future__ import annotations

import logging

import pytest

from infer.cli.warmup_plan import estimate_plan
from infer.engine.config import EngineConfig
from infer.engine.llm import LLM


def _notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "does not apply" in r.getMessage()]


def test_gpu_memory_utilization_on_a_cpu_engine_is_named_once_with_the_option_that_applies(caplog):
    with caplog.at_level(logging.WARNING):
        LLM("tiny-llama", device="cpu", gpu_memory_utilization=0.5, max_model_len=64, max_num_seqs=2)
    notes = _notes(caplog)
    assert len(notes) == 1, notes
    assert notes[0].startswith("--gpu-memory-utilization 0.5 does not apply on cpu: the CPU budget is --memory-limit")
    assert "half the available RAM" in notes[0]


def test_memory_options_that_apply_or_keep_their_defaults_say_nothing(caplog):
    """The command line always passes --gpu-memory-utilization's default (0.9): that value is not a choice made."""
    with caplog.at_level(logging.WARNING):
        LLM("tiny-llama", device="cpu", gpu_memory_utilization=0.9, memory_limit="1GiB", max_model_len=64,
            max_num_seqs=2)
    assert _notes(caplog) == []


def test_warmup_names_an_unused_gpu_memory_utilization_too(caplog):
    cfg = EngineConfig("tiny-llama", device="cpu", gpu_memory_utilization=0.7, memory_limit="1GiB", max_num_seqs=2)
    with caplog.at_level(logging.WARNING):
        estimate_plan(cfg, 64, 1)
    assert _notes(caplog) == ["--gpu-memory-utilization 0.7 does not apply on cpu: the CPU budget is --memory-limit "
                              "(here 1.00 GiB)"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_memory_limit_on_a_gpu_names_gpu_memory_utilization(device):
    """The decision alone (no GPU needed): --memory-limit is what a CPU budget reads, never a GPU's."""
    note = EngineConfig("tiny-llama", memory_limit="8GB", gpu_memory_utilization=0.8).unused_memory_option(device)
    if device == "cpu":
        assert note == ("--gpu-memory-utilization 0.8 does not apply on cpu: the CPU budget is --memory-limit "
                        "(here 8.00 GiB)")
    else:
        assert note == ("--memory-limit 8.00 GiB does not apply on cuda: the GPU budget is --gpu-memory-utilization "
                        "(0.8 of the GPU's memory)")
    assert EngineConfig("tiny-llama").unused_memory_option(device) is None


@pytest.mark.parametrize("value", ["8", "1.5", 1.5])
def test_memory_limit_without_a_unit_below_a_mebibyte_asks_for_the_unit(value):
    """--memory-limit 8 (meaning 8 GB) was 8 bytes: the engine start then said "a budget of 0.0 MiB" with no word of
    the unit."""
    from infer.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--memory-limit .* byte\(s\): a size without a unit counts bytes") as e:
        EngineConfig("tiny-llama", memory_limit=value)
    assert "GB" in str(e.value.hint)


@pytest.mark.parametrize("value, size", [("8GiB", 8 << 30), ("8GB", 8 << 30), ("1048576", 1 << 20), (4096, 4096)])
def test_memory_limit_sizes_with_a_unit_or_of_a_mebibyte_or_in_bytes_from_python_still_parse(value, size):
    assert EngineConfig("tiny-llama", memory_limit=value).memory_limit == size
