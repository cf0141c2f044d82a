"""Property test of the scheduler with the real block manager and the real adapter slots.

Random arrivals, prompt lengths, shared prefixes, adapters (three adapters for two device slots), aborts at random
steps, prefix caching on or off, and a KV cache small enough that sequences are preempted. The model does not run:
a step is the engine's step (schedule -> the batch's tokens are computed -> a token is appended to every sequence
whose tokens are all computed -> finish at max_new_tokens) with a made-up token, so hundreds of schedules are checked
in seconds. tests/test_engine_property.py runs the same kind of workload through the real engine and model.

After every step: reference counts equal the block tables that hold them, only running sequences hold blocks, every
computed block holds the K/V of exactly the tokens (and adapter) the sequence expects there (a block shared through
the prefix cache included), adapter pins equal the running sequences of each adapter and their adapters sit in
distinct slots, the batch respects max_num_seqs and max_num_batched_tokens, and a step with work pending schedules
something. At the end: every request finished (or was aborted), no block in use, no adapter pinned.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from infer.engine.block_manager import BlockManager
from infer.engine.config import EngineConfig
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler
from infer.engine.sequence import Sequence, Status
from infer.lora.manager import LoRAManager
from infer.models.loader import load_model
from infer.models.tiny import ensure_builtin

from lora_helpers import THREE, hf_float, save_adapter

MAX_LORAS = 2
PREFIXES = [[1, 2, 3, 1, 2, 3, 1, 2], [3, 3, 0, 1, 2, 0, 0, 1], [1, 2, 3, 1, 0, 0, 0, 0]]


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """The tiny model (its layers are what the adapter slots attach to) and three PEFT adapters for it."""
    base = ensure_builtin("tiny-llama")
    root = tmp_path_factory.mktemp("adapters")
    hf = hf_float(base)
    paths = {n: save_adapter(hf, root / n, seed=i + 1, **kw) for i, (n, kw) in enumerate(THREE.items())}
    model, _ = load_model(base, torch.float32, torch.device("cpu"))
    return Quiet((model, paths))


class Quiet(tuple):
    """A fixture value whose repr stays one line in hypothesis' report of a failing example."""

    def __repr__(self) -> str:
        return "<tiny-llama and adapters a, b, c>"


requests = st.lists(st.fixed_dictionaries({
    "arrival": st.integers(0, 12),
    "prefix": st.sampled_from(range(len(PREFIXES))),
    "prefix_len": st.integers(0, 8),
    "tail": st.lists(st.integers(0, 3), min_size=1, max_size=10),
    "lora": st.sampled_from([None, *THREE]),
    "max_new": st.integers(1, 6),
    "abort": st.one_of(st.none(), st.integers(0, 40)),
    "priority": st.integers(0, 3),  # read under the priority policy (fcfs: every request 0)
}), min_size=1, max_size=10)


