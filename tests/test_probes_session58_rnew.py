"""Session 58 review of the newcomer's messages: every shell command a message tells runs as written (a file name with
a space or a quote, an input already named prompts.jsonl), and the values check of config.json refuses no real model's
config (the families' transformers defaults, with the null / 0 / false fields real hub configs hold)."""

from __future__ import annotations

import gzip
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from infer.cli.batch_io import check_input_encoding
from infer.errors import ConfigError

def _shell(words: list[str]) -> None:
    """Run `COMMAND ARGS > OUT` (a hint's command split by shlex) in a shell, as the user would."""
    subprocess.run(shlex.join(words[:-2]) + " > " + shlex.quote(words[-1]), shell=True, check=True)


_ARRAY = json.dumps(["The weather today is", "Trains leave"]).encode()


@pytest.mark.parametrize("name, content", [
    ("prompts.jsonl", _ARRAY),  # `> prompts.jsonl` emptied it before jq read it
    ("it's prompts.json", json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2).encode()),
    ("my prompts.jsonl", b'"The weather today is"\n"Trains leave"\n'),
    ("prompts.jsonl", b"The weather today is\nTrains leave\n"),
    ("my $prompts.json", b'{\n  "prompt": "a"\n}\n{\n  "prompt": "b"\n}\n'),
    ("prompts.jsonl", b'{"prompt": "a"},\n{"prompt": "b"},\n'),
    ("prompts.jsonl", gzip.compress(b'{"prompt": "a"}\n{"prompt": "b"}\n')),
], ids=["array-named-prompts", "quote", "string-lines", "text-named-prompts", "pretty-objects", "commas", "gzip"])
def test_a_conversion_command_keeps_the_input_and_runs_as_written(tmp_path, monkeypatch, name, content):
    """The hint's command for a file that is not JSONL named the input unquoted (`jq -c '.[]' it's prompts.json`: a
    shell syntax error; `my prompts.jsonl`: two files) and wrote prompts.jsonl, which for an input prompts.jsonl is
    the input itself: the shell empties it before jq reads it, and the user's prompts were lost."""
    monkeypatch.chdir(tmp_path)
    Path(name).write_bytes(content)
    with pytest.raises(ConfigError) as e:
        check_input_encoding(Path(name))
    command = re.search(r"(?:e\.g\.|:) ((?:jq|sed|gunzip) .+?)(?: for | \(a CSV|$)", e.value.hint).group(1)
    words = shlex.split(command)
    assert words[-3:-1] == [name, ">"] and words[-1] != name, command
    if shutil.which(words[0]) is None:
        pytest.skip(f"{words[0]} is not installed")
    _shell(words)
    assert Path(name).read_bytes() == content
    made = [json.loads(line) for line in Path(words[-1]).read_text().splitlines()]
    assert all(isinstance(m, dict) and isinstance(m.get("prompt"), str) for m in made) and len(made) == 2, made
    check_input_encoding(Path(words[-1]))  # the file made is JSONL


def test_an_unknown_body_model_is_told_the_served_model_name_that_runs_the_base_by_it(tmp_path):
    """A batch file written for a vLLM server of the hub model ("model": "meta-llama/Llama-3.2-1B", the name vllm
    serve gives it) run on a local copy: every line was a 404 whose hint named only the base's own names and --lora;
    vllm run-batch's remedy is --served-model-name, which the hint now gives, and which runs the line as written."""
    from test_probes_session58_batch import _batch, _records, _run, _write
    hub = "meta-llama/Llama-3.2-1B"
    inp, out = _write(tmp_path / "in.jsonl", [_batch("hub", model=hub)]), tmp_path / "out.jsonl"
    res = _run(str(inp), "-o", str(out), "--output-format", "openai")
    assert res.exit_code == 1, res.output
    error = _records(out)[0]["error"]["message"]
    given = re.search(r"give (--served-model-name \S+) \(vllm run-batch's\)", error)
    assert given is not None and "--lora meta-llama/Llama-3.2-1B=PATH" in error, error
    res = _run(str(inp), "-o", str(out), "--output-format", "openai", *shlex.split(given.group(1)))
    assert res.exit_code == 0, res.output
    record = _records(out)[0]
    assert record["error"] is None and record["response"]["body"]["model"] == hub


