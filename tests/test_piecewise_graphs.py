"""Steps that are not all decodes through piecewise CUDA graphs (engine.cuda_graphs.PiecewiseGraphs): the forward
between two attentions replayed per bucket of tokens, the attention eager on the step's real sequences. Without a
GPU the graphs are emulated (the same static buffers, buckets, padding rows and adapter maps, replayed by running
the pieces again); on a GPU the real graphs must give the eager engine's tokens."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.cuda_graphs import token_buckets
from infer.errors import ConfigError
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, random_prompts


def test_token_buckets():
    assert token_buckets(8) == [8]
    assert token_buckets(16) == [16]
    assert token_buckets(40) == [16, 32, 40]
    assert token_buckets(512) == [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert token_buckets(1000)[-4:] == [640, 768, 896, 1000]
    buckets = token_buckets(4096)
    for below, b in zip([0] + buckets, buckets):  # the worst step of a bucket: one row more than the bucket below
        worst = below + 1
        assert b - worst <= 15 if worst <= 64 else (b - worst) / worst < 0.25, (worst, b)


def test_option_is_checked_and_capped_by_the_step_budget():
    assert EngineConfig("m").piecewise_tokens() == 512
    assert EngineConfig("m", max_num_batched_tokens=100).piecewise_tokens() == 100
    assert EngineConfig("m", cuda_graph_max_tokens=0).piecewise_tokens() == 0
    with pytest.raises(ConfigError, match="--cuda-graph-max-tokens must be in 0..8192, got -1"):
        EngineConfig("m", cuda_graph_max_tokens=-1)


def test_pool_budget_grows_with_the_piecewise_tokens(monkeypatch):
    from transformers import LlamaConfig

    from infer.memory.plan import cuda_graph_bytes
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)
    none = cuda_graph_bytes(EngineConfig("m", max_num_seqs=16, cuda_graph_max_tokens=0), cfg, torch.float16)
    some = cuda_graph_bytes(EngineConfig("m", max_num_seqs=16, cuda_graph_max_tokens=512), cfg, torch.float16)
    # a 512-token piece holds the MLP's gate_up, silu and product (4 x intermediate per token, fp16), and the
    # static query, attention output, residual and hidden buffers (4 x 4096 per token)
    assert some - none >= 512 * (4 * 11008 + 4 * 4096) * 2
    assert some - none < 1 << 30


def _route(llm, check_hidden: bool = False) -> list[tuple[list[int], str]]:
    """Record, for every forward, the tokens of each sequence and the path it took (decode graph, pieces, eager).
    check_hidden: the hidden states of every step through the pieces must equal the whole forward's on the same
    inputs (run again: it writes the same K and V into the same slots)."""
    runner = llm.engine.runner
    graphs, pieces = runner.graphs, runner.pieces  # (the warm-up takes the pieces away for a while)
    seen = []
    forward = runner.forward

    def spy(input_ids, positions, ctx, num_new_tokens):
        before = sum(graphs.replays.values()), sum(pieces.replays.values())
        out = forward(input_ids, positions, ctx, num_new_tokens)
        after = sum(graphs.replays.values()), sum(pieces.replays.values())
        path = "decode" if after[0] > before[0] else "pieces" if after[1] > before[1] else "eager"
        seen.append((list(num_new_tokens), path))
        if check_hidden and path == "pieces":
            torch.testing.assert_close(out, runner.model(input_ids, positions, ctx), rtol=1e-5, atol=1e-5)
        return out

    runner.forward = spy
    return seen


def _expected_path(tokens: list[int], most: int) -> str:
    return "decode" if max(tokens) == 1 else "pieces" if sum(tokens) <= most else "eager"


def _generate(llm, prompts, lens, lora=None):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens]
    return [o.token_ids for o in llm.generate(prompts, params, lora=lora)]


def test_emulated_pieces_take_prefills_and_mixed_steps_and_give_hf_tokens():
    """3 running at most, 6 prompts: the later prompts' prefills run beside decodes (mixed steps). Steps of up to
    32 tokens replay the pieces (buckets 16, 32, padded), the 40-token prompt's step runs eagerly, decodes replay
    the decode graphs; the tokens equal HF's."""
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), max_num_seqs=3, max_num_batched_tokens=64, cuda_graph_max_tokens=32, block_size=4,
              num_kv_blocks=128, max_model_len=96)
    llm.engine.runner.capture_graphs(96, emulate=True)
    assert llm.engine.runner.pieces.buckets == [16, 32]
    seen = _route(llm, check_hidden=True)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 9, 3, 40, 7, 12), seed=3)
    lens = [3, 9, 5, 4, 7, 6]
    got = _generate(llm, prompts, lens)
    assert [p for _, p in seen] == [_expected_path(t, 32) for t, _ in seen]
    mixed = [t for t, p in seen if p == "pieces" and min(t) == 1]
    assert mixed and any(p == "eager" for _, p in seen) and any(p == "decode" for _, p in seen)
    assert set(llm.engine.runner.pieces.replays) == {16, 32}
    assert llm.engine.stats()["piecewise_graph_steps"] == sum(p == "pieces" for _, p in seen)
    assert got == [hf_greedy(str(path), p, n) for p, n in zip(prompts, lens)]


