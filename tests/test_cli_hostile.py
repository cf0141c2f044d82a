"""`infer run` against hostile input files: every line gets exactly one record, the run never dies, outputs are
valid UTF-8 JSON read back by the rule they are written with, and --resume never doubles or loses a record."""

import json
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from infer.cli.batch_io import encode_record, read_inputs, read_lines
from infer.cli.main import app
from infer.cli.resume import done_ids, fingerprint_path

runner = CliRunner()
ODD = "\u2028\u2029\u0085\r\x0b\x0c\x1c\x1d\x1e"


def _write_bytes(path, lines: list[bytes]):
    path.write_bytes(b"".join(l + b"\n" for l in lines))
    return path


def _records(path):
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return [json.loads(l.decode("utf-8")) for l in data.split(b"\n")[:-1]]


def _run(*args):
    return runner.invoke(app, ["run", "tiny-llama", *map(str, args), "-q"])


def _hostile_lines() -> list[bytes]:
    deep = b"[" * 5000 + b"]" * 5000
    return [
        b'{"id": "sur", "prompt": "abc\\ud800def", "max_new_tokens": 3}',        # lone surrogate in a prompt
        b'{"id": "x\\udc80", "prompt": "hello", "max_new_tokens": 3}',           # lone surrogate in an id
        b'{"id": "deep", "prompt": ' + deep + b"}",                               # nesting beyond the parser
        deep,
        b'{"id": "inf", "prompt": "hi", "temperature": Infinity}',
        b'{"id": "rp", "prompt": "hi", "repetition_penalty": Infinity}',
        b'{"id": "nan", "prompt": "hi", "top_p": NaN}',
        b'{"id": "big", "prompt": "hi", "max_new_tokens": 99999999999999999999}',
        b'{"id": "seed", "prompt": "hi", "seed": -2}',  # (-1 is vLLM's "no seed")
        b'{"id": "cr", "prompt": "a\rb", "max_new_tokens": 2}',                 # a bare \r inside a line (raw)
        '{"id": "ls\u2028\u2029\u0085", "prompt": "x\u2028y", "max_new_tokens": 2}'.encode(),
        b'{"id": "bad-utf8", "prompt": "\xff\xfe"}',
        b'{"id": "trunc", "prompt": "hi',
        b"12345678901234567890" * 300,                                            # a number of 6000 digits
        b'{"id": "ok", "prompt": "hello world", "max_new_tokens": 3}',
    ]


def test_every_hostile_line_gets_one_record_and_the_run_completes(tmp_path):
    lines = _hostile_lines()
    inp = _write_bytes(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    res = _run(inp, "-o", out)
    assert res.exit_code == 1, res.output  # some lines failed; none ended the run
    recs = _records(out)
    assert len(recs) == len(lines)
    by_id = {r["id"]: r for r in recs}
    assert by_id["ok"]["error"] is None and by_id["x\udc80"]["error"] is None  # a bad id is still a valid request
    assert by_id["ls\u2028\u2029\u0085"]["error"] is None
    assert "line 10: bad JSON: Invalid control character" in by_id["line10"]["error"]  # one line, one record
    assert "surrogate" in by_id["sur"]["error"] and "line 1" in by_id["sur"]["error"]
    assert "nested too deeply" in by_id["line3"]["error"] and "nested too deeply" in by_id["line4"]["error"]
    assert "temperature" in by_id["inf"]["error"] and "repetition_penalty" in by_id["rp"]["error"]
    assert "top_p" in by_id["nan"]["error"] and "max_new_tokens" in by_id["big"]["error"]
    assert "seed" in by_id["seed"]["error"] and "UTF-8" in by_id["line12"]["error"]
    assert "line 13" in by_id["line13"]["error"] and "line 14" in by_id["line14"]["error"]  # numbering never shifts


def test_strict_exits_2_listing_every_bad_line_before_the_model_loads(tmp_path, monkeypatch):
    from infer.engine import llm_engine

    def no_load(*a, **k):
        raise AssertionError("the model must not load when --strict finds bad lines")
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_load)
    inp = _write_bytes(tmp_path / "in.jsonl", _hostile_lines())
    res = _run(inp, "-o", tmp_path / "out.jsonl", "--strict")
    assert res.exit_code == 2, res.output
    assert "lines are invalid (--strict)" in res.output and "line 1:" in res.output and "line 13:" in res.output
    assert not (tmp_path / "out.jsonl").exists()


