"""Decode steps through CUDA graphs (engine.cuda_graphs). Without a GPU the graphs are emulated: the same static
buffers, buckets, padding rows and LoRA maps, replayed by calling the model again, so everything but the recording
is checked on CPU; on a GPU the real graphs must give the eager engine's tokens."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine import cuda_graphs
from infer.engine.cuda_graphs import batch_buckets
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64)[-3:] == [48, 56, 64]


def _generate(llm, prompts, lens, lora=None):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens]
    return [o.token_ids for o in llm.generate(prompts, params, lora=lora)]


def test_emulated_graphs_give_hf_tokens_with_padding_rows():
    """7 sequences of different output lengths: the decode batch shrinks 7 -> 1, so every bucket (1, 2, 4, 8) is
    replayed with padding rows; tokens equal HF's and the eager engine's."""
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), max_num_seqs=8, block_size=4, num_kv_blocks=128, max_model_len=96)
    llm.engine.runner.capture_graphs(96, emulate=True)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 9, 3, 12, 7, 4, 10), seed=11)
    lens = [3, 5, 8, 11, 14, 17, 20]
    got = _generate(llm, prompts, lens)
    graphs = llm.engine.runner.graphs
    assert set(graphs.replays) == {1, 2, 4, 8} and sum(graphs.replays.values()) >= 15
    assert got == [hf_greedy(str(path), p, n) for p, n in zip(prompts, lens)]


def test_emulated_graphs_with_mixed_adapters_match_peft(tmp_path):
    from test_lora_engine import SPECS, hf_float, peft_greedy, save_adapter
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    adapters = {name: save_adapter(hf, tmp_path / name, seed=i + 1, **kw) for i, (name, kw) in enumerate(SPECS.items())}
    llm = LLM(str(path), loras={n: str(p) for n, p in adapters.items()}, max_loras=4, max_lora_rank=64,
              max_num_seqs=8, block_size=4, num_kv_blocks=128, max_model_len=96)
    llm.engine.runner.capture_graphs(96, emulate=True)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 11, 3, 17, 8, 6), seed=5)
    names = [*SPECS, None, "all8"]
    got = _generate(llm, prompts, [6] * 6, lora=names)
    assert llm.engine.runner.graphs.replays[8] >= 5
    assert got == peft_greedy(hf, adapters, list(zip(names, prompts)), n=6)
    # a step with no adapter at all replays the same graph with every row in the base group
    plain = _generate(llm, prompts[:3], [4] * 3)
    assert plain == peft_greedy(hf, adapters, [(None, p) for p in prompts[:3]], n=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_graphs_equal_eager_on_gpu(dtype):
    path = ensure_builtin("tiny-llama")
    prompts = random_prompts(256, (5, 9, 3, 12, 7), seed=2)
    lens = [4, 9, 13, 6, 16]
    out = {}
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype=dtype, max_num_seqs=8, block_size=16, enforce_eager=eager)
        out[eager] = _generate(llm, prompts, lens)
        assert (llm.engine.runner.graphs is None) == eager
        if not eager:
            assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert out[True] == out[False]
    if dtype == "float32":
        assert out[False] == [hf_greedy(str(path), p, n) for p, n in zip(prompts, lens)]


@pytest.fixture
def triton_everywhere(monkeypatch):
    """Every op through its Triton kernel, interpreted on CPU (conftest sets TRITON_INTERPRET=1 without a GPU):
    the whole GPU code path of the engine, graphs emulated, at tiny sizes."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels and graphs (test_cuda_graphs_equal_eager_on_gpu)")
    from infer import kernels
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_interpreted_triton_engine_with_emulated_graphs_gives_hf_tokens(triton_everywhere, name):
    path = ensure_builtin(name)
    llm = LLM(str(path), max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64, cuda_graph_max_tokens=16)
    llm.engine.runner.capture_graphs(64, emulate=True)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 9, 3), seed=1)
    lens = [4, 6, 8]
    got = _generate(llm, prompts, lens)
    assert set(llm.engine.runner.graphs.replays) == {1, 2, 4}
    assert got == [hf_greedy(str(path), p, n) for p, n in zip(prompts, lens)]


