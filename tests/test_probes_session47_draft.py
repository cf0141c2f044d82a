"""Draft-model speculative decoding (vLLM's speculative_config {"model": DRAFT, "num_speculative_tokens": k}, method
"draft_model"): the options and refusals, the draft's own KV cache in the target's block layout, and the engine's
outputs: greedy tokens equal a run without speculation token for token (and transformers'), in batches that mix
prefill chunks and decodes, under preemption, with prefix-cache hits, n > 1, adapters, penalties, a grammar, stops
and max_tokens; with the target as its own draft nearly every draft is accepted."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.speculative import parse_speculative_config
from infer.errors import ConfigError

from helpers import hf_greedy, random_prompts
from helpers import plain_llm as plain, tiny_llama_path as path  # noqa: F401 (fixtures)

K = 3


def draft_spec(model, k: int = K) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def selfdraft(path):
    """The target as its own draft (float32): its greedy drafts are the target's own tokens."""
    return LLM(str(path), block_size=4, speculative_config=draft_spec(path))


@pytest.fixture(scope="module")
def other(path):
    """Another random tiny model (same vocabulary) as the draft: its drafts are mostly rejected."""
    return LLM(str(path), block_size=4, speculative_config=draft_spec("tiny-qwen2"))


def stats(llm) -> dict:
    return llm.engine.stats()


def no_leaks(llm):
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


# ------------------------------------------------------------------ options and refusals
def test_a_model_key_means_a_draft_model_as_vllm_infers_it(path):
    assert parse_speculative_config({"model": "tiny-qwen2", "num_speculative_tokens": 2}) == \
        {"method": "draft_model", "model": "tiny-qwen2", "num_speculative_tokens": 2}
    assert parse_speculative_config('{"method": "draft_model", "model": "x", "num_speculative_tokens": 4}') == \
        {"method": "draft_model", "model": "x", "num_speculative_tokens": 4}
    assert parse_speculative_config({"model": path, "num_speculative_tokens": 1})["model"] == str(path)  # a Path
    assert parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2})["method"] == "ngram"
    from infer.engine.speculative import SpeculativeConfig
    typed = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="tiny-qwen2")
    assert parse_speculative_config(typed) == {"method": "draft_model", "model": "tiny-qwen2",
                                               "num_speculative_tokens": 2}
    cfg = EngineConfig("tiny-llama", speculative_config=draft_spec("tiny-qwen2"))
    assert cfg.speculative_config["method"] == "draft_model" and not cfg.use_overlap()


@pytest.mark.parametrize("value, message", [
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "unknown key(s) prompt_lookup_max"),
    ({"model": "x"}, "num_speculative_tokens must be an integer of at least 1, got None"),
    ({"model": "x", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "draft_model", "model": "", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "mtp", "model": "x", "num_speculative_tokens": 2}, "is not supported"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "takes no draft model"),
])
def test_a_wrong_draft_config_is_refused_naming_the_problem(value, message):
    with pytest.raises(ConfigError, match="speculative-config") as e:
        EngineConfig("tiny-llama", speculative_config=value)
    assert message in str(e.value)


