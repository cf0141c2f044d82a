"""Session 57 probes of feature combinations: mixed LoRA adapters (on Phi-3's fused qkv_proj / gate_up_proj and on
Mixtral's attention), prefix-cache hits, draft-model speculation, the fp8 KV cache, chunked prefills and
preemption (a tiny KV cache), with penalties, logprobs, n > 1, min_tokens and stop ids, beam search and the server's
streamed n > 1 replies. Every feature here but the fp8 cache is lossless, so each run is held to the engine's plain
path (no speculation, no prefix cache, a roomy cache) on the same weights and KV dtype: identical greedy tokens."""

from __future__ import annotations

import json

import pytest

from infer import LLM, BeamSearchParams, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import hf_float, save_adapter

TARGETS = {"tiny-phi3": ["qkv_proj", "gate_up_proj", "o_proj"], "tiny-mixtral": ["q_proj", "o_proj"],
           "tiny-llama": ["q_proj", "v_proj", "down_proj"]}
NAMES = ["a", None, "b", "a", "a", "b"]
TIGHT = dict(num_kv_blocks=12, max_num_batched_tokens=8)  # preemptions and chunked prefills


def draft(name: str) -> dict:
    return {"method": "draft_model", "model": name, "num_speculative_tokens": 3}


def prompts() -> list[list[int]]:
    """Four prompts that repeat themselves (n-gram drafts find matches), two sharing a prefix with the first two."""
    ps = [p + p[:4] + p for p in random_prompts(512, (6, 9, 5, 11), seed=3)]
    return ps + [ps[0][:12] + [7, 8], ps[1][:8] + [9]]


def adapters(name: str, root) -> tuple:
    base = ensure_builtin(name)
    hf = hf_float(base)
    t = TARGETS[name]
    return base, {"a": str(save_adapter(hf, root / "a", seed=1, r=8, lora_alpha=16, target_modules=t,
                                        lora_dropout=0.0)),
                  "b": str(save_adapter(hf, root / "b", seed=2, r=4, lora_alpha=8, target_modules=t[:1],
                                        lora_dropout=0.0))}


def options(ad: dict, **kw) -> dict:
    return {**dict(block_size=4, max_model_len=48, loras=ad, max_loras=2, max_lora_rank=8, max_num_seqs=4,
                   max_logprobs=5), **kw}


def completions(llm, params) -> list:
    """Each request's completions: tokens, finish reason and logprob records (rounded: a verify step's batch sums in
    another order than a decode's), and its prompt logprobs."""
    def rec(r):
        tops = sorted(t["token_id"] for t in r.get("top_logprobs") or [])
        return r["token_id"], r["rank"], round(r["logprob"], 3), tops
    return [([(list(c.token_ids), c.finish_reason, [rec(r) for r in c.logprobs or []]) for c in o.outputs],
             [r and r["token_id"] for r in o.prompt_logprobs or []])
            for o in llm.generate(prompts(), params, lora=NAMES)]


def check_against_plain(base, opts: dict, params, **features) -> dict:
    """The plain path's completions equal those with `features`, run twice (the second run hits the prefix cache);
    no block is left in use. Returns the engine's stats."""
    with LLM(str(base), enable_prefix_caching=False, **opts) as llm:
        want = completions(llm, params)
    with LLM(str(base), **features, **opts) as llm:
        assert completions(llm, params) == want
        assert completions(llm, params) == want
        assert llm.engine.block_manager.num_used_blocks == 0
        return llm.engine.stats()


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("name", ["tiny-phi3", "tiny-mixtral"])
def test_fused_and_moe_bases_with_adapters_prefix_cache_draft_model_and_preemption_equal_the_plain_path(name, kv,
                                                                                                     tmp_path):
    base, ad = adapters(name, tmp_path)
    s = check_against_plain(base, options(ad, kv_cache_dtype=kv), SamplingParams(max_new_tokens=10, ignore_eos=True),
                            speculative_config=draft(name), **TIGHT)
    assert s["spec_decode_num_accepted_tokens"] > 0 and s["prefix_cache_hits"] > 0


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.8, logprobs=2),
    dict(presence_penalty=1.5, frequency_penalty=1.0, logprobs=1, prompt_logprobs=2),
    dict(n=2, logprobs=1),
    dict(logit_bias={5: 3.0}, logprobs=3),
], ids=["repetition", "presence-frequency-prompt-logprobs", "n2", "logit-bias"])
def test_penalties_logprobs_and_n_with_a_draft_model_prefix_cache_and_preemption_equal_the_plain_path(params, tmp_path):
    """A verify step scores each drafted position with the penalties of the tokens before it (drafts included)."""
    base, ad = adapters("tiny-llama", tmp_path)
    s = check_against_plain(base, options(ad), SamplingParams(max_new_tokens=10, ignore_eos=True, **params),
                            speculative_config=draft("tiny-llama"), **TIGHT)
    assert s["spec_decode_num_accepted_tokens"] > 0 and s["num_preemptions"] > 0


