"""Probes of n-gram speculative decoding as a vLLM user drives it: drafts cut by a step's token budget and by a
small KV cache, the server's streamed chunks of several tokens, and the data-parallel driver's summed counters."""

from __future__ import annotations

import json

import pytest

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import random_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
FEW = [5, 6, 7, 8]


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=8, max_num_seqs=4),
                                dict(num_kv_blocks=30, max_model_len=48, max_num_seqs=6),
                                dict(block_size=2, num_kv_blocks=40, max_model_len=40)], ids=["budget", "kv", "bs2"])
def test_drafts_cut_by_the_budget_or_the_kv_cache_change_no_token(kw):
    path = ensure_builtin("tiny-qwen3")
    kw = {"block_size": 4, **kw}
    a, b = LLM(str(path), **kw), LLM(str(path), speculative_config=SPEC, **kw)
    prompts = random_prompts(a.engine.model_config.vocab_size, (5, 9, 14, 7, 11, 3, 20), seed=5)
    params = SamplingParams(max_new_tokens=25, ignore_eos=True, allowed_token_ids=FEW)
    assert [o.token_ids for o in b.generate(prompts, params)] == [o.token_ids for o in a.generate(prompts, params)]
    assert b.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert b.engine.block_manager.num_used_blocks == 0


def test_the_server_streams_the_same_tokens_text_and_logprobs():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    body = {"prompt": [5, 6, 7, 8, 5, 6, 7, 8], "max_tokens": 30, "allowed_token_ids": FEW, "logprobs": 1,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True,
            "temperature": 0}
    seen = {}
    for name, kw in (("plain", {}), ("spec", {"speculative_config": SPEC})):
        engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, **kw))
        with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama"))) as client:
            r = client.post("/v1/completions", json=body)
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            choices = [ch for c in chunks for ch in c.get("choices", [])]
            seen[name] = ([t for ch in choices for t in ch.get("token_ids") or []],
                          [t for ch in choices for t in (ch.get("logprobs") or {}).get("tokens") or []],
                          "".join(ch["text"] for ch in choices), chunks[-1]["usage"])
            metrics = client.get("/metrics").text
        if name == "spec":
            assert len(chunks) < 30  # some chunks carried several tokens
            assert 'infer:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny-llama",' \
                   'position="0"}' in metrics
    assert seen["spec"] == seen["plain"] and len(seen["spec"][0]) == 30


def test_data_parallel_stats_sum_the_spec_decode_counters():
    from infer.parallel.serve_engine import RayAsyncEngine
    drv = RayAsyncEngine.__new__(RayAsyncEngine)

    class R:
        def __init__(self, stats, alive=True):
            self.stats, self.alive, self.index, self.info, self.inflight = stats, alive, 0, {}, {}
    one = {"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 5, "spec_decode_num_accepted_tokens": 3,
           "spec_decode_num_accepted_tokens_per_pos": [2, 1, 0]}
    two = {"spec_decode_num_drafts": 1, "spec_decode_num_draft_tokens": 3, "spec_decode_num_accepted_tokens": 1,
           "spec_decode_num_accepted_tokens_per_pos": [1, 0, 0]}
    drv.replicas = [R(one), R(two, alive=False)]
    total = drv._aggregate()
    assert (total["spec_decode_num_drafts"], total["spec_decode_num_accepted_tokens"]) == (3, 4)
    assert total["spec_decode_num_accepted_tokens_per_pos"] == [3, 1, 0]
    drv.replicas = [R({})]
    assert "spec_decode_num_drafts" not in drv._aggregate()
