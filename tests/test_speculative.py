"""N-gram speculative decoding (vLLM's speculative_config {"method": "ngram", ...}): the proposer, the options, and
the engine's outputs: greedy tokens equal a run without speculation (and transformers / peft) token for token, with
drafts accepted (the counters say so), in batches, at stops, EOS and max_tokens, under preemption, with the prefix
cache, with an adapter and with logprobs; random sampling keeps the distribution of plain sampling."""

from __future__ import annotations

import json
import math

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.speculative import parse_speculative_config, propose_ngram
from infer.errors import ConfigError

from helpers import FEW, NGRAM_SPEC as SPEC, hf_greedy, random_prompts
from helpers import ngram_llm as spec, plain_llm as plain, tiny_llama_path as path  # noqa: F401 (fixtures)


class AllowOnly:
    """transformers' logits processor for allowed_token_ids (the oracle of a restricted greedy reply)."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, input_ids, scores):
        out = torch.full_like(scores, -math.inf)
        out[:, self.ids] = scores[:, self.ids]
        return out


def hf_restricted(path, prompt, n, ids=FEW, **kw):
    from transformers import LogitsProcessorList
    return hf_greedy(path, prompt, n, logits_processor=LogitsProcessorList([AllowOnly(ids)]), **kw)


def accepted(llm) -> int:
    return llm.engine.stats()["spec_decode_num_accepted_tokens"]


def no_leaks(llm):
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)
    for block in bm.blocks:  # every cached block holds a whole block of ids
        if block.hash is not None:
            assert block.token_ids is not None and len(block.token_ids) == bm.block_size


# ------------------------------------------------------------------ the proposer and the options
def test_proposer_takes_the_longest_most_recent_match():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert propose_ngram(toks, 2, 2, 4) == [8, 7]  # [1, 2, 3] most recently followed by 8, 7
    assert propose_ngram(toks, 5, 2, 4) == [8, 7, 1, 2, 3]
    assert propose_ngram([4, 1, 2, 5, 6, 3, 1, 2], 3, 2, 2) == [5, 6, 3]
    assert propose_ngram([1, 2, 3, 4], 3, 2, 4) == []  # no earlier occurrence
    assert propose_ngram([7, 1, 2, 7, 1, 2, 9, 1, 2], 2, 2, 3) == [9, 1]  # [1, 2]'s most recent: before 9
    assert propose_ngram([7, 1, 2, 7, 1, 2, 9, 1, 2], 2, 3, 3) == []  # [9, 1, 2] occurs once
    assert propose_ngram([5, 5, 5, 5], 3, 2, 3) == [5]  # fewer near the end
    assert propose_ngram([3, 4, 3], 2, 1, 1) == [4, 3]  # n = 1
    assert propose_ngram([3], 2, 1, 1) == []
    # the longest n first, even where a shorter one matches later
    assert propose_ngram([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], 1, 2, 3) == [4]


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "needs \"model\", the EAGLE head's folder"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "\"method\": \"eagle3\", \"model\": \"./eagle-head\""),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs \"model\""),
    ({"method": "mtp", "model": "some/draft", "num_speculative_tokens": 3}, "only with \"ngram\""),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer of at least 1, got None"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) is above prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown key"),
    ("{not json", "is not JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_a_wrong_speculative_config_is_refused_naming_the_problem(value, message):
    with pytest.raises(ConfigError, match="speculative-config") as e:
        EngineConfig("tiny-llama", speculative_config=value)
    assert message in str(e.value)


def test_speculative_config_defaults_and_spellings():
    both = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (both["prompt_lookup_min"], both["prompt_lookup_max"]) == (5, 5)  # vLLM's defaults
    one = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one["prompt_lookup_min"], one["prompt_lookup_max"]) == (3, 3)
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    cfg = EngineConfig("tiny-llama", speculative_config=json.dumps(SPEC))
    assert cfg.speculative_config == SPEC and not cfg.use_overlap()
    assert EngineConfig("tiny-llama", overlap=True).use_overlap()  # unset: nothing changes


# ------------------------------------------------------------------ greedy: token for token
def test_greedy_batch_equals_plain_and_transformers_with_drafts_accepted(path, plain, spec):
    vocab = plain.engine.model_config.vocab_size
    free = random_prompts(vocab, (3, 12, 25), seed=0) + [[5, 6, 7, 8] * 6]
    few = random_prompts(vocab, (4, 9, 17), seed=1)
    before = accepted(spec)
    for prompts, params, oracle in (
            (free, SamplingParams(max_new_tokens=24, ignore_eos=True), hf_greedy),
            (few, SamplingParams(max_new_tokens=40, ignore_eos=True, allowed_token_ids=FEW), hf_restricted)):
        want = [o.token_ids for o in plain.generate(prompts, params)]
        got = spec.generate(prompts, params)
        assert [o.token_ids for o in got] == want
        assert all(o.finish_reason == "length" for o in got)
        assert [oracle(path, p, params.max_new_tokens) for p in prompts] == want
    stats = spec.engine.stats()
    assert accepted(spec) - before > 20, stats  # speculation really happened
    assert stats["spec_decode_num_drafts"] > 0 and sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == \
        stats["spec_decode_num_accepted_tokens"]
    no_leaks(spec)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 11])
def test_max_tokens_is_never_passed(plain, spec, n):
    prompts = random_prompts(plain.engine.model_config.vocab_size, (5, 8), seed=2)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, allowed_token_ids=FEW)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    assert all(len(o.token_ids) == n and o.finish_reason == "length" for o in got)


def test_drafts_never_reach_past_max_tokens_or_the_context(path, monkeypatch):
    """vLLM's rule: a sequence is given no more drafts than the tokens it may still add, less the one the step adds
    of its own (a draft past them is verified for nothing)."""
    llm = LLM(str(path), block_size=4, max_model_len=30, speculative_config=SPEC)
    engine, seen, over = llm.engine, [], []
    propose = engine._propose

    def checked():  # (an assertion here would end the requests with an error, not fail the test)
        propose()
        for seq in engine.scheduler.running:
            left = min(seq.params.max_new_tokens - seq.num_generated, seq.max_total_len - len(seq))
            if len(seq.draft_token_ids) > left - 1:
                over.append((seq.request_id, left, list(seq.draft_token_ids)))
            seen.append(len(seq.draft_token_ids) == left - 1 > 0)
    monkeypatch.setattr(engine, "_propose", checked)
    prompts = random_prompts(engine.model_config.vocab_size, (3, 5, 8, 6, 12, 20, 24), seed=12)
    for n in (4, 7, 9, 30):
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True, allowed_token_ids=FEW))
        assert all(o.finish_reason == "length" for o in outs)
    assert not over
    assert any(seen)  # some drafts went right up to the limit


def test_the_context_limit_is_never_passed(path):
    kw = dict(block_size=4, max_model_len=40)
    a, b = LLM(str(path), **kw), LLM(str(path), speculative_config=SPEC, **kw)
    prompts = random_prompts(a.engine.model_config.vocab_size, (9, 30), seed=3)
    params = SamplingParams(max_new_tokens=100, ignore_eos=True, allowed_token_ids=FEW)
    want, got = a.generate(prompts, params), b.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [len(p) + len(o.token_ids) for p, o in zip(prompts, got)] == [40, 40]
    assert accepted(b) > 0


def test_stop_token_ids_eos_and_stop_strings_end_where_plain_runs_end(plain, spec):
    vocab = plain.engine.model_config.vocab_size
    prompts = random_prompts(vocab, (6, 13), seed=4)
    ref = plain.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True, allowed_token_ids=FEW))
    before = accepted(spec)
    for o in ref:  # stop at a token that comes after a run the drafts can predict
        stop = o.token_ids[25]
        params = SamplingParams(max_new_tokens=40, stop_token_ids=[stop], allowed_token_ids=FEW)
        a, b = plain.generate([o.prompt_token_ids], params)[0], spec.generate([o.prompt_token_ids], params)[0]
        assert (b.token_ids, b.finish_reason, b.stop_reason) == (a.token_ids, a.finish_reason, a.stop_reason)
        text = plain.tokenizer.decode(o.token_ids[20:23])
        if text.strip():
            params = SamplingParams(max_new_tokens=40, stop=[text], allowed_token_ids=FEW, ignore_eos=True)
            a, b = plain.generate([o.prompt_token_ids], params)[0], spec.generate([o.prompt_token_ids], params)[0]
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    eos = plain.engine.tokenizer_eos
    params = SamplingParams(max_new_tokens=30, allowed_token_ids=FEW + [eos], logit_bias={eos: 0.5})
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in b] == [(o.token_ids, o.finish_reason) for o in a]
    assert accepted(spec) > before
    no_leaks(spec)


def test_streamed_deltas_join_to_the_text(spec):
    """A step may append several tokens to a request: one output with every new token and the text they add."""
    engine = spec.engine
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, allowed_token_ids=FEW)
    engine.add_request("s", [9, 10, 11, 12], params)
    ids, text, multi = [], "", False
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.delta_text
            multi = multi or len(out.new_token_ids) > 1
            last = out
        seq = engine.requests.get("s")
        if seq is not None:  # the blocks only rejected drafts used were given back
            assert len(seq.block_table) <= engine.block_manager.blocks_needed(len(seq))
            assert seq.num_computed_tokens == len(seq) - 1 and not seq.draft_token_ids
    assert multi and ids == last.token_ids and text == last.text and len(ids) == 40


def test_preemption_with_a_small_kv_cache_changes_nothing(path):
    kw = dict(block_size=4, num_kv_blocks=24, max_model_len=64)
    a, b = LLM(str(path), **kw), LLM(str(path), speculative_config=SPEC, **kw)
    prompts = random_prompts(a.engine.model_config.vocab_size, (5, 9, 14, 7, 11), seed=5)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, allowed_token_ids=FEW)
    want = [o.token_ids for o in a.generate(prompts, params)]
    assert [o.token_ids for o in b.generate(prompts, params)] == want
    assert b.engine.stats()["num_preemptions"] > 0 and accepted(b) > 0
    assert b.engine.block_manager.num_used_blocks == 0


def test_prefix_cache_holds_only_accepted_tokens(path):
    """Blocks that rejected drafts were written to are freed and never cached; a later request whose prompt is an
    earlier one's prompt and reply finds its blocks, and continues exactly as the plain engine does."""
    a, b = LLM(str(path), block_size=4), LLM(str(path), block_size=4, speculative_config=SPEC)
    prompt = random_prompts(a.engine.model_config.vocab_size, (10,), seed=6)[0]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, allowed_token_ids=FEW)
    first = b.generate([prompt], params)[0]
    assert first.token_ids == a.generate([prompt], params)[0].token_ids
    bm = b.engine.block_manager
    full = prompt + first.token_ids
    for block in bm.blocks:  # every cached block holds the ids of the sequence at its place
        if block.hash is not None:
            assert block.token_ids is not None and len(block.token_ids) == 4
    assert sum(block.hash is not None for block in bm.blocks) == (len(full) - 1) // 4
    again = full[:36]
    hits = bm.prefix_hits
    assert b.generate([again], params)[0].token_ids == a.generate([again], params)[0].token_ids
    assert bm.prefix_hits - hits == 32
    assert accepted(b) > 0


