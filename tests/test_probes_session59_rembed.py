"""Review of the pooling runner (embeddings): POST /v1/embeddings names the field a refusal is about, refuses the
body fields it would otherwise drop (add_special_tokens false) and takes vLLM's priority; infer bench refuses a
pooling runner before it runs."""

from __future__ import annotations

import pytest

from test_probes_session59_embed import _post, served_pooling  # noqa: F401 (a fixture)


@pytest.mark.parametrize("body, param, says", [
    ({"input": "x" * 2000}, "input", "context"),  # a text certainly past the context (was param "the")
    ({"input": "hi", "dimensions": 8}, "dimensions", "matryoshka"),  # (was param "prompt")
    ({"input": "hi", "add_special_tokens": False}, "add_special_tokens", "add_special_tokens=false"),  # (was dropped)
    ({"input": "hi", "priority": "high"}, "priority", "priority must be an integer"),
    ({"input": "hi", "priority": 3}, "priority", "scheduling"),  # (was dropped: vLLM refuses it without the policy)
])
def test_embeddings_refusals_name_the_field(served_pooling, body, param, says):  # noqa: F811
    base, _, _ = served_pooling
    status, got = _post(base, "/v1/embeddings", body)
    assert status == 400, got
    assert got["error"]["param"] == param, got
    assert says in got["error"]["message"], got


def test_embeddings_priority_zero_and_special_tokens_true_are_taken(served_pooling):  # noqa: F811
    """What a client may always send: the defaults, and null."""
    base, _, _ = served_pooling
    want = _post(base, "/v1/embeddings", {"input": "hi"})
    for extra in ({"priority": 0}, {"priority": None}, {"add_special_tokens": True}):
        status, got = _post(base, "/v1/embeddings", {"input": "hi", **extra})
        assert status == 200, got
        assert got["data"] == want[1]["data"]


def test_bench_refuses_a_pooling_runner_before_it_runs(tmp_path, monkeypatch):
    """Every request failed after the whole run (its report written): refused at once, and nothing written."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--runner", "pooling", "-c", "1", "--num-prompts", "1"])
    assert res.exit_code == 2, res.output
    assert "infer bench measures text generation" in res.output and "--runner pooling" in res.output
    assert not (tmp_path / "bench-results").exists()
