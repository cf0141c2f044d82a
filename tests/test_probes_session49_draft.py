"""Draft-model speculative decoding, the forty-ninth session's probes: warmup's graph capture records the draft's
decode graphs as the engine does and reports the target's and the draft's share (measured and by the formula), the
engine's stats count the draft's graph replays and eager forwards, and a draft of another tokenizer (or vocabulary
size) is refused naming the draft and the target."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.models.tiny import ensure_builtin

from helpers import random_prompts


@pytest.fixture(scope="module")
def path():
    return ensure_builtin("tiny-llama")


def spec(model, k: int = 3) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


def _outputs(llm, prompts, lengths):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    return [o.token_ids for o in llm.generate(prompts, params)]


# ------------------------------------------------------------------ warmup's graph capture with a draft model
def test_warmup_graph_capture_records_and_measures_the_drafts_graphs(path, monkeypatch, capsys):
    """graph_capture (what `infer warmup` measures) records the draft's one-token forwards as the engine's start
    does (ModelRunner.capture_graphs: after the target's decode graphs, in their pool), counts them, and splits
    the memory kept into the target's and the draft's part, measured (a stand-in allocator here: each capture
    adds its model's bytes) and by the formula (cuda_graph_bytes + draft_graph_bytes)."""
    from infer.cli import warmup_plan
    from infer.cli.warmup import print_plan
    from infer.engine.cuda_graphs import DecodeGraphs, batch_buckets
    from infer.engine.draft import DraftRunner, load_draft
    from infer.memory.plan import cuda_graph_bytes, draft_graph_bytes
    config = EngineConfig(str(path), max_num_seqs=4, block_size=4, cuda_graph_max_tokens=32, max_model_len=64,
                          speculative_config=spec("tiny-qwen3"))
    llm = LLM(str(path), max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64)
    model = llm.engine.runner.model
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)  # (the formula's figures)
    draft = load_draft(config, model.config, torch.float32, torch.device("cpu"), 64)
    held = [0]  # the stand-in allocator's reserved bytes: 1000 per target decode capture, 7 per draft's
    real_capture = DecodeGraphs.capture

    def capture(self):
        real_capture(self)
        held[0] += 7 if self.model is draft.model else 1000
    monkeypatch.setattr(DecodeGraphs, "capture", capture)
    monkeypatch.setattr(warmup_plan, "_reserved", lambda device, emulate=False: held[0])
    seen, real_draft = [], DraftRunner.capture_graphs
    monkeypatch.setattr(DraftRunner, "capture_graphs",
                        lambda self, *a, **kw: seen.append((self.model, a, kw)) or real_draft(self, *a, **kw))
    got = warmup_plan.graph_capture(model, config, torch.float32, torch.device("cpu"), 64, emulate=True, draft=draft)
    [(drafted, args, kw)] = seen
    assert drafted is draft.model and args[:2] == (4, 16) and kw["pool"] is None  # (emulated: no pool)
    layers = len(model.layers)
    assert got["cuda_graphs_draft"] == len(batch_buckets(4))
    assert got["cuda_graphs"] == 2 * len(batch_buckets(4)) + 2 * (layers + 1)
    assert got["cuda_graph_bytes_measured"] == 1007
    assert (got["cuda_graph_bytes_measured_target"], got["cuda_graph_bytes_measured_draft"]) == (1000, 7)
    target, ours = cuda_graph_bytes(config, model.config, torch.float32), \
        draft_graph_bytes(config, draft.model_config, torch.float32)
    assert ours > 0 and got["cuda_graph_bytes_formula_draft"] == ours
    assert got["cuda_graph_bytes_formula_target"] == target
    assert got["cuda_graph_bytes_formula"] == target + ours
    assert all(m.k_cache is None for m in draft.model.modules() if hasattr(m, "k_cache"))  # the draft's cache let go
    from infer.cli.warmup_plan import estimate_plan
    plan, extra = estimate_plan(EngineConfig(str(path)), 64, 2)
    print_plan(plan, {**extra, **got, "cuda_graph_bytes_measured": 3 * 2**20, "cuda_graph_bytes_formula": 2**22,
                      "cuda_graph_bytes_measured_target": 2 * 2**20, "cuda_graph_bytes_formula_target": 3 * 2**20,
                      "cuda_graph_bytes_measured_draft": 2**20, "cuda_graph_bytes_formula_draft": 2**20})
    out = capsys.readouterr().out
    assert "the target's (measured / formula)" in out and "2.0 MiB / 3.0 MiB" in out
    assert f"the draft model's, {len(batch_buckets(4))} graphs (measured / formula)" in out
    assert "1.0 MiB / 1.0 MiB" in out


def test_measured_warmup_passes_its_draft_to_the_graph_capture(monkeypatch):
    from infer.cli import warmup_plan
    seen = []
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)
    monkeypatch.setattr(warmup_plan, "graph_capture", lambda model, config, dtype, device, max_length, lora,
                        draft=None: seen.append(draft) or {})
    path = str(ensure_builtin("tiny-llama"))
    warmup_plan.measured_plan(EngineConfig(path, speculative_config=spec("tiny-qwen3"), block_size=4), 48, 2)
    [draft] = seen
    assert draft is not None and draft.path.name.startswith("tiny-qwen3")


