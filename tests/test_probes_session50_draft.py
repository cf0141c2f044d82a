"""Draft-model speculative decoding, the fiftieth session's probes: a draft whose context is shorter than the
engine's max_model_len is taken, as vLLM takes it (its speculative_max_model_len): a sequence drafts only while its
tokens and drafts fit the draft's context and then goes on without drafts (per sequence: the others of the step
keep drafting), the draft is never fed past its context, its rope table, graphs and memory share are of its own
context, and stats() counts the decodes left without drafts by it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.models.tiny import ensure_builtin

from helpers import random_prompts

SHORT = 32  # the short draft's max_position_embeddings


@pytest.fixture(scope="module")
def path():
    return ensure_builtin("tiny-llama")


@pytest.fixture(scope="module")
def short(path, tmp_path_factory):
    """The target itself with a context of SHORT tokens: its drafts are the target's own while it drafts."""
    dst = tmp_path_factory.mktemp("short") / "draft"
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": SHORT}))
    return dst


def spec(model, k: int = 3) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


def _outputs(llm, prompts, lengths):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    return [o.token_ids for o in llm.generate(prompts, params)]


KW = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=96)
# some prompts cross the draft's context mid-generation, one stays within it, one starts past it
PROMPTS = random_prompts(512, (20, 5, 26, 40, 9), seed=50)
LENGTHS = [20, 8, 12, 10, 30]


@pytest.fixture(scope="module")
def plain(path):
    return _outputs(LLM(str(path), **KW), PROMPTS, LENGTHS)


def _fed_positions(monkeypatch):
    """Every position the draft's forwards were fed (its first forward's and the one-token forwards')."""
    from infer.engine.draft import DraftRunner
    seen = []
    real_forward, real_decode = DraftRunner._forward, DraftRunner._decode

    def forward(self, feeds, rows):
        for seq, start, tokens in feeds:
            seen.extend(range(start, start + len(tokens)))
        return real_forward(self, feeds, rows)

    def decode(self, ids, positions, ctx):
        seen.extend(positions.tolist())
        return real_decode(self, ids, positions, ctx)
    monkeypatch.setattr(DraftRunner, "_forward", forward)
    monkeypatch.setattr(DraftRunner, "_decode", decode)
    return seen


@pytest.mark.parametrize("graphs", [False, True])
def test_a_shorter_draft_is_taken_and_sequences_stop_drafting_past_its_context(path, short, plain, monkeypatch,
                                                                               caplog, graphs):
    """Refused at start before; now taken (said once), greedy tokens equal a run without speculation, per sequence:
    the short sequences of the batch draft to their end while the others stop at the draft's context, the draft is
    never fed a position past it, and stats() counts the decodes that ran without drafts because of it."""
    seen = _fed_positions(monkeypatch)
    with caplog.at_level("WARNING", logger="infer"):
        llm = LLM(str(path), speculative_config=spec(short), **KW)
    notes = [r.getMessage() for r in caplog.records if "context of 32 tokens" in r.getMessage()]
    assert len(notes) == 1 and "without drafts" in notes[0] and "draft_context_skipped_steps" in notes[0]
    assert llm.engine.drafter.context == SHORT
    if graphs:
        llm.engine.runner.capture_graphs(96, emulate=True)
        assert llm.engine.drafter.graphs.max_blocks == SHORT // 4  # (the draft's tables: its context's blocks)
    drafted = []  # (length, drafts) of every sequence with drafts at each verify
    real_verify = llm.engine.runner.verify

    def verify(batch):
        drafted.extend((len(s), len(s.draft_token_ids)) for s in batch.seqs if s.draft_token_ids)
        return real_verify(batch)
    monkeypatch.setattr(llm.engine.runner, "verify", verify)
    seen.clear()
    assert _outputs(llm, PROMPTS, LENGTHS) == plain
    assert seen and max(seen) < SHORT
    assert drafted and all(n + k <= SHORT for n, k in drafted)
    assert any(n + k > SHORT - 4 for n, k in drafted)  # drafting up to the limit (a step adds up to k + 1)
    stats = llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    # the decodes without drafts: every step of a sequence whose length and drafts pass SHORT (k = 3, or fewer
    # near max_tokens), prompt 40 (all 9 decodes after its prefill's token), 26 (from length 30 on)...
    want = 0
    for prompt, n in zip(PROMPTS, LENGTHS):
        for length in range(len(prompt) + 1, len(prompt) + n):  # the decodes: their lengths before the step
            k = min(3, len(prompt) + n - length)
            want += length + k > SHORT
    assert 0 < stats["draft_context_skipped_steps"] <= want  # (a step may accept drafts over several lengths)
    assert stats["draft_context_skipped_steps"] >= 9  # the 40-token prompt's decodes alone
    if graphs:
        assert stats["draft_cuda_graph_replays"] > 0