def _copy_with(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_draft_of_another_vocabulary_is_refused_and_one_of_a_shorter_context_taken(tmp_path, path):
    small_vocab = _copy_with(path, tmp_path / "v", vocab_size=256)
    with pytest.raises(ConfigError) as e:
        LLM(str(path), speculative_config=draft_spec(small_vocab))
    assert "vocabulary of 256 tokens, the target model 512" in str(e.value) and e.value.hint
    short = _copy_with(path, tmp_path / "s", max_position_embeddings=32)
    # (as vLLM: a sequence past the draft's context goes on without drafts; test_probes_session50_draft)
    llm = LLM(str(path), max_model_len=64, block_size=4, speculative_config=draft_spec(short))
    assert llm.engine.drafter.context == 32
    assert llm.generate([[5, 6, 7] * 9], greedy(10))[0].token_ids == hf_greedy(path, [5, 6, 7] * 9, 10)
    llm = LLM(str(path), max_model_len=32, block_size=4, speculative_config=draft_spec(short))  # within it: taken
    assert llm.generate([[5, 6, 7]], greedy(8))[0].token_ids == hf_greedy(path, [5, 6, 7], 8)
    with pytest.raises(Exception, match="speculative-config model 'no-such-draft'"):
        LLM(str(path), speculative_config=draft_spec("no-such-draft"))


# ------------------------------------------------------------------ the draft's KV cache and the memory plan
def test_the_draft_cache_has_the_targets_block_layout_and_is_zeroed_with_it(selfdraft):
    eng = selfdraft.engine
    draft, target = eng.drafter.kv_cache, eng.runner.kv_cache
    assert draft.shape[2:4] == target.shape[2:4] and draft.data_ptr() != target.data_ptr()
    draft[:, :, 1].fill_(1.0)
    target[:, :, 1].fill_(1.0)
    eng.runner.zero_blocks([1])
    assert not draft[:, :, 1].any() and not target[:, :, 1].any()


def test_the_memory_plan_counts_the_drafts_weights_kv_and_activations(path, plain):
    from infer.memory.sizes import kv_bytes_per_token, weights_bytes
    llm = LLM(str(path), block_size=4, speculative_config=draft_spec("tiny-qwen3"))
    p, q = plain.engine.memory_plan, llm.engine.memory_plan
    draft = llm.engine.drafter
    assert q.kv_bytes_per_token == p.kv_bytes_per_token + kv_bytes_per_token(draft.model_config, torch.float32)
    assert q.weights_bytes == p.weights_bytes + weights_bytes(draft.model)
    assert q.activation_peak_bytes > p.activation_peak_bytes
    from infer.memory.plan import make_plan, start_activation_bytes
    eng = llm.engine
    args = (eng.config, eng.model_config, torch.float32, torch.device("cpu"), q.weights_bytes, 2 ** 20, 64, 1, 64)
    budget = 2 ** 20 + q.weights_bytes + 8 * 2 ** 20 + 1000 * p.kv_block_bytes
    with_draft = make_plan(*args, budget=budget, draft_config=draft.model_config)
    alone = make_plan(*args, budget=budget)
    assert with_draft.kv_block_bytes == q.kv_block_bytes and with_draft.kv_blocks < alone.kv_blocks
    assert start_activation_bytes(eng.config, eng.model_config, eng.runner.model, torch.float32, 64,
                                  draft.model_config) > \
        start_activation_bytes(eng.config, eng.model_config, eng.runner.model, torch.float32, 64)


# ------------------------------------------------------------------ greedy: token for token
def test_greedy_equals_plain_and_transformers_with_nearly_every_draft_accepted(path, plain, selfdraft, other):
    prompts = random_prompts(plain.engine.model_config.vocab_size, (3, 12, 25), seed=0) + [[5, 6, 7, 8] * 6]
    params = greedy(24)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [hf_greedy(path, p, 24) for p in prompts] == want
    before = stats(selfdraft)
    assert [o.token_ids for o in selfdraft.generate(prompts, params)] == want
    after = stats(selfdraft)
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert drafted > 30 and accepted >= 0.95 * drafted, after
    assert sum(after["spec_decode_num_accepted_tokens_per_pos"]) == after["spec_decode_num_accepted_tokens"]
    assert [o.token_ids for o in other.generate(prompts, params)] == want
    assert stats(other)["spec_decode_num_drafts"] > 0 and stats(other)["spec_decode_num_draft_tokens"] > 30
    no_leaks(selfdraft)
    no_leaks(other)


@pytest.mark.parametrize("draft", ["self", "tiny-qwen3"])
def test_chunked_prefills_mixed_with_decodes(path, plain, draft):
    """A small token budget: prompts are prefilled in chunks while others decode; the draft's KV follows every
    chunk (no catch-up prefill), so the self-draft still has its drafts accepted."""
    kw = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    llm = LLM(str(path), speculative_config=draft_spec(path if draft == "self" else draft), **kw)
    prompts = random_prompts(plain.engine.model_config.vocab_size, (5, 19, 14, 30, 3, 11), seed=2)
    want = [o.token_ids for o in LLM(str(path), **kw).generate(prompts, greedy(20))]
    assert [o.token_ids for o in llm.generate(prompts, greedy(20))] == want
    s = stats(llm)
    if draft == "self":
        assert s["spec_decode_num_accepted_tokens"] >= 0.95 * s["spec_decode_num_draft_tokens"] > 0, s
    no_leaks(llm)


def test_the_draft_feeds_only_what_its_kv_lacks_each_step(path, plain, monkeypatch):
    """Each step the draft's first forward holds the step's own tokens and at most one more a sequence (the last
    accepted draft after a step that accepted all), never a catch-up prefill: not after a prefix-cache hit (it
    starts at the cached prefix), nor after a preemption (it recomputes with the target)."""
    from infer.engine.draft import DraftRunner
    fed, real_propose, real_forward = [], DraftRunner.propose, DraftRunner._forward

    def propose(self, batch):
        own = sum(n - len(s.draft_token_ids) for s, n in zip(batch.seqs, batch.num_new_tokens))
        fed.append([own, len(batch.seqs), None])
        return real_propose(self, batch)

    def forward(self, feeds, rows):
        if fed[-1][2] is None:
            fed[-1][2] = sum(len(tokens) for _, _, tokens in feeds)
        return real_forward(self, feeds, rows)
    monkeypatch.setattr(DraftRunner, "propose", propose)
    monkeypatch.setattr(DraftRunner, "_forward", forward)
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=14, max_model_len=48,
              speculative_config=draft_spec(path))
    prompts = random_prompts(plain.engine.model_config.vocab_size, (10, 7, 13), seed=13)
    first = llm.generate(prompts[:1], greedy(14))[0]
    again = [prompts[0] + first.token_ids[:10]] + prompts[1:]
    assert [o.token_ids for o in llm.generate(again, greedy(20))] == \
        [o.token_ids for o in plain.generate(again, greedy(20))]
    s = stats(llm)
    assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] >= 16
    assert all(tokens <= own + seqs for own, seqs, tokens in fed), fed


