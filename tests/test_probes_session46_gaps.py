"""Probes of the forty-sixth session (known gaps): what `infer serve`'s banner names, iteration_tokens_total with
speculative decoding, warmup's worst case with a verify step, data-parallel requests not yet on a replica, and the
memory a long prefill takes on a CPU under --memory-limit."""

from __future__ import annotations

import json

import pytest

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


class _NoUvicorn:
    def run(self, sockets=None):  # the banner is printed before this: serving nothing, it returns at once
        return None


def test_serve_banner_names_the_kv_cache_dtype_and_speculative_decoding(monkeypatch):
    """`infer run`'s banner said "KV cache N blocks x B tokens of float8_e5m2, max length L"; `infer serve`'s only
    "KV N blocks", with neither the cache's type nor speculative decoding."""
    from typer.testing import CliRunner

    import infer.serve.app  # noqa: F401  (imported first: its own uvicorn_server stays the real one)
    from infer.cli.main import app
    from infer.serve import lifecycle
    monkeypatch.setattr(lifecycle, "uvicorn_server", lambda *a, **k: _NoUvicorn())  # what cli/serve.py calls
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--device", "cpu", "--kv-cache-dtype",
                                   "fp8_e5m2", "--speculative-config", json.dumps(SPEC)])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("infer: serving"))
    assert "tokens of float8_e5m2, max length" in line, line
    assert "n-gram speculative decoding (3 draft tokens)" in line, line


def test_run_banner_names_speculative_decoding(tmp_path):
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o.jsonl"), "--max-new-tokens",
                                   "2", "--speculative-config", json.dumps(SPEC)])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("infer: tiny-llama"))
    assert "n-gram speculative decoding (3 draft tokens)" in line and " of " not in line, line


def test_data_parallel_banners_name_the_kv_cache_dtype_and_speculative_decoding():
    """`infer serve --data-parallel`'s banner said only "KV N blocks each"; run's and serve's replica banners now say
    what one engine's says, for each replica."""
    from infer.cli.banner import replica_traits
    from infer.engine.config import EngineConfig
    infos = [{"dtype": "float32", "num_blocks": 40, "kv_cache_dtype": "float8_e5m2", "max_model_len": 256}] * 2
    cfg = EngineConfig("tiny-llama", block_size=4, kv_cache_dtype="fp8_e5m2", speculative_config=SPEC)
    assert replica_traits(infos, cfg) == ("float32, KV cache 40 blocks x 4 tokens of float8_e5m2 each, max length 256, "
                                          "n-gram speculative decoding (3 draft tokens)")
    plain = EngineConfig("tiny-llama", block_size=4)
    assert replica_traits(infos, plain) == "float32, KV cache 40 blocks x 4 tokens each, max length 256"

def _families(base: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}


def _sum(families: dict, name: str, sample: str) -> float:
    return sum(s.value for s in families[name].samples if s.name == sample)


def test_iteration_tokens_count_accepted_drafts_not_rejected_ones():
    """vLLM's iteration_tokens_total observes a step's prompt tokens and the tokens it generated (a speculative row:
    its accepted drafts and the target's own token); infer observed every token the step scheduled, the drafts it
    rejected too. Every token is computed once: each prompt, and every generated token but the last."""
    httpx = pytest.importorskip("httpx")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, max_num_seqs=4, max_num_batched_tokens=256,
                                    speculative_config=SPEC))
    # every token of the vocabulary (512) in the prompt: whatever a step samples, the n-gram lookup finds drafts
    prompts = [list(range(3, 512)), list(range(511, 2, -1))]
    made = 12
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": prompts, "max_tokens": made, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        families = _families(base)
    stats = engine.stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > accepted  # some drafts were rejected: they are no tokens of the step
    name = "infer:iteration_tokens_total"
    assert _sum(families, name, name + "_sum") == sum(map(len, prompts)) + len(prompts) * (made - 1)
    engine.close()