def test_one_sequence_past_the_context_does_not_stop_the_others_of_its_step(path, short, monkeypatch):
    """Per sequence, not per batch: in a step where one sequence is past the draft's context the others draft."""
    llm = LLM(str(path), speculative_config=spec(short), **KW)
    steps = []
    real_verify = llm.engine.runner.verify

    def verify(batch):
        steps.append([(len(s), len(s.draft_token_ids), n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        return real_verify(batch)
    monkeypatch.setattr(llm.engine.runner, "verify", verify)
    prompts = random_prompts(512, (40, 4), seed=7)
    want = _outputs(LLM(str(path), **KW), prompts, [12, 12])
    assert _outputs(llm, prompts, [12, 12]) == want
    mixed = [s for s in steps if len(s) == 2 and s[0][0] > SHORT and s[0][1] == 0 and s[1][1] > 0]
    assert mixed, steps
    # the draft's catch-up (Scheduler.lag) counts no tokens it is never fed: the long prompt's second chunk is its
    # 8 tokens beside the short prompt's 4, not one token a step (its draft KV "lagging" ever more)
    assert steps[:2] == [[(40, 0, 32)], [(40, 0, 8), (4, 0, 4)]], steps


def test_the_draft_is_loaded_and_planned_for_its_own_context(path, short, monkeypatch):
    """Its rope table holds its context's positions (not max_model_len's), and the engine's memory plan counts its
    step and graphs at its context: a draft of the same shapes and a longer context costs more."""
    from infer.engine.setup import load_engine_parts
    from infer.memory.plan import draft_activation_bytes, draft_graph_bytes
    from infer.models.loader import load_config
    kw = dict(KW, max_model_len=512, memory_limit="64MB")
    parts = load_engine_parts(EngineConfig(model=path, speculative_config=spec(short), **kw))
    assert parts.draft.context == SHORT
    cos = [b for n, b in parts.draft.model.named_buffers() if "cos" in n or "rope" in n or "inv" in n]
    assert cos and max(b.shape[0] for b in cos if b.dim() >= 2) <= SHORT
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)
    cfg = EngineConfig(model=path, speculative_config=spec(short), **kw)
    short_cfg, long_cfg = load_config(short), load_config(path)
    assert draft_activation_bytes(cfg, short_cfg, torch.float32, 512) < \
        draft_activation_bytes(cfg, long_cfg, torch.float32, 512)
    assert draft_graph_bytes(cfg, short_cfg, torch.float32) < draft_graph_bytes(cfg, long_cfg, torch.float32)


def test_a_prefix_hit_takes_no_draft_kv_that_a_sequence_past_the_context_never_fed(path, short):
    """A sequence past the draft's context feeds it nothing: a cached prefix it hit (draft KV unwritten: its first
    owner was past the context too) must stay marked unwritten while it runs, or a request within the context that
    hits it meanwhile drafts from a draft KV of zeros (greedy tokens the same, the drafts rejected). The target as
    its own draft accepts every draft of a right draft KV."""
    llm = LLM(str(path), speculative_config=spec(short), enable_prefix_caching=True, **KW)
    eng = llm.engine
    base = random_prompts(512, (36,), seed=3)[0]
    llm.generate([base + [7]], SamplingParams(max_new_tokens=2, ignore_eos=True))  # its blocks cached, unwritten
    eng.add_request("hit", base + [9], SamplingParams(max_new_tokens=20, ignore_eos=True))  # a hit, past it too
    eng.step()
    before = dict(eng.stats())
    prompt = base[:20] + [11]  # within the context: hits the first 20 tokens' blocks while "hit" runs
    eng.add_request("within", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
    got = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids if hasattr(out, "outputs") else out.token_ids
    want = _outputs(LLM(str(path), **KW), [prompt], [6])[0]
    assert list(got["within"]) == want
    stats = eng.stats()
    drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert stats["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert drafted > 0 and accepted == drafted


# ------------------------------------------------------------------ a draft whose tokenizer differs in special tokens
def _special_renamed(src, dst, at: int, name: str, special: bool = True):
    """A copy of `src` whose tokenizer names added token `at` `name` (marked special or not), with a chat template
    of its own."""
    shutil.copytree(src, dst)
    data = json.loads((dst / "tokenizer.json").read_text())
    for t in data["added_tokens"]:
        if t["id"] == at:
            old, t["content"], t["special"] = t["content"], name, special
    vocab = data["model"]["vocab"]
    if old in vocab:
        vocab[name] = vocab.pop(old)
    (dst / "tokenizer.json").write_text(json.dumps(data))
    (dst / "chat_template.jinja").write_text("{% for m in messages %}<|im_start|>{{ m.content }}" + name +
                                             "{% endfor %}")
    return dst


def test_a_draft_whose_tokenizer_names_a_special_token_otherwise_is_taken(path, tmp_path, caplog):
    """A base model's "<|reserved_special_token_N|>" where the chat target has "<|eot_id|>" (Llama 3.2 1B drafting
    Llama 3 70B), and a chat template of its own: the same ids to both models, the target's tokenizer reads them
    (as vLLM takes such a draft): taken, said once, greedy tokens as without speculation; an id the draft holds
    as a plain token where the target has a special one stays refused."""
    from infer.errors import ConfigError
    draft = _special_renamed(path, tmp_path / "renamed", 2, "<|reserved_special_token_0|>")
    prompts = random_prompts(512, (9, 14), seed=5)
    want = _outputs(LLM(str(path), block_size=4), prompts, [8, 8])
    with caplog.at_level("WARNING", logger="infer"):
        llm = LLM(str(path), block_size=4, speculative_config=spec(draft))
    notes = [r.getMessage() for r in caplog.records if "special token" in r.getMessage()]
    assert len(notes) == 1 and "id 2: '<|reserved_special_token_0|>' in the draft, '<|im_end|>'" in notes[0]
    assert _outputs(llm, prompts, [8, 8]) == want
    plain = _special_renamed(path, tmp_path / "plain", 2, "eot", special=False)
    with pytest.raises(ConfigError, match="token id 2 is 'eot' in the draft, '<|im_end|>' in the target"):
        LLM(str(path), block_size=4, speculative_config=spec(plain))


# ------------------------------------------------------------------ a step interrupted in the draft's forward
@pytest.mark.parametrize("where", ["draft", "verify", "run"])
def test_a_step_interrupted_before_the_verify_leaves_its_blocks_to_be_zeroed(path, monkeypatch, where):
    """Ctrl-C while the draft's tokens are read back (or in the verify) ends the step before the target zeroed the
    KV blocks it got: the next step zeroes them, or the target's attention read what their memory held (NaN here, as
    uninitialised memory may: the request ended "logits were not finite"). Greedy tokens as without speculation.
    ("run": a step without speculation interrupted in its forward, the same.)"""
    from infer.engine.draft import DraftRunner
    from infer.engine.model_runner import ModelRunner
    prompts = random_prompts(512, (20, 5), seed=50)
    want = _outputs(LLM(str(path), **KW), prompts, [12, 12])
    llm = LLM(str(path), speculative_config=None if where == "run" else spec(path), overlap=False, **KW)
    eng = llm.engine
    for cache in (eng.runner.kv_cache, *([eng.drafter.kv_cache] if eng.drafter else [])):
        cache.fill_(float("nan"))  # (memory as torch.empty may hand it out: every block is zeroed when handed out)
    calls, interrupts = [0], []
    owner, name = {"draft": (DraftRunner, "_forward"), "verify": (ModelRunner, "verify"),
                   "run": (ModelRunner, "run")}[where]
    real = getattr(owner, name)

    def interrupted(self, *a):
        calls[0] += 1
        zero = a[0].zero if owner is ModelRunner else self._zero
        if calls[0] > 1 and zero and not interrupts:  # the first step after the prefill that got a new block
            raise KeyboardInterrupt
        return real(self, *a)
    monkeypatch.setattr(owner, name, interrupted)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    got = {}
    while eng.has_unfinished_requests():
        try:
            outs = eng.step()
        except KeyboardInterrupt:
            interrupts.append(True)
            continue
        for out in outs:
            if out.finished:
                got[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
    assert interrupts == [True]
    assert [got[str(i)] for i in range(2)] == [(w, "length") for w in want]


# ------------------------------------------------------------------ the new counter beside the draft's others
def test_the_context_counter_is_summed_over_replicas_and_counted_per_benchmark_run():
    """draft_context_skipped_steps is a counter as draft_eager_forwards is: a data-parallel server sums it over
    its replicas (a replaced replica's figure kept), and a benchmark's sampler reports its change over the run."""
    from fakeray import FakeRay, Handle

    from infer.bench.monitor import ResourceSampler
    from infer.parallel.serve_engine import RayAsyncEngine, _Replica

    class Stub:
        def info(self) -> dict:
            return {"error": None}
    r = _Replica(0, None, {}, stats={"num_steps": 10, "draft_context_skipped_steps": 7})
    engine = RayAsyncEngine.__new__(RayAsyncEngine)
    engine.ray, engine.replicas, engine._starting = FakeRay(), [r], {}
    engine._restart, engine.max_restarts = lambda index: Handle(Stub()), 3
    assert RayAsyncEngine._aggregate(engine)["draft_context_skipped_steps"] == 7
    engine._replace(r)
    r.stats, r.alive = {"num_steps": 1, "draft_context_skipped_steps": 2}, True
    assert RayAsyncEngine._aggregate(engine)["draft_context_skipped_steps"] == 9

    class Engine:
        figures = {"draft_context_skipped_steps": 4}

        def stats(self):
            return dict(self.figures)
    sampler = ResourceSampler(Engine(), interval_s=0)
    sampler.start()
    Engine.figures = {"draft_context_skipped_steps": 10}
    sampler.sample(force=True)
    assert sampler.last_stats["run_draft_context_skipped_steps"] == 6


def test_warmup_measures_the_drafts_peak_at_its_own_context(path, short, monkeypatch):
    """`infer warmup` (measured) with a draft of a shorter context: the draft's peak is run on the worst case of
    its own context (past it a sequence feeds it nothing), not on the target's batches at max_length, whose
    drafting rows it would run past its rope table (or measure nothing for)."""
    from infer.cli import warmup_plan
    from infer.engine.draft import DraftRunner
    seen, real = [], DraftRunner.propose

    def propose(self, batch):
        seen.append(max(len(s) + len(s.draft_token_ids) for s in batch.seqs))
        return real(self, batch)
    monkeypatch.setattr(DraftRunner, "propose", propose)
    cfg = EngineConfig(str(path), speculative_config=spec(short), block_size=4, max_num_batched_tokens=64)
    plan, _ = warmup_plan.measured_plan(cfg, 96, 2)
    assert plan.max_length == 96 and plan.activation_peak_bytes > 0
    assert seen and max(seen) <= SHORT
