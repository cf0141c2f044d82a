"""infer.bench.host_overhead: the host's share of a GPU-path engine step, measured on the CPU with Triton's launches
stubbed out and counted."""

from __future__ import annotations

import pytest
import triton.runtime.interpreter as interpreter
import triton.runtime.jit as jit

from infer import kernels
from infer.bench import host_overhead
from infer.quant.gptq_linear import GPTQLinearMethod


def test_rows_count_the_launches_and_the_piecewise_alternative():
    rows = host_overhead.measure("llama-2-7b", concurrency=4, adapters=2, prompt_len=6, repeats=2, num_layers=2)
    assert [(r["step"], r["adapters"], r["tokens"]) for r in rows] == [
        ("decode", "none", 4), ("decode", "2 mixed", 4), ("mixed", "none", 9), ("mixed", "2 mixed", 9)]
    plain, mixed = rows[0]["launches"], rows[1]["launches"]
    assert plain > 0 and mixed > plain  # the adapters' shrink and expand launches come on top
    # a decode step without adapters, per layer: the norm (the first with the embedding), qkv, the attention, o, the
    # norm, gate_up applying silu_and_mul in its epilogue (EngineConfig.silu_in_gate_up), down; the final norm
    assert plain == 7 * 2 + 1
    # with two adapters: one shrink per projection (qkv, o, gate_up, down) and layer, and no expand launch: the
    # rms_norm after o and after down adds theirs, the int4 kernels of qkv and gate_up theirs in the epilogue (two
    # adapters' chunks are a short walk: gptq_gemm.fuses_lora); gate_up's delta comes before the activation, so
    # silu_and_mul is launched after it
    assert mixed - plain == 4 * 2 + 2
    assert all(r["host_ms"] > 0 and r["us_per_launch"] > 0 for r in rows)
    # 3 replays, the 2 attentions' launches (one each here), 2 copies, the input copies
    assert rows[2]["launches_piecewise"] == 3 + 2 + 2 + host_overhead.INPUT_COPIES
    assert rows[0]["launches_piecewise"] is None


def test_the_stubs_are_undone_even_on_an_error():
    saved = (jit.JITFunction.run, interpreter.InterpretedFunction.run, kernels.use_triton,
             GPTQLinearMethod.finish_loading)
    with pytest.raises(RuntimeError):
        with host_overhead.gpu_code_path_without_launches() as count:
            assert kernels.use_triton(None) and count == [0]
            raise RuntimeError("inside")
    assert (jit.JITFunction.run, interpreter.InterpretedFunction.run, kernels.use_triton,
            GPTQLinearMethod.finish_loading) == saved
