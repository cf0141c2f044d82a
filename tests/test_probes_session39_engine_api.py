"""Session 39 probes of the low-level engine API as vLLM's LLMEngine users drive it, and of `infer run`'s I/O."""

from __future__ import annotations

import pytest

from infer import LLM, LLMEngine, SamplingParams
from infer.engine.config import EngineConfig
from infer.errors import RequestError

P = SamplingParams(max_new_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4))
    yield eng
    eng.close()


def _run(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def _idle(engine) -> bool:
    return not engine.requests and engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_add_request_takes_vllms_text_prompts(engine):
    """vLLM's LLMEngine.add_request takes a prompt as text or {"prompt": text} besides {"prompt_token_ids": ids};
    infer's refused both ("LLMEngine takes a prompt as token ids, not text"), so vLLM code driving the engine did
    not run. Text is tokenized as LLM.generate does, and the outputs' `prompt` is the text, as vLLM's."""
    ids = engine.tokenizer("hello world")["input_ids"]
    engine.add_request("ids", {"prompt_token_ids": ids}, P)
    engine.add_request("text", "hello world", P)
    engine.add_request("dict", {"prompt": "hello world"}, P)
    done = _run(engine)
    assert done["text"].prompt_token_ids == done["dict"].prompt_token_ids == ids
    assert done["text"].token_ids == done["dict"].token_ids == done["ids"].token_ids
    assert done["text"].prompt == done["dict"].prompt == "hello world" and done["ids"].prompt is None
    with LLM("tiny-llama", max_model_len=64, block_size=4) as llm:
        assert llm.generate(["hello world"], P)[0].token_ids == done["text"].token_ids
    assert _idle(engine)


@pytest.mark.parametrize("prompt,match", [
    ({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": None}}, "'multi_modal_data', which infer does not"),
    ({"prompt_token_ids": [5, 6], "prompt": "hi"}, "not both"),
    ({}, "needs one of 'prompt'"),
    ("x " * 10000, "leaves no room"),
], ids=["multimodal", "both", "empty", "text-too-long"])
def test_add_request_refuses_prompt_dicts_it_cannot_honour(engine, prompt, match):
    """A {"prompt_token_ids": ..., "multi_modal_data": ...} ran as the token ids alone, the image dropped without a
    word (LLM.generate refuses such keys); nothing is queued for a refused prompt."""
    with pytest.raises(RequestError, match=match):
        engine.add_request("bad", prompt, P)
    assert _idle(engine)


def test_get_num_unfinished_requests(engine):
    """vLLM's LLMEngine.get_num_unfinished_requests() was an AttributeError."""
    assert engine.get_num_unfinished_requests() == 0
    engine.add_request("a", [5, 6, 7], P)
    engine.add_request("b", [5, 6], SamplingParams(max_new_tokens=6, ignore_eos=True))
    engine.add_request("c", [7, 8], P)
    assert engine.get_num_unfinished_requests() == 3
    engine.abort_request("c")
    assert engine.get_num_unfinished_requests() == 3  # its abort output is not handed out yet
    counts = []
    while engine.has_unfinished_requests():
        engine.step()
        counts.append(engine.get_num_unfinished_requests())
    assert counts[0] == 2 and counts[-1] == 0 and 1 in counts
    assert _idle(engine)


def test_get_num_unfinished_requests_with_overlapped_steps():
    """With overlap (a step's tokens reach the host one step later), a loop on get_num_unfinished_requests() still
    gets every request's last output exactly once."""
    eng = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4, overlap=True))
    for i in range(4):
        eng.add_request(f"r{i}", [5, 6, 7 + i], SamplingParams(max_new_tokens=3 + i, ignore_eos=True))
    eng.abort_request("r1")
    finished = []
    while eng.get_num_unfinished_requests() > 0:
        finished += [o.request_id for o in eng.step() if o.finished]
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]
    eng.close()