# ------------------------------------------------------------------ the draft's forwards in the engine's stats
def test_stats_count_the_drafts_graph_replays_and_eager_forwards(path, monkeypatch):
    """Beside cuda_graph_replays (the target's): draft_cuda_graph_replays (the draft's one-token forwards replayed
    from its decode graphs, emulated here) and draft_eager_forwards (each step's first forward, and drafts 2..k
    without graphs); warm_kernels leaves them at 0 as it leaves the target's; a bench's monitor counts them per
    run."""
    from infer.bench.monitor import ResourceSampler
    from infer.engine.draft import DraftRunner
    calls = {"first": 0, "decode": 0}
    real_forward, real_decode = DraftRunner._forward, DraftRunner._decode

    def forward(self, feeds, rows):
        calls["first"] += any(tokens for _, _, tokens in feeds)
        return real_forward(self, feeds, rows)

    def decode(self, *a):
        calls["decode"] += 1
        return real_decode(self, *a)
    monkeypatch.setattr(DraftRunner, "_forward", forward)
    monkeypatch.setattr(DraftRunner, "_decode", decode)
    kw = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    prompts = random_prompts(512, (3, 17, 9, 5), seed=49)
    lengths = [9, 6, 11, 4]
    eager = LLM(str(path), speculative_config=spec(path, 3), **kw)
    assert {"draft_cuda_graph_replays", "draft_eager_forwards"} <= set(eager.engine.stats())
    want = _outputs(eager, prompts, lengths)
    s = eager.engine.stats()
    assert s["draft_cuda_graph_replays"] == 0 and s["draft_eager_forwards"] == calls["first"] + calls["decode"] > 0
    assert "draft_cuda_graph_replays" not in LLM(str(path), **kw).engine.stats()  # no draft: no figures
    llm = LLM(str(path), speculative_config=spec(path, 3), **kw)
    llm.engine.runner.capture_graphs(64, emulate=True)
    llm.engine.warm_kernels()
    s = llm.engine.stats()
    assert (s["draft_cuda_graph_replays"], s["draft_eager_forwards"], s["cuda_graph_replays"]) == (0, 0, 0)
    calls.update(first=0, decode=0)
    sampler = ResourceSampler(llm.engine)
    sampler.start()
    assert _outputs(llm, prompts, lengths) == want
    sampler.sample(force=True)
    s = llm.engine.stats()
    assert s["draft_cuda_graph_replays"] == calls["decode"] > 0 and s["draft_eager_forwards"] == calls["first"] > 0
    assert sampler.last_stats["run_draft_cuda_graph_replays"] == calls["decode"]
    assert sampler.last_stats["run_draft_eager_forwards"] == calls["first"]