def _noisy_copy(src, dst, scale: float):
    """A copy of the model whose matrices (not the embeddings) carry some noise: a draft that agrees with the
    target on some tokens only."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(0)
    for f in dst.glob("*.safetensors"):
        tensors = {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)
                   if v.dim() == 2 and "embed" not in k else v for k, v in load_file(f).items()}
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


def test_the_draft_kv_holds_exactly_the_tokens_that_stay(tmp_path, path, plain):
    """A draft that agrees with the target now and then: every draft it makes is its argmax given the sequence's
    real tokens (its KV of a rejected draft's position is never taken for the token that replaced it), so the
    counters are what teacher-forced drafting predicts, step by step."""
    draft, k, n = _noisy_copy(path, tmp_path / "d", 0.05), 2, 40
    llm = LLM(str(path), block_size=4, speculative_config=draft_spec(draft, k))
    prompt = random_prompts(plain.engine.model_config.vocab_size, (9,), seed=14)[0]
    out = llm.generate([prompt], greedy(n))[0].token_ids
    assert out == plain.generate([prompt], greedy(n))[0].token_ids
    full = prompt + out
    rec = LLM(str(draft), block_size=4).generate([full], SamplingParams(max_new_tokens=1, prompt_logprobs=1))[0]
    guess = {i: r["top_logprobs"][0]["token_id"] for i, r in enumerate(rec.prompt_logprobs) if i}
    at, made, drafted, accepted = len(prompt) + 1, 1, 0, 0  # the prefill's step made the first token
    while made < n:
        j = min(k, n - made - 1)
        m = 0
        while m < j and guess[at + m] == full[at + m]:
            m += 1
        drafted, accepted, made, at = drafted + j, accepted + m, made + m + 1, at + m + 1
    s = stats(llm)
    assert (s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]) == (drafted, accepted)
    assert 0 < accepted < drafted


def test_preemption_resets_the_draft_kv_and_changes_nothing(path):
    kw = dict(block_size=4, num_kv_blocks=24, max_model_len=64)
    a, b = LLM(str(path), **kw), LLM(str(path), speculative_config=draft_spec(path), **kw)
    prompts = random_prompts(a.engine.model_config.vocab_size, (5, 9, 14, 7, 11), seed=5)
    want = [o.token_ids for o in a.generate(prompts, greedy(30))]
    assert [o.token_ids for o in b.generate(prompts, greedy(30))] == want
    s = stats(b)
    assert s["num_preemptions"] > 0 and s["spec_decode_num_accepted_tokens"] >= 0.9 * s["spec_decode_num_draft_tokens"]
    no_leaks(b)


def test_prefix_cache_hits_start_the_draft_at_the_cached_prefix(path, plain, selfdraft):
    prompt = random_prompts(plain.engine.model_config.vocab_size, (10,), seed=6)[0]
    first = selfdraft.generate([prompt], greedy(30))[0]
    assert first.token_ids == plain.generate([prompt], greedy(30))[0].token_ids
    again = (prompt + first.token_ids)[:36]
    bm, before = selfdraft.engine.block_manager, stats(selfdraft)
    hits = bm.prefix_hits
    out = selfdraft.generate([again], greedy(20))[0]
    assert out.token_ids == plain.generate([again], greedy(20))[0].token_ids
    assert bm.prefix_hits - hits == 32
    after = stats(selfdraft)
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted >= 0.8 * drafted  # the cached blocks' draft KV was the draft's own


def test_n_samples_and_seeded_sampling_are_reproducible(path):
    params = SamplingParams(n=2, max_new_tokens=20, temperature=0.8, seed=11, ignore_eos=True)
    prompts = [[9, 10, 11], [12, 13, 14, 15]]
    runs = []
    for _ in range(2):
        llm = LLM(str(path), block_size=4, speculative_config=draft_spec(path))
        runs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)])
        assert stats(llm)["spec_decode_num_accepted_tokens"] > 0
        no_leaks(llm)
    assert runs[0] == runs[1] and all(len(c) == 20 for r in runs[0] for c in r)


def test_greedy_n_samples_equal_plain(plain, other):
    params = SamplingParams(n=3, max_new_tokens=12, ignore_eos=True, temperature=0)
    want = [[c.token_ids for c in o.outputs] for o in plain.generate([[4, 5, 6, 7]], params)]
    assert [[c.token_ids for c in o.outputs] for o in other.generate([[4, 5, 6, 7]], params)] == want


def test_logprobs_prompt_logprobs_and_beam_search_equal_plain(plain, selfdraft):
    import math

    from infer.engine.beam import BeamSearchParams
    prompts = random_prompts(plain.engine.model_config.vocab_size, (7, 15), seed=8)
    params = greedy(20, logprobs=2, prompt_logprobs=1)
    for a, b in zip(plain.generate(prompts, params), selfdraft.generate(prompts, params)):
        assert a.token_ids == b.token_ids and len(b.logprobs) == 20
        for x, y in zip(a.logprobs, b.logprobs):
            assert x["token_id"] == y["token_id"] and math.isclose(x["logprob"], y["logprob"], abs_tol=1e-4)
        assert [r and r["token_id"] for r in a.prompt_logprobs] == [r and r["token_id"] for r in b.prompt_logprobs]
    beams = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    want = [[s.tokens for s in o.sequences] for o in plain.beam_search([{"prompt_token_ids": prompts[0]}], beams)]
    assert [[s.tokens for s in o.sequences] for o in selfdraft.beam_search([{"prompt_token_ids": prompts[0]}],
                                                                             beams)] == want
    no_leaks(selfdraft)


def test_an_adapter_on_the_target_with_the_base_as_draft(tmp_path, path):
    from lora_helpers import ALL, hf_float, save_adapter
    adapter = save_adapter(hf_float(path), tmp_path / "a", seed=3, r=4, lora_alpha=8, target_modules=ALL)
    kw = dict(block_size=4, loras={"a": str(adapter)})
    a, b = LLM(str(path), **kw), LLM(str(path), speculative_config=draft_spec(path), **kw)
    prompts = random_prompts(a.engine.model_config.vocab_size, (6, 12, 4), seed=7)
    lora = ["a", None, "a"]
    want = [o.token_ids for o in a.generate(prompts, greedy(20), lora=lora)]
    assert [o.token_ids for o in b.generate(prompts, greedy(20), lora=lora)] == want
    assert stats(b)["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5), dict(presence_penalty=1.0, frequency_penalty=0.5),
                                dict(min_tokens=10, ignore_eos=False)], ids=["repetition", "presence", "min_tokens"])
def test_penalties_and_min_tokens_equal_plain(plain, selfdraft, kw):
    params = SamplingParams(max_new_tokens=24, **{"ignore_eos": True, **kw})
    prompts = random_prompts(plain.engine.model_config.vocab_size, (6, 13), seed=9)
    assert [o.token_ids for o in selfdraft.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]


def test_structured_output_cuts_the_drafts_and_equals_plain(plain, selfdraft, other):
    pytest.importorskip("xgrammar")
    from infer.engine.sampling_params import StructuredOutputsParams
    for regex in ("(ab)+c", "[a-z ]{5,30}\\."):
        params = SamplingParams(max_new_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex))
        prompts = [[5, 6, 7, 8] * 4, [40, 41, 42]]
        want = [o.token_ids for o in plain.generate(prompts, params)]
        assert [o.token_ids for o in selfdraft.generate(prompts, params)] == want
        assert [o.token_ids for o in other.generate(prompts, params)] == want
    no_leaks(other)


def test_stop_strings_and_tokens_inside_accepted_drafts_and_max_tokens(plain, selfdraft):
    prompt = random_prompts(plain.engine.model_config.vocab_size, (9,), seed=4)[0]
    full = plain.generate([prompt], greedy(30))[0]
    tok = plain.engine.tokenizer
    stop = tok.decode(full.token_ids[7:9])
    for params in (greedy(30, stop=[stop]), greedy(30, stop_token_ids=[full.token_ids[10]]),
                   *(greedy(n) for n in (1, 2, 4, 5, 7))):
        a, b = plain.generate([prompt], params)[0], selfdraft.generate([prompt], params)[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
            (a.token_ids, a.text, a.finish_reason, a.stop_reason)
    no_leaks(selfdraft)


def test_the_draft_runs_in_the_targets_dtype_and_kv_cache_dtype(path):
    """The draft runs in the target's dtype (bfloat16 here), whatever its checkpoint says."""
    llm = LLM(str(path), block_size=4, dtype="bfloat16", speculative_config=draft_spec("tiny-qwen2"))
    assert next(llm.engine.drafter.model.parameters()).dtype == torch.bfloat16
    assert llm.engine.drafter.kv_cache.dtype == torch.bfloat16
    ref = LLM(str(path), block_size=4, dtype="bfloat16")
    p = [[5, 9, 13, 17]]
    assert llm.generate(p, greedy(12))[0].token_ids == ref.generate(p, greedy(12))[0].token_ids
    fp8 = LLM(str(path), block_size=4, kv_cache_dtype="fp8", speculative_config=draft_spec(path))
    assert fp8.engine.drafter.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.generate(p, greedy(12))[0].token_ids == \
        LLM(str(path), block_size=4, kv_cache_dtype="fp8").generate(p, greedy(12))[0].token_ids
    assert stats(fp8)["spec_decode_num_accepted_tokens"] > 0


# ------------------------------------------------------------------ the commands and the server
def test_infer_run_names_the_draft_in_its_banner(tmp_path, path):
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "x y x y x y", "max_new_tokens": 8}) + "\n")
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "--speculative-config",
                                   json.dumps(draft_spec("tiny-llama"))])
    assert res.exit_code == 0, res.output
    assert "draft-model speculative decoding (tiny-llama, 3 draft tokens)" in res.output
    assert len(json.loads(out.read_text())["token_ids"]) == 8