def test_vllm_priority_and_lora_request_keywords(engine):
    """vLLM's add_request keywords `priority` and `lora_request` were a bare TypeError ("unexpected keyword
    argument"). priority 0 (vLLM's default) is taken; another is refused as vLLM's first-come-first-served
    scheduler refuses it; lora_request is refused naming lora=NAME, as LLM.generate does."""
    engine.add_request("p0", [5, 6, 7], P, priority=0)
    with pytest.raises(RequestError, match="priority=3"):
        engine.add_request("p3", [5, 6, 7], P, priority=3)
    with pytest.raises(RequestError, match="lora=NAME"):
        engine.add_request("lr", [5, 6, 7], P, lora_request=object())
    assert set(_run(engine)) == {"p0"}
    assert _idle(engine)


def test_a_request_id_that_is_not_a_string_is_refused(engine):
    """add_request(7, ...) queued the request as "7": its outputs' request_id was not the id given (a caller's
    dict keyed by 7 never matched), and 7 and "7" were one id ("already running"). vLLM refuses it (TypeError)."""
    for rid in (7, None, ("a", 1)):
        with pytest.raises(RequestError, match="request_id must be a string"):
            engine.add_request(rid, [5, 6, 7], P)
    assert _idle(engine)
    assert engine.get_tokenizer() is engine.tokenizer  # vLLM's LLMEngine.get_tokenizer()


def test_add_request_takes_vllms_keywords(engine):
    """vLLM's add_request(request_id=..., prompt=..., params=...) was a TypeError (infer named the prompt
    prompt_token_ids, which still works); a call with neither or both is refused, nothing queued."""
    engine.add_request(request_id="kw", prompt="hello world", params=P)
    engine.add_request("old", prompt_token_ids=engine.tokenizer("hello world")["input_ids"], params=P)
    for kwargs in ({}, {"prompt": [5], "prompt_token_ids": [5]}):
        with pytest.raises(RequestError, match="add_request needs one prompt"):
            engine.add_request("bad", params=P, **kwargs)
    done = _run(engine)
    assert set(done) == {"kw", "old"} and done["kw"].token_ids == done["old"].token_ids
    assert _idle(engine)


def test_adapters_on_a_closed_engine_say_it_is_closed(tmp_path):
    """close() drops the LoRA manager, so add_lora / remove_lora on a closed engine said "this engine has no LoRA
    adapter slots ... start it with --enable-lora", about an engine started with them. ClosedError now, as every
    other call; list_loras (vLLM's) lists the adapters of an open one."""
    from infer.errors import ClosedError
    eng = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4, enable_lora=True))
    assert eng.list_loras() == []
    eng.close()
    for call in (lambda: eng.add_lora("a", str(tmp_path)), lambda: eng.remove_lora("a"), eng.list_loras):
        with pytest.raises(ClosedError, match="closed"):
            call()


# ------------------------------------------------------------------ infer run's I/O
import gzip  # noqa: E402
import json  # noqa: E402

from typer.testing import CliRunner  # noqa: E402

from infer.cli import run as run_module  # noqa: E402
from infer.cli.main import app  # noqa: E402

LINES = [{"id": f"r{i}", "prompt": f"hello {i}", "max_new_tokens": 3} for i in range(4)]


def _input(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


def _no_model(monkeypatch):
    monkeypatch.setattr(run_module, "_start_engine", lambda *a, **k: pytest.fail("the model was loaded"))


def test_a_gzip_input_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """A gzip-compressed prompts.jsonl.gz loaded the model, then wrote an error record "not valid UTF-8" for every
    "line" of the compressed bytes and exited 1; it is refused at once, saying how to decompress it."""
    _no_model(monkeypatch)
    packed = tmp_path / "in.jsonl.gz"
    packed.write_bytes(gzip.compress(_input(tmp_path).read_bytes()))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(packed), "-o", str(tmp_path / "out.jsonl"), "-q"])
    assert res.exit_code == 2, res.output
    assert "gzip-compressed" in res.output and "gunzip -c" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "out.jsonl").exists()


def test_stdin_as_input_is_refused_naming_stdin(tmp_path, monkeypatch):
    """`infer run MODEL - -o out.jsonl` (the usual spelling of stdin) said "input file - does not exist"."""
    _no_model(monkeypatch)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["run", "tiny-llama", "-", "-o", "out.jsonl", "-q"],
                             input=_input(tmp_path).read_text())
    assert res.exit_code == 2, res.output
    assert "cannot be stdin" in res.output and "save the requests to a file" in res.output