def test_data_parallel_stats_sum_the_drafts_forwards():
    from infer.parallel.serve_engine import RayAsyncEngine
    drv = RayAsyncEngine.__new__(RayAsyncEngine)

    class R:
        def __init__(self, stats, alive=True):
            self.stats, self.alive, self.index, self.info, self.inflight = stats, alive, 0, {}, {}
    drv.replicas = [R({"draft_cuda_graph_replays": 5, "draft_eager_forwards": 2}),
                    R({"draft_cuda_graph_replays": 1, "draft_eager_forwards": 4}, alive=False)]
    total = drv._aggregate()
    assert (total["draft_cuda_graph_replays"], total["draft_eager_forwards"]) == (6, 6)
    drv.replicas = [R({})]
    assert "draft_eager_forwards" not in drv._aggregate()


# ------------------------------------------------------------------ a draft of another tokenizer
def _retokenized(src, dst, swap: bool = True, drop: bool = False):
    """A copy of `src` whose tokenizer.json gives ids 100..109 other tokens (pairs swapped), or (`drop`) without
    any tokenizer file."""
    import json
    import shutil
    shutil.copytree(src, dst)
    if drop:
        (dst / "tokenizer.json").unlink()
        return dst
    data = json.loads((dst / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = sorted((i, t) for t, i in vocab.items() if 100 <= i < 110)
    for (i, t), (j, u) in zip(tokens[::2], tokens[1::2]):
        vocab[t], vocab[u] = j, i
    (dst / "tokenizer.json").write_text(json.dumps(data, indent=1) if swap else json.dumps(data))
    return dst


def test_a_draft_of_another_tokenizer_of_the_same_size_is_refused_naming_both(tmp_path, path):
    """The same vocab_size, other token ids: refused at start (and by warmup --estimate), naming the draft, the
    target and a token id whose meaning differs; the same tokenizer written otherwise, or a draft folder without a
    tokenizer, is taken."""
    import json

    from infer.cli.warmup_plan import estimate_plan
    from infer.errors import ConfigError
    other = _retokenized(path, tmp_path / "other")
    with pytest.raises(ConfigError) as e:
        LLM(str(path), block_size=4, speculative_config=spec(other))
    msg = str(e.value)
    assert f"model {str(other)!r} has another tokenizer than the target model ({path})" in msg, msg
    assert "token id 100 is" in msg and e.value.hint
    with pytest.raises(ConfigError, match="another tokenizer"):
        estimate_plan(EngineConfig(str(path), speculative_config=spec(other)), 64, 2)
    same = tmp_path / "same"  # the same ids, the file written otherwise
    import shutil
    shutil.copytree(path, same)
    (same / "tokenizer.json").write_text(json.dumps(json.loads((path / "tokenizer.json").read_text()), indent=2))
    none = _retokenized(path, tmp_path / "none", drop=True)
    prompts = random_prompts(512, (7, 4), seed=9)
    want = _outputs(LLM(str(path), block_size=4), prompts, [8, 8])
    for draft in (same, none):
        assert _outputs(LLM(str(path), block_size=4, speculative_config=spec(draft)), prompts, [8, 8]) == want
    from infer.engine.draft import _token_ids  # (a tokenizer.json read as transformers loads it: the same ids)
    assert _token_ids(path, True) == _token_ids(path, False) and len(_token_ids(path, True)[0]) == 512  # (, special)


def test_a_draft_of_another_vocabulary_size_is_refused_naming_the_target_too(tmp_path, path):
    import json
    import shutil

    from infer.errors import ConfigError
    small = tmp_path / "small"
    shutil.copytree(path, small)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 256}))
    with pytest.raises(ConfigError) as e:
        LLM(str(path), speculative_config=spec(small))
    assert f"model {str(small)!r} has a vocabulary of 256 tokens, the target model 512 ({path})" in str(e.value)