def test_banner_names_ngram_and_draft_model():
    from infer.cli.banner import engine_traits
    ngram = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 5, "prompt_lookup_min": 5}
    assert engine_traits("f32", 8, 4, None, 64, ngram).endswith("n-gram speculative decoding (1 draft token)")
    assert engine_traits("f32", 8, 4, None, 64, draft_spec("./small") | {"method": "draft_model"}).endswith(
        "draft-model speculative decoding (./small, 3 draft tokens)")


def test_the_server_streams_the_plain_runs_tokens(path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 16, "ignore_eos": True, "return_token_ids": True,
            "temperature": 0, "stream": True}
    seen = {}
    for name, kw in (("plain", {}), ("draft", {"speculative_config": draft_spec(path)})):
        engine = LLMEngine(EngineConfig("tiny-llama", block_size=4, **kw))
        with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama"))) as client:
            r = client.post("/v1/completions", json=body)
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            seen[name] = [t for c in chunks for ch in c.get("choices", []) for t in ch.get("token_ids") or []]
            metrics = client.get("/metrics").text
        if name == "draft":
            assert len(chunks) < 16 and "infer:spec_decode_num_accepted_tokens_total" in metrics
    assert seen["draft"] == seen["plain"] and len(seen["plain"]) == 16


def test_bench_baseline_no_spec_runs_with_a_draft_model(tmp_path):
    from typer.testing import CliRunner

    from infer.cli.main import app
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"alpha beta {i} gamma", "max_tokens": 6, "ignore_eos": True})
                            + "\n" for i in range(2)))
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--out", str(tmp_path / "b"), "-q", "--speculative-config",
                                   json.dumps(draft_spec("tiny-llama")), "--baseline", "no-spec", "-c", "1",
                                   "--dataset", f"jsonl:{data}", "--save-detailed"])
    assert res.exit_code == 0, res.output
    [r] = json.loads((tmp_path / "b" / "results.json").read_text())
    assert r["baseline"]["label"] == "infer (no speculation)"
    assert r["config"]["engine"]["speculative_config"]["method"] == "draft_model"
    assert r["engine_stats"]["run_spec_decode_num_accepted_tokens"] > 0
    assert r["generated_texts"] == r["baseline"]["generated_texts"]


