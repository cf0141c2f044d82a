"""`infer run` through typer's CliRunner: the JSONL contract, bad lines, --strict, --resume after a kill."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from infer.cli.main import app

runner = CliRunner()


def _write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def _records(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


GOOD = [
    {"id": "a", "prompt": "hello world", "max_new_tokens": 8},
    {"id": "b", "messages": [{"role": "user", "content": "how is the weather"}], "max_new_tokens": 6},
    {"id": "c", "prompt_token_ids": [5, 6, 7, 8], "max_new_tokens": 5, "logprobs": 2},
    {"custom_id": "d", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}},
]


def test_run_writes_one_record_per_line(tmp_path):
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", GOOD)), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    recs = {r["id"]: r for r in _records(out)}
    assert set(recs) == {"a", "b", "c", "d"}
    for r in recs.values():
        assert r["error"] is None and r["finish_reason"] in ("stop", "length")
        assert r["usage"]["completion_tokens"] == len(r["token_ids"]) > 0
    assert recs["c"]["usage"]["prompt_tokens"] == 4 and len(recs["c"]["logprobs"]) == len(recs["c"]["token_ids"])
    assert len(recs["d"]["token_ids"]) <= 4


def test_dash_output_is_stdout(tmp_path, monkeypatch):
    """`-o -` wrote a file named "-" in the current directory; it is stdout, as without -o."""
    monkeypatch.chdir(tmp_path)
    inp = _write(tmp_path / "in.jsonl", GOOD)
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", "-", "-q"])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "-").exists()
    recs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["id"] for r in recs) == ["a", "b", "c", "d"]
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", "-", "--resume"])
    assert res.exit_code == 2 and "--resume needs -o OUTPUT" in res.output, res.output


def test_eager_flag_reaches_the_engine(tmp_path, monkeypatch):
    """--eager turns the decode CUDA graphs off (on CPU there are none either way; the flag must still parse)."""
    from infer.engine import llm_engine
    seen = []
    real = llm_engine.LLMEngine.__init__

    def spy(self, config, parts=None):
        seen.append((config.enforce_eager, config.use_cuda_graphs()))
        real(self, config, parts)
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", spy)
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", GOOD[:1])), "-o", str(out), "-q",
                              "--eager"])
    assert res.exit_code == 0, res.output
    assert seen == [(True, False)] and len(_records(out)) == 1


def test_same_prompt_tokens_as_transformers(tmp_path):
    from transformers import AutoTokenizer
    from infer.engine.inputs import parse_request
    from infer.models.tiny import ensure_builtin
    tok = AutoTokenizer.from_pretrained(ensure_builtin("tiny-qwen2"))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the rain in spain"}]
    r = parse_request({"messages": msgs}, tok, "1")
    assert r.prompt_token_ids == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                              return_dict=True)["input_ids"])
    assert parse_request({"prompt": "the rain"}, tok, "2").prompt_token_ids == tok("the rain")["input_ids"]


def test_null_fields_keep_the_runs_defaults():
    """`"max_new_tokens": null` (or an OpenAI batch line's `"max_tokens": null`) is "not given": the run's
    --max-new-tokens holds, not the engine's own default."""
    from transformers import AutoTokenizer
    from infer.engine.inputs import parse_request
    from infer.models.tiny import ensure_builtin
    tok = AutoTokenizer.from_pretrained(ensure_builtin("tiny-qwen2"))
    defaults = {"max_new_tokens": 7}
    ours = parse_request({"prompt": "x", "max_new_tokens": None, "temperature": None}, tok, "1", defaults)
    batch = parse_request({"custom_id": "a", "body": {"prompt": "x", "max_tokens": None}}, tok, "2", defaults)
    given = parse_request({"custom_id": "b", "body": {"prompt": "x", "max_tokens": 3}}, tok, "3", defaults)
    assert (ours.params.max_new_tokens, batch.params.max_new_tokens, given.params.max_new_tokens) == (7, 7, 3)


def test_ids_are_strings_or_integers():
    """A list or object id used to become its Python repr ("{'x': 1}"); it is refused, naming the field."""
    from transformers import AutoTokenizer
    from infer.engine.inputs import parse_request
    from infer.errors import RequestError
    from infer.models.tiny import ensure_builtin
    tok = AutoTokenizer.from_pretrained(ensure_builtin("tiny-qwen2"))
    assert parse_request({"id": 5, "prompt": "x"}, tok, "1").id == "5"
    for bad in ({"x": 1}, [1], True):
        with pytest.raises(RequestError, match="field 'id' must be a string or an integer"):
            parse_request({"id": bad, "prompt": "x"}, tok, "1")
    for bad in ({"x": 1}, [1], True, 5):  # (a batch line's custom_id is a string, as OpenAI's and vLLM's)
        with pytest.raises(RequestError, match="field 'custom_id' must be a string, got"):
            parse_request({"custom_id": bad, "body": {"prompt": "x"}}, tok, "1")


BAD = [
    "this is not json",
    {"id": "noprompt", "max_new_tokens": 3},
    {"id": "topp", "prompt": "x", "top_p": 1.5},
    {"id": "type", "prompt": "x", "max_new_tokens": "many"},
    {"id": "long", "prompt_token_ids": list(range(5, 60)), "max_length": 20},
    {"id": "ctx", "prompt_token_ids": [5] * 5000},
    {"id": "field", "prompt": "x", "max_tokenz": 3},
    {"id": "lora", "prompt": "x", "lora": "nope"},
]


def test_bad_lines_get_error_records_and_others_run(tmp_path):
    out = tmp_path / "out.jsonl"
    lines = [GOOD[0]] + BAD + [GOOD[2]]
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out), "-q",
                              "--max-model-len", "512"])
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in _records(out)}
    assert recs["a"]["error"] is None and recs["c"]["error"] is None
    errors = {k: v["error"] for k, v in recs.items() if v["finish_reason"] == "error"}
    assert len(errors) == len(BAD)
    assert "line 2" in errors["line2"] and "JSON" in errors["line2"]
    assert "no prompt" in errors["noprompt"]
    assert "top_p" in errors["topp"]
    assert "max_new_tokens" in errors["type"]
    assert "max_length" in errors["long"]
    assert "context" in errors["ctx"] or "max-model-len" in errors["ctx"]
    assert "max_tokenz" in errors["field"]
    assert "nope" in errors["lora"]