def test_a_second_run_of_the_same_output_is_refused_while_the_first_writes(tmp_path, monkeypatch):
    """Nothing kept two runs of one -o apart: a `--resume` started while the first run was still generating ran
    every id the file did not hold yet, as the first run did, and the output ended with two records of those ids
    (a plain re-run truncated the file under the first). The second run is refused now; the first completes, and
    leaves no lock behind."""
    inp, out = _input(tmp_path), tmp_path / "out.jsonl"
    second = []
    generate = run_module._generate

    def first_generating(*args, **kwargs):  # the first run is under way: a second one starts
        if not second:
            second.append(CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume"]))
        return generate(*args, **kwargs)
    monkeypatch.setattr(run_module, "_generate", first_generating)
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    assert second[0].exit_code == 2 and "being written by another infer run" in second[0].output, second[0].output
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == ["r0", "r1", "r2", "r3"]
    assert not (tmp_path / "out.jsonl.lock").exists()
    monkeypatch.setattr(run_module, "_generate", generate)
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("fail_from", [1, 2], ids=["at-start", "at-end"])
def test_a_full_disk_writing_the_resume_record_is_one_error_line(tmp_path, monkeypatch, fail_from):
    """OUT.resume.json is written when the run starts and marked complete at its end; a full disk at either was a
    traceback (an OSError out of the command) with OUT.resume.json.tmp left behind. It is one error line (exit 2)
    now, and at the end, where every record is written, a --resume marks the output complete."""
    import errno

    from infer.cli import resume
    inp, out = _input(tmp_path), tmp_path / "out.jsonl"
    replace, calls = resume.os.replace, []

    def full(src, dst):
        calls.append(dst)
        if len(calls) >= fail_from:
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(src, dst)
    monkeypatch.setattr(resume.os, "replace", full)
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert "cannot write" in res.output and "No space left on device" in res.output
    assert not (tmp_path / "out.jsonl.resume.json.tmp").exists()
    monkeypatch.setattr(resume.os, "replace", replace)
    if fail_from == 2:
        assert "every record is in" in res.output
        assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["r0", "r1", "r2", "r3"]
        assert json.loads((tmp_path / "out.jsonl.resume.json").read_text())["complete"] is False
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume"])
    assert res.exit_code == 0, res.output
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["r0", "r1", "r2", "r3"]
    assert json.loads((tmp_path / "out.jsonl.resume.json").read_text())["complete"] is True


def test_a_full_disk_cutting_a_torn_line_on_resume_is_one_error_line(tmp_path, monkeypatch):
    """--resume cuts a torn last line by writing the good records to OUT.tmp and renaming it over OUT; a full disk
    there was a traceback with the partial copy left behind. One error line now, OUT untouched, no .tmp."""
    import errno

    from infer.cli import resume
    _no_model(monkeypatch)
    inp, out = _input(tmp_path), tmp_path / "out.jsonl"
    torn = json.dumps({"id": "r0", "text": "x", "token_ids": [1], "finish_reason": "length"}) + "\n" + '{"id": "r1'
    out.write_text(torn)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(resume.os, "replace", full)
    monkeypatch.setattr(run_module, "_start_engine", lambda *a, **k: type("E", (), {
        "tokenizer": None, "max_model_len": 64, "validate": lambda *a: None})())
    monkeypatch.setattr(run_module, "_checked_lines", lambda *a, **k: [])
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--force-resume"])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert "cannot remove 1 unreadable" in res.output and "No space left" in res.output
    assert out.read_text() == torn and not (tmp_path / "out.jsonl.tmp").exists()


def test_the_data_parallel_servers_view_of_its_engines_reaches_the_adapter_slots():
    """The data-parallel server's ReplicaView borrows LLMEngine.lora_slots, which now checks the engine is open
    first: the view had no such check, so every POST /v1/load_lora_adapter with --data-parallel was a 500."""
    from infer.parallel.serve_engine import ReplicaView, _Adapters
    view = ReplicaView.__new__(ReplicaView)
    view.lora_manager = _Adapters(["a"])
    assert view.lora_slots() is view.lora_manager
