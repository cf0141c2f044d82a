"""Session 40's own probes (not a helper's): a jsonl dataset shorter than --num-prompts ran its 2 requests and
reported them as the run, with not a word that 10 were asked for (vLLM repeats requests to reach the number)."""

import json

import pytest

from typer.testing import CliRunner

from infer.cli.main import app


def test_a_dataset_shorter_than_num_prompts_is_said(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"hello {i}", "max_tokens": 2}) for i in range(2)) + "\n")
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--out", str(tmp_path / "o"), "-c", "1", "-q",
                                   "--dataset", f"jsonl:{data}", "--num-prompts", "10"])
    assert res.exit_code == 0, res.output
    assert "--num-prompts 10, but jsonl:" in res.output and "gives 2 usable requests" in res.output
    [r] = json.loads((tmp_path / "o" / "results.json").read_text())
    assert r["completed"] == 2
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--out", str(tmp_path / "o2"), "-c", "1", "-q",
                                   "--dataset", f"jsonl:{data}", "--num-prompts", "2"])
    assert res.exit_code == 0 and "usable request" not in res.output, res.output


def test_quantize_checks_the_widths_of_a_qwen3_without_head_dim_as_transformers_reads_it(tmp_path):
    """A Qwen3 config.json without head_dim has transformers' 128, not hidden_size / heads (42 here): quantize's
    width check derived 42 and refused a model whose projections (3 x 128 = 384) take --group-size 32 and pack."""
    from infer.errors import InferError
    from infer.quant.quantize import QuantizeOptions, quantize_model
    d = tmp_path / "qwen3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 3, "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 128}))
    with pytest.raises(InferError) as e:  # the folder has no weights: refused for that, after the width check
        quantize_model(d, tmp_path / "o", QuantizeOptions(group_size=32))
    said = str(e.value).replace(str(d), "MODEL")  # (the folder's path may hold 42: pytest-142)
    assert "has no weights" in said and not any(w in said for w in ("divide", "pack", "42")), said