def test_strict_checks_first_and_generates_nothing(tmp_path):
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(_write(tmp_path / "in.jsonl", [GOOD[0], BAD[2]])), "-o",
                              str(out), "-q", "--strict"])
    assert res.exit_code == 2
    assert "top_p" in res.output and "--strict" in res.output
    assert not out.exists() or out.read_text() == ""


@pytest.mark.parametrize("args, message", [
    (["run", "no-such-model", "IN"], "neither a local model folder nor a built-in"),
    (["run", "tiny-llama", "missing.jsonl"], "does not exist"),
    (["run", "tiny-llama", "IN", "--dtype", "float64"], "--dtype"),
    (["run", "tiny-llama", "IN", "--block-size", "0"], "--block-size"),
    (["run", "tiny-llama", "IN", "--resume"], "--resume needs -o"),
    (["run", "tiny-llama", "IN", "--lora", "bad"], "NAME=PATH"),
])
def test_run_cannot_start(tmp_path, args, message):
    inp = _write(tmp_path / "in.jsonl", GOOD[:1])
    args = [str(inp) if a == "IN" else str(tmp_path / a) if a == "missing.jsonl" else a for a in args]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


def test_unsupported_architecture(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    res = runner.invoke(app, ["run", str(tmp_path / "m"), str(_write(tmp_path / "in.jsonl", GOOD[:1]))])
    assert res.exit_code == 2 and "LlamaForCausalLM" in res.output


def test_resume_after_kill_completes_without_duplicates(tmp_path):
    n = 24
    lines = [{"id": f"r{i}", "prompt": f"request number {i} about the weather", "max_new_tokens": 40 + i,
              "ignore_eos": True} for i in range(n)]
    inp, out = _write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "infer.cli", "run", "tiny-llama", str(inp), "-o", str(out), "-q",
           "--max-num-seqs", "4"]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = len(out.read_text().splitlines())
    assert 0 < first < n, "the kill should land midway"
    with open(out, "a") as f:
        f.write('{"id": "r99", "text": "torn')  # a torn last line, as a kill mid-write leaves
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume", "--max-num-seqs", "4"])
    assert res.exit_code == 0, res.output
    ids = [r["id"] for r in _records(out)]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n)) and len(ids) == n
