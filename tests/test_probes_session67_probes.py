"""Probes of the sixty-seventh session: bad inputs that crashed, hung or lost work (the CLI's runs, the server, the
tool parsers)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import infer.cli.run as run_module
from infer.cli.batch_io import RecordWriter
from infer.cli.main import app
from infer.errors import ConfigError


# --------------------------------------------------------------------------- OUTPUT.lock deleted while a run writes
def _prompts(tmp_path, n=4):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"count {i}", "max_new_tokens": 3}) + "\n"
                            for i in range(n)))
    return path


@pytest.mark.parametrize("again", [["--resume"], []], ids=["resume", "plain"])
def test_a_second_run_is_refused_when_the_first_runs_lock_file_was_deleted(tmp_path, monkeypatch, again):
    """`rm out.jsonl.lock` (a cleanup of stale locks) while a run wrote out.jsonl: a second run of the same -o made a
    new lock and wrote beside the first (--resume: the ids still missing, each ending with two records; plain: the
    file emptied under the first). The first run's writer locks the output itself: the second is refused at once (no
    model loaded for it), naming the other run, and the first completes with one record per id."""
    inp, out = _prompts(tmp_path), tmp_path / "out.jsonl"
    second, loads = [], []
    generate, start = run_module._generate, run_module._start_engine
    monkeypatch.setattr(run_module, "_start_engine", lambda *a: loads.append(1) or start(*a))

    def first_generating(engine, todo, writer, *args, **kwargs):  # a record is written, the lock deleted
        if not second:
            writer.write({"id": "r0", "text": "early"})
            (tmp_path / "out.jsonl.lock").unlink()
            second.append(CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", *again]))
        return generate(engine, [item for item in todo if item.id != "r0"], writer, *args, **kwargs)
    monkeypatch.setattr(run_module, "_generate", first_generating)
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"])
    assert res.exit_code == 0, (res.output, res.exception, second[0].output)
    text = " ".join(second[0].output.split())
    assert second[0].exit_code == 2 and "is being written by another infer run" in text, text
    assert loads == [1]  # (the first run's)
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["r0", "r1", "r2", "r3"]
    assert not (tmp_path / "out.jsonl.lock").exists()  # (neither run left one behind)


def test_a_second_writer_of_one_output_is_refused_before_emptying_it(tmp_path):
    """Two writers of one file (the second run's model loaded while the first's lock file was gone): the second is
    refused at its open, and the records the first wrote stay; once the first closes, the file can be written
    again."""
    path = tmp_path / "o.jsonl"
    first = RecordWriter(path, append=False)
    first.write({"id": "a", "text": "x"})
    with pytest.raises(ConfigError, match="being written by another infer run"):
        RecordWriter(path, append=False)
    with pytest.raises(ConfigError, match="being written by another infer run"):
        RecordWriter(path, append=True)
    first.write({"id": "b", "text": "y"})
    first.close()
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b"]
    again = RecordWriter(path, append=False)
    again.write({"id": "c", "text": "z"})
    again.close()
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["c"]


# ------------------------------------------------------------------------------- a beam search's length_penalty
def _beams():
    from infer.engine.beam import BeamSearchSequence
    return {name: BeamSearchSequence(list(range(length)), [], cum, num_prompt_tokens=1)
            for name, length, cum in (("a", 3, -1.0), ("b", 2, -0.5), ("c", 4, -10.0), ("d", 5, 0.0))}


def _order(beams: dict, penalty: float) -> str:
    from infer.engine.beam import ranked
    return "".join(next(k for k, v in beams.items() if v is b) for b in ranked(list(beams.values()), set(), penalty))


@pytest.mark.parametrize("penalty, order", [(1.0, "dbac"), (1e6, "dcab"), (-1e6, "dbac"), (1e308, "dcab"),
                                            (-1e308, "dbac")])
def test_a_huge_length_penalty_orders_beams_as_the_score_does(penalty, order):
    """length ** length_penalty is no float for a length_penalty of 1e6 (OverflowError) or -1e6 (0.0: a division by
    zero): a beam search with it was a 500 ("beam search failed: OverflowError"). The beams are ranked by the score's
    logarithm then, in the order the exact score gives (positive: the longer beam's |score| the smaller; negative:
    the shorter's; a cumulative logprob of 0 first)."""
    assert _order(_beams(), penalty) == order


def test_beams_whose_scores_all_overflow_to_infinity_keep_their_order():
    """2 ** -1070 is a float (a subnormal one), and a logprob over it is -inf: every beam tied, the search kept them
    in the order they came. They are ranked by the score's logarithm (the smallest |logprob| first)."""
    from infer.engine.beam import BeamSearchSequence
    beams = {name: BeamSearchSequence([0, 1], [], cum, num_prompt_tokens=1)
             for name, cum in (("a", -1.0), ("b", -0.5), ("c", -2.0))}
    assert _order(beams, -1070.0) == "bac"


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_model_len=64))
    with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama")), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("penalty", [1e308, -1e308])
def test_a_beam_search_with_a_huge_length_penalty_is_served(server, penalty):
    """The server's beam search with length_penalty 1e308 (any float is vLLM's) was a 500; it is served, and so is
    the next request."""
    r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "n": 3, "use_beam_search": True,
                                             "length_penalty": penalty})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


# ----------------------------------------------------------------------------------- a line's lora naming a folder
def test_a_lines_lora_naming_the_root_folder_gets_a_remedy_with_a_name():
    """A line's "lora": "/" (a folder, as a path given for a name) was told to use `--lora =/` and `"lora": ""`: the
    root folder has no name, and that remedy is itself refused. It names a placeholder adapter instead."""
    from infer.cli.run import adapter_remedy
    from infer.errors import UnknownAdapterError
    text = adapter_remedy(UnknownAdapterError("unknown LoRA adapter '/'", name="/"))
    assert "--lora adapter=/ and write \"lora\": \"adapter\"" in text and "--lora =" not in text, text


def test_infer_run_completes_a_beam_line_with_a_huge_length_penalty(tmp_path):
    """A batch line's use_beam_search with length_penalty 1e308 ended the whole `infer run` with a traceback
    (OverflowError), no record written for any line: each line has its record now."""
    lines = [{"custom_id": "plain", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}},
             {"custom_id": "beams", "url": "/v1/completions",
              "body": {"prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True, "length_penalty": 1e308}}]
    inp, out = tmp_path / "b.jsonl", tmp_path / "o.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--output-format", "openai"])
    assert res.exit_code == 0, (res.output, res.exception)
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == ["beams", "plain"] and records["beams"]["response"]["status_code"] == 200


def test_a_beam_lines_search_that_fails_is_that_lines_error_record(tmp_path, monkeypatch):
    """Any failure of one line's beam search (the OverflowError above) ended the run with a traceback, every other
    line's record lost with it: that line gets an engine error record (500), the others theirs."""
    from infer.cli import beam_lines

    def broken(self):
        raise OverflowError("numerical result out of range")
    monkeypatch.setattr(beam_lines.LineBeams, "advance", broken)
    lines = [{"custom_id": "plain", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}},
             {"custom_id": "beams", "url": "/v1/completions",
              "body": {"prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True}}]
    inp, out = tmp_path / "b.jsonl", tmp_path / "o.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--output-format", "openai"])
    assert res.exit_code == 1, (res.output, res.exception)
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["plain"]["response"]["status_code"] == 200
    assert records["beams"]["response"]["status_code"] == 500
    assert "OverflowError: numerical result out of range" in json.dumps(records["beams"])