def test_the_start_checks_the_pieces_against_the_whole_forward(caplog):
    """After capturing, the runner compares a test prefill through the pieces with the whole forward; pieces that
    disagree (here: the last piece's hidden states scaled) are not used, with a warning, and every step runs as
    before, eagerly."""
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), max_num_seqs=3, cuda_graph_max_tokens=32, block_size=4, num_kv_blocks=64, max_model_len=64)
    runner = llm.engine.runner
    runner.capture_graphs(64, emulate=True)
    assert runner.pieces is not None and 0 <= runner.pieces_check < 1e-5
    model = runner.model
    real = model.piece

    def skewed(i, *args):
        out, residual = real(i, *args)
        return (out * 1.5 if residual is None else out), residual
    model.piece = skewed
    with caplog.at_level("WARNING", logger="infer"):
        runner.capture_graphs(64, emulate=True)
    assert runner.pieces is None and runner.pieces_check == pytest.approx(0.5, rel=1e-4)
    assert "prefills and mixed steps run eagerly instead" in caplog.text
    scale = [float("nan")]  # hidden states that are not numbers fail the check too

    def poisoned(i, *args):
        out, residual = real(i, *args)
        return (out * scale[0] if residual is None else out), residual
    model.piece = poisoned
    runner.capture_graphs(64, emulate=True)
    assert runner.pieces is None and runner.pieces_check != runner.pieces_check  # NaN
    prompts = random_prompts(llm.engine.model_config.vocab_size, (6, 9), seed=6)
    assert _generate(llm, prompts, [3, 3]) == [hf_greedy(str(path), p, 3) for p in prompts]
    assert llm.engine.stats()["piecewise_graph_steps"] == 0


def test_emulated_pieces_with_mixed_adapters_match_peft(tmp_path):
    """Prefills of different adapters beside decodes of others: the static adapter map of the pieces (padding
    rows first in the order, segment starts shifted by them) gives peft's tokens."""
    from test_lora_engine import SPECS, hf_float, peft_greedy, save_adapter
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    adapters = {name: save_adapter(hf, tmp_path / name, seed=i + 1, **kw) for i, (name, kw) in enumerate(SPECS.items())}
    llm = LLM(str(path), loras={n: str(p) for n, p in adapters.items()}, max_loras=4, max_lora_rank=64,
              max_num_seqs=3, cuda_graph_max_tokens=48, block_size=4, num_kv_blocks=128, max_model_len=96)
    llm.engine.runner.capture_graphs(96, emulate=True)
    seen = _route(llm)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 11, 3, 17, 8, 6), seed=5)
    names = [*SPECS, None, "all8"]
    lens = [3, 6, 4, 5, 6, 2]
    got = _generate(llm, prompts, lens, lora=names)
    assert any(p == "pieces" and min(t) == 1 for t, p in seen)
    assert all(p != "eager" for _, p in seen)
    want = peft_greedy(hf, adapters, list(zip(names, prompts)), n=max(lens))
    assert got == [o[:n] for o, n in zip(want, lens)]


@pytest.fixture
def triton_everywhere(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels and graphs (test_piecewise_graphs_equal_eager_on_gpu)")
    from infer import kernels
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)


def test_interpreted_triton_pieces_with_adapters_match_peft(triton_everywhere, tmp_path):
    """The Triton kernels (interpreted) read the pieces' static buffers and adapter map on mixed steps."""
    from test_lora_engine import SPECS, hf_float, peft_greedy, save_adapter
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    specs = {n: SPECS[n] for n in ("all8", "mlp16rs")}
    adapters = {name: save_adapter(hf, tmp_path / name, seed=i + 1, **kw) for i, (name, kw) in enumerate(specs.items())}
    llm = LLM(str(path), loras={n: str(p) for n, p in adapters.items()}, max_loras=2, max_lora_rank=16,
              max_num_seqs=2, cuda_graph_max_tokens=16, block_size=4, num_kv_blocks=64, max_model_len=64)
    llm.engine.runner.capture_graphs(64, emulate=True)
    seen = _route(llm)
    prompts = random_prompts(llm.engine.model_config.vocab_size, (5, 8, 6), seed=9)
    names = ["all8", None, "mlp16rs"]
    lens = [2, 4, 3]
    got = _generate(llm, prompts, lens, lora=names)
    assert any(p == "pieces" and min(t) == 1 for t, p in seen)
    assert got == [o[:n] for o, n in zip(peft_greedy(hf, adapters, list(zip(names, prompts)), n=max(lens)), lens)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_piecewise_graphs_equal_eager_on_gpu(dtype):
    """Real recordings: with prefills and mixed steps routed through the pieces, the tokens equal the eager engine's
    (and HF's in float32). In float16 a padded bucket may round a row differently from the eager step's size, so a
    divergence passes only at a near-tie of the eager run: both tokens its top two, within 0.01 in logprob."""
    path = ensure_builtin("tiny-llama")
    prompts = random_prompts(256, (5, 9, 3, 40, 7, 12), seed=2)
    lens = [4, 9, 13, 6, 16, 5]
    out = {}
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype=dtype, max_num_seqs=3, block_size=16, enforce_eager=eager,
                  cuda_graph_max_tokens=32)
        seen = _route(llm) if not eager else None
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=2) for n in lens]
        out[eager] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
        if not eager:
            assert any(p == "pieces" and min(t) == 1 for t, p in seen)
            assert [p for _, p in seen] == [_expected_path(t, 32) for t, _ in seen]
        llm.close()
    for (want, records), (got, _) in zip(out[True], out[False]):
        if dtype == "float32" or want == got:
            assert got == want
            continue
        d = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        top = {t["token_id"]: t["logprob"] for t in records[d]["top_logprobs"]}
        assert set(top) >= {got[d], want[d]} and abs(top[got[d]] - top[want[d]]) <= 0.01, (d, records[d])
    if dtype == "float32":
        assert [t for t, _ in out[False]] == [hf_greedy(str(path), p, n) for p, n in zip(prompts, lens)]