def test_min_tokens_with_stop_ids_drafted_early_end_where_the_plain_path_ends(tmp_path):
    """The draft model (the target itself) drafts each request's stop ids before min_tokens: the verify step must
    mask them at those positions as a decode step does."""
    base, ad = adapters("tiny-llama", tmp_path)
    opts = options(ad)
    with LLM(str(base), enable_prefix_caching=False, **opts) as llm:
        free = completions(llm, SamplingParams(max_new_tokens=10, ignore_eos=True))
    stops = sorted({c[0][0][i] for c, _ in free for i in (1, 3)})
    s = check_against_plain(base, opts, SamplingParams(max_new_tokens=10, stop_token_ids=stops, min_tokens=5),
                            speculative_config=draft("tiny-llama"), **TIGHT)
    assert s["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_beam_search_with_adapters_prefix_cache_and_preemption_equals_the_plain_path(kv, tmp_path):
    base, ad = adapters("tiny-phi3", tmp_path)
    opts = options(ad, kv_cache_dtype=kv, max_logprobs=6)  # (beam search asks for 2 * beam_width)

    def beams(llm):
        out = llm.beam_search(prompts()[:4], BeamSearchParams(beam_width=3, max_tokens=5), lora=NAMES[:4])
        return [[(list(s.tokens), round(s.cum_logprob, 3)) for s in o.sequences] for o in out]
    with LLM(str(base), enable_prefix_caching=False, **opts) as llm:
        want = beams(llm)
    with LLM(str(base), num_kv_blocks=20, max_num_batched_tokens=8, **opts) as llm:
        assert beams(llm) == want
        assert beams(llm) == want
        assert llm.engine.stats()["prefix_cache_hits"] > 0


def _streamed(text: str, chat: bool) -> dict:
    """index -> (joined text, finish reason, [(token, logprob)]) of a streamed reply."""
    got: dict = {}
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:])["choices"]:
            text, finish, lps = got.get(c["index"], ("", None, []))
            text += ((c.get("delta") or {}).get("content") or "") if chat else c.get("text", "")
            got[c["index"]] = (text, c.get("finish_reason") or finish, lps + _tokens(c.get("logprobs")))
    return got


def _tokens(lp) -> list:
    if not lp:
        return []
    if "content" in lp:
        return [(t["token"], round(t["logprob"], 3)) for t in lp["content"]]
    return [(t, round(p, 3)) for t, p in zip(lp["tokens"], lp["token_logprobs"])]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_servers_streamed_n2_replies_with_speculation_equal_the_plain_whole_replies(chat):
    """Speculation hands the server several tokens a step; the streamed deltas of both choices (and their logprobs)
    join to the plain engine's whole reply."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine

    def client(**kw):
        engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4, max_num_seqs=4, **kw))
        return TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama")))
    body = {"max_tokens": 10, "temperature": 0, "n": 2, "ignore_eos": True}
    if chat:
        url, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Hello hello there"}],
                                             "logprobs": True, "top_logprobs": 2}
    else:
        url, body = "/v1/completions", {**body, "prompt": "Hello hello hello there hello", "logprobs": 2}
    with client(enable_prefix_caching=False) as c:
        whole = c.post(url, json=body).json()["choices"]
    want = {ch["index"]: (ch["message"]["content"] if chat else ch["text"], ch["finish_reason"],
                          _tokens(ch["logprobs"])) for ch in whole}
    assert len(want) == 2 and all(len(w[2]) == 10 for w in want.values())
    with client(speculative_config=draft("tiny-llama"), num_kv_blocks=20, max_num_batched_tokens=8) as c:
        for _ in range(2):  # the second: a prefix-cache hit
            r = c.post(url, json={**body, "stream": True})
            assert r.status_code == 200, r.text
            assert _streamed(r.text, chat) == want