class World:
    """The scheduler under test, its block manager and adapter slots, and a shadow of what every block holds."""

    def __init__(self, model, paths, block_size, num_blocks, caching, max_num_seqs, max_tokens, policy="fcfs"):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.lora = LoRAManager(model, max_loras=MAX_LORAS, max_lora_rank=8)
        for name, path in paths.items():
            self.lora.register(name, path)
        config = EngineConfig(model="tiny-llama", max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                              block_size=block_size, scheduling_policy=policy)
        self.sched = Scheduler(config, self.bm, self.lora)
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_tokens
        self.seqs: list[Sequence] = []
        self.written: dict[int, tuple] = {}  # block id -> (adapter, the tokens up to the last one written in it)
        self.aborted: set[str] = set()

    def abort(self, seq: Sequence) -> None:
        """What LLMEngine.abort_request does to a request that has not finished."""
        self.sched.finish(seq, "abort")
        self.aborted.add(seq.request_id)

    def step(self) -> None:
        batch = self.sched.schedule()
        assert batch or not self.sched.has_unfinished(), "work is pending but nothing was scheduled (deadlock)"
        assert len(batch.seqs) <= self.max_num_seqs and batch.num_tokens <= self.max_tokens
        assert len(set(map(id, batch.seqs))) == len(batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status == Status.RUNNING and 1 <= n <= seq.num_uncomputed_tokens
            assert seq.request_id not in self.aborted, f"aborted {seq.request_id} is scheduled again"
            self._write(seq, seq.num_computed_tokens, n)
            seq.num_computed_tokens += n
            self.bm.register_computed(seq)
            if seq.num_computed_tokens == len(seq):
                seq.output_token_ids.append((len(seq) * 7 + len(seq.request_id)) % 4)
                if seq.num_generated >= seq.params.max_new_tokens:
                    self.sched.finish(seq, "length")

    def _write(self, seq: Sequence, start: int, n: int) -> None:
        """Record what the K/V of positions start..start+n-1 are computed from; only an unshared block is written, or
        one that this step's schedule put in the prefix cache (register_scheduled), which a request admitted later in
        the step shares: the forward writes every K/V of the step before any attention reads (checked after it)."""
        bs = self.bm.block_size
        for p in range(start, start + n):
            bid = seq.block_table[p // bs]
            assert self.bm.blocks[bid].ref_count == 1 or bid in self.bm.scheduled, \
                "a step writes into a block another sequence shares"
            self.written[bid] = (seq.lora, tuple(seq.all_token_ids[:p + 1]))

    def check(self) -> None:
        bm, running = self.bm, self.sched.running
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        refs = [0] * bm.num_blocks
        for seq in running:
            for bid in seq.block_table:
                refs[bid] += 1
        for block in bm.blocks:
            assert block.ref_count == refs[block.block_id], "reference count differs from the block tables"
            assert (block.ref_count == 0) == (block.block_id in bm.free)
        for seq in self.seqs:
            if seq.status != Status.RUNNING:
                assert not seq.block_table, f"{seq.status.value} sequence {seq.request_id} holds blocks"
            assert (seq.status == Status.RUNNING) == any(s is seq for s in running)
        for seq in running:
            self._check_contents(seq)
        self._check_adapters()
        if self.sched.by_priority:  # both queues in (priority, arrival, admission) order: the last is the victim
            for queue in (self.sched.running, list(self.sched.waiting)):
                ranks = [Scheduler.rank(s) for s in queue]
                assert ranks == sorted(ranks), "a queue is out of priority order"

    def _check_contents(self, seq: Sequence) -> None:
        """Every computed position's block holds the K/V of this sequence's tokens up to there, with its adapter."""
        bs = self.bm.block_size
        assert seq.num_computed_tokens <= len(seq) and len(seq.block_table) * bs >= seq.num_computed_tokens
        tokens = seq.all_token_ids
        for i in range(-(-seq.num_computed_tokens // bs)):
            end = min((i + 1) * bs, seq.num_computed_tokens)
            assert self.written.get(seq.block_table[i]) == (seq.lora, tuple(tokens[:end])), \
                f"block {i} of {seq.request_id} holds K/V computed from other tokens (or another adapter)"

    def _check_adapters(self) -> None:
        running = self.sched.running
        for name in self.lora.names():
            users = sum(1 for s in running if s.lora == name)
            assert self.lora.pins(name) == users, f"adapter {name!r}: {self.lora.pins(name)} pins, {users} users"
        slots = self.lora.resident()
        assert len(set(slots.values())) == len(slots) and all(0 <= s < MAX_LORAS for s in slots.values())
        for seq in running:
            assert seq.lora is None or seq.lora in slots, f"{seq.request_id} runs without its adapter in a slot"


def _req(lora, tail, max_new, arrival=0, abort=None) -> dict:
    return dict(arrival=arrival, prefix=0, prefix_len=0, tail=tail, lora=lora, max_new=max_new, abort=abort,
                priority=0)


# Always tried first: three adapters running at once for two slots; two adapters whose sequences preempt each other.
THREE_AT_ONCE = dict(reqs=[_req(n, [1, 2], 4) for n in THREE], block_size=4, extra_blocks=8, caching=True,
                     max_num_seqs=3, max_tokens=32)
PREEMPT_WITH_ADAPTERS = dict(reqs=[_req("a", [1] * 6, 6), _req("b", [2] * 6, 6), _req("c", [3], 2, arrival=3)],
                             block_size=2, extra_blocks=0, caching=False, max_num_seqs=4, max_tokens=32)


def _sequence(i: int, r: dict, policy: str = "fcfs") -> Sequence:
    prompt = PREFIXES[r["prefix"]][:r["prefix_len"]] + r["tail"]
    params = SamplingParams(max_new_tokens=r["max_new"], ignore_eos=True,
                            priority=r["priority"] if policy == "priority" else 0)
    return Sequence(f"r{i}", prompt, params, r["lora"], max_total_len=len(prompt) + r["max_new"])


def drive(w, seqs, reqs) -> None:
    """Step the world `w` until every sequence is done: each request arrives and is aborted at its step, and the
    invariants are checked after every step; the step count is bounded."""
    step, limit = 0, 40 + 10 * sum(s.max_total_len for s in seqs)
    while step <= 12 or w.sched.has_unfinished():
        assert step < limit, "the workload did not finish in a bounded number of steps"
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                w.seqs.append(seqs[i])
                w.sched.add(seqs[i])
            if r["abort"] == step and seqs[i] in w.seqs and not seqs[i].finished:
                w.abort(seqs[i])
        w.step()
        w.check()
        step += 1


@example(**THREE_AT_ONCE, policy="fcfs")
@example(**PREEMPT_WITH_ADAPTERS, policy="priority")
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 24),
       caching=st.booleans(), max_num_seqs=st.integers(1, 6), max_tokens=st.integers(1, 32),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_workloads_keep_invariants_and_finish(lora_model, reqs, block_size, extra_blocks, caching,
                                                     max_num_seqs, max_tokens, policy):
    seqs = [_sequence(i, r, policy) for i, r in enumerate(reqs)]
    need = max(-(-s.max_total_len // block_size) for s in seqs)  # the engine refuses a request above the cache
    max_tokens = max(max_tokens, max_num_seqs)  # the engine refuses fewer tokens a step than sequences (as vLLM)
    w = World(*lora_model, block_size, need + extra_blocks, caching, max_num_seqs, max_tokens, policy)
    drive(w, seqs, reqs)
    for seq, r in zip(seqs, reqs):
        assert seq.finished and (seq.finish_reason == "abort") == (seq.request_id in w.aborted)
        if seq.finish_reason != "abort":
            assert seq.finish_reason == "length" and seq.num_generated == r["max_new"]
    assert w.bm.num_used_blocks == 0 and w.bm.num_free_blocks == w.bm.num_blocks
    assert all(w.lora.pins(n) == 0 for n in w.lora.names()), {n: w.lora.pins(n) for n in w.lora.names()}
