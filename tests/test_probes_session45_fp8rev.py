"""Session 45 probes of the fp8 KV cache (--kv-cache-dtype) and the served beam search."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import reference as ref
from test_triton_kernels import DEV, ops  # noqa: F401


def test_gpu_e2e_roofline_counts_an_fp8_caches_one_byte(tmp_path):
    """gpu_e2e --kv-cache-dtype fp8: infer's decode floor reads 1 byte a KV element (it counted the model's 2);
    transformers' rows keep their cache in the model's dtype."""
    from infer.bench import e2e_models
    from infer.bench import gpu_e2e as e2e
    cfg = e2e_models.hf_config("llama-2-7b")
    runs = {kv: e2e.ShapeRun("llama-2-7b", cfg, None, e2e.parse_args(["--out", str(tmp_path), "--kv-cache-dtype", kv]),
                             1e12, "cuda", torch.float16) for kv in ("auto", "fp8", "fp8_e5m2")}
    kv_term = {kv: run.roofline(0)["step_bytes"] for kv, run in runs.items()}
    assert kv_term["fp8"] == kv_term["fp8_e5m2"] == kv_term["auto"] / 2 > 0
    assert runs["fp8"].roofline(0, kv_dtype=torch.float16)["step_bytes"] == kv_term["auto"]


def test_data_parallel_run_announces_the_kv_cache_dtype(tmp_path):
    """infer run --data-parallel --kv-cache-dtype fp8 says its replicas' KV cache is float8, as one engine's banner
    does (it named only the model's dtype)."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"prompt": "hi", "max_new_tokens": 2}) + "\n")
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "--data-parallel", "2",
                                   "--device", "cpu", "--block-size", "4", "--kv-cache-dtype", "fp8_e5m2"])
    assert res.exit_code == 0, res.output
    assert "tokens of float8_e5m2 each" in res.output, res.output


def test_infer_run_beam_lines_without_max_tokens_fit_the_context(tmp_path):
    """A use_beam_search line without max_tokens gets the run's --max-new-tokens (256) as a plain line does, at
    most the context left (a plain line is cut there): it failed with "its beams outgrow the context"."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    msgs = [{"role": "user", "content": "hello there"}]
    bodies = {"chat": ("/v1/chat/completions", {"messages": msgs, "n": 2, "use_beam_search": True}),
              "cmpl": ("/v1/completions", {"prompt": list(range(5, 57)), "n": 2, "use_beam_search": True,
                                           "ignore_eos": True}),
              "plain": ("/v1/completions", {"prompt": list(range(5, 57)), "ignore_eos": True})}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": k, "method": "POST", "url": u, "body": b}) + "\n"
                           for k, (u, b) in bodies.items()))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--block-size", "4",
                                   "--max-model-len", "64", "--output-format", "openai"])
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert res.exit_code == 0 and all(r["error"] is None for r in records.values()), records
    cmpl, plain = records["cmpl"]["response"]["body"], records["plain"]["response"]["body"]
    assert len(cmpl["choices"]) == 2 and cmpl["usage"]["completion_tokens"] == 2 * 12
    assert plain["usage"]["completion_tokens"] == 12
    chat = records["chat"]["response"]["body"]
    assert len(chat["choices"]) == 2 and chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"] // 2 <= 64


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_nan_key_stays_nan_in_a_float8_cache_as_the_reference_stores_it(ops, dtype):
    """A NaN in K or V (a model that overflowed) is stored as NaN, as reference.to_cache (torch's cast) stores it, so
    that the non-finite logits are caught; fp8.to_cache's saturation (tl.minimum, NaN-dropping) wrote +-448 / 57344
    instead: finite, wrong attention. inf still saturates."""
    t, hk, d, bs, nb = 3, 2, 16, 4, 2
    k, v = torch.zeros(t, hk, d, device=DEV), torch.zeros(t, hk, d, device=DEV)
    k[0, 0, 3], k[1, 1, 0], v[2, 0, 5], v[0, 1, 1] = float("nan"), float("-nan"), float("nan"), float("inf")
    slots = torch.tensor([0, 5, 6], device=DEV)
    got = [torch.zeros(nb, bs, hk, d, dtype=dtype, device=DEV) for _ in range(2)]
    want = [c.cpu().clone() for c in got]
    ops[0].store_kv(k, v, *got, slots)
    ref.store_kv(k.cpu(), v.cpu(), *want, slots.cpu())
    for g_c, w_c in zip(got, want):
        g, w = g_c.cpu().float(), w_c.float()
        assert torch.equal(g.isnan(), w.isnan()) and int(w.isnan().sum()) >= 1
        assert torch.equal(g.nan_to_num(0.0), w.nan_to_num(0.0))


def test_infer_run_beam_line_keeps_the_end_of_a_truncated_prompt(tmp_path):
    """A use_beam_search line with truncate_prompt_tokens searches from the prompt's last tokens, as a plain line
    and the server do (it searched from the whole prompt and failed: its beams outgrow the context)."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    body = {"prompt": list(range(5, 105)), "max_tokens": 3, "truncate_prompt_tokens": 10, "ignore_eos": True,
            "return_token_ids": True}
    lines = [{"custom_id": "beam", "url": "/v1/completions", "body": {**body, "n": 2, "use_beam_search": True}},
             {"custom_id": "plain", "url": "/v1/completions", "body": body}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--block-size", "4",
                                   "--max-model-len", "64", "--output-format", "openai"])
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert res.exit_code == 0 and all(r["error"] is None for r in records.values()), records
    beam = records["beam"]["response"]["body"]
    assert beam["usage"]["prompt_tokens"] == records["plain"]["response"]["body"]["usage"]["prompt_tokens"] == 10
    assert [c["prompt_token_ids"] for c in beam["choices"]] == [list(range(95, 105))] * 2
