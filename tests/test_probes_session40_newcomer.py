"""Session 40 probes of a newcomer's first minutes: the mistakes everyone makes once get one clear error naming the
problem and what to do."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer.cli.main import app
from infer.errors import ModelLoadError
from infer.models.resolve import resolve_model

from helpers import in_empty_hub_cache

runner = CliRunner()


def _refusal(name: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as e:
        resolve_model(name)
    return e.value


def test_a_hub_id_says_how_to_download_it(tmp_path, monkeypatch):
    """`infer run meta-llama/Llama-2-7b-hf` only said to pass a folder: it now names the download command."""
    in_empty_hub_cache(tmp_path, monkeypatch)
    err = _refusal("meta-llama/Llama-2-7b-hf")
    assert "hub id" in err.hint and "hf download meta-llama/Llama-2-7b-hf" in err.hint


def test_a_hub_id_in_the_local_hub_cache_is_read_from_its_snapshot(tmp_path, monkeypatch):
    """Session 40 named the snapshot in a hint; the forty-first reads it (DESIGN: "local folders (or the local
    Hugging Face cache)"): tests/test_probes_session41_main.py runs such a model."""
    in_empty_hub_cache(tmp_path, monkeypatch)
    snap = tmp_path / "hf" / "hub" / "models--org--model" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert resolve_model("org/model") == snap
    err = _refusal(str(tmp_path / "hf" / "hub" / "models--org--model"))  # the cache's folder itself
    assert "cache" in err.message and str(snap) in err.hint


@pytest.mark.parametrize("name, meant", [("tiny-lama", "tiny-llama"), ("Tiny-Llama", "tiny-llama"),
                                         ("tiny_qwen2", "tiny-qwen2"), ("llama-100", "llama-100m")])
def test_a_misspelt_builtin_name_suggests_the_builtin(tmp_path, monkeypatch, name, meant):
    monkeypatch.chdir(tmp_path)
    assert f"did you mean the built-in model {meant!r}" in _refusal(name).hint


def test_a_gguf_file_or_folder_is_named_as_gguf(tmp_path):
    """A GGUF file got "is a file, not a model folder: pass the folder that holds config.json" (there is none)."""
    gguf = tmp_path / "m" / "model-Q4_K_M.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    for path in (gguf, gguf.parent):
        err = _refusal(str(path))
        assert "GGUF" in err.message and "infer quantize" in err.hint


def test_an_adapter_folder_given_as_model_says_to_pass_it_with_lora(tmp_path):
    ad = tmp_path / "adapter"
    ad.mkdir()
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    err = _refusal(str(ad))
    assert "LoRA adapter" in err.message and f"--lora NAME={ad}" in err.hint


@pytest.fixture
def _no_engine(monkeypatch):
    """A refusal that did not come before the model loads would start an engine: starting one fails the test."""
    from infer.engine import llm_engine
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError))


@pytest.mark.parametrize("text, named", [
    ("id,prompt\n1,hello there\n2,how are you\n", "is not JSONL"),                    # a CSV
    ("The weather today is\nTrains leave\n", "is not JSONL"),                         # a plain text file
    ('[{"prompt": "a"}, {"prompt": "b"}]\n', "is a JSON document"),                   # a JSON array on one line
    ('[\n  {"prompt": "a"},\n  {"prompt": "b"}\n]\n', "is a JSON document"),          # a pretty-printed array
    ('{\n  "prompt": "a"\n}\n', "is a JSON document"),                                # a pretty-printed object
    ('{"prompt": "a"},\n{"prompt": "b"},\n', "its lines end with a comma"),           # an array's items
], ids=["csv", "text", "array", "pretty-array", "pretty-object", "commas"])
def test_an_input_that_is_not_jsonl_is_refused_once_before_the_model_loads(tmp_path, _no_engine, text, named):
    """Each line got an error record ("bad JSON", "expected a JSON object, got list") after the model loaded,
    and the run exited 1 as if some requests had failed."""
    inp = tmp_path / "prompts.json"
    inp.write_text(text)
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o.jsonl"), "-q"])
    assert res.exit_code == 2 and named in res.output, res.output
    assert ("sed " if "comma" in named else "jq ") in res.output and not (tmp_path / "o.jsonl").exists()


