"""Session 43, review of session 42's code."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infer.cli.main import app


def test_two_bench_runs_started_in_the_same_second_get_their_own_default_folders(tmp_path, monkeypatch):
    """The default --out (bench-results/<timestamp>) got a -2 suffix only when the other run's folder already
    existed, and a run's folder was made only when its report was written, at its end: two runs a script started at
    once both chose the same folder and the later report replaced the earlier one. The folder is made when chosen."""
    from infer.cli import bench as bench_cli
    monkeypatch.setattr(bench_cli.time, "strftime", lambda fmt, *a: "20260101-000000")
    first, second = bench_cli.default_out(tmp_path), bench_cli.default_out(tmp_path)
    assert first != second and first.is_dir() and second.is_dir()


def test_a_bench_run_that_ends_before_its_report_leaves_no_empty_default_folder(tmp_path, monkeypatch):
    """The default folder, now made when chosen, is removed again when the run ends before writing a report."""
    import infer.bench.plan as plan_mod
    from infer.errors import ConfigError
    monkeypatch.chdir(tmp_path)

    def fail(*a, **k):
        raise ConfigError("the model cannot load")
    monkeypatch.setattr(plan_mod, "run_plan", fail)
    result = CliRunner().invoke(app, ["bench", "tiny-llama", "-c", "1", "--num-prompts", "1"])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "bench-results").exists()  # nothing left behind


def test_the_request_id_headers_hint_says_infer_makes_no_id_up():
    """vLLM's --enable-request-id-headers puts an X-Request-Id (a random uuid when the request has none) on every
    answer; the hint said infer always sends one back, so dropping the option, as told, left a client that sends
    none without the header it relied on."""
    result = CliRunner().invoke(app, ["serve", "tiny-llama", "--enable-request-id-headers"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "makes up none for a request that sends none" in text, result.output


def _capped_model(tmp_path, cap: int):
    import json
    import shutil

    from infer.models.tiny import ensure_builtin
    model = tmp_path / "m"
    shutil.copytree(ensure_builtin("tiny-llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": cap, "temperature": 0}))
    return model


def test_a_max_tokens_past_the_context_is_named_as_asked_not_as_generation_configs_cap(tmp_path):
    """The server checked the context against max_tokens after generation_config.json's cap (50) had lowered it:
    a client that sent 100 was told 'max_tokens asks for 50 more', a number it never sent, and one that sent 60
    with a prompt of 17 and a context of 64 got a 200 (17 + 50 fit), where vLLM checks the client's own number
    (a 400 'max_tokens ... is too large: 60')."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(str(_capped_model(tmp_path, 40)), max_model_len=64))
    chat = [{"role": "user", "content": "hi"}]
    with TestClient(create_app(Server(AsyncEngine(engine), "m"))) as client:
        r = client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 100})
        assert r.status_code == 400 and "max_tokens asks for 100 more" in r.text, r.text
        prompt = client.post("/tokenize", json={"messages": chat}).json()["count"]
        asked = 64 - prompt + 1  # past the context by one, while the cap (40) fits
        assert prompt + 40 <= 64 < prompt + asked
        r = client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": asked})
        assert r.status_code == 400 and f"max_tokens asks for {asked} more" in r.text, r.text
        r = client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 64 - prompt, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40  # fits: capped at 40


def test_a_batch_lines_max_tokens_past_the_context_is_named_as_asked_not_as_the_cap(tmp_path):
    import json
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "big", "url": "/v1/completions",
                               "body": {"prompt": "hello there", "max_tokens": 100}}) + "\n")
    res = CliRunner().invoke(app, ["run", str(_capped_model(tmp_path, 40)), str(src), "-o", str(out),
                                   "--output-format", "openai", "--max-model-len", "32", "-q"])
    rec = json.loads(out.read_text())
    assert res.exit_code == 1, res.output
    assert rec["response"]["status_code"] == 400 and "body.max_tokens asks for 100 more" in rec["error"]["message"]


def test_a_structured_replys_logprobs_with_bad_words_are_the_same_with_overlapping_steps():
    """Session 42 made a structured reply's logprobs describe the distribution over the tokens its grammar allows.
    With overlapping steps (the GPU default) the grammar's mask is filled late, with the bad words' bans in it, so
    a row with bad_words had their tokens' mass spread over the others: other logprobs than without overlap (vLLM
    masks bad words after its logprobs are computed). Now both see the grammar alone."""
    import math

    from infer import SamplingParams
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.engine.structured import StructuredOutputsParams

    def run(overlap: bool, bad: list[str] | None):
        engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4, overlap=overlap))
        params = SamplingParams(max_tokens=4, temperature=0, logprobs=8, bad_words=bad,
                                structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,40}"))
        engine.add_request("r", [5, 6, 7, 8], params)
        done = None
        while engine.has_unfinished_requests():
            done = next((o for o in engine.step() if o.finished), done)
        tokenizer = engine.tokenizer
        engine.close()
        return done.outputs[0], tokenizer

    free, tokenizer = run(False, None)
    ids = [x["token_id"] for x in free.logprobs[2]["top_logprobs"]
           if x["token_id"] != free.token_ids[2] and math.isfinite(x["logprob"])]
    word = next(w for w in (tokenizer.decode([t]).strip() for t in ids)
                if w and len(tokenizer(w, add_special_tokens=False).input_ids) == 1)
    plain, _ = run(False, [word])
    overlapped, _ = run(True, [word])
    assert overlapped.token_ids == plain.token_ids
    for a, b in zip(plain.logprobs, overlapped.logprobs):
        assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        assert [x["token_id"] for x in a["top_logprobs"]] == [x["token_id"] for x in b["top_logprobs"]]
        assert [x["logprob"] for x in a["top_logprobs"]] == pytest.approx([x["logprob"] for x in b["top_logprobs"]],
                                                                          abs=1e-4)