def test_lora_adapter_equals_peft_and_plain(tmp_path, path):
    from lora_helpers import ALL, hf_float, save_adapter
    from test_lora_engine import peft_greedy
    hf = hf_float(path)
    adapter = save_adapter(hf, tmp_path / "a", seed=3, r=4, lora_alpha=8, target_modules=ALL)
    kw = dict(block_size=4, loras={"a": str(adapter)})
    a, b = LLM(str(path), **kw), LLM(str(path), speculative_config=SPEC, **kw)
    prompts = random_prompts(a.engine.model_config.vocab_size, (6, 12, 4), seed=7) + [[5, 6, 7] * 5]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in a.generate(prompts, params, lora=["a", None, "a", "a"])]
    got = [o.token_ids for o in b.generate(prompts, params, lora=["a", None, "a", "a"])]
    assert got == want
    assert want == peft_greedy(hf, {"a": adapter}, list(zip(["a", None, "a", "a"], prompts)), n=24)
    few = SamplingParams(max_new_tokens=30, ignore_eos=True, allowed_token_ids=FEW)
    assert [o.token_ids for o in b.generate(prompts, few, lora="a")] == \
        [o.token_ids for o in a.generate(prompts, few, lora="a")]
    assert accepted(b) > 0


def test_logprobs_equal_the_plain_run(plain, spec):
    prompts = random_prompts(plain.engine.model_config.vocab_size, (7, 15), seed=8)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, allowed_token_ids=FEW, logprobs=2)
    before = accepted(spec)
    for a, b in zip(plain.generate(prompts, params), spec.generate(prompts, params)):
        assert a.token_ids == b.token_ids and len(b.logprobs) == 30
        for x, y in zip(a.logprobs, b.logprobs):
            assert x["token_id"] == y["token_id"] and math.isclose(x["logprob"], y["logprob"], abs_tol=1e-4)
            assert [t["token_id"] for t in x["top_logprobs"]] == [t["token_id"] for t in y["top_logprobs"]]
    assert accepted(spec) > before