def test_a_jsonl_file_with_a_bad_line_still_gets_its_error_record(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "a", "max_new_tokens": 2,}\n')
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"])
    assert res.exit_code == 1, res.output
    assert json.loads(out.read_text())["error"].startswith("line 1: bad JSON")


@pytest.mark.parametrize("command, option, says", [
    ("run", "--temperature", '"temperature" is a request\'s field, set per line of INPUT'),
    ("run", "--top-p=0.9", '"top_p" is a request\'s field, set per line of INPUT'),
    ("run", "--max-tokens", "use --max-new-tokens N"),
    ("serve", "--temperature", "\"temperature\" is a request's field: send it in each request's body"),
    ("serve", "--max-tokens", "a request's max_tokens"),
])
def test_a_requests_field_given_as_an_option_says_where_it_goes(command, option, says):
    """`infer run M in.jsonl --temperature 0.7` got click's guess "Possible options: --chat-template"."""
    res = runner.invoke(app, [command, "tiny-llama", *(["in.jsonl"] if command == "run" else []), option, "1"])
    assert res.exit_code == 2 and says in res.output and "--chat-template" not in res.output, res.output
    assert f"`infer {command}` has no option {option.split('=')[0]}" in res.output


def test_an_unknown_option_that_is_no_field_still_gets_clicks_guess():
    res = runner.invoke(app, ["run", "tiny-llama", "in.jsonl", "--max-new-token", "4"])
    assert res.exit_code == 2 and "Possible options: --max-new-tokens" in res.output, res.output