def test_warm_kernels_runs_eagerly_first_then_through_the_pieces_and_keeps_them():
    """The engine start's warm-up (a GPU engine's; called by hand here over emulated graphs): its prompts run eagerly
    first (the path of steps too long for the pieces), then one prefill through the pieces; the pieces stay in place
    afterwards and their counter starts from zero."""
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), max_num_seqs=4, cuda_graph_max_tokens=16, block_size=4, num_kv_blocks=64, max_model_len=64)
    runner = llm.engine.runner
    runner.capture_graphs(64, emulate=True)
    pieces = runner.pieces
    seen = _route(llm)
    llm.engine.warm_kernels()
    assert runner.pieces is pieces and llm.engine.stats()["piecewise_graph_steps"] == 0
    prefills = [p for t, p in seen if max(t) > 1]
    assert prefills[-1] == "pieces" and set(prefills[:-1]) == {"eager"} and len(prefills) >= 2
    prompts = random_prompts(llm.engine.model_config.vocab_size, (6,), seed=4)
    assert _generate(llm, prompts, [3]) == [hf_greedy(str(path), prompts[0], 3)]
    assert seen[-3][1] == "pieces" and llm.engine.stats()["piecewise_graph_steps"] == 1


def test_warmup_reports_the_graph_capture(capsys):
    """`infer warmup` on a GPU times the engine start's graph capture and measures the memory it keeps beside the
    plan's formula (`warmup_plan.graph_capture`); here the capture is emulated, so only the count and the time."""
    from infer.cli.warmup import print_plan
    from infer.cli.warmup_plan import estimate_plan, graph_capture
    from infer.engine.cuda_graphs import batch_buckets
    path = ensure_builtin("tiny-llama")
    llm = LLM(str(path), max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64)
    model = llm.engine.runner.model
    config = EngineConfig(str(path), max_num_seqs=4, block_size=4, cuda_graph_max_tokens=32)
    got = graph_capture(model, config, torch.float32, torch.device("cpu"), 64, emulate=True)
    layers = len(model.layers)
    assert got["cuda_graphs"] == len(batch_buckets(4)) + 2 * (layers + 1)  # buckets 16 and 32 of the pieces
    assert got["cuda_graphs_s"] > 0 and got["cuda_graph_bytes_measured"] is None
    assert all(m.k_cache is None for m in model.modules() if hasattr(m, "k_cache"))  # the runner's cache let go
    plan, extra = estimate_plan(EngineConfig(str(path)), 64, 2)
    print_plan(plan, {**extra, **got, "cuda_graph_bytes_measured": 3 * 2**20, "cuda_graph_bytes_formula": 2**22})
    out = capsys.readouterr().out
    assert f"CUDA graph capture at start ({got['cuda_graphs']} graphs, s)" in out
    assert "CUDA graph memory (measured / formula)" in out and "3.0 MiB / 4.0 MiB" in out


def test_measured_warmup_captures_the_graphs_an_engine_would(monkeypatch):
    """measured_plan asks for the capture's figures whenever the engine would record graphs (a GPU without
    --eager), after the worst case ran; stood in for on CPU."""
    from infer.cli import warmup_plan
    seen = []
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: not self.enforce_eager)
    monkeypatch.setattr(warmup_plan, "graph_capture", lambda model, config, dtype, device, max_length, lora, draft=None:
                        (seen.append((config.cuda_graph_max_tokens, max_length)), {"cuda_graphs_s": 1.5})[1])
    path = str(ensure_builtin("tiny-llama"))
    _, extra = warmup_plan.measured_plan(EngineConfig(path, cuda_graph_max_tokens=64), 48, 2)
    assert seen == [(64, 48)] and extra["cuda_graphs_s"] == 1.5 and extra["worst_case_run"]
    _, extra = warmup_plan.measured_plan(EngineConfig(path, enforce_eager=True), 48, 2)
    assert seen == [(64, 48)] and "cuda_graphs_s" not in extra