def test_structured_output_equals_plain(plain, spec):
    """(drafts of structured outputs: tests/test_probes_session46_specx.py)"""
    pytest.importorskip("xgrammar")
    from infer.engine.sampling_params import StructuredOutputsParams
    params = SamplingParams(max_new_tokens=16, structured_outputs=StructuredOutputsParams(regex="(ab)+c"))
    prompt = [[5, 6, 7, 8] * 4]
    assert spec.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids


# ------------------------------------------------------------------ random sampling
def test_seeded_random_requests_are_reproducible(path):
    params = SamplingParams(max_new_tokens=30, temperature=0.8, seed=11, allowed_token_ids=FEW, ignore_eos=True)
    prompts = [[9, 10, 11], [12, 13, 14, 15]]
    runs = []
    for _ in range(2):
        llm = LLM(str(path), block_size=4, speculative_config=SPEC)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert accepted(llm) > 0
    assert runs[0] == runs[1]


def test_rejection_sampling_keeps_the_target_distribution():
    """The sampler's verification of one draft over many identical rows: each row's token is distributed as the
    target's p (top-k and temperature applied), the draft accepted with probability p(draft)."""
    from infer.engine.sampler import Sampler, SamplingInputs
    from infer.engine.sequence import Sequence
    torch.manual_seed(0)
    vocab, n = 6, 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -3.0]]).repeat(n, 1)
    for params, draft in ((SamplingParams(temperature=1.0), 4), (SamplingParams(temperature=0.7, top_k=4), 1),
                          (SamplingParams(temperature=1.3), 5)):
        seqs = [Sequence("r", [1], params)] * n
        sampler = Sampler(seed=3)
        drafts = torch.full((n,), draft)
        inputs = SamplingInputs.build(seqs, vocab, torch.device("cpu"))
        out, ok = sampler.sample_speculative(logits, seqs, inputs, drafts)
        p = Sampler.probs(logits[:1].clone(), seqs[:1])[0]
        p = p / p.sum()
        counts = torch.bincount(out.tokens, minlength=vocab).double()
        expected = p.double() * n
        live = expected > 0
        chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
        assert chi2 < 25, (params, counts, expected)  # 5 degrees of freedom: p < 1e-4 by chance
        assert counts[~live].sum() == 0
        rate = ok.double().mean().item()
        assert abs(rate - p[draft].item()) < 4 * math.sqrt(max(p[draft].item() * (1 - p[draft].item()), 1e-9) / n)
        assert bool((out.tokens[ok] == draft).all())