def test_warmup_counts_the_draft_as_the_engine_start_does(monkeypatch):
    """warmup's formula (--estimate) and its measured worst case (which runs the draft's steps too) plan the draft's
    weights, its KV in every block and its activations as an engine start does."""
    from infer.cli.warmup_plan import estimate_plan, measured_plan
    from infer.engine import profile
    from infer.engine.setup import load_engine_parts
    ran, real = [], profile._draft_peak
    monkeypatch.setattr(profile, "_draft_peak", lambda *a: ran.append(a) or real(*a))
    kw = dict(max_num_seqs=4, max_model_len=128, memory_limit="64MB", block_size=4)
    spec = dict(kw, speculative_config=draft_spec("tiny-qwen3"))
    alone = load_engine_parts(EngineConfig(model="tiny-llama", **kw)).memory_plan
    engine = load_engine_parts(EngineConfig(model="tiny-llama", **spec)).memory_plan
    assert engine.kv_bytes_per_token > alone.kv_bytes_per_token and engine.weights_bytes > alone.weights_bytes
    est, _ = estimate_plan(EngineConfig(model="tiny-llama", **spec), 128, 4)
    assert est.activation_peak_bytes == engine.activation_peak_bytes
    assert est.kv_bytes_per_token == engine.kv_bytes_per_token
    assert est.weights_bytes - engine.weights_bytes == \
        estimate_plan(EngineConfig(model="tiny-llama", **kw), 128, 4)[0].weights_bytes - alone.weights_bytes
    plan, extra = measured_plan(EngineConfig(model="tiny-llama", **spec), 128, 4)
    assert ran and extra["worst_case_run"] and extra["activation_estimate_bytes"] == engine.activation_peak_bytes
    assert plan.kv_bytes_per_token == engine.kv_bytes_per_token and plan.weights_bytes == engine.weights_bytes


