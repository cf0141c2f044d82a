"""Session 64: the Triton kernels of Granite 4.0's and Nemotron-H's Mamba-2 layers (kernels.mamba2_triton: the
selective state update of every decode row in one launch, in place at the slots; the varlen chunked SSD scan of a
prefill step's sequences, its chunk states carried linearly; the conv kernels of delta_triton with the conv's bias)
under TRITON_INTERPRET=1 (compiled on a GPU) against the torch references (mamba2.state_update_slots,
chunk_scan_varlen, delta_rule's convs): several sequences, padding slots, sequences from zero state over a NaN
slot, states carried over steps, chunk boundaries inside and across sequences, sequences shorter than a chunk;
compiled for sm_90 and sm_89 at granite-4.0-h's shapes within their shared memory; tiny-granite4 and tiny-nemotron-h
through the kernels (forced on, interpreted) give transformers' tokens; the benchmark's rows and refusals."""

from __future__ import annotations

import textwrap

import pytest
import torch

from infer.kernels import delta_rule, mamba2
from infer.models.tiny import ensure_builtin

from helpers import COMPILE_ONLY_SHARED, check_gpu_graphs_equal_hf, hf_greedy, interpreted_module, random_prompts
from test_probes_session63_delta import BF16_TOL, _pool
from test_probes_session63_rdelta import check_compiled_shared_memory

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def m2():
    yield from interpreted_module("infer.kernels.mamba2_triton")


@pytest.fixture(scope="module")
def delta():
    yield from interpreted_module("infer.kernels.delta_triton")


def _params(heads: int, gen, dtype):
    """A layer's A (float32, -1 to -9), D and dt_bias (about -3: softplus(dt + dt_bias) mostly 0.01 to 0.3, as a
    checkpoint's; the first head's 25, past softplus' threshold 20)."""
    bias = torch.randn(heads, generator=gen) - 3
    bias[0] = 25.0
    return (-1 - torch.rand(heads, generator=gen).to(DEV) * 8, torch.randn(heads, generator=gen).to(DEV, dtype),
            bias.to(DEV, dtype))


def _tokens(t: int, heads: int, p: int, groups: int, n: int, gen, dtype):
    """x [T, H, P], dt [T, H], B and C [T, G, N]: strided views of one row per token, as the mixer's split gives."""
    row = torch.randn(t, heads * p + 2 * groups * n + heads, generator=gen).to(DEV, dtype)
    x, b, c, dt = row.split([heads * p, groups * n, groups * n, heads], dim=-1)
    return x.reshape(t, heads, p), dt, b.reshape(t, groups, n), c.reshape(t, groups, n)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Every element of `got` within tol x the largest of `want` (both finite where `want` is; NaN where it is)."""
    got, want = got.float(), want.float()
    if not torch.equal(torch.isnan(got), torch.isnan(want)):
        return False
    got, want = got.nan_to_num(), want.nan_to_num()
    return bool((got - want).abs().max() <= tol * want.abs().max())


# bfloat16 under TRITON_INTERPRET: each of a decode's seven roundings (dt + dt_bias, its softplus, dt B, dt B x, the
# state read, y, y + D x) truncated toward zero, where the reference rounds to nearest
BF16_DECODE_TOL = 4e-2


# 3 sequences and 2 padding rows on the pool's last slot; the second sequence starts from zero state over a NaN slot
SLOTS, KEPT, NUM_SLOTS = [4, 0, 2, 5, 5], [True, False, True, False, False], 6


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, BF16_DECODE_TOL)])
@pytest.mark.parametrize("heads, p, groups, n", [(4, 48, 2, 16), (2, 8, 2, 8)], ids=["grouped-2tiles", "plain"])
def test_state_update_equals_torch_over_steps(m2, dtype, tol, heads, p, groups, n):
    """Heads sharing a group's B and C, P over two tiles of DIM_BLOCK (48: one partly masked) and a small plain
    shape; 3 steps of the same slots: outputs and states (the padding slot left out: its rows race) equal the
    reference's."""
    gen = torch.Generator().manual_seed(0)
    mine = _pool((heads, p, n), NUM_SLOTS, torch.float32, gen)
    mine[SLOTS[1]] = float("nan")
    ref = mine.clone()
    A, D, dt_bias = _params(heads, gen, dtype)
    slots, kept = torch.tensor(SLOTS, device=DEV), torch.tensor(KEPT, device=DEV)
    real = slice(0, 3)
    for step in range(3):
        x, dt, b, c = _tokens(len(SLOTS), heads, p, groups, n, gen, dtype)
        want = mamba2.state_update_slots(x, dt, A, b, c, D, dt_bias, ref, slots, kept)
        got = m2.state_update_slots(x, dt, A, b, c, D, dt_bias, mine, slots, kept)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.isfinite(got[real].float()).all()
        assert _close(got[real], want[real], tol), step
        assert _close(mine[:-1], ref[:-1], tol), step
        kept = torch.ones_like(kept)
        kept[3:] = False
    assert not torch.isnan(mine[:-1]).any()  # the NaN slot now holds its sequence's state