@pytest.mark.parametrize("key", ["text", "input", "instruction"])
def test_a_line_whose_prompt_is_under_another_datasets_key_says_to_rename_it(tmp_path, key):
    """{"text": ...} (what `infer quantize --calibration` reads) got "unknown field(s) ['text']" and a list of 31
    allowed fields, 'prompt' somewhere in it."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({key: "hello there"}) + "\n")
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"])
    assert res.exit_code == 1, res.output
    assert f"the prompt's field is 'prompt' (a chat's 'messages'), e.g. {{\"prompt\": \"...\"}}: rename {key!r}" \
        in json.loads(out.read_text())["error"]


def test_a_bench_dataset_line_with_text_says_to_rename_it(tmp_path):
    from infer.bench.datasets import jsonl_requests
    from infer.engine.setup import load_tokenizer
    from infer.errors import ConfigError
    from infer.models.tiny import ensure_builtin
    inp = tmp_path / "d.jsonl"
    inp.write_text('{"text": "hello there"}\n')
    with pytest.raises(ConfigError) as e:
        jsonl_requests(str(inp), load_tokenizer(ensure_builtin("tiny-llama")), 8)
    assert "rename 'text'" in e.value.hint


@pytest.mark.parametrize("keyword, says", [("trust_remote_code", "never a checkpoint's Python"),
                                           ("quantization", "read from the model's config")])
def test_a_vllm_keyword_of_llm_says_what_to_do_instead(keyword, says):
    """`LLM(model, tensor_parallel_size=1, trust_remote_code=True)` (vLLM's quick start) listed EngineConfig's 30
    fields; the command line said what to do for the same options."""
    from infer import LLM
    from infer.errors import UnknownOptionError
    with pytest.raises(UnknownOptionError) as e:
        LLM("tiny-llama", **{keyword: 1})
    assert f"LLM() has no option {keyword!r}: it is vLLM's keyword" == e.value.message and says in e.value.hint
    assert isinstance(e.value, TypeError)


@pytest.mark.parametrize("keyword", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"])
def test_vllms_parallel_sizes_of_one_are_taken_and_more_refused(keyword):
    """vLLM's quick start passes `tensor_parallel_size=1`, which is what infer runs (one GPU): taken; 2 says what to
    do instead."""
    from infer.engine.llm import _check_options
    from infer.errors import UnknownOptionError
    assert _check_options({keyword: 1, "max_num_seqs": 2}) == {"max_num_seqs": 2}
    with pytest.raises(UnknownOptionError) as e:
        _check_options({keyword: 2})
    assert f"takes vLLM's {keyword} only as 1" in e.value.message and "one GPU" in e.value.hint


@pytest.mark.parametrize("argv, says", [
    (["run", "tiny-llama", "in.jsonl", "out.jsonl"],
     "the output file is an option: infer run MODEL INPUT -o out.jsonl"),
    (["serve", "tiny-llama", "8000"], "the port is an option: infer serve MODEL --port 8000"),
], ids=["run-output", "serve-port"])
def test_one_positional_argument_too_many_says_which_option_it_is(argv, says):
    res = runner.invoke(app, argv)
    assert res.exit_code == 2 and "unexpected extra argument" in res.output and says in res.output, res.output


def test_model_and_input_swapped_are_named(tmp_path, _no_engine):
    """`infer run prompts.jsonl tiny-llama` said "input file tiny-llama does not exist"."""
    inp = tmp_path / "prompts.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    res = runner.invoke(app, ["run", str(inp), "tiny-llama", "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2 and "swapped" in res.output and f"infer run tiny-llama {inp}" in res.output, res.output


@pytest.fixture(scope="module")
def llm():
    from infer import LLM
    engine = LLM("tiny-llama", max_num_seqs=4)
    yield engine
    engine.close()


@pytest.mark.parametrize("prompts, says", [
    ({"role": "user", "content": "hi"}, "the prompt is one chat message, not a list of them"),
    (["a", {"role": "user", "content": "hi"}], "prompt 1 is one chat message, not a list of them"),
    ({"text": "hi"}, "the prompt is a dict of 'text', which is no prompt"),
    ([{"prompt": "a"}, {"text": "b"}], "prompt 1 is a dict of 'text', which is no prompt"),
], ids=["message", "message-in-list", "text-dict", "text-dict-in-list"])
def test_a_dict_that_is_no_prompt_says_what_it_is(llm, prompts, says):
    """One chat message not put in a list got "prompts must be a string, ... got dict", and a {"text": ...} among
    prompts "is of type dict, not text, token ids or chat messages (give ... a list of chat messages (dicts))"."""
    from infer import RequestError, SamplingParams
    with pytest.raises(RequestError) as e:
        llm.generate(prompts, SamplingParams(max_new_tokens=2))
    assert e.value.message == says
    assert ('[{"role": "user", "content": ...}]' if "chat" in says else '{"prompt": text}') in e.value.hint
    assert llm.engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("dtype, says", [("int4", "int4/int8 weights come from a GPTQ checkpoint"),
                                         ("gptq", "`infer quantize MODEL -o OUT --bits 4`"),
                                         ("fp16", "(did you mean float16?)"), ("bf16", "(did you mean bfloat16?)")])
def test_a_quantized_or_short_dtype_says_what_to_do(dtype, says):
    """`--dtype int4` (a newcomer who forgot to quantize) only listed the float types."""
    res = runner.invoke(app, ["run", "tiny-llama", "in.jsonl", "--dtype", dtype])
    assert res.exit_code == 2 and f"--dtype {dtype!r} is not one of" in res.output and says in res.output, res.output


def test_quantize_with_its_default_group_size_on_a_tiny_model_names_the_size_that_fits(tmp_path):
    """`infer quantize tiny-llama -o OUT` (the default --group-size 128 on a hidden size of 64) said only "pick a
    group size that divides every layer's input size"."""
    res = runner.invoke(app, ["quantize", "tiny-llama", "-o", str(tmp_path / "q")])
    assert res.exit_code == 2 and "--group-size 128 does not divide the model's hidden_size (64)" in res.output
    assert "use --group-size 64, the largest that divides every layer's input size" in res.output, res.output


def test_an_adapter_no_line_names_is_a_note(tmp_path, monkeypatch):
    """`infer run M in.jsonl --lora support=PATH` with lines that name no adapter ran the base model without a word:
    a newcomer took the replies for the adapter's."""
    from infer.cli import batch_io
    from infer.cli.batch_io import InputLine
    from infer.engine.inputs import ParsedRequest
    from infer.engine.sampling_params import SamplingParams
    base = InputLine(1, "a", ParsedRequest("a", [1, 2], SamplingParams(), None))
    legal = InputLine(2, "b", ParsedRequest("b", [1, 2], SamplingParams(), "legal"))
    note = batch_io.unused_adapters_note({"support": "/s", "legal": "/l"}, [base, legal])
    assert note.startswith("note: no line of the input names the adapter(s) support given with --lora")
    assert '"lora": "support"' in note
    assert batch_io.unused_adapters_note({"legal": "/l"}, [base, legal]) is None
    assert batch_io.unused_adapters_note({}, [base]) is None


def test_infer_run_prints_the_note_for_an_adapter_no_line_names(tmp_path):
    from pathlib import Path

    from infer.models.tiny import ensure_builtin
    from test_serve import make_adapter
    adapter = make_adapter(Path(ensure_builtin("tiny-llama")), tmp_path / "support")
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi", "max_new_tokens": 2}\n')
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o.jsonl"),
                              "--lora", f"support={adapter}"])
    assert res.exit_code == 0 and "no line of the input names the adapter(s) support" in res.output, res.output