# the fields real hub configs leave null, 0, false or empty (Mistral v0.3's and Mixtral's sliding_window null, Qwen2's
# window with use_sliding_window false, Qwen2-MoE's sliding_window 0 of transformers' defaults, Gemma 3's
# sliding_window_pattern, head_dim / num_key_value_heads / rope_scaling null, MoE's mlp_only_layers [])
_HUB_FIELDS = {
    "llama": [{"num_key_value_heads": None, "head_dim": None, "rope_scaling": None}],
    "mistral": [{"sliding_window": None, "head_dim": None}, {"sliding_window": 4096}],
    "qwen2": [{"sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28},
              {"sliding_window": None, "max_window_layers": 70}],
    "qwen3": [{"sliding_window": None, "head_dim": 16, "max_window_layers": 2, "use_sliding_window": False}],
    "phi3": [{"sliding_window": 2047}, {"sliding_window": 262144, "rope_scaling": None}],
    "gemma": [{"head_dim": 16}],
    "gemma2": [{"sliding_window": 4096, "head_dim": 16, "query_pre_attn_scalar": 16}],
    "gemma3_text": [{"sliding_window": 512, "sliding_window_pattern": 6, "rope_scaling": None, "head_dim": 16,
                     "query_pre_attn_scalar": 16}],
    "qwen3_moe": [{"sliding_window": None, "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": None}],
    "mixtral": [{"sliding_window": None, "head_dim": None}],
    "qwen2_moe": [{"sliding_window": 0, "shared_expert_intermediate_size": 0, "mlp_only_layers": []},
                  {"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21}],
}


@pytest.mark.parametrize("model_type, fields", [(t, f) for t, many in _HUB_FIELDS.items() for f in [{}, *many]])
def test_real_configs_are_read(tmp_path, model_type, fields):
    """config.json's values check (a size no model has, refused before transformers reads the file) on each supported
    family's config as transformers writes it (AutoConfig.for_model's defaults, small sizes), alone and with the
    null / 0 / false fields of real hub configs: none of them is refused."""
    from transformers import AutoConfig

    from infer.models.loader import load_config
    from infer.models.registry import SUPPORTED
    arch = next(a for a, t in SUPPORTED.items() if t == model_type)
    small = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
             "intermediate_size": 128, "vocab_size": 256}
    if model_type.endswith("moe") or model_type == "mixtral":
        small.update(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    config = AutoConfig.for_model(model_type, **small, architectures=[arch])
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **fields}))
    assert load_config(tmp_path).model_type == model_type


@pytest.mark.parametrize("given", ["./sharegpt.json", "data dir/ShareGPT_V3_unfiltered_cleaned_split.json",
                                   "it's/sharegpt.json"])
def test_the_sharegpt_download_lands_where_the_dataset_is_then_read(tmp_path, monkeypatch, given):
    """`infer bench M --dataset sharegpt:./sharegpt.json` (README's) was told `hf download ... --local-dir .`, which
    writes ShareGPT_V3_unfiltered_cleaned_split.json, not ./sharegpt.json: the same command failed again. The
    download now goes to the folder the option names (quoted), and the option to pass then is said."""
    from infer.cli.bench import SHAREGPT_FILE, check_dataset
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        check_dataset(f"sharegpt:{given}")
    fetch = shlex.split(re.search(r"`(hf download [^`]+)`", e.value.hint).group(1))
    assert fetch[2:] == ["anon8231489123/ShareGPT_Vicuna_unfiltered", SHAREGPT_FILE, "--repo-type", "dataset",
                         "--local-dir", fetch[-1]], fetch
    downloaded = Path(fetch[-1]) / SHAREGPT_FILE  # where hf download --local-dir writes the one file
    downloaded.parent.mkdir(parents=True, exist_ok=True)
    downloaded.write_text("[]")
    then = re.search(r", then pass --dataset (\S+)$", e.value.hint)
    assert (then is None) == given.endswith(SHAREGPT_FILE), e.value.hint
    check_dataset(shlex.split(then.group(1))[0] if then else f"sharegpt:{given}")  # the file is found


@pytest.mark.parametrize("url", ["https://huggingface.co/datasets/org/prompts",
                                 "huggingface.co/spaces/org/demo/tree/main"])
def test_a_hub_page_that_is_no_models_is_not_told_a_download_of_it(tmp_path, monkeypatch, url):
    """https://huggingface.co/datasets/ORG/NAME as MODEL was read as the model `datasets/ORG`: told `hf download
    datasets/ORG`, a repository that does not exist."""
    from helpers import in_empty_hub_cache
    from test_probes_session58_newcomer import _hint
    in_empty_hub_cache(tmp_path, monkeypatch)
    hint = _hint(url)
    assert "hf download" not in hint and "no model's page on the hub" in hint and "ORG/NAME" in hint, hint


def test_importing_infer_main_runs_no_command():
    """infer/__main__.py ran the CLI when imported (pydoc, a doctest run over the package): it exited the importer."""
    import importlib
    import sys
    sys.modules.pop("infer.__main__", None)
    module = importlib.import_module("infer.__main__")
    assert callable(module.main)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-32-be"])
def test_a_wide_input_is_told_the_iconv_that_reads_it(tmp_path, monkeypatch, encoding):
    """A UTF-32 file (its byte order mark) was told `iconv -f UTF-16`, which makes garbage of it."""
    monkeypatch.chdir(tmp_path)
    text = '{"prompt": "The weather today is"}\n'
    Path("my prompts.jsonl").write_bytes(("\ufeff" + text).encode(encoding) if encoding.endswith("be") else
                                         text.encode(encoding))
    with pytest.raises(ConfigError) as e:
        check_input_encoding(Path("my prompts.jsonl"))
    words = shlex.split(re.search(r"e\.g\. (iconv .+)$", e.value.hint).group(1))
    assert words[:5] == ["iconv", "-f", encoding[:6].upper(), "-t", "UTF-8"] and words[5:7] == ["my prompts.jsonl", ">"]
    if shutil.which("iconv") is None:
        pytest.skip("iconv is not installed")
    _shell(words)
    assert Path(words[-1]).read_text(encoding="utf-8").removeprefix("\ufeff") == text
    check_input_encoding(Path(words[-1]))  # infer reads what iconv made