# a prefill step: 40 tokens (chunks of 16, 16 and 8), 5 (shorter than a chunk) from zero state over a NaN slot, 1,
# 16 (exactly one chunk) and 33 (a chunk of one token last), each sequence's chunks beside the next one's
LENS, PRE_SLOTS, PRE_KEPT = [40, 5, 1, 16, 33], [4, 0, 2, 1, 3], [True, False, True, True, True]


def _prefill_step(lens):
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return starts, torch.tensor(PRE_SLOTS, device=DEV), torch.tensor(PRE_KEPT, device=DEV)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-4)])
@pytest.mark.parametrize("heads, p, groups, n, limit", [(4, 48, 2, 16, (0.0, float("inf"))),
                                                        (2, 16, 1, 32, (0.05, 0.5))], ids=["grouped", "limited"])
def test_chunk_scan_varlen_equals_torch_over_steps(m2, dtype, tol, heads, p, groups, n, limit):
    """A prefill step of 5 sequences (chunk 16) from their slots, then a second step from the states the first left
    (the NaN slot's sequence now kept): the float32 outputs and the states equal the reference's (each sequence's
    chunk_scan); time_step_limit clamps dt where given. (Tolerance relative: the kernels decay by differences of
    cumulative sums, the reference by masked segment sums.)"""
    gen = torch.Generator().manual_seed(1)
    mine = _pool((heads, p, n), NUM_SLOTS, torch.float32, gen)
    mine[PRE_SLOTS[1]] = float("nan")
    ref = mine.clone()
    A, D, dt_bias = _params(heads, gen, dtype)
    starts, slots, kept = _prefill_step(LENS)
    for step in range(2):
        x, dt, b, c = _tokens(sum(LENS), heads, p, groups, n, gen, dtype)
        want = mamba2.chunk_scan_varlen(x, dt, A, b, c, D, dt_bias, 16, ref, starts, slots, kept, limit)
        got = m2.chunk_scan_varlen(x, dt, A, b, c, D, dt_bias, 16, mine, starts, slots, kept, limit)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert _close(got, want, tol), (step, float((got - want).abs().max() / want.abs().max()))
        assert _close(mine[:-1], ref[:-1], tol), step
        kept = torch.ones_like(kept)


def test_chunk_scan_varlen_of_one_sequence_is_the_per_sequence_scan(m2):
    """One sequence of 3 whole chunks and one of 7 tokens, each alone and both in one call: the same outputs and
    states (no chunk reads another sequence's tokens or state)."""
    gen = torch.Generator().manual_seed(2)
    heads, p, groups, n = 2, 16, 1, 16
    A, D, dt_bias = _params(heads, gen, torch.float32)
    x, dt, b, c = _tokens(55, heads, p, groups, n, gen, torch.float32)
    pool = torch.randn(3, heads, p, n, generator=gen).to(DEV)
    both = pool.clone()
    kept = torch.tensor([True, True], device=DEV)
    y = m2.chunk_scan_varlen(x, dt, A, b, c, D, dt_bias, 16, both, torch.tensor([0, 48, 55], device=DEV),
                             torch.tensor([2, 0], device=DEV), kept)
    for s, e, slot in ((0, 48, 2), (48, 55, 0)):
        alone = m2.chunk_scan_varlen(x[s:e], dt[s:e], A, b[s:e], c[s:e], D, dt_bias, 16, pool,
                                     torch.tensor([0, e - s], device=DEV), torch.tensor([slot], device=DEV),
                                     kept[:1])
        assert torch.allclose(alone, y[s:e], atol=1e-6, rtol=1e-6)
        assert torch.allclose(pool[slot], both[slot], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, BF16_TOL)])
