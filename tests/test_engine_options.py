"""Engine options given through the Python API with the wrong type or out of range: each is a ConfigError (or an
OutOfMemoryError for a KV cache the budget cannot hold) naming the option and what it got, raised before anything
is loaded or allocated, never a raw TypeError, a hang, or a value silently replaced by the default. And starting an
engine leaves the caller's random state alone."""

from __future__ import annotations

import pytest
import torch

from infer import LLM
from infer.engine.config import EngineConfig
from infer.errors import ConfigError, OutOfMemoryError


@pytest.mark.parametrize("kw, message", [
    (dict(enable_prefix_caching="false"), "enable_prefix_caching must be True or False, got 'false'"),
    (dict(enable_lora="yes"), "enable_lora must be True or False, got 'yes'"),
    (dict(enforce_eager=None), "enforce_eager must be True or False, got None"),
    (dict(overlap=1), "overlap must be True, False or None, got 1"),
    (dict(lora_epilogue="x"), "lora_epilogue must be True, False or None, got 'x'"),
    (dict(lora_streams=0), "lora_streams must be True, False or None, got 0"),
    (dict(lora_expand_beside=None), "lora_expand_beside must be True or False, got None"),
    (dict(gpu_memory_utilization="0.5"), "--gpu-memory-utilization must be a number in (0, 1], got '0.5'"),
    (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    (dict(memory_limit=0), "--memory-limit 0 is not a positive number of bytes"),
    (dict(memory_limit=-5), "--memory-limit -5 is not a positive number of bytes"),
    (dict(memory_limit=True), "--memory-limit True is not a size"),
    (dict(seed=-1), "--seed must be in 0..9223372036854775807, got -1"),
    (dict(max_num_seqs=None), "--max-num-seqs must be an integer, got None"),
    (dict(max_num_seqs=2.0), "--max-num-seqs must be an integer, got 2.0"),
    (dict(dtype=["float16"]), "--dtype ['float16'] is not one of"),
    (dict(device=5), "--device 5 is not one of"),
])
def test_a_wrong_option_is_a_config_error_naming_it(kw, message):
    with pytest.raises(ConfigError) as e:
        EngineConfig("tiny-llama", **kw)
    assert message in str(e.value)


def test_options_that_may_be_none_accept_it_and_sizes_accept_their_spellings():
    cfg = EngineConfig("tiny-llama", overlap=None, lora_epilogue=None, lora_streams=None, max_model_len=None,
                       num_kv_blocks=None,
                       max_cpu_loras=None, memory_limit="512MB", gpu_memory_utilization=1)
    assert cfg.memory_limit == 512 << 20
    assert EngineConfig("tiny-llama", memory_limit=1 << 30).memory_limit == 1 << 30


def test_a_model_that_is_not_a_name_is_refused():
    with pytest.raises(ConfigError, match="the model must be a built-in name, a folder or a Hugging Face id, got None"):
        EngineConfig(None)


def test_num_kv_blocks_beyond_the_budget_is_refused_before_anything_is_allocated():
    """10**12 blocks hung building a Python object per block; 3e6 died in the allocator."""
    with pytest.raises(OutOfMemoryError, match="leaves room for"):  # about twice the budget: it would fit in RAM
        LLM("tiny-llama", num_kv_blocks=12_366, memory_limit="64MB")
    with pytest.raises(OutOfMemoryError) as e:
        LLM("tiny-llama", num_kv_blocks=10 ** 12, memory_limit="64MB")
    msg = str(e.value)
    assert "num_kv_blocks=1,000,000,000,000 needs" in msg and "leaves room for" in msg
    assert "use num_kv_blocks=" in msg and "raise --memory-limit" in msg


def test_num_kv_blocks_below_one_sequence_names_num_kv_blocks_not_the_memory_limit():
    with pytest.raises(ConfigError) as e:
        LLM("tiny-llama", num_kv_blocks=2, max_model_len=256)
    msg = str(e.value)
    assert "num_kv_blocks=2 holds 32 tokens, less than one sequence of 256 tokens" in msg
    assert "use num_kv_blocks=16 or more, or lower --max-model-len to 32 or less" in msg
    assert "--memory-limit" not in msg
    with LLM("tiny-llama", num_kv_blocks=16, max_model_len=256) as llm:  # exactly one sequence: it runs
        assert llm.engine.block_manager.num_blocks == 16


def test_starting_an_engine_leaves_the_callers_random_state_alone():
    """LLM() reset the global torch generator to its seed (and drew initial weights from it)."""
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    with LLM("tiny-llama", seed=7, max_model_len=64):
        pass
    assert torch.equal(torch.rand(4), want)


def test_a_budget_below_the_weights_says_so_rather_than_blaming_the_batch():
    """--memory-limit 1KB: the hint spoke of --max-num-seqs "whose activations take most of the budget" when the
    weights alone did not fit."""
    with pytest.raises(OutOfMemoryError) as e:
        LLM("tiny-llama", memory_limit="1KB")
    assert "the weights alone take" in str(e.value) and "raise --memory-limit" in str(e.value)
    assert "--max-num-seqs" not in str(e.value)


def test_seed_none_draws_a_seed_as_vllm_reads_it():
    """vLLM's seed=None is "not reproducible", not an error: the engine draws one, which its config (and a run's
    records) then shows."""
    seeds = {EngineConfig("tiny-llama", seed=None).seed for _ in range(4)}
    assert all(isinstance(s, int) and 0 <= s < 2 ** 63 for s in seeds) and len(seeds) > 1
