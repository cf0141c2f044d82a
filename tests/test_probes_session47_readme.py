"""Session 47 probes of README's examples, run as a newcomer types them: each mistyped path, key or option value
gets an error that names the problem and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer.errors import LoRAError, ModelLoadError
from infer.lora.adapter import read_config
from infer.models.resolve import resolve_model

from helpers import in_empty_hub_cache


def _model_refusal(name: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as e:
        resolve_model(name)
    return e.value


def test_a_typo_in_a_local_model_path_is_no_hub_id(tmp_path, monkeypatch):
    """`infer run infer-demo/tiny-llama-gtpq ...` (a typo under the demo's folder) was told it looked like a hub id
    and to `huggingface-cli download infer-demo/tiny-llama-gtpq`: the folder is local, and the hint now says which
    folder there was meant."""
    in_empty_hub_cache(tmp_path, monkeypatch)
    (tmp_path / "infer-demo" / "tiny-llama-gptq").mkdir(parents=True)
    err = _model_refusal("infer-demo/tiny-llama-gtpq")
    assert "hf download" not in err.hint
    assert "infer-demo/tiny-llama-gptq" in err.hint
    err = _model_refusal("infer-demo/zzz")
    assert "hf download" not in err.hint and "'infer-demo' has no 'zzz'" in err.hint
    # an ORG/NAME whose ORG is no local folder is still a hub id
    assert "hf download meta-llama/Llama-2-7b-hf" in _model_refusal("meta-llama/Llama-2-7b-hf").hint


def test_a_typo_in_a_local_adapter_path_is_no_hub_id(tmp_path, monkeypatch):
    """`infer lora-validate BASE support=./adapters/suport` (and a served load_lora_adapter's lora_path): Path drops
    the `./`, so the hint read `adapters/suport` as a hub id to download; it now names the local folder meant."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adapters" / "support").mkdir(parents=True)
    with pytest.raises(LoRAError) as e:
        read_config("support", Path("./adapters/suport"))
    text = str(e.value) + " " + (e.value.hint or "")
    assert "hub id" not in text and "hf download" not in text
    assert "adapters/support" in text


class _Resp:
    status_code = 401

    def json(self):
        return {"error": {"message": "invalid or missing API key"}}


@pytest.mark.parametrize("key", [None, "wrong"])
def test_bench_url_names_a_refused_key_apart_from_a_missing_one(monkeypatch, key):
    """`infer bench MODEL --url ... --api-key wrong` was told to "pass --api-key KEY", the option it had passed."""
    import httpx

    from infer.cli.bench import check_url
    from infer.errors import ConfigError
    monkeypatch.setattr(httpx, "get", lambda *a, **k: _Resp())
    with pytest.raises(ConfigError) as e:
        check_url("http://127.0.0.1:9", "tiny-llama", [], key)
    if key is None:
        assert "requires an API key" in str(e.value) and e.value.hint == "pass --api-key KEY"
    else:
        assert "refused the --api-key given" in str(e.value) and "started with" in e.value.hint


def test_quantize_progress_counts_the_head_with_lm_head():
    """`infer quantize tiny-llama -o OUT --group-size 32 --lm-head` (README's example) showed "Quantizing layers 3/2"
    and "layer 2 quantized" for the head: the bar's total now counts the head and the log names it."""
    import io

    from rich.console import Console

    from infer.cli.quantize import RichObserver
    from infer.quant.calibration import CalibrationSet
    buf = io.StringIO()
    obs = RichObserver(Console(file=buf, width=200, log_path=False, log_time=False), lm_head=True)
    obs.start(2, CalibrationSet(source="built-in", samples=[{"input_ids": [1, 2], "attention_mask": [1, 1]}]))
    for layer in range(3):
        obs.layer_done(layer)
    task = obs.progress.tasks[0]
    obs.stop()
    assert task.total == 3 and task.completed == 3
    assert "lm_head quantized" in buf.getvalue() and "layer 2 quantized" not in buf.getvalue()


@pytest.mark.parametrize("argv", [[], ["tiny-llama", "ad"], ["tiny-llama", "ad", "mine"]])
def test_demo_adapter_step_gives_usage_not_traceback(argv, capsys, tmp_path, monkeypatch):
    """The demo prints its adapter step as `python -m infer.cli.demo tiny-llama infer-demo/adapters support legal`;
    re-typed without arguments or with another name it raised TypeError / KeyError tracebacks (or, with no name,
    made nothing and said nothing)."""
    from infer.cli.demo import _adapters_main
    monkeypatch.chdir(tmp_path)
    assert _adapters_main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: python -m infer.cli.demo MODEL FOLDER NAME..." in err and "support, legal" in err
    assert not (tmp_path / "ad").exists()


def test_demo_takes_dash_o_as_every_other_command(monkeypatch, tmp_path):
    """`infer demo -o DIR` was "No such option: -o": run, quantize, convert and bench all take -o for their
    output."""
    from typer.testing import CliRunner

    import infer.cli.demo as demo_mod
    from infer.cli.main import app
    from infer.errors import ConfigError
    seen = []

    def stop(out, model):
        seen.append(out)
        raise ConfigError("stopped here")
    monkeypatch.setattr(demo_mod, "_check_args", stop)
    result = CliRunner().invoke(app, ["demo", "-o", str(tmp_path / "d")])
    assert result.exit_code == 2 and seen == [tmp_path / "d"], result.output


def test_a_misspelt_jsonl_field_names_the_field_meant():
    """A line `{"promt": "hi"}` or `{"prompt": "hi", "temprature": 0.5}` got the whole list of 35 allowed fields to
    search; the hint now starts with the field meant (the server ignores such a field; `infer run` refuses it)."""
    from infer.engine.inputs import parse_request
    from infer.errors import RequestError
    with pytest.raises(RequestError) as e:
        parse_request({"prompt": "hi", "temprature": 0.5, "max_new_token": 3}, None, "1")
    assert e.value.hint.startswith("did you mean 'max_new_tokens' for 'max_new_token', 'temperature' for 'temprature'?")
    with pytest.raises(RequestError) as e:
        parse_request({"promt": "hi"}, None, "1")
    assert "did you mean 'prompt' for 'promt'?" in e.value.hint
    with pytest.raises(RequestError) as e:
        parse_request({"prompt": "hi", "zzz": 1}, None, "1")
    assert "did you mean" not in e.value.hint and e.value.hint.startswith("allowed: ")


@pytest.mark.parametrize("chat", [True, False])
def test_a_body_sent_to_the_other_endpoint_names_it(chat):
    """`{"prompt": ...}` posted to /v1/chat/completions (or `{"messages": ...}` to /v1/completions) was told only
    that the other field is missing; the 400 now says which endpoint takes the field sent."""
    from infer.serve.protocol import ApiError, parse_chat, parse_completion
    body = {"model": "m", "prompt": "hi"} if chat else {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError) as e:
        (parse_chat if chat else parse_completion)(body, None)
    text = e.value.message
    assert ("POST /v1/completions" if chat else "POST /v1/chat/completions") in text


def test_bench_lora_policy_split_without_adapters_is_refused(tmp_path):
    """`infer bench tiny-llama --lora-policy split` without --lora ran the base model as one group, the very run
    mixed makes, and labelled it split; it is now refused before anything loads."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    result = CliRunner().invoke(app, ["bench", "tiny-llama", "--lora-policy", "split", "-o", str(tmp_path / "b")])
    assert result.exit_code == 2 and "no --lora is given" in result.output
    assert not (tmp_path / "b").exists()


def test_a_mistyped_lora_folder_names_the_folder_meant(tmp_path, monkeypatch):
    """`--lora support=./adapters/suport` (run, serve, bench, warmup) was told only "pass a PEFT adapter folder",
    and `--lora sql=org/sql-lora` (vLLM downloads such an id) the same; they now get the loader's hints."""
    from infer.engine.config import parse_loras
    from infer.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adapters" / "support").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        parse_loras(["support=./adapters/suport"])
    assert "did you mean 'adapters/support'?" in e.value.hint
    with pytest.raises(ConfigError) as e:
        parse_loras(["sql=org/sql-lora"])
    assert "hf download org/sql-lora" in e.value.hint


def test_a_misspelt_sampling_params_field_names_the_field_meant():
    """`SamplingParams(max_new_token=32)` listed every field; `LLM(max_num_seq=16)` already said what was meant."""
    from infer import SamplingParams
    from infer.errors import RequestError
    with pytest.raises(RequestError) as e:
        SamplingParams(max_new_token=32)
    assert e.value.hint.startswith("did you mean 'max_new_tokens'?")
    with pytest.raises(RequestError) as e:
        SamplingParams(zzz=1)
    assert e.value.hint.startswith("the fields are")