def test_conv_kernels_with_the_bias_equal_torch(delta, dtype, tol):
    """Mamba-2's conv1d has a bias: the decode update and the prefill's varlen conv add it as F.conv1d does (300
    channels over two programs; sequences of 40, 2 and 1 tokens, one from zero state)."""
    gen = torch.Generator().manual_seed(3)
    ch, taps = 300, 4
    weight = torch.randn(ch, 1, taps, generator=gen).to(DEV, dtype)
    bias = torch.randn(ch, generator=gen).to(DEV, dtype)
    mine = _pool((ch, taps - 1), NUM_SLOTS, dtype, gen)
    ref = mine.clone()
    slots, kept = torch.tensor(SLOTS, device=DEV), torch.tensor(KEPT, device=DEV)
    x = torch.randn(len(SLOTS), ch, generator=gen).to(DEV, dtype)
    want = delta_rule.causal_conv1d_update(x, weight, ref, slots, kept, bias)
    got = delta.causal_conv1d_update(x, weight, mine, slots, kept, bias)
    assert torch.allclose(got[:3].float(), want[:3].float(), atol=tol, rtol=tol)
    assert torch.allclose(mine[:-1].float(), ref[:-1].float(), atol=tol, rtol=tol, equal_nan=True)
    starts = torch.tensor([0, 40, 42, 43], device=DEV)
    slots, kept = slots[:3], torch.tensor([True, False, True], device=DEV)
    x = torch.randn(43, ch, generator=gen).to(DEV, dtype)
    want = delta_rule.causal_conv1d_varlen(x, weight, ref, starts, slots, kept, 40, bias)
    got = delta.causal_conv1d_varlen(x, weight, mine, starts, slots, kept, 40, bias)
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.allclose(mine[:-1].float(), ref[:-1].float(), atol=tol, rtol=tol, equal_nan=True)


COMPILED = COMPILE_ONLY_SHARED + textwrap.dedent('''
    from infer.kernels import delta_triton, mamba2_triton as M
    h, p, g, n, taps, t, bf16 = 128, 64, 1, 128, 4, 300, torch.bfloat16  # (granite-4.0-h-small's mixer)
    row = torch.zeros(t, 2 * h * p + 2 * g * n + h, dtype=bf16)  # (z | x|B|C | dt: in_proj's output)
    xbc, dt = row[:, h * p:2 * h * p + 2 * g * n], row[:, -h:]
    x, b, c = xbc[:, :h * p].view(t, h, p), xbc[:, h * p:h * p + g * n].view(t, g, n), xbc[:, -g * n:].view(t, g, n)
    A, D, bias = torch.zeros(h), torch.zeros(h, dtype=bf16), torch.zeros(h, dtype=bf16)
    w, cb = torch.zeros(xbc.shape[1], 1, taps, dtype=bf16), torch.zeros(xbc.shape[1], dtype=bf16)
    conv, rec = torch.zeros(3, xbc.shape[1], taps - 1, dtype=bf16), torch.zeros(3, h, p, n)
    slots, kept = torch.tensor([0, 1]), torch.tensor([True, False])
    starts = torch.tensor([0, 256, t], dtype=torch.int32)
    for arch[0] in (90, 89):
        triton.runtime.driver.set_active(Driver(arch[0]))
        delta_triton.causal_conv1d_update(xbc[:2], w, conv, slots, kept, cb)
        delta_triton.causal_conv1d_varlen(xbc, w, conv, starts, slots, kept, 256, cb)
        M.state_update_slots(x[:2], dt[:2], A, b[:2], c[:2], D, bias, rec, slots, kept)
        M.chunk_scan_varlen(x, dt, A, b, c, D, bias, 256, rec, starts, slots, kept)
    print(json.dumps(shared))
''')