def test_random_sampling_matches_plain_sampling_in_distribution(path):
    """Many unseeded requests on a tiny vocabulary (allowed_token_ids), with speculation and without (both engines
    seeded: no flake): how often a token is the one the n-gram proposer predicts from the tokens before it (what a
    wrong rejection sampler biases: drawing a rejected draft again made it 881 of 1359 against 600 of 1206), and
    each position's token counts, agree by two-sample chi-square tests."""
    prompts = [[9, 10, 11, 12]] * 384
    params = SamplingParams(max_new_tokens=10, temperature=1.0, allowed_token_ids=[5, 6, 7], ignore_eos=True)
    hits, counts = [], []
    for kw in ({}, {"speculative_config": SPEC}):
        llm = LLM(str(path), block_size=4, seed=1, max_num_seqs=384, max_num_batched_tokens=4096, **kw)
        c, h = torch.zeros(10, 3), torch.zeros(2)
        for o in llm.generate(prompts, params):
            full = o.prompt_token_ids + o.token_ids
            for j, t in enumerate(o.token_ids):
                c[j, t - 5] += 1
                at = len(o.prompt_token_ids) + j
                d = propose_ngram(full[:at], 1, SPEC["prompt_lookup_min"], SPEC["prompt_lookup_max"])
                if d:
                    h[int(t != d[0])] += 1
        counts.append(c)
        hits.append(h)
        if kw:
            assert accepted(llm) > 200
    assert two_sample_chi2(*hits) < 10.8  # 1 degree of freedom: p < 1e-3 by chance
    assert two_sample_chi2(*counts) < 45  # 20 degrees of freedom: p < 1e-3 by chance


