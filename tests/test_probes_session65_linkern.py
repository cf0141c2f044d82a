"""Session 65: faster linear-attention kernels. The WY intra-chunk kernel (delta_triton._chunk_terms_kernel) inverts
its unit lower triangular system in blocks (_unit_lower_inverse: 16-row diagonal blocks by substitution, all at once,
merged by tl.dot rounds) instead of row by row over the chunk: interpreted on CPU against the torch code
(delta_rule.chunk_terms), the row-by-row solve (solve_block = CHUNK, session 64's) and a float64 inverse, outputs
poisoned first, over several heads, uneven sequences, chunk boundaries, gates near 0 and 1 and near-singular
systems; compiled for sm_90 / sm_89 within their shared memory, the merge in the compiled code; tiny-qwen3-next
through it gives transformers' tokens. The Mamba-2 CPU scan (mamba2.chunk_scan) carries the state from chunk to
chunk in place, linear in the chunks: against a float64 token-by-token recurrence, its temporaries' peak what
memory.sizes.mamba_scan_bytes counts, linear in the chunks."""

from __future__ import annotations

import textwrap

import pytest
import torch

from infer.kernels import delta_rule, mamba2
from infer.kernels.moe import SM90_SMEM
from infer.models.tiny import ensure_builtin

from helpers import COMPILE_ONLY_SHARED, interpreted_module, nan_filled_empty, run_compile_only
from test_probes_session63_gaps import _LiveBytes
from test_probes_session63_rdelta import SM89_SMEM
from test_probes_session64_wy import check_interpreted_prefills

TOL = 1e-5  # (float32: the kernel's sums in another order than torch's)


@pytest.fixture(scope="module")
def delta():
    yield from interpreted_module("infer.kernels.delta_triton")