@pytest.mark.parametrize("in_consumers", [False, True])
def test_interpreted_triton_lora_under_emulated_graphs_matches_peft(triton_everywhere, tmp_path, in_consumers):
    """The static adapter map a graph replays (padding rows first in the order, shifted segment starts) read by
    the Triton shrink/expand kernels, as on a GPU; the o/down expands added by the rms_norm after them, the qkv and
    gate_up expands launched after their matmuls or (in_consumers: EngineConfig.lora_expand_fused) added by
    decode_attention and silu_and_mul."""
    from test_lora_engine import SPECS, hf_float, peft_greedy, save_adapter
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    specs = {n: SPECS[n] for n in ("qv4", "all8", "mlp16rs")}
    adapters = {name: save_adapter(hf, tmp_path / name, seed=i + 1, **kw) for i, (name, kw) in enumerate(specs.items())}
    llm = LLM(str(path), loras={n: str(p) for n, p in adapters.items()}, max_loras=3, max_lora_rank=16,
              max_num_seqs=8, block_size=4, num_kv_blocks=64, max_model_len=64, cuda_graph_max_tokens=16,
              **({"lora_expand_fused": True} if in_consumers else {}))
    # by default the o/down expands only go to their consumer (the rms_norm after them)
    assert {(layer.fused, layer.fused_norm) for layer in llm.engine.lora_manager.layers} == {(in_consumers, True)}
    llm.engine.runner.capture_graphs(64, emulate=True)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 8, 3, 6, 4), seed=9)
    names = ["all8", None, "qv4", "mlp16rs", "all8"]
    got = _generate(llm, prompts, [4] * 5, lora=names)
    assert llm.engine.runner.graphs.replays[8] >= 3  # 5 rows padded to 8
    assert got == peft_greedy(hf, adapters, list(zip(names, prompts)), n=4)


@pytest.mark.parametrize("lora", [False, True], ids=["no-adapters", "adapters"])
def test_graphs_recorded_on_a_high_priority_stream_with_graph_priority(monkeypatch, lora):
    """EngineConfig.graph_priority: True records the decode graphs and the piecewise ones on one stream of high
    priority (made once per device), so that their main branch's kernels outrank the LoRA shrinks on the side stream
    (torch instantiates graphs with each node's priority); False on torch's own capture stream (stream=None); None
    (the default) at high priority only where there are adapters and the graph has PRIORITY_AUTO_TOKENS tokens or
    more. The CUDA calls are stood in for on the CPU: the recordings run the model eagerly."""
    import contextlib

    made, used = [], []

    class Graph:
        def pool(self):
            return "pool"

    @contextlib.contextmanager
    def recording(graph, pool=None, stream=None):
        used.append(stream)
        yield
    path = ensure_builtin("tiny-llama")
    auto = cuda_graphs.PRIORITY_AUTO_TOKENS
    for high in (False, True, None):
        llm = LLM(str(path), max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=auto + 16,
                  graph_priority=high, cuda_graph_max_tokens=auto + 16, enable_lora=lora, max_lora_rank=8)
        made.clear(), used.clear()
        with monkeypatch.context() as m:  # (after the engine is built: the libraries it imports look at them)
            m.setattr(torch.cuda, "Stream", lambda device=None, priority=0: made.append(priority) or ("s", priority))
            m.setattr(torch.cuda, "CUDAGraph", Graph)
            m.setattr(torch.cuda, "graph", recording)
            m.setattr(torch.cuda, "synchronize", lambda device=None: None)
            m.setattr(cuda_graphs, "_HIGH", {})
            m.setattr(llm.engine.runner, "check_pieces", lambda pieces: 0.0)  # stand-in graphs compute nothing
            llm.engine.runner.capture_graphs(auto + 16)
        runner = llm.engine.runner
        decode, pieces = runner.graphs.buckets, runner.pieces.buckets
        assert max(decode) < auto <= max(pieces) and auto in pieces, (decode, pieces, auto)
        # one recording per decode bucket, and per piece of the forward for each token bucket of the pieces
        n = runner.pieces.num_pieces
        assert len(used) == len(decode) + n * len(pieces)
        want = len(used) if high else 0 if high is False or not lora else n * sum(b >= auto for b in pieces)
        assert used.count(("s", -1)) == want and used.count(None) == len(used) - want, (high, lora, used)
        assert made == ([-1] if want else []), (high, made)
        llm.close()
