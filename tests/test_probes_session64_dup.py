"""Session 64 (p64dup): the MoE bench's int4 and MXFP4 rows (a step's inputs drawn by one function) count the
experts a step's routing chooses, each expert once."""

from __future__ import annotations

from test_probes_session61_epi import counted_clock, interpreted, moe  # noqa: F401 (moe: a fixture)


@interpreted
def test_the_moe_bench_rows_count_each_chosen_expert_once(moe, monkeypatch):
    """`python -m infer.bench.moe`'s int4 and --mxfp4 measuring code (interpreted, a wall-clock timer, tiny experts):
    a step's experts_chosen (the experts its bytes are counted over) is at least top_k and at most the experts there
    are, and its tokens' picks."""
    from infer.bench import moe as bench
    from infer.kernels import gptq_tune
    monkeypatch.setattr(gptq_tune, "time_graph", counted_clock)
    experts, top_k = 4, 2
    for rows in (bench.measure([1, 5], experts, top_k, 64, 32, 32, False, 1e12, device="cpu"),
                 bench.measure_mxfp4([1, 5], experts, top_k, 64, 32, 1e12, device="cpu")):
        assert [r["tokens"] for r in rows] == [1, 5]
        for r in rows:
            assert top_k <= r["experts_chosen"] <= min(experts, r["tokens"] * top_k), r
