"""Multi-LoRA decode steps whose adapter tokens are not a tidy block, through the whole engine, with peft as the
oracle (each request's greedy tokens equal peft's with its adapter).

The CPU reference (infer.kernels.lora_reference) runs a decode step with three or more adapters, a token or two
each, as one bmm: over views of the tokens ("uniform") when they are in slot order and the used slots consecutive
with equal counts, otherwise over gathered tokens and the weights of the slots in use ("padded"). The engine sorts
a batch by adapter, so two layouts are left for an engine test to produce on purpose:

- eager, a gap in the used slots: four adapters resident, one of them finished early, so slots 0, 2, 3 decode
  together (with base rows) and the padded path must pick the weights of exactly those slots;
- decode graphs (emulated on CPU): padding rows join the base group at the front of the token order, so the order
  is not the identity even though the batch is sorted, and the view path must not be taken.

A spy on the plan checks that each test really produces its layout, rather than trusting the setup.
"""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.kernels import lora_reference
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import THREE, PeftOracle, hf_float, save_adapter

FOUR = {**THREE, "d": dict(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"])}
OPTS = dict(max_loras=4, max_lora_rank=8, block_size=4, num_kv_blocks=96, max_model_len=64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = ensure_builtin("tiny-llama")
    root = tmp_path_factory.mktemp("gap_adapters")
    hf = hf_float(base)
    paths = {name: save_adapter(hf, root / name, seed=40 + i, **kw) for i, (name, kw) in enumerate(FOUR.items())}
    oracle = PeftOracle(hf, paths)
    yield base, {n: str(p) for n, p in paths.items()}, oracle
    oracle.close()


@pytest.fixture
def steps(monkeypatch):
    """Every LoRA plan the reference makes: (kind, slot of every segment, tokens per segment, in_order, order is
    the identity)."""
    seen = []
    make = lora_reference._make_plan

    def spy(groups):
        found = make(groups)
        segs = lora_reference.segments(groups)
        order = groups.order.tolist()
        seen.append((found[0], [s for s, _, _ in segs], [e - b for _, b, e in segs], groups.in_order,
                     order == list(range(len(order)))))
        return found

    monkeypatch.setattr(lora_reference, "_make_plan", spy)
    return seen


def _run(llm, rows):
    """Generate every (adapter, prompt, max_new_tokens) row in one call; the token ids of each."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, _, n in rows]
    outs = llm.generate([p for _, p, _ in rows], params, lora=[name for name, _, _ in rows])
    assert [o.finish_reason for o in outs] == ["length"] * len(rows)
    return [o.token_ids for o in outs]


def _check_peft(oracle, rows, got):
    assert got == [oracle.greedy(name, p, n) for name, p, n in rows]
    changed = [oracle.greedy(name, p, n) != oracle.greedy(None, p, n) for name, p, n in rows if name is not None]
    assert sum(changed) >= len(changed) - 1  # the adapters do change the tokens


def test_decode_with_a_gap_in_the_used_slots_matches_peft(setup, steps):
    """a, b, c, d take slots 0..3; b's request stops after 2 tokens, so the later decode steps use slots 0, 2, 3
    (a with two requests, c and d one each) beside two base rows: the padded path, gathering slots 0, 2, 3."""
    base, loras, oracle = setup
    llm = LLM(str(base), loras=loras, **OPTS)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (6, 9, 4, 11, 7, 5, 8), seed=17)
    names = ["a", "b", "c", "d", None, "a", None]
    lens = [7, 2, 7, 6, 7, 5, 3]
    rows = list(zip(names, prompts, lens))
    got = _run(llm, rows)
    assert llm.engine.lora_manager.resident() == {"a": 0, "b": 1, "c": 2, "d": 3}
    gaps = {(tuple(slots), tuple(counts)) for kind, slots, counts, _, _ in steps
            if kind == "padded" and slots != list(range(len(slots)))}
    assert ((0, 2, 3), (2, 1, 1)) in gaps, steps  # two tokens of a, one of c and d: slot 1 idle between them
    _check_peft(oracle, rows, got)


def test_decode_graph_padding_rows_leave_the_token_order_unsorted(setup, steps):
    """Five sequences replay the graph of 8: its 3 padding rows sit first in the token order, then the 2 base rows,
    then a, b, c one token each in slots 0, 1, 2. In slot order that is the layout of the view path (consecutive
    slots, equal counts), but the tokens are not in that order, so the reference must gather them."""
    base, loras, oracle = setup
    llm = LLM(str(base), loras=loras, max_num_seqs=8, **OPTS)
    llm.engine.runner.capture_graphs(OPTS["max_model_len"], emulate=True)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 8, 3, 10, 6), seed=23)
    rows = list(zip(["a", "b", None, "c", None], prompts, [6] * 5))
    got = _run(llm, rows)
    assert llm.engine.runner.graphs.replays[8] >= 5
    assert {"a", "b", "c"} <= set(llm.engine.lora_manager.resident())
    unsorted = [(slots, counts) for _, slots, counts, in_order, identity in steps if not in_order and not identity]
    assert ([0, 1, 2], [1, 1, 1]) in unsorted, steps
    _check_peft(oracle, rows, got)
