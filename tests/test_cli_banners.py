"""What a first command prints: only infer's own lines. Building a built-in model imports transformers' model
classes, which import torchao (GPTQModel's dependency), whose CUDA extensions cannot load on a CPU machine: four
lines of "Failed to load ..._C_mxfp8...so" and a torch deprecation on the first `infer run tiny-llama`; `infer
convert` also printed transformers' loading and writing bars."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _infer(args: list[str], cache) -> subprocess.CompletedProcess:
    env = {**os.environ, "INFER_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env.pop("INFER_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "infer.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_a_first_run_and_a_convert_print_only_infers_lines(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "hi", "max_new_tokens": 2}) + "\n")
    cache = tmp_path / "cache"  # empty: the built-in model is built by this command
    res = _infer(["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o.jsonl")], cache)
    assert res.returncode == 0, res.stderr
    assert [line.split(":")[0] for line in res.stderr.splitlines()] == ["infer", "infer"], res.stderr
    conv = tmp_path / ("a-folder-name-long-enough-to-pass-the-eighty-columns-rich-wraps-at-" * 2) / "conv"
    res = _infer(["convert", "tiny-llama", "-o", str(conv)], cache)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.startswith(f"Wrote {conv} (same dtype)"), res.stdout  # a long path was wrapped after "Wrote"
    # --debug hides nothing (the torchao lines show wherever torchao is installed and cannot load its extensions)
    res = _infer(["--debug", "convert", "tiny-llama", "-o", str(tmp_path / "conv2")], tmp_path / "cache2")
    assert res.returncode == 0 and "Loading weights" in res.stderr, res.stderr
