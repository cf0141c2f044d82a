"""Session 40's own probes (not a helper's): a jsonl dataset shorter than --num-prompts ran its 2 requests and
reported them as the run, with not a word that 10 were asked for (vLLM repeats requests to reach the number)."""

import json

from typer.testing import CliRunner

from infer.cli.main import app


def test_a_dataset_shorter_than_num_prompts_is_said(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"hello {i}", "max_tokens": 2}) for i in range(2)) + "\n")
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--out", str(tmp_path / "o"), "-c", "1", "-q",
                                   "--dataset", f"jsonl:{data}", "--num-prompts", "10"])
    assert res.exit_code == 0, res.output
    assert "--num-prompts 10, but jsonl:" in res.output and "gives 2 usable requests" in res.output
    [r] = json.loads((tmp_path / "o" / "results.json").read_text())
    assert r["completed"] == 2
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--out", str(tmp_path / "o2"), "-c", "1", "-q",
                                   "--dataset", f"jsonl:{data}", "--num-prompts", "2"])
    assert res.exit_code == 0 and "usable request" not in res.output, res.output