def test_mamba2_kernels_compile_for_sm90_and_sm89_within_their_shared_memory():
    """Each kernel of a Mamba-2 step (the convs with the bias, the state update, the scan's three), compiled for
    sm_90 and sm_89 at granite-4.0-h-small's shapes (128 heads of 64, 128 state dims, chunk 256) through the real
    launchers, takes no more shared memory than a program may have there (else the launch fails on that GPU)."""
    check_compiled_shared_memory(COMPILED, ["_conv_update_kernel", "_conv_varlen_kernel", "_state_update_kernel",
                                            "_chunk_state_kernel", "_state_passing_kernel", "_chunk_scan_kernel"])


def _counted(monkeypatch):
    """Every op through its Triton kernel (interpreted), the Mamba-2 kernels' calls counted."""
    from infer import kernels
    from infer.kernels import delta_triton, mamba2_triton
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    calls = []
    for mod, name in ((mamba2_triton, "state_update_slots"), (mamba2_triton, "chunk_scan_varlen"),
                      (delta_triton, "causal_conv1d_update"), (delta_triton, "causal_conv1d_varlen")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name: (calls.append(_n), _r(*a))[1])
    return calls


def _with_conv_bias(name: str, folder):
    """A copy of the builtin model `name` in `folder` whose Mamba-2 conv1d biases are drawn (the builtin's are
    transformers' zeros: a kernel that drops the bias would pass)."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(ensure_builtin(name), folder)
    gen = torch.Generator().manual_seed(5)
    for f in folder.glob("*.safetensors"):
        tensors = load_file(f)
        for k, v in tensors.items():
            if k.endswith("conv1d.bias"):
                tensors[k] = (torch.randn(v.shape, generator=gen) * 0.5).to(v.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("name", ["tiny-granite4", "tiny-nemotron-h"])
def test_interpreted_mamba2_kernels_give_hf_tokens(monkeypatch, tmp_path, name):
    """tiny-granite4 / tiny-nemotron-h (chunk 16; the conv biases drawn) with every op through its Triton kernel:
    prompts of 40, 5, 21 and 3 tokens cut into steps of 24 tokens (a prompt's scan over chunk boundaries and across
    steps, beside the others' decodes in mixed steps), the decode steps through emulated CUDA graphs (padding rows
    on the padding slot): the Mamba-2 kernels run (counted), the tokens are transformers'."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (test_mamba2_on_gpu_with_graphs_gives_hf_tokens)")
    from infer import LLM, SamplingParams
    calls = _counted(monkeypatch)
    path = _with_conv_bias(name, tmp_path / name)
    prompts = random_prompts(256, (40, 5, 21, 3), seed=3)
    lens = [4, 9, 6, 12]
    with LLM(str(path), max_num_seqs=4, block_size=4, num_kv_blocks=96, max_model_len=64, cuda_graph_max_tokens=16,
             max_num_batched_tokens=24) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        got = [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                           for n in lens])]
        assert llm.engine.runner.graphs.replays  # (decode steps through the graphs)
    for op in ("state_update_slots", "chunk_scan_varlen", "causal_conv1d_update", "causal_conv1d_varlen"):
        assert calls.count(op) >= 2, (op, calls.count(op))
    assert got == [hf_greedy(str(path), p, n) for p, n in zip(prompts, lens)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-granite4", "tiny-nemotron-h"])
def test_mamba2_on_gpu_with_graphs_gives_hf_tokens(tmp_path, name):
    """On a GPU: the model (its conv biases drawn) in float32 through the compiled kernels, eager and under real CUDA
    graphs (the slots through the graph's static buffer, padding rows on the padding slot): transformers' tokens
    both ways."""
    path = _with_conv_bias(name, tmp_path / name)
    prompts = random_prompts(256, (40, 5, 21, 3), seed=3)
    lens = [4, 9, 6, 12]
    check_gpu_graphs_equal_hf(path, prompts, lens, 24)


class _NoLaunch:
    """A kernel whose launches do nothing (the interpreter's own copies of the arguments are not the GPU's bytes)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_scan_bytes_count_the_gpu_path(m2, monkeypatch):
    """mamba2.varlen_scan_bytes (in memory.sizes.mamba_scan_bytes: the larger of the two paths) is at least the peak
    of the live tensors the Triton scan of a step creates (the kernels allocate none), within 1.5x."""
    from test_probes_session63_gaps import _LiveBytes
    from infer.memory.sizes import mamba_scan_bytes
    from infer.models.loader import load_config
    gen = torch.Generator().manual_seed(4)
    heads, p, groups, n = 2, 16, 1, 16
    A, D, dt_bias = _params(heads, gen, torch.float32)
    x, dt, b, c = _tokens(sum(LENS), heads, p, groups, n, gen, torch.float32)
    starts, slots, kept = _prefill_step(LENS)
    pool = torch.zeros(6, heads, p, n)
    for kernel in ("_chunk_state_kernel", "_state_passing_kernel", "_chunk_scan_kernel"):
        monkeypatch.setattr(m2, kernel, _NoLaunch())
    with _LiveBytes() as meter:
        m2.chunk_scan_varlen(x, dt, A, b, c, D, dt_bias, 16, pool, starts, slots, kept)
    formula = mamba2.varlen_scan_bytes(sum(LENS), len(LENS), heads, p, n, 16)
    assert meter.peak <= formula <= 1.5 * meter.peak, (meter.peak, formula)
    cfg = load_config(ensure_builtin("tiny-granite4"))
    inter = cfg.mamba_n_heads * cfg.mamba_d_head  # (+ the mixer's whole-step conv output and norm temporaries)
    assert mamba_scan_bytes(cfg, 16, 4096, 256) == mamba2.varlen_scan_bytes(
        4096, 256, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_chunk_size) \
        + 4096 * (inter + 2 * cfg.mamba_n_groups * cfg.mamba_d_state + 2 * inter) * 4


def test_bench_refuses_without_cuda(monkeypatch, capsys):
    from infer.bench import mamba2 as bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [(["--out", "{tmp}/missing/m.csv"], "missing does not exist"),
                                           (["--out", "{tmp}/m.csv", "--batch", "0"], "--batch 0: give batch sizes"),
                                           (["--out", "{tmp}/m.csv", "--prefill", "-1"], "--prefill -1: give")])
def test_bench_refuses_bad_arguments_before_timing(tmp_path, monkeypatch, capsys, argv, message):
    from test_probes_session62_probe import _on_a_gpu_that_never_times
    from infer.bench import mamba2 as bench
    _on_a_gpu_that_never_times(monkeypatch)
    assert bench.main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


@pytest.fixture
def small_bench(monkeypatch, m2, delta):
    """infer.bench.mamba2 at a small shape (the interpreter's pace), with a stand-in timer of 1 ms a call."""
    from infer.bench import mamba2 as bench
    for k, v in dict(H=4, P=16, G=2, N=16, CHUNK=16).items():
        monkeypatch.setattr(bench, k, v)
    return bench, (lambda fn: (fn(), 1.0)[1]), torch.Generator(device=DEV).manual_seed(0)


def test_bench_decode_row_on_interpreted_kernels(small_bench):
    """A decode row at batch 2: the Triton outputs equal torch's within bfloat16's rounding, gains 1, the bytes per
    second those of 1 ms, the floor the bytes at the given bandwidth."""
    bench, timer, gen = small_bench
    row = bench.measure(2, 1e12, timer, gen, DEV)
    conv_bytes, ssm_bytes = bench.bytes_moved(2)
    assert row["conv_gain"] == row["ssm_gain"] == 1.0 and row["max_abs_err"] < 0.1
    assert row["ssm_GBps"] == round(ssm_bytes / 1e6, 1) and row["conv_floor_us"] == conv_bytes / 1e6
    assert ssm_bytes > 2 * 4 * 16 * 16 * 4 * 2  # the float32 states read and written


def test_bench_prefill_row_on_interpreted_kernels(small_bench):
    """A prefill row of 3 prompts of at most 40 tokens (40, 30, 20): Triton's outputs equal torch's."""
    bench, timer, gen = small_bench
    row = bench.measure_prefill(3, 40, 1e12, timer, gen, DEV)
    assert row["tokens"] == 90 and row["gain"] == 1.0 and row["max_abs_err"] < 1e-3
    assert row["GBps"] == round(bench.prefill_bytes(3, 90) / 1e6, 1)
