"""Probes of the sixty-fifth session: inputs that crashed, hung or misled (the CLI, the server, the Python API)."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from infer.cli.main import app
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin


@pytest.fixture(scope="module")
def llm():
    from infer import LLM
    return LLM("tiny-llama", block_size=4)


@pytest.mark.parametrize("kwargs", [{}, {"pooling_task": "embed"}, {"pooling_task": "classify"},
                                    {"pooling_task": "token_embed"}])
def test_encode_on_a_generating_llm_names_llm_encode(llm, kwargs):
    """LLM.encode on a text-generation LLM said "LLM.embed needs the LLM started with --runner pooling": a method the
    user never called."""
    with pytest.raises(RequestError) as e:
        llm.encode(["hi"], **kwargs)
    assert "LLM.encode needs" in e.value.message and "LLM.embed" not in e.value.message, e.value
    assert 'runner="pooling"' in e.value.hint


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_a_json_file_with_a_utf8_bom_is_refused_with_the_fix(tmp_path, name):
    """A config.json saved "UTF-8 with BOM" (transformers cannot read it either) said "cannot read ...: Unexpected UTF-8
    BOM (decode using utf-8-sig)" with the hint "fix or remove the file" (removing config.json breaks the model); a
    tokenizer_config.json with one said the tokenizer "cannot be loaded". Both now name the mark and how to drop it."""
    folder = tmp_path / "m"
    shutil.copytree(ensure_builtin("tiny-llama"), folder)
    path = folder / name
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi", "max_new_tokens": 2}\n')
    res = CliRunner().invoke(app, ["run", str(folder), str(src), "-o", str(tmp_path / "o.jsonl"), "-q"])
    assert res.exit_code == 2, res.output
    assert f"{path} starts with a UTF-8 byte-order mark (BOM)" in res.output, res.output
    assert "without a BOM" in res.output and "fix or remove" not in res.output, res.output
    path.write_bytes(path.read_bytes()[3:])  # the fix the hint gives: the same folder runs
    res = CliRunner().invoke(app, ["run", str(folder), str(src), "-o", str(tmp_path / "o.jsonl"), "-q"])
    assert res.exit_code == 0, res.output


def test_convert_refuses_a_config_json_with_a_bom(tmp_path):
    """infer convert reads config.json itself first: the same refusal, not "it is not valid JSON ... corrupted"."""
    folder = tmp_path / "m"
    shutil.copytree(ensure_builtin("tiny-llama"), folder)
    path = folder / "config.json"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    res = CliRunner().invoke(app, ["convert", str(folder), "-o", str(tmp_path / "out")])
    assert res.exit_code != 0 and "starts with a UTF-8 byte-order mark" in res.output, res.output
    assert "corrupted" not in res.output, res.output


def _batch(custom_id, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "hi", "max_tokens": 2}, **extra}


def test_a_batch_line_with_a_number_as_custom_id_is_refused(tmp_path):
    """An OpenAI batch line's custom_id is a string (OpenAI's Batch API and vllm run-batch refuse a number); infer ran
    "custom_id": 7 and wrote "7" back, which a join on the input's custom_id misses. The line is refused naming the
    field; the other lines complete, and a null custom_id still falls back to the line's number."""
    from helpers import infer_run_records
    lines = [_batch(7), _batch("ok"), _batch(True), _batch(["a"]), _batch(None), _batch(1.5)]
    records, output = infer_run_records(tmp_path, lines, "--output-format", "openai", key="custom_id")
    assert sorted(records) == ["1", "3", "4", "5", "6", "ok"], records
    assert records["ok"]["error"] is None and records["5"]["error"] is None  # (null: the line number)
    want = {"1": 'got 7 (quote it: "custom_id": "7")', "3": "got true (e.g.", "4": 'got ["a"]', "6": "got 1.5 (quote"}
    for key, said in want.items():
        assert records[key]["response"]["status_code"] == 400, records[key]
        message = records[key]["error"]["message"]
        assert message.startswith(f"line {key}: field 'custom_id' must be a string, {said}"), message


def test_a_numeric_custom_id_gives_way_to_a_later_lines_own_id(tmp_path):
    """The refused line's record carries its line number, which is no id of its own: a later line whose custom_id is
    that number (as a string) runs, and is not refused as its duplicate."""
    from helpers import infer_run_records
    records, _ = infer_run_records(tmp_path, [_batch(2), _batch("1")], "--output-format", "openai",
                                   key="custom_id")
    assert records["1"]["error"] is None and records["1"]["response"]["status_code"] == 200, records
    assert len(records) == 2 and "custom_id' must be a string" in next(
        r for k, r in records.items() if k != "1")["error"]["message"], records