def test_a_missing_extra_is_named_with_the_pip_command(monkeypatch):
    """`pip install -e .` without [serve], then `infer serve`: a traceback ending in "No module named 'fastapi'"."""
    def no_fastapi(*a, **kw):
        raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
    monkeypatch.setattr("infer.cli.serve._serve", no_fastapi)
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0"])
    assert res.exit_code == 2 and "infer serve needs 'fastapi', which is not installed" in res.output, res.output
    assert "pip install 'infer[serve]'" in res.output and "Traceback" not in res.output


def test_bench_without_pandas_is_refused_before_it_measures(tmp_path, monkeypatch):
    """pandas is imported when the report is written: a missing bench extra lost every level measured."""
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pandas" else find(name, *a))
    from infer.engine import llm_engine
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    res = runner.invoke(app, ["bench", "tiny-llama", "--num-prompts", "2", "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and "writes its report with pandas, which is not installed" in res.output, res.output
    assert "pip install 'infer[bench]'" in res.output


def test_a_wrong_route_or_method_says_which_routes_there_are():
    """`curl HOST:8000/completions` got {"error": {"message": "Not Found"}}, a GET of a POST route "Method Not
    Allowed", and the runtime LoRA routes of a server without --allow-runtime-lora "Not Found" too."""
    import httpx

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, max_num_seqs=2))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as url:
        r = httpx.post(f"{url}/completions", json={"prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["message"].startswith(
            "no route POST /completions: the OpenAI routes are under /v1 (POST /v1/completions"), r.text
        r = httpx.get(f"{url}/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["message"] == "GET /v1/completions is not allowed: use POST"
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 404 and "--allow-runtime-lora" in r.json()["error"]["message"], r.text
        r = httpx.get(f"{url}/v1/models/nope")  # a route's own 404 keeps its message
        assert r.status_code == 404 and "the model 'nope' does not exist" in r.json()["error"]["message"]


@pytest.mark.parametrize("method", ["generate", "stream"])
def test_sampling_options_given_as_keywords_say_to_use_sampling_params(llm, method):
    """transformers' habit, `llm.generate("hi", max_new_tokens=32)`, got Python's bare "unexpected keyword
    argument"."""
    with pytest.raises(TypeError) as e:
        getattr(llm, method)("hi", max_new_tokens=4, temperature=0.5)
    assert str(e.value).startswith(f"{method}() has no keyword 'max_new_tokens': sampling options go in a "
                                   "SamplingParams")
    assert f"llm.{method}(prompts, SamplingParams(max_new_tokens=4, temperature=0.5))" in e.value.hint
    assert llm.engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("argv, says", [
    (["run", "-help"], "-help is read as one-letter options (-h -e ...); long options take two dashes: --help"),
    (["run", "tiny-llama", "in.jsonl", "-max-new-tokens", "3"], "long options take two dashes: --max-new-tokens"),
    (["version"], "the version is an option: infer --version"),
], ids=["help", "max-new-tokens", "version"])
def test_one_dash_long_options_and_a_version_command_say_what_was_meant(argv, says):
    """`infer run -help` said "No such option: -e" and nothing else; `infer version` "No such command"."""
    res = runner.invoke(app, argv)
    assert res.exit_code == 2 and says in res.output, res.output


def test_a_sharegpt_line_says_how_to_write_it_as_messages(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"])
    assert res.exit_code == 1, res.output
    assert "'conversations' is ShareGPT's chat: write it as 'messages'" in json.loads(out.read_text())["error"]