def test_resume_with_odd_terminators_never_doubles(tmp_path):
    lines = [json.dumps({"id": f"r{i}{ODD[i % len(ODD)]}", "prompt": f"p{ODD}{i}", "max_new_tokens": 2},
                        ensure_ascii=False).encode() for i in range(6)]
    inp = _write_bytes(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert _run(inp, "-o", out).exit_code == 0
    first = _records(out)
    for _ in range(3):
        res = _run(inp, "-o", out, "--resume")
        assert res.exit_code == 0, res.output
    assert _records(out) == first and len(first) == 6


def test_resume_removes_torn_and_garbage_lines_with_a_note(tmp_path):
    inp = _write_bytes(tmp_path / "in.jsonl", [json.dumps({"id": i, "prompt": "hi", "max_new_tokens": 2}).encode()
                                               for i in "abc"])
    out = tmp_path / "out.jsonl"
    assert _run(inp, "-o", out).exit_code == 0
    good = out.read_bytes().split(b"\n")
    out.write_bytes(good[0] + b"\n" + b'{"id": "b", "te\n' + b"\x00garbage\n" + good[2] + b"\n" + b'{"id": "c"')
    res = _run(inp, "-o", out, "--resume")
    assert res.exit_code == 0, res.output
    assert "removed 3 unreadable" in res.output
    assert sorted(r["id"] for r in _records(out)) == ["a", "b", "c"]


def test_resume_refuses_another_input_unless_forced(tmp_path):
    def inp(name, prompts):
        return _write_bytes(tmp_path / name, [json.dumps({"prompt": p, "max_new_tokens": 2}).encode()
                                              for p in prompts])
    a, b = inp("a.jsonl", ["one", "two"]), inp("b.jsonl", ["three", "four", "five"])
    out = tmp_path / "out.jsonl"
    assert _run(a, "-o", out).exit_code == 0
    assert json.loads(fingerprint_path(out).read_text())["input"]["bytes"] == a.stat().st_size
    res = _run(b, "-o", out, "--resume")
    assert res.exit_code == 2 and "another input" in res.output and "--force-resume" in res.output
    res = _run(a, "-o", out, "--resume", "--seed", "7")
    assert res.exit_code == 2 and "seed 0 -> 7" in res.output
    a.write_bytes(a.read_bytes() + b'{"prompt": "appended", "max_new_tokens": 2}\n')  # the same input, grown
    assert _run(a, "-o", out, "--resume").exit_code == 0
    assert [r["id"] for r in _records(out)] == ["1", "2", "3"]
    res = _run(b, "-o", out, "--force-resume")
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in _records(out)] == ["1", "2", "3"]  # line ids 1..3 count as done: forced, as asked


def test_output_to_dev_null_and_a_pipe(tmp_path):
    inp = _write_bytes(tmp_path / "in.jsonl", [b'{"id": "a", "prompt": "hi", "max_new_tokens": 2}'])
    assert _run(inp, "-o", "/dev/null").exit_code == 0
    proc = subprocess.run([sys.executable, "-m", "infer.cli", "run", "tiny-llama", str(inp), "-o", "/dev/stdout", "-q"],
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert json.loads(proc.stdout.decode("utf-8"))["id"] == "a"


def test_bad_paths_fail_before_the_model_loads(tmp_path, monkeypatch):
    from infer.engine import llm_engine
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    inp = _write_bytes(tmp_path / "in.jsonl", [b'{"prompt": "hi"}'])
    cases = [([inp, "-o", tmp_path], "is a directory"), ([tmp_path, "-o", tmp_path / "o.jsonl"], "is a directory"),
             ([tmp_path / "missing.jsonl"], "does not exist"), ([inp, "-o", inp / "x.jsonl"], "not a directory"),
             ([inp, "--max-new-tokens", "0"], "--max-new-tokens"), ([inp, "--resume"], "--resume needs -o")]
    for args, message in cases:
        res = _run(*args)
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output and "hint:" in res.output and "Traceback" not in res.output


def test_max_new_tokens_counts_generated_tokens_only(tmp_path):
    inp = _write_bytes(tmp_path / "in.jsonl", [json.dumps(
        {"id": "p", "prompt": "hello", "prefix_token_ids": [5, 6, 7, 8, 9], "max_new_tokens": 3}).encode()])
    out = tmp_path / "out.jsonl"
    assert _run(inp, "-o", out).exit_code == 0
    rec = _records(out)[0]
    assert rec["usage"]["completion_tokens"] <= 3


line_bytes = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=30).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(
                     st.sampled_from(["id", "prompt", "max_new_tokens", "temperature", "messages", "seed", "x"]),
                     c, max_size=4), max_leaves=8).map(lambda o: json.dumps(o).encode()),
).map(lambda b: b.replace(b"\n", b" "))


class _Tok:
    """Enough of a tokenizer for the reader: one id per byte."""
    chat_template = None

    def __call__(self, text):
        return {"input_ids": list(text.encode("utf-8"))[:50] or [0]}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(st.lists(line_bytes, min_size=1, max_size=12))
def test_fuzz_reader_one_record_per_nonblank_line(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("fuzz") / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    items = read_inputs(path, _Tok(), {"max_new_tokens": 4})
    assert len(list(read_lines(path))) == len(lines)
    assert [it.line_no for it in items] == [n for n, line in enumerate(lines, 1) if _counts(line, n)]
    out = path.with_name("out.jsonl")
    with open(out, "wb") as f:
        for it in items:
            assert (it.request is None) != (it.error is None)
            f.write(encode_record({"id": it.id, "error": it.error}))
    assert len(done_ids(out)) == len({it.id for it in items}) == len(items)


def _counts(line: bytes, line_no: int) -> bool:
    """A line gets a record unless it is blank (after dropping a first line's UTF-8 byte order mark and a CRLF's
    \\r); undecodable bytes always count."""
    line = line[3:] if line_no == 1 and line.startswith(b"\xef\xbb\xbf") else line
    line = line[:-1] if line.endswith(b"\r") else line
    try:
        return bool(line.decode("utf-8").strip())
    except UnicodeDecodeError:
        return True
