"""The README's classification section read by a newcomer: a classifier's server and LLM refuse text generation
naming what a classifier answers (/classify, /score, /rerank; LLM.classify, LLM.score), not embeddings, which it
refuses too."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.errors import RequestError

from test_probes_session60_classify import _post, _serve, llama3  # noqa: F401


@pytest.fixture(scope="module")
def served(llama3):  # noqa: F811
    yield from _serve(llama3[0])


@pytest.mark.parametrize("route,body,api", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "Completions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "Chat Completions"),
])
def test_classifier_server_refuses_generation_naming_its_routes(served, route, body, api):
    status, reply = _post(served, route, body)
    msg = reply["error"]["message"]
    assert status == 400 and msg.startswith(f"The model does not support {api} API: "), reply
    assert "/classify, /score and /rerank" in msg and "/v1/embeddings" not in msg, msg
    status, reply = _post(served, "/v1/embeddings", {"input": "hi"})  # (which the old message pointed to)
    assert status == 400 and "is a classifier" in reply["error"]["message"], reply


def test_classifier_llm_generate_points_to_classify(llama3):  # noqa: F811
    llm = LLM(str(llama3[0]), max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8, block_size=4)
    with pytest.raises(RequestError) as e:
        llm.generate(["hi"], SamplingParams(max_tokens=2))
    text = str(e.value)
    assert "classifier" in text and "LLM.classify" in text and "embed instead" not in text, text


def test_run_summary_escapes_an_id_holding_a_nul(tmp_path):
    """The README's NUL id (`\\u0000`) is that line's error, and the summary names the id as its record writes it,
    not with a raw NUL written to the terminal."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    line = {"custom_id": "c\u0000", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(line) + "\n")
    res = CliRunner().invoke(app, ["run", "tiny-qwen3", str(inp), "-o", str(out), "--runner", "pooling",
                                   "--output-format", "openai"])
    assert res.exit_code == 1, res.output
    assert "first error (id c\\u0000): line 1: field 'custom_id' holds a NUL" in res.output, res.output
    assert "\x00" not in res.output


@pytest.mark.parametrize("command", ["serve", "run", "warmup"])
def test_pooler_config_help_names_use_activation(command, monkeypatch):
    """--pooler-config's help lists the classifier's key the README documents (use_activation), beside the
    embedding keys."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    monkeypatch.setenv("COLUMNS", "250")
    res = CliRunner().invoke(app, [command, "--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    start = text.index("--pooler-config")
    assert "use_activation" in text[start:start + 400], text[start:start + 400]