def test_warmups_worst_case_runs_a_verify_step_with_every_draft(monkeypatch):
    """With --speculative-config the measured worst case ran no verify step (its draft rows' logits were only added
    by formula): it now runs one, a full batch near max_length with num_speculative_tokens drafts each as far as the
    token budget goes, and adds nothing by formula on top of what it measured."""
    from infer.cli.warmup_plan import measured_plan
    from infer.engine import profile
    from infer.engine.config import EngineConfig
    from infer.engine.model_runner import ModelRunner
    spec = {**SPEC, "num_speculative_tokens": 4}
    verified = []
    real = ModelRunner.verify

    def verify(self, batch):
        verified.append((list(batch.num_new_tokens), [len(s.draft_token_ids) for s in batch.seqs],
                         max(len(s) for s in batch.seqs)))
        return real(self, batch)
    monkeypatch.setattr(ModelRunner, "verify", verify)
    kw = dict(max_num_seqs=8, max_model_len=128, memory_limit="64MB", max_num_batched_tokens=36)
    measured_plan(EngineConfig(model="tiny-llama", speculative_config=spec, **kw), 128, 8)
    assert verified, "no verify step was measured"
    tokens, drafts, longest = verified[-1]
    assert sum(tokens) == 36 and drafts == [4] * 7 + [0]  # the budget: 8 own tokens and 28 drafts
    assert longest + 4 <= 128  # the drafts fit the context
    monkeypatch.setattr(profile, "_peak_activations", lambda *a, **k: 0)
    plain, _ = measured_plan(EngineConfig(model="tiny-llama", **kw), 128, 8)
    with_spec, _ = measured_plan(EngineConfig(model="tiny-llama", speculative_config=spec, **kw), 128, 8)
    assert with_spec.activation_peak_bytes == plain.activation_peak_bytes  # measured, not added again


def test_data_parallel_counts_requests_no_replica_has_counted_yet_as_waiting():
    """--data-parallel: a request the front accepted and the driver had not routed yet, or routed and sent to a
    replica that had not answered since, was in no replica's num_requests_waiting (nor the front's in
    num_requests_in_flight): /metrics' running+waiting showed fewer requests than the server held. They now wait on
    the replica they go (or went) to until its figures count them."""
    import asyncio
    import threading

    from infer.engine.sampling_params import SamplingParams
    from helpers import metric_families as _samples
    from helpers import samples_by_engine as _by_engine
    from test_probes_session45_dpmet import _dp_server
    replicas, aengine, server = _dp_server()
    entered, gate = threading.Event(), threading.Event()
    real = replicas[0].serve_step

    def gated(wires, aborts):  # replica 0 holds the driver (the fake ray runs a call in it) until the gate opens
        if wires:
            entered.set()
            gate.wait(60)
        return real(wires, aborts)
    replicas[0].serve_step = gated
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    aengine.start()

    async def scenario():
        queue, loop = asyncio.Queue(), asyncio.get_running_loop()
        aengine.add("a", [5, 17, 99], params, None, queue)  # routed to replica 0, sent; its answer is held
        assert await loop.run_in_executor(None, entered.wait, 30)
        aengine.add("b", [6, 7], params, None, queue)  # the driver is held: not routed (it would go to replica 1)
        held = _samples(server.metrics.render().decode())
        gate.set()
        finished = set()
        while len(finished) < 2:
            out = await asyncio.wait_for(queue.get(), 60)
            if out.finished:
                finished.add(out.request_id)
        return held

    try:
        held = asyncio.run(scenario())
    finally:
        gate.set()
        aengine.shutdown(5)
    assert _by_engine(held, "infer:num_requests_waiting") == {"0": 1.0, "1": 1.0}, held
    assert _by_engine(held, "infer:num_requests_in_flight") == {"0": 1.0, "1": 1.0}, held
    assert server.stats()["num_waiting"] == 0 and aengine.stats["num_waiting"] == 0
    assert all(e["num_waiting"] == e["num_in_flight"] == 0 for e in aengine.stats["engines"])


def test_cpu_attention_after_a_context_bounds_its_mask(monkeypatch):
    """A chunked prefill's later chunk (n queries after a context, L keys) built one n x L boolean mask, which torch's
    CPU SDPA copied to floats: 19 MB for 1,928 queries over 2,008 keys, outside the memory plan (a tiny-llama run
    under --memory-limit grew well past it with long prompts). The queries now go in row chunks whose mask stays
    within 2^17 entries; the output is the same causal attention."""
    import torch

    from infer.kernels import reference
    sizes = []
    real = reference.F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None:
            sizes.append(attn_mask.numel())
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(reference.F, "scaled_dot_product_attention", sdpa)
    g = torch.Generator().manual_seed(0)
    offset, n, hq, hk, d = 1500, 700, 4, 2, 8
    q = torch.randn(n, hq, d, generator=g)
    k, v = torch.randn(offset + n, hk, d, generator=g), torch.randn(offset + n, hk, d, generator=g)
    out = reference._attend(q, k, v, 0.5, offset)
    assert sizes and max(sizes) <= 1 << 17, sizes
    qd, kd, vd = q.double(), k.double().repeat_interleave(hq // hk, 1), v.double().repeat_interleave(hq // hk, 1)
    scores = torch.einsum("qhd,khd->hqk", qd, kd) * 0.5
    pos = torch.arange(offset, offset + n)[:, None]
    scores = scores.masked_fill(torch.arange(offset + n)[None] > pos, float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd)
    assert torch.allclose(out.double(), want, atol=1e-5)