def two_sample_chi2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson's chi-square of the 2 x cells contingency table of two samples' counts."""
    total, n = a + b, a.sum() + b.sum()
    stat = 0.0
    for x in (a, b):
        expected = total * x.sum() / n
        live = expected > 0
        stat += float(((x[live] - expected[live]) ** 2 / expected[live]).sum())
    return stat


# ------------------------------------------------------------------ metrics and the command line
def test_metrics_show_the_spec_decode_counters(spec):
    from infer.serve.metrics import _EngineCollector
    spec.generate([[5, 6, 7, 8] * 3], SamplingParams(max_new_tokens=20, ignore_eos=True, allowed_token_ids=FEW))
    stats = spec.engine.stats()
    families = {f.name: f for f in _EngineCollector(lambda: stats, ["m", "0"]).collect()}
    assert families["infer:spec_decode_num_drafts"].samples[0].value == stats["spec_decode_num_drafts"]
    assert families["infer:spec_decode_num_accepted_tokens"].samples[0].value == \
        stats["spec_decode_num_accepted_tokens"]
    per_pos = families["infer:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [s.labels["position"] for s in per_pos] == ["0", "1", "2"]
    plain_stats = {"num_running": 0}
    assert not any("spec" in f.name for f in _EngineCollector(lambda: plain_stats, ["m", "0"]).collect())


def test_infer_run_takes_speculative_config(tmp_path):
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "x y x y x y", "max_new_tokens": 8}) + "\n")
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--speculative-config",
                                   json.dumps(SPEC)])
    assert res.exit_code == 0, res.output
    assert len(json.loads(out.read_text())["token_ids"]) == 8
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "o2.jsonl"), "-q",
                                   "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'])
    assert res.exit_code != 0 and "only with \"ngram\"" in res.output


def test_bench_reports_acceptance_rate_and_length(spec):
    from infer.bench.monitor import ResourceSampler
    from infer.bench.report import spec_decode_figures
    sampler = ResourceSampler(spec.engine)
    sampler.start()
    spec.generate([[5, 6, 7, 8] * 3], SamplingParams(max_new_tokens=20, ignore_eos=True, allowed_token_ids=FEW))
    sampler.sample(force=True)
    run = {k: v for k, v in sampler.last_stats.items() if k.startswith("run_spec")}
    assert run["run_spec_decode_num_drafts"] > 0
    figures = spec_decode_figures(sampler.last_stats)
    assert figures["spec_decode_acceptance_rate"] == \
        run["run_spec_decode_num_accepted_tokens"] / run["run_spec_decode_num_draft_tokens"]
    assert figures["spec_decode_mean_acceptance_length"] == \
        1 + run["run_spec_decode_num_accepted_tokens"] / run["run_spec_decode_num_drafts"]
    assert spec_decode_figures({"num_steps": 3}) == {}


def test_drafts_take_only_free_blocks_and_budget_never_preempting():
    from infer.engine.block_manager import BlockManager
    from infer.engine.scheduler import Scheduler
    from infer.engine.sequence import Sequence
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig("tiny-llama", max_num_seqs=4, max_num_batched_tokens=64), bm)
    a, b = (Sequence(name, [1, 2, 3], SamplingParams(max_new_tokens=50)) for name in "ab")
    for s in (a, b):
        sched.add(s)
    batch = sched.schedule()  # both prefills: a block each
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        s.output_token_ids.append(9)  # 4 tokens, the last one to compute
    a.draft_token_ids = [5, 6, 7, 8, 9, 10]
    batch = sched.schedule()
    # a's last token fits its block; one free block holds 4 of its drafts (positions 4..7); b still runs
    assert (batch.seqs, batch.num_new_tokens, a.draft_token_ids) == ([a, b], [5, 1], [5, 6, 7, 8])
    assert sched.num_preemptions == 0
    sched.bm.shrink(a, 4)  # the drafts were rejected: the block goes back
    a.draft_token_ids = [5, 6]
    sched.max_num_batched_tokens = 2
    batch = sched.schedule()  # the budget cuts them: a's and b's own tokens first, no room left for a draft
    assert (batch.num_new_tokens, a.draft_token_ids, b.draft_token_ids) == ([1, 1], [], [])
    sched.bm.shrink(a, 4)
    a.draft_token_ids = [5, 6]
    sched.max_num_batched_tokens = 3
    batch = sched.schedule()
    assert (batch.num_new_tokens, a.draft_token_ids) == ([2, 1], [5])


def test_overlap_asked_for_still_verifies_each_step_first(path, plain):
    """overlap=True (CUDA's default: the next step prepared while this one runs) with speculation on: a speculative
    step is verified on the host before the next is planned, so drafts are still made and accepted and the tokens
    are plain's."""
    llm = LLM(str(path), block_size=4, speculative_config=SPEC, overlap=True)
    prompts = random_prompts(plain.engine.model_config.vocab_size, (4, 9), seed=1)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, allowed_token_ids=FEW)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert accepted(llm) > 10
    no_leaks(llm)
    llm.close()