def test_a_seeds_refusal_names_minus_one_which_it_takes():
    """seed -1 is taken as no seed (vLLM's), yet the refusal of -2 said "seed must be in 0..2^63-1": it now names -1."""
    from infer import SamplingParams
    assert SamplingParams(seed=-1).seed is None
    for bad in (-2, 2 ** 63):
        with pytest.raises(RequestError, match=r"seed must be in 0\.\.9223372036854775807, or -1 for none"):
            SamplingParams(seed=bad)


def test_score_on_a_generating_llm_names_llm_score(llm):
    """LLM.score on a text-generation LLM said "LLM.embed needs the LLM started with --runner pooling"."""
    with pytest.raises(RequestError) as e:
        llm.score("a", ["b", "c"])
    assert "LLM.score needs" in e.value.message and "LLM.embed" not in e.value.message, e.value


@pytest.mark.parametrize("command", [["convert", "{model}", "-o", "{tmp}/out"],
                                     ["quantize", "{model}", "-o", "{tmp}/q"], ["lora-validate", "{model}", "{tmp}"]])
@pytest.mark.parametrize("model", ["", " "])
def test_an_empty_model_is_refused_as_empty(tmp_path, command, model):
    """An empty MODEL (`infer convert "$UNSET" -o out`) was Path(''), the current folder: "model folder . has no
    config.json" (convert, quantize, lora-validate), or for " " a hint to `hf download ORG/ `."""
    args = [a.format(model=model, tmp=tmp_path) for a in command]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert f"error: the model is empty ({model!r})" in res.output, res.output
    assert "model folder ." not in res.output and "ORG/" not in res.output, res.output


@pytest.mark.parametrize("given", ["", "  "])
def test_an_empty_input_path_is_refused_as_empty(tmp_path, given):
    """`infer run MODEL ""` said "input . is a directory, not a file": Path('') is the current folder."""
    res = CliRunner().invoke(app, ["run", "tiny-llama", given, "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2, res.output
    assert "error: Invalid value for 'input': it is empty; give the path of a JSONL file" in res.output, res.output
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("line", [{"id": "q0", "prompt": "hello"}, {"messages": [{"role": "user", "content": "hi"}]},
                                  {"custom_id": "q0", "method": "POST", "url": "/v1/completions",
                                   "body": {"prompt": "hi"}}])
def test_an_input_file_given_as_output_is_kept(tmp_path, resume, line):
    """`-o` naming another input file (prompts.jsonl for prompts2.jsonl) no run wrote: a plain run deleted its
    requests without a word; --resume took their ids for records and said "nothing to resume" (exit 0, no record).
    Both are refused and the file kept; an output a finished run wrote still starts over."""
    src, other = tmp_path / "in.jsonl", tmp_path / "other.jsonl"
    src.write_text('{"id": "q0", "prompt": "hi", "max_new_tokens": 2}\n')
    other.write_text(json.dumps(line) + "\n")
    kept = other.read_bytes()
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(src), "-o", str(other), "-q",
                                   *(["--resume"] if resume else [])])
    assert res.exit_code == 2, res.output
    key = next(k for k in ("prompt", "messages", "body") if k in line)
    assert f"error: -o {other} holds requests, not records (its first line has '{key}')" in " ".join(
        res.output.split()), res.output
    assert other.read_bytes() == kept and not (tmp_path / "other.jsonl.resume.json").exists()


def test_records_without_their_fingerprint_still_start_over(tmp_path):
    """The check reads the first line only as a request: infer's own records (an id, no finish_reason... would be
    a request) of a run whose fingerprint is gone are started over, as before, and resumed."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "hi", "max_new_tokens": 2}) + "\n" for i in range(2)))
    for fmt in ([], ["--output-format", "openai"]):
        if fmt:
            src.write_text("".join(json.dumps(_batch(f"q{i}")) + "\n" for i in range(2)))
        assert CliRunner().invoke(app, ["run", "tiny-llama", str(src), "-o", str(out), "-q", *fmt]).exit_code == 0
        (tmp_path / "out.jsonl.resume.json").unlink()
        res = CliRunner().invoke(app, ["run", "tiny-llama", str(src), "-o", str(out), "-q", *fmt])
        assert res.exit_code == 0 and len(out.read_text().splitlines()) == 2, res.output
        (tmp_path / "out.jsonl.resume.json").unlink()
        res = CliRunner().invoke(app, ["run", "tiny-llama", str(src), "-o", str(out), "-q", "--resume", *fmt])
        assert res.exit_code == 0 and len(out.read_text().splitlines()) == 2, res.output


BIG = "9" * 5000  # an integer of more digits than Python reads (4300): json.loads raises a plain ValueError
DEEP = "[" * 100000 + "]" * 100000  # arrays nested past the parser's recursion: RecursionError


def test_a_5000_digit_number_in_a_run_line_says_so_without_pythons_advice(tmp_path):
    """A line holding a 5000-digit number said "... use sys.set_int_max_str_digits() to increase the limit": advice
    for a Python program, which no user of infer run can follow. The line is refused naming the number; the others
    complete."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": "big", "prompt": "hi", "max_new_tokens": ' + BIG + '}\n'
                   '{"id": "ok", "prompt": "hi", "max_new_tokens": 2}\n')
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(src), "-o", str(out), "-q"])
    assert res.exit_code == 1, res.output
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["ok"]["error"] is None, records
    error = records["line1"]["error"]
    assert error == "line 1: bad JSON: Exceeds the limit (4300 digits) for integer string conversion: value has " \
                    "5000 digits", error