def test_each_data_parallel_replica_loads_its_own_draft_from_its_full_path(tmp_path, path, monkeypatch):
    import pickle

    from infer.parallel.replica import Replica
    from infer.parallel.runtime import replica_config
    shutil.copytree(path, tmp_path / "small")
    monkeypatch.chdir(tmp_path)
    cfg = EngineConfig(str(path), block_size=4, speculative_config=draft_spec("small"))
    rep = replica_config(cfg, path, "cpu", 2, single_node=True)
    assert rep.speculative_config["model"] == str((tmp_path / "small").resolve())
    assert cfg.speculative_config["model"] == "small"  # the driver's own is left as given
    replica = Replica(pickle.loads(pickle.dumps(rep)), threads=1)
    assert replica.error is None and replica.engine.drafter is not None
    replica.engine.add_request("a", [5, 6, 7, 8], greedy(10))
    while replica.engine.has_unfinished_requests():
        replica.engine.step()
    assert replica.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_gptq_int4_draft_of_the_target(tmp_path, path, plain):
    """The draft loads as the target does: an int4 GPTQ checkpoint of the target (a random tiny model, whose int4
    argmax agrees with the float one's about 40% of the time) has its drafts accepted as often."""
    from quant_helpers import needs_gptqmodel
    if needs_gptqmodel.args[0]:
        pytest.skip("needs the quantize extra (gptqmodel)")
    from typer.testing import CliRunner

    from infer.cli.main import app
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "-o", str(out), "--group-size", "32", "--num-samples",
                                   "8", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    llm = LLM(str(path), block_size=4, speculative_config=draft_spec(out))
    assert any(hasattr(m, "qweight") for m in llm.engine.drafter.model.modules())
    prompts = random_prompts(plain.engine.model_config.vocab_size, (5, 11), seed=12)
    assert [o.token_ids for o in llm.generate(prompts, greedy(20))] == \
        [o.token_ids for o in plain.generate(prompts, greedy(20))]
    s = stats(llm)
    assert s["spec_decode_num_accepted_tokens"] >= 0.2 * s["spec_decode_num_draft_tokens"] > 0, s
