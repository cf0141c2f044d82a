"""A newcomer's pass over README's account of session 53's additions (AWQ, Phi-3, prompt tokens details,
max_logprobs, vLLM API parity), run for real: what the commands and their help texts say."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infer.cli.main import app


def _help(*cmd: str) -> str:
    res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "300"}, terminal_width=300)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def test_convert_help_names_awq_models():
    """convert reads AWQ checkpoints (--to gptq rewrites them): its MODEL help named only float and GPTQ."""
    assert "float, GPTQ or AWQ" in _help("convert")


def test_quantize_refusing_an_awq_config_names_convert_to_gptq(tmp_path):
    """README: `infer quantize` refuses an AWQ input, naming `infer convert --to gptq`. An AWQ config.json
    (quant_method awq) got only "quantize the float model it came from"."""
    src = tmp_path / "awq"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}}))
    res = CliRunner().invoke(app, ["quantize", str(src), "-o", str(tmp_path / "out"), "--group-size", "32"])
    assert res.exit_code == 2 and "already quantized (quant_method 'awq')" in res.output, res.output
    assert f"infer convert {src} -o OUT --to gptq" in " ".join(res.output.split()), res.output
    assert not (tmp_path / "out").exists()


def test_a_logprobs_count_past_max_logprobs_says_what_to_do():
    """A server or batch line's logprobs / top_logprobs past the engine's max_logprobs said only "must be in 0..N"
    (the engine's prompt_logprobs refusal named --max-logprobs): each names the option that raises the bound now."""
    import pytest

    from infer.engine.inputs import MAX_LOGPROBS, ModelNames, parse_request
    from infer.errors import RequestError
    from infer.serve.protocol import ApiError, parse_chat, parse_completion
    from infer.serve.responses import to_chat
    with pytest.raises(ApiError) as e:
        parse_completion({"model": "m", "prompt": "hi", "logprobs": 6}, None, defaults={MAX_LOGPROBS: 5})
    assert "logprobs must be in 0..5, got 6" in str(e.value) and "--max-logprobs" in str(e.value)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 6}
    with pytest.raises(ApiError) as e:
        parse_chat(chat, None, defaults={MAX_LOGPROBS: 5})
    assert "top_logprobs must be in 0..5, got 6" in str(e.value) and "--max-logprobs" in str(e.value)
    with pytest.raises(ApiError) as e:
        to_chat({"model": "m", "input": "hi", "top_logprobs": 6}, 5)
    assert "--max-logprobs" in str(e.value)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat}
    with pytest.raises(RequestError) as e:
        parse_request(line, None, "1", names=ModelNames(max_logprobs=5))
    assert "in 0..5, got 6" in str(e.value) and "--max-logprobs" in str(e.value)
    with pytest.raises(ApiError) as e:  # below 0 the bound is no help
        parse_completion({"model": "m", "prompt": "hi", "logprobs": -2}, None, defaults={MAX_LOGPROBS: 5})
    assert "--max-logprobs" not in str(e.value)


def test_the_hf_baseline_refuses_int4_layers_transformers_leaves_unset(tmp_path):
    """`infer bench --baseline hf` (the demo's bench step) on a GPTQ Phi-3 checkpoint infer quantize wrote
    (GPTQModel's gate_proj and up_proj apart; transformers' Phi3MLP has one gate_up_proj): transformers left those
    int4 layers uninitialized and generate died in GPTQModel's kernel ("IndexError: index 358612992 is out of bounds").
    The baseline now refuses such a checkpoint naming the tensor. Simulated here by moving a layer's tensors where
    transformers does not look."""
    import pytest
    from safetensors.torch import load_file, save_file

    from quant_helpers import has_gptqmodel
    if not has_gptqmodel():
        pytest.skip("needs gptqmodel")
    from test_probes_session53_awq import float_model, write_awq

    from infer.bench.hf_baseline import load_hf
    from infer.errors import ModelLoadError
    base = float_model(tmp_path)
    write_awq(base, tmp_path / "awq")
    res = CliRunner().invoke(app, ["convert", str(tmp_path / "awq"), "-o", str(tmp_path / "gptq"), "--to", "gptq"])
    assert res.exit_code == 0, res.output
    load_hf(str(tmp_path / "gptq"), device="cpu")  # its own layout loads
    weights = tmp_path / "gptq" / "model.safetensors"
    tensors = load_file(weights)
    moved = {k.replace("layers.0.mlp.gate_proj.", "layers.0.mlp.gate_projection."): v for k, v in tensors.items()}
    save_file(moved, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as e:
        load_hf(str(tmp_path / "gptq"), device="cpu")
    assert "no tensor for model.layers.0.mlp.gate_proj." in str(e.value), str(e.value)
    assert "model.layers.0.mlp.gate_projection." in str(e.value) and "--baseline hf" in e.value.hint


def test_quantize_help_says_which_phi3_checkpoint_transformers_cannot_read():
    """quantize writes a Phi-3's MLP as transformers' and vLLM's one gate_up_proj, except with --desc-act (gate and up
    then have different g_idx: GPTQModel's split layout stays, which transformers and vLLM cannot load): the help
    says so (session 53 phiquant; before, every Phi-3 checkpoint kept the split layout)."""
    text = _help("quantize")
    assert "Phi-3" in text and "gate_up_proj" in text and "--desc-act" in text and "vLLM" in text