def test_the_servers_body_with_a_5000_digit_number_is_refused_without_pythons_advice():
    from infer.serve.body import load_json
    from infer.serve.protocol import ApiError
    with pytest.raises(ApiError) as e:
        load_json(('{"prompt": "hi", "max_tokens": ' + BIG + "}").encode(), 64)
    assert e.value.status == 400 and "value has 5000 digits" in str(e.value), e.value
    assert "set_int_max_str_digits" not in str(e.value), e.value


@pytest.mark.parametrize("text, said", [('{"method": "ngram", "num_speculative_tokens": ' + BIG + "}",
                                         "value has 5000 digits"), (DEEP, "nested too deeply")])
def test_speculative_and_pooler_config_json_python_cannot_read_is_a_config_error(text, said):
    """--speculative-config or --pooler-config holding a 5000-digit number, or arrays nested past the parser, was a
    ValueError or RecursionError traceback (only JSONDecodeError was caught)."""
    from infer.engine.pooling import parse_pooler_config
    from infer.engine.speculative import parse_speculative_config
    from infer.errors import ConfigError
    for parse, flag in ((parse_speculative_config, "--speculative-config"), (parse_pooler_config, "--pooler-config")):
        with pytest.raises(ConfigError) as e:
            parse(text)
        assert e.value.message == f"{flag} is not JSON: {said}" or (
            said.startswith("value") and e.value.message.startswith(f"{flag} is not JSON: Exceeds the limit")
            and e.value.message.endswith(said)), e.value
        assert "set_int_max_str_digits" not in str(e.value)


def test_a_json_schema_text_nested_past_the_parser_is_a_request_error():
    """structured_outputs.json given as JSON text nested past the parser raised RecursionError (only ValueError was
    caught): a server answered it 500."""
    from infer import SamplingParams
    with pytest.raises(RequestError, match="structured_outputs.json is not valid JSON: nested too deeply"):
        SamplingParams(structured_outputs={"json": DEEP})


def test_cors_and_calibration_json_python_cannot_read_is_a_config_error(tmp_path):
    """--allowed-origins nested past the parser, and a calibration line with a 5000-digit number, were tracebacks."""
    from infer.errors import ConfigError
    from infer.quant.calibration import _jsonl_text
    from infer.serve.cors import json_list
    with pytest.raises(ConfigError, match=r"--allowed-origins '\[\[\[.*' is not JSON \(nested too deeply\)"):
        json_list(DEEP, "--allowed-origins")
    with pytest.raises(ConfigError, match=r"line 3 is not valid JSON \(Exceeds the limit .* 5000 digits\)"):
        _jsonl_text('{"text": ' + BIG + "}", tmp_path / "c.jsonl", 3, str)


def test_an_adapter_config_with_a_bom_or_a_5000_digit_number_is_refused_clearly(tmp_path):
    """adapter_config.json saved with a BOM said "is not valid JSON: Unexpected UTF-8 BOM" and to re-save the adapter
    with peft; one holding a 5000-digit number was a ValueError traceback (only JSONDecodeError was caught)."""
    from infer.errors import LoRAError
    from infer.lora.adapter import read_config
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    bom, big = tmp_path / "bom", tmp_path / "big"
    for folder in (bom, big):
        folder.mkdir()
    (bom / "adapter_config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(config).encode())
    (big / "adapter_config.json").write_text(json.dumps(config).replace('"r": 4', '"r": ' + BIG))
    with pytest.raises(LoRAError) as e:
        read_config("bom", bom)
    assert "adapter_config.json starts with a UTF-8 byte-order mark (BOM)" in e.value.message, e.value
    assert "without a BOM" in e.value.hint
    with pytest.raises(LoRAError,
                       match=r"adapter_config.json is not valid JSON: Exceeds the limit .* 5000 digits \(re-"):
        read_config("big", big)


def test_an_empty_merge_lora_is_refused_as_empty(tmp_path):
    """`infer convert MODEL -o OUT --merge-lora "$UNSET"` said "--merge-lora .: adapter_config.json is missing"."""
    res = CliRunner().invoke(app, ["convert", "tiny-llama", "-o", str(tmp_path / "out"), "--merge-lora", ""])
    assert res.exit_code == 2, res.output
    assert "error: Invalid value for '--merge-lora': it is empty; give the path of a PEFT adapter folder" \
        in res.output, res.output
    assert not (tmp_path / "out").exists()