def _inputs(gen, lens, hk, hv, dk, dv, how):
    """A prefill step's q, k [T, Hk, Dk], v [T, Hv, Dv] (strided views of one row per token), g [T, Hv], beta [T, Hv]
    and query_start_loc. `how`: "random" (g in (-2, 0), beta in (0, 1)); "near_one" (gates exp(g) within 1e-6 of 1,
    beta near 1, keys nearly repeated: A's entries near 1, its inverse's near the limit); "near_zero" (gates exp(g)
    below 1e-8: the decays underflow past the diagonal); "mixed" (each token's gate one of the two at random)."""
    t = sum(lens)
    x = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen)
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv)
    near_one, near_zero = -torch.rand(t, hv, generator=gen) * 1e-6, -20 - torch.rand(t, hv, generator=gen)
    beta = torch.rand(t, hv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 2
    if how == "near_one":
        g, beta = near_one, 1 - beta * 1e-3
        k.copy_(torch.randn(1, hk, dk, generator=gen) + 0.05 * k)
    elif how == "near_zero":
        g = near_zero
    elif how == "mixed":
        g = torch.where(torch.rand(t, hv, generator=gen) < 0.5, near_one, near_zero)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, starts


def _float64_terms(q, k, v, g, beta, rows):
    """u and w of delta_rule.chunk_terms in float64 with the system inverted by torch.linalg.inv (the truth the
    float32 solves round)."""
    hv, hk = v.shape[1], k.shape[1]
    q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    q, k, v, beta, g = (x.transpose(0, 1).double() for x in (q, k, v, beta, g))
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    k, v = (torch.nn.functional.pad(x, (0, 0, 0, 1))[:, rows] for x in (k, v))
    beta, g = (torch.nn.functional.pad(x, (0, 1))[:, rows] for x in (beta, g))
    gc = g.cumsum(-1)
    c = rows.shape[1]
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(torch.ones(c, c, dtype=torch.bool).triu(1), -torch.inf)
    system = ((k * beta[..., None]) @ k.transpose(-1, -2) * decay.exp()).tril(-1) + torch.eye(c, dtype=torch.float64)
    inv = torch.linalg.inv(system)
    return dict(u=inv @ (v * beta[..., None]), w=inv @ (k * (beta * gc.exp())[..., None]))


# sequences of 70 tokens (a chunk of 64, then 6), 48 + 5 (3 whole blocks of 16 and part of one), 128 (two whole
# chunks), 7, 17 (a block and a row) and 1
LENS = [70, 53, 128, 7, 17, 1]


@pytest.mark.parametrize("chunk, block", [(64, 16), (64, 32), (32, 16), (16, 16)])
@pytest.mark.parametrize("how", ["random", "near_one", "near_zero", "mixed"])
def test_blocked_solve_equals_torch_the_row_by_row_solve_and_float64(delta, monkeypatch, chunk, block, how):
    """Every term of every chunk (u, w, inner, qd, kd, last) of the blocked kernel (4, 2 or 1 blocks a chunk), its
    outputs poisoned with NaN first, equals delta_rule.chunk_terms' and the row-by-row solve's (solve_block =
    CHUNK) within float32 rounding; u and w are as close to the float64 inverse's as torch's own
    solve_triangular is (GQA: 2 key heads, 4 value heads; 40 value columns: a tile and part of one)."""
    monkeypatch.setattr(delta, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(chunk + block)
    hk, hv, dk, dv = 2, 4, 16, 40
    q, k, v, g, beta, starts = _inputs(gen, LENS, hk, hv, dk, dv, how)
    lay = delta_rule.chunk_layout(starts, chunk)
    want = delta_rule.chunk_terms(q, k, v, g, beta, lay["rows"])
    with nan_filled_empty(delta):
        got = delta.chunk_terms(q, k, v, g, beta, lay, solve_block=block)
        rows = delta.chunk_terms(q, k, v, g, beta, lay, solve_block=chunk)
    assert sorted(got) == sorted(want)
    truth = _float64_terms(q, k, v, g, beta, lay["rows"])
    # (both round g's cumulative sum in float32, in another order: exp of a difference of sums near |gc| carries
    # their ulps as a relative error, 1e-4 where gates of exp(-20) a token sum to -1300 over a chunk)
    sums = torch.nn.functional.pad(g.double(), (0, 0, 0, 1))[lay["rows"]].sum(1)  # [NC, Hv]: each chunk's
    gates = 4 * torch.finfo(torch.float32).eps * float(sums.abs().max())
    assert 0 < gates < 1e-3
    for name, x in want.items():
        assert got[name].shape == x.shape and torch.isfinite(got[name]).all(), name
        scale = max(1.0, float(x.abs().max()))
        # (torch's float32 solve_triangular rounds too: u and w within its own distance from the float64 truth)
        slack = float((x.double() - truth[name]).abs().max()) if name in truth else 0.0
        err = float((got[name] - x).abs().max())
        assert err <= (TOL + gates) * scale + slack, (name, err, slack, gates)
        if name in truth:
            assert (got[name] - rows[name]).abs().max() <= TOL * scale, name
        else:  # (the same code as the row-by-row kernel's)
            assert torch.equal(got[name], rows[name]), name
    for name, x in truth.items():
        err = float((got[name].double() - x).abs().max())
        torch_err = float((want[name].double() - x).abs().max())
        # (within 4x torch's own float32 error: its solve rounds in another order; on an AMD EPYC without AVX-512 the
        # near_one case came to 3.1x, 1.3e-6 against 4.2e-7, on values up to 0.64; a wrong block is off by O(1))
        assert err <= max(4 * torch_err, 2e-6 * float(x.abs().max())), (name, err, torch_err)


def test_blocked_solve_of_a_known_inverse(delta, monkeypatch):
    """One chunk of 64 identical keys, beta 1, gates 1: A is 1 below the diagonal, (I + A)^-1 is 1 on the diagonal
    and -1 just below it (zero elsewhere), so w's rows are the key minus the row above: exactly k_0, then zero
    (every block's first row reads the block above through the merge)."""
    monkeypatch.setattr(delta, "CHUNK", 64)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(1, 1, 16, generator=gen)
    k = key.expand(64, 1, 16).clone()
    q, v = torch.randn(64, 1, 16, generator=gen), torch.eye(64)[:, None, :16].clone()
    g, beta = torch.zeros(64, 1), torch.ones(64, 1)
    lay = delta_rule.chunk_layout(torch.tensor([0, 64], dtype=torch.int32), 64)
    with nan_filled_empty(delta):
        got = delta.chunk_terms(q, k, v, g, beta, lay)
    kn = (key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6))[0, 0]
    want_w = torch.zeros(64, 16)
    want_w[0] = kn
    assert torch.allclose(got["w"][0, 0], want_w, atol=1e-6)
    inverse = torch.eye(64) - torch.eye(64).roll(-1, dims=1).tril(-1)  # (1 on the diagonal, -1 below it)
    assert torch.allclose(got["u"][0, 0], inverse[:, :16], atol=1e-6)  # (u = T v, v the identity's columns)


def test_the_whole_rule_through_the_blocked_kernel_carries_states(delta):
    """delta_triton.chunk_gated_delta_rule_varlen (the blocked intra-chunk kernel at CHUNK = 64) against delta_rule's
    over two steps (the states carried), a sequence from zero state over a NaN slot, gates of both extremes."""
    gen = torch.Generator().manual_seed(7)
    hk, hv, dk, dv = 1, 2, 16, 16
    slots, kept = torch.tensor([3, 0, 1, 2, 5, 4]), torch.tensor([True, False, True, True, True, True])
    mine = torch.randn(6, hv, dk, dv, generator=gen) * 0.1
    mine[0] = float("nan")
    ref = mine.clone()
    for step in range(2):
        q, k, v, g, beta, starts = _inputs(gen, LENS, hk, hv, dk, dv, "mixed")
        got = delta.chunk_gated_delta_rule_varlen(q, k, v, g, beta, mine, starts, slots, kept)
        want = delta_rule.chunk_gated_delta_rule_varlen(q, k, v, g, beta, ref, starts, slots, kept)
        assert torch.allclose(got, want, atol=TOL, rtol=TOL), (step, float((got - want).abs().max()))
        assert torch.allclose(mine[1:], ref[1:], atol=TOL, rtol=TOL), step
        kept = torch.ones_like(kept)


def test_a_solve_block_the_kernel_cannot_take_is_refused(delta):
    q, k, v, g, beta, starts = _inputs(torch.Generator().manual_seed(0), [5], 1, 1, 16, 16, "random")
    lay = delta_rule.chunk_layout(starts, delta.CHUNK)
    for bad in (8, 24, 128):
        with pytest.raises(AssertionError, match=f"solve block {bad}: whole blocks of a power of 2 >= 16 rows"):
            delta.chunk_terms(q, k, v, g, beta, lay, solve_block=bad)


COMPILED_TERMS = COMPILE_ONLY_SHARED + textwrap.dedent('''
    import re
    from infer.kernels import delta_triton as D
    from infer.kernels.delta_rule import chunk_layout
    ir = {}
    run_shared = jit.JITFunction.run  # (COMPILE_ONLY_SHARED's record, itself compiling only)
    def keep_ir(self, *args, grid, warmup, **kwargs):
        kern = run_shared(self, *args, grid=grid, warmup=warmup, **kwargs)
        ir[f"{self.fn.__name__} sm_{arch[0]}"] = kern.asm["ttir"]
        return kern
    jit.JITFunction.run = keep_ir
    hk, hv, dk, dv, t = 16, 32, 128, 128, 70
    x = torch.zeros(t, 2 * hk * dk + hv * dv, dtype=torch.bfloat16)
    q, k = x[:, :hk * dk].view(t, hk, dk), x[:, hk * dk:2 * hk * dk].view(t, hk, dk)
    v = x[:, 2 * hk * dk:].view(t, hv, dv)
    g, beta = torch.zeros(t, hv), torch.zeros(t, hv, dtype=torch.bfloat16)
    lay = chunk_layout(torch.tensor([0, 64, t], dtype=torch.int32), D.CHUNK)  # (a whole chunk, then 6 tokens)
    for arch[0] in (90, 89):
        triton.runtime.driver.set_active(Driver(arch[0]))
        D.chunk_terms(q, k, v, g, beta, lay)
    text = ir["_chunk_terms_kernel sm_90"]
    print(json.dumps(dict(shared=shared, dots=len(re.findall(r"= tt\\.dot ", text)),
                          loops=re.findall(r"scf\\.for %\\S+ = %\\S+ to (%\\S+) step .*-> \\((tensor<\\S+>)\\)", text),
                          consts=dict(re.findall(r"(%\\S+) = arith\\.constant (\\d+) : i32", text)))))
''')


def test_blocked_kernel_compiles_within_the_shared_memory_of_sm90_and_sm89():
    """The intra-chunk kernel compiled for sm_90 and sm_89 at Qwen3-Next's shapes (Dk = Dv = 128, q|k|v strided views)
    through chunk_terms: within each GPU's shared memory a program, and its code the blocked solve: 10 tl.dot (q k^T,
    beta k k^T, w, u and the merge's two for each of block rows 1 to 3), the substitution a loop of SOLVE_BLOCK - 1 = 15
    steps (1 to 16) over the [4, 16, 16] diagonal blocks, not of C - 1 = 63 over [64, 64]."""
    out = run_compile_only(COMPILED_TERMS, 600)
    shared = out["shared"]
    assert set(shared) == {"_chunk_terms_kernel sm_90", "_chunk_terms_kernel sm_89"}, shared
    assert 0 < shared["_chunk_terms_kernel sm_90"] <= SM90_SMEM
    assert 0 < shared["_chunk_terms_kernel sm_89"] <= SM89_SMEM
    assert out["dots"] == 10, out
    # (the one loop that carries a tensor: the substitution's, over the [4, 16, 16] diagonal blocks, to 16)
    assert [(int(out["consts"].get(bound, -1)), carried) for bound, carried in out["loops"]] == \
        [(16, "tensor<4x16x16xf32>")], out


def test_interpreted_triton_qwen3_next_prefills_give_hf_tokens(monkeypatch):
    """tiny-qwen3-next with every op through its Triton kernel (interpreted on CPU): a prompt of 70 tokens in steps
    of 48 (a chunk's blocks of 16 whole and partial), 5 and 20 beside it: the prefill steps run the blocked
    intra-chunk kernel and the tokens are transformers'."""
    blocks = check_interpreted_prefills(monkeypatch, "tiny-qwen3-next", 3, [4, 5, 3])
    assert len(blocks) >= 2 and max(blocks) >= 2


# --- the Mamba-2 CPU scan ---

def _scan_inputs(tokens: int, heads: int, p: int, groups: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(tokens, heads, p), dt=r(tokens, heads), A=-0.5 - torch.rand(heads, generator=gen),
                B=r(tokens, groups, n), C=r(tokens, groups, n), D=r(heads), dt_bias=r(heads) - 1), r(heads, p, n)


def _recurrence(x, dt, A, B, C, D, dt_bias, state, limit):
    """The scan token by token in float64 (state = exp(dt A) state + dt x B^T, y = state C + D x): the truth."""
    rep = x.shape[1] // B.shape[1]
    dt = torch.nn.functional.softplus(dt.double() + dt_bias.double()).clamp(*limit)
    B, C = (z.double().repeat_interleave(rep, dim=1) for z in (B, C))
    s, ys = state.double(), []
    for t in range(x.shape[0]):
        s = s * torch.exp(dt[t] * A.double())[:, None, None] + (dt[t, :, None] * x[t].double())[..., None] \
            * B[t][:, None, :]
        ys.append((s * C[t][:, None, :]).sum(-1) + D.double()[:, None] * x[t].double())
    return torch.stack(ys), s


@pytest.mark.parametrize("tokens, chunk", [(300, 16), (64, 16), (129, 32), (7, 16)])
def test_chunk_scan_equals_the_token_recurrence(tokens, chunk):
    """mamba2.chunk_scan (states carried chunk by chunk in place) of 19, 4, 5 and 1 chunks (the last partial) from a
    nonzero state, dt clamped by a time_step_limit: outputs and final state equal a float64 token-by-token
    recurrence within float32 rounding."""
    args, state = _scan_inputs(tokens, 4, 8, 2, 6, seed=tokens)
    limit = (0.0, 1.5)
    y, final = mamba2.chunk_scan(**args, chunk=chunk, state=state, limit=limit)
    want_y, want_s = _recurrence(**args, state=state, limit=limit)
    assert float((y.double() - want_y).abs().max()) <= 2e-5 * float(want_y.abs().max())
    assert float((final.double() - want_s).abs().max()) <= 2e-5 * float(want_s.abs().max())


def test_chunk_scan_varlen_carries_each_slot_in_place():
    """chunk_scan_varlen over 3 sequences of several chunks (one from zero state over a NaN slot): each sequence's
    output and the state written at its slot are the token recurrence's."""
    args, _ = _scan_inputs(100, 4, 8, 2, 6, seed=1)
    states = torch.randn(4, 4, 8, 6, generator=torch.Generator().manual_seed(2))
    states[0] = float("nan")
    before = states.clone()
    starts, slots, kept = torch.tensor([0, 37, 40, 100]), torch.tensor([2, 0, 3]), torch.tensor([True, False, True])
    y = mamba2.chunk_scan_varlen(**args, chunk=16, states=states, query_start_loc=starts, slots=slots, kept=kept)
    for i, (s, e) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        seq = {n: (a[s:e] if a.dim() > 1 else a) for n, a in args.items()}
        start = before[slots[i]] if kept[i] else torch.zeros_like(before[0])
        want_y, want_s = _recurrence(**seq, state=start, limit=(0.0, float("inf")))
        assert float((y[s:e].double() - want_y).abs().max()) <= 2e-5 * float(want_y.abs().max()), i
        assert float((states[slots[i]].double() - want_s).abs().max()) <= 2e-5 * float(want_s.abs().max()), i
    assert torch.equal(states[1], before[1])


def test_scan_temporaries_are_linear_in_the_chunks_and_counted():
    """Scans of 256 and 512 chunks of 16 tokens at tiny-granite4's shape: no temporary of (chunks + 1)^2 elements a
    head (transformers' carry [H, c + 1, c + 1]), the peak of the live temporaries what mamba_scan_bytes counts
    (within 1.3x), and twice the chunks about twice the peak (the quadratic carry's three [H, c + 1, c + 1] took 6
    MiB, then 25)."""
    from infer.memory.sizes import mamba_scan_bytes
    from infer.models.loader import load_config
    cfg = load_config(ensure_builtin("tiny-granite4"))
    chunk, heads, p, n, groups = 16, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups
    assert cfg.mamba_chunk_size == chunk
    peaks = []
    for chunks in (256, 512):
        tokens = chunks * chunk
        args, state = _scan_inputs(tokens, heads, p, groups, n)
        with _LiveBytes() as meter:
            mamba2.chunk_scan(**args, chunk=chunk, state=state)
        assert meter.largest < (chunks + 1) ** 2 * heads
        # (the largest: the states before each chunk [c + 1, H, P, N], or a group's scores, or a per-token tensor)
        assert meter.largest <= heads * max((mamba2.SCAN_GROUP_CHUNKS + 1) * chunk * chunk, tokens * max(p, n),
                                            (chunks + 1) * p * n)
        formula = mamba_scan_bytes(cfg, tokens)
        assert meter.peak <= formula <= 1.3 * meter.peak, (chunks, meter.peak, formula)
        peaks.append(meter.peak)
    assert peaks[1] < 2.1 * peaks[0], peaks
