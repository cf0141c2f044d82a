"""Session 58, an OpenAI batch line's body.model in `infer run`, as `vllm run-batch` reads it (the server's
_check_model): no model, an empty one or a name of the base runs the base, a registered adapter's name runs that
adapter, and any other name is that line's error ("The model `X` does not exist.", status 404) while the other lines
run. A batch file naming an adapter ("model": "support") with no --lora given ran the base model without a word."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer.cli.main import app
from infer.engine.config import EngineConfig
from infer.errors import UnknownModelError

runner = CliRunner()
PROMPT = "The rain in Spain"


def _batch(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body}}


def _write(path: Path, lines) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(*args: str):
    return runner.invoke(app, ["run", "tiny-llama", *args, "-q"])


LINES = [_batch("named-adapter", model="support"), _batch("base", model="tiny-llama"), _batch("no-model"),
         _batch("empty", model="")]


def test_an_unknown_model_gets_its_own_404_record_and_the_other_lines_run(tmp_path):
    """vLLM answers "The model `support` does not exist." (404) for that line alone; infer ran the base for it."""
    inp, out = _write(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"
    res = _run(str(inp), "-o", str(out), "--output-format", "openai")
    assert res.exit_code == 1, res.output  # a failed line, as any bad line: the others are written
    recs = {r["custom_id"]: r for r in _records(out)}
    assert sorted(recs) == sorted(line["custom_id"] for line in LINES) and len(_records(out)) == len(LINES)
    bad = recs["named-adapter"]
    assert bad["response"]["status_code"] == 404 and bad["response"]["body"] is None
    error = bad["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "the model `support` does not exist" in error["message"]
    assert "name one of: tiny-llama" in error["message"] and "--lora support=PATH" in error["message"]
    texts = set()
    for cid in ("base", "no-model", "empty"):
        assert recs[cid]["error"] is None and recs[cid]["response"]["status_code"] == 200, recs[cid]
        texts.add(recs[cid]["response"]["body"]["choices"][0]["text"])
    assert len(texts) == 1  # greedy, one prompt: the base's one reply for each way of naming the base

    again = _run(str(inp), "-o", str(out), "--output-format", "openai", "--resume")
    assert again.exit_code in (0, 1), again.output
    assert sorted(r["custom_id"] for r in _records(out)) == sorted(recs)  # nothing written twice, nothing lost


def test_infer_records_say_the_same_for_an_unknown_model(tmp_path):
    inp, out = _write(tmp_path / "in.jsonl", LINES[:2]), tmp_path / "out.jsonl"
    res = _run(str(inp), "-o", str(out))
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in _records(out)}
    assert recs["named-adapter"]["finish_reason"] == "error"
    assert recs["named-adapter"]["error"].startswith("line 1: body.model 'support' is neither the base model nor a "
                                                     "registered adapter: the model `support` does not exist")
    assert recs["base"]["error"] is None and recs["base"]["token_ids"]


def test_strict_stops_before_generating_on_an_unknown_model(tmp_path):
    inp, out = _write(tmp_path / "in.jsonl", LINES[:2]), tmp_path / "out.jsonl"
    res = _run(str(inp), "-o", str(out), "--strict")
    assert res.exit_code != 0 and "the model `support` does not exist" in res.output, res.output
    assert not out.exists() or out.read_text() == ""


def test_the_names_a_run_accepts_are_its_models_and_adapters(tmp_path):
    """A model folder is named by the path as given or the folder's name; with adapters registered, the hint names
    them and a typo of one is refused (404), the adapter itself runs."""
    from infer.cli.batch_io import model_names
    folder = tmp_path / "models" / "my-llama"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # (the names are read from the path; the config is not loaded)
    names = model_names(EngineConfig(str(folder), loras={"support": str(tmp_path)}))
    for name in (str(folder), "my-llama", None, ""):
        assert names.lora_for(name) is None
    assert names.lora_for("support") == "support"
    with pytest.raises(UnknownModelError) as e:
        names.lora_for("suport")
    assert e.value.name == "suport" and e.value.known == ("my-llama", str(folder), "support")
    assert f"name one of: my-llama, {folder}, support" in e.value.hint and "--lora suport=PATH" in e.value.hint
    without = model_names(EngineConfig(str(folder)))
    with pytest.raises(UnknownModelError, match="the model `gpt-4o-mini` does not exist"):
        without.lora_for("gpt-4o-mini")  # a file written for OpenAI: vLLM's 404 too (name the base, or leave it out)


def test_a_plain_line_never_runs_the_base_for_an_adapter_it_names(tmp_path):
    """infer's own format: "lora" names an adapter (unknown: the line's error, naming --lora NAME=PATH), and "model"
    is refused as an unknown field with the way to name an adapter."""
    inp, out = _write(tmp_path / "in.jsonl", [{"id": "l", "prompt": PROMPT, "lora": "support"},
                                              {"id": "m", "prompt": PROMPT, "model": "support"},
                                              {"id": "ok", "prompt": PROMPT, "max_new_tokens": 2}]), \
        tmp_path / "out.jsonl"
    res = _run(str(inp), "-o", str(out))
    assert res.exit_code == 1, res.output
    recs = {r["id"]: r for r in _records(out)}
    assert "--lora support=PATH" in recs["l"]["error"]
    assert "unknown field(s) ['model']" in recs["m"]["error"] and '"lora": "support"' in recs["m"]["error"]
    assert recs["ok"]["error"] is None


def test_served_model_name_gives_the_names_a_batch_line_may_give_the_base(tmp_path):
    """vllm run-batch --served-model-name: a file written for a server (`"model": "llama"`) runs on the base under
    those names alone, and a line without a model reports the first; `infer run` had no such option."""
    lines = [_batch("llama", model="llama"), _batch("gpt", model="gpt"), _batch("none"),
             _batch("folder", model="tiny-llama")]
    inp, out = _write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    res = _run(str(inp), "-o", str(out), "--output-format", "openai", "--served-model-name", "llama", "gpt")
    assert res.exit_code == 1, res.output
    recs = {r["custom_id"]: r for r in _records(out)}
    bodies = {cid: recs[cid]["response"]["body"] for cid in ("llama", "gpt", "none")}
    assert [bodies[cid]["model"] for cid in ("llama", "gpt", "none")] == ["llama", "gpt", "llama"]
    assert len({b["choices"][0]["text"] for b in bodies.values()}) == 1  # greedy: the base's one reply
    assert recs["folder"]["response"]["status_code"] == 404  # as vLLM: with the option, its names alone
    assert "name one of: gpt, llama" in recs["folder"]["error"]["message"]
    res = _run(str(inp), "-o", str(out), "--served-model-name", "")
    assert res.exit_code == 2 and "--served-model-name is empty" in res.output, res.output


def test_the_error_class_is_exported():
    import infer
    from infer.errors import RequestError
    assert infer.UnknownModelError is UnknownModelError and issubclass(UnknownModelError, RequestError)


def test_data_parallel_replicas_write_the_same_404_record(tmp_path):
    """--data-parallel writes its own error records (run_parallel._generate): the unknown model's is a 404 there too,
    and the base's lines are answered as one engine answers them."""
    from fakeray import FakeRay, Handle

    from infer.cli import run_parallel
    from infer.cli.batch_io import Records, RecordWriter, model_names, read_inputs
    from infer.parallel.pool import ReplicaPool
    from infer.parallel.replica import Replica
    inp = _write(tmp_path / "in.jsonl", LINES[:3])
    cfg = EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=1, memory_limit=2 ** 29)
    replicas = [Replica(cfg) for _ in range(2)]
    tokenizer = replicas[0].engine.tokenizer
    lines = read_inputs(inp, tokenizer, {"max_new_tokens": 3}, model_names(cfg), 64)
    writer = RecordWriter(tmp_path / "dp.jsonl", append=False)
    pool = ReplicaPool(FakeRay(), [Handle(r) for r in replicas], capacity=2, notify=lambda m: None)
    assert run_parallel._generate(pool, lines, writer, tokenizer, True, Records("openai", tokenizer, lines,
                                                                                "tiny-llama")) == 1
    writer.close()
    recs = {r["custom_id"]: r for r in _records(tmp_path / "dp.jsonl")}
    assert recs["named-adapter"]["response"]["status_code"] == 404
    assert recs["named-adapter"]["error"]["code"] == "model_not_found"
    texts = {recs[cid]["response"]["body"]["choices"][0]["text"] for cid in ("base", "no-model")}
    assert len(texts) == 1
