"""Session 63's hostile inputs to what session 62 built: hybrid (Gated DeltaNet) configs the layers cannot run,
linear-attention state slots past the memory budget (an engine start, warmup's advice and its room for more
sequences), --lora-target-modules naming the linear-attention projections."""

import pytest
from typer.testing import CliRunner

from helpers import tiny_llama_with_json
from infer.cli.main import app


@pytest.mark.parametrize("base, changes, message", [
    ("tiny-qwen3_5", {"linear_num_value_heads": 3},
     "qwen3_5_text with linear_num_value_heads 3 not a multiple of linear_num_key_heads 2 is not supported"),
    ("tiny-qwen3-next", {"linear_num_value_heads": 1},
     "qwen3_next with linear_num_value_heads 1 not a multiple of linear_num_key_heads 2"),
    ("tiny-qwen3_5", {"linear_num_key_heads": 0}, "qwen3_5_text with linear_num_key_heads 0 is not supported"),
    ("tiny-qwen3_5", {"linear_conv_kernel_dim": 1}, "qwen3_5_text with linear_conv_kernel_dim 1 is not supported"),
    ("tiny-qwen3_5", {"layer_types": ["sliding_attention", "linear_attention", "linear_attention",
                                      "full_attention"]},
     "qwen3_5_text layer_types ['sliding_attention'] are not supported"),
])
def test_hybrid_config_its_layers_cannot_run_refused_before_start(tmp_path, base, changes, message):
    """(They failed every request of the run with an internal engine error at the first step, or named a missing
    self_attn tensor.)"""
    folder = tiny_llama_with_json(tmp_path / "m", "config.json", base, **changes)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["run", str(folder), str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output


@pytest.fixture(scope="module")
def large_states_model(tmp_path_factory):
    """tiny-qwen3_5's shape with linear-attention states of 384 KiB a sequence (8 heads of 64 x 64, float32)."""
    from helpers import save_random_model
    from infer.models.tiny import _QWEN3_5
    folder = tmp_path_factory.mktemp("large_states")
    save_random_model(folder, "qwen3_5_text", "Qwen3_5ForCausalLM", dict(
        _QWEN3_5, vocab_size=512, linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64))
    return folder


def test_states_past_the_budget_named_at_start_and_in_warmup(tmp_path, large_states_model):
    """Slots for --max-num-seqs 512 sequences (219 MiB) pass a budget of 200 MB: the start's refusal names them and
    --max-num-seqs (it listed the weights, activations and reserve, 30 MiB in all, and advised only a larger budget),
    warmup's advice names them beside --concurrency."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["run", str(large_states_model), str(tmp_path / "p.jsonl"), "-o",
                                   str(tmp_path / "o.jsonl"), "--max-num-seqs", "512", "--memory-limit", "200MB",
                                   "--max-model-len", "64"])
    out = " ".join(res.output.split())
    assert res.exit_code == 2, out
    assert "linear-attention states 219.4 MiB and a reserve" in out, out
    assert "lower --max-num-seqs (512), whose linear-attention states (a slot per sequence) take 219.4 MiB" in out
    res = CliRunner().invoke(app, ["warmup", str(large_states_model), "--concurrency", "512", "--max-length", "64",
                                   "--memory-limit", "200MB", "--estimate"], env={"COLUMNS": "250"})
    out = " ".join(res.output.split())
    assert res.exit_code == 1, out
    # (the step's activations too: 512 sequences' prefill chunks' delta rule temporaries, memory.sizes.delta_rule_bytes)
    assert "Lower --max-num-batched-tokens (4,096) or --concurrency (512), whose activations take most" in out, out
    assert "or lower --concurrency, whose linear-attention states (a slot per sequence) take 219.4 MiB" in out, out


def test_lora_target_modules_of_linear_attention_named_as_such():
    """--lora-target-modules in_proj_qkv on Qwen3.5: refused as a linear-attention projection infer does not adapt
    (it was an "unknown module name", which it is not)."""
    from infer.errors import ConfigError
    from infer.lora.targets import check_target_modules
    from infer.models.loader import load_config
    from infer.models.tiny import ensure_builtin
    cfg = load_config(ensure_builtin("tiny-qwen3_5"))
    with pytest.raises(ConfigError, match=r"in_proj_qkv, out_proj: linear-attention \(Gated DeltaNet\) projections, "
                                          "which infer's adapters do not adapt"):
        check_target_modules(["q_proj", "in_proj_qkv", "out_proj"], cfg)
    with pytest.raises(ConfigError, match="conv1d: unknown module name"):
        check_target_modules(["conv1d"], cfg)


def _estimate(folder, concurrency: int) -> dict:
    import json
    res = CliRunner().invoke(app, ["warmup", str(folder), "--concurrency", str(concurrency), "--max-length", "64",
                                   "--memory-limit", "200MB", "--estimate", "--json"])
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.output.strip().splitlines()[-1])


def test_warmup_room_for_more_sequences_counts_their_state_slots(large_states_model):
    """warmup's room at the length (max_concurrency_at_max_length) for a hybrid model: each more sequence takes a
    state slot beside its KV blocks, so the plan of that many fits and of one more does not (the room was counted
    with the slots of --concurrency alone: 2657 promised, whose slots alone, 1.1 GiB, pass the budget)."""
    room = _estimate(large_states_model, 4)["max_concurrency_at_max_length"]
    assert room > 4
    at_room, past = _estimate(large_states_model, room), _estimate(large_states_model, room + 1)
    assert at_room["fits"] and at_room["state_bytes"] <= at_room["budget_bytes"], at_room
    assert not past["fits"], past
