"""Session 54: sliding-window attention (Mistral, Phi-3, Qwen2/Qwen3's layers from max_window_layers on, Gemma 2's
even layers): the query at position p attends to the keys p - window + 1..p only (transformers' masking_utils:
kv_idx > q_idx - sliding_window). Every attention path against a brute-force oracle: the CPU reference (a chunked
prefill's masked rows, the padded decode batch, the per-sequence decodes, verify rows, soft-capped scores), the
Triton kernels interpreted (the unified prefill/mixed kernel, the decode kernel with one partition and several,
decode_attention's rotary + KV write); then tiny models whose prompts and generations run well past a window of 16
to their max_position_embeddings, greedy tokens equal transformers', on the CPU path and the GPU path."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import reference

from helpers import greedy_each, interpreted_module, norms_and_biases_shifted, save_random_model


@pytest.fixture(scope="module")
def attention():
    """infer.kernels.attention, its kernels interpreted on CPU when there is no GPU."""
    yield from interpreted_module("infer.kernels.attention")


def _oracle(q, k_cache, v_cache, tables, lens, qsl, scale, window, softcap=0.0):
    """Brute force: every query's scores over its sequence's keys, masked outside p - window < k <= p."""
    out = torch.empty_like(q, dtype=torch.float32)
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hk
    for b in range(len(lens)):
        n_keys, start, end = int(lens[b]), int(qsl[b]), int(qsl[b + 1])
        slots = [int(tables[b, i // bs]) * bs + i % bs for i in range(n_keys)]
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)  # [L, Hq, D]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)
        for t in range(start, end):
            p = n_keys - (end - start) + (t - start)
            s = torch.einsum("hd,lhd->hl", q[t].float(), k) * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            pos = torch.arange(n_keys)
            seen = (pos <= p) & ((pos > p - window) if window else True)
            s = s.masked_fill(~seen[None], float("-inf"))
            out[t] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
    return out


def _batch(lens, queries, bs=4, hq=4, hk=2, d=16, seed=0):
    """Caches of random keys (unused blocks NaN, block 0 among them) and the tables, lens and query_start_loc of
    sequences of `lens` keys, the last `queries[b]` of them querying."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum((n + bs - 1) // bs for n in lens) + 2
    k_cache = torch.full((nblocks, bs, hk, d), float("nan"))
    v_cache = torch.full((nblocks, bs, hk, d), float("nan"))
    width = max((n + bs - 1) // bs for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    perm = (torch.randperm(nblocks - 1, generator=g) + 1).tolist()  # block 0 unused (NaN)
    for b, n in enumerate(lens):
        for i in range((n + bs - 1) // bs):
            blk = perm.pop()
            tables[b, i] = blk
            k_cache[blk] = torch.randn(bs, hk, d, generator=g)  # (a last block's unused slots: finite, as a
            v_cache[blk] = torch.randn(bs, hk, d, generator=g)  # block's earlier owner left them)
    qsl = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), qsl


CASES = {  # lens, queries: decodes only (equal and uneven lengths), a prefill, chunks after a context, verify rows
    "decodes-uneven": ([40, 9, 23, 16, 17], [1, 1, 1, 1, 1]),
    "decodes-equal": ([37, 37, 37], [1, 1, 1]),
    "prefill-and-chunks": ([50, 33, 7], [50, 20, 7]),
    "verify-rows-and-decodes": ([45, 30, 12], [4, 1, 3]),
}


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("case", CASES)
def test_reference_attends_to_the_window_only(case, softcap):
    lens, queries = CASES[case]
    q, kc, vc, tables, lens_t, qsl = _batch(lens, queries)
    want = _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 16, softcap)
    got = reference.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, max(queries), softcap=softcap, window=16)
    torch.testing.assert_close(got.float(), want, atol=2e-5, rtol=2e-5)
    full = _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 0, softcap)
    assert not torch.allclose(full, want, atol=1e-3)  # (the window changes these outputs)


def test_reference_decodes_one_sequence_at_a_time_within_the_window(monkeypatch):
    """The per-sequence decode path (long contexts, large batches: `_per_sequence`) and the row chunks of a chunked
    prefill's masked queries (MASK_ELEMENTS small: many chunks, each from its own first query's window)."""
    monkeypatch.setattr(reference, "PER_SEQUENCE_LEN", 8)
    monkeypatch.setattr(reference, "MASK_ELEMENTS", 64)
    for lens, queries in CASES.values():
        q, kc, vc, tables, lens_t, qsl = _batch(lens, queries, seed=1)
        want = _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 16)
        got = reference.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, max(queries), window=16)
        torch.testing.assert_close(got.float(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("case", CASES)
def test_triton_paged_attention_attends_to_the_window_only(attention, case, softcap):
    lens, queries = CASES[case]
    q, kc, vc, tables, lens_t, qsl = _batch(lens, queries, seed=2)
    want = _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 16, softcap)
    got = attention.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, max(queries), softcap=softcap, window=16)
    torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)


def decode_batch(lens: list[int]) -> tuple:
    """A decode step of one token a sequence of `lens` (_batch's caches, seed 3): (q, k cache, v cache, block tables,
    lengths, query starts, q flat, the step's k and v, positions, KV slots, a random rotary table)."""
    q, kc, vc, tables, lens_t, qsl = _batch(lens, [1] * len(lens), seed=3)
    g = torch.Generator().manual_seed(4)
    t, hq, d = q.shape
    hk = kc.shape[2]
    qf, k, v = q.reshape(t, -1), torch.randn(t, hk * d, generator=g), torch.randn(t, hk * d, generator=g)
    positions, bs = (lens_t - 1).long(), kc.shape[1]
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens)])
    return q, kc, vc, tables, lens_t, qsl, qf, k, v, positions, slots, torch.randn(128, d, generator=g)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_triton_decode_attention_within_the_window_in_partitions(attention, parts):
    """decode_attention (rotary, KV write, attention in one launch) over 1-3 partitions a sequence: equal to the
    reference's, with the window (the partitions share out the window's keys only)."""
    q, kc, vc, tables, lens_t, qsl, qf, k, v, positions, slots, cos_sin = decode_batch([70, 9, 33, 16])
    t, hq, d = q.shape
    kr, vr = kc.clone(), vc.clone()
    want = reference.decode_attention(positions, qf, k, v, cos_sin, d, kr, vr, slots, tables, lens_t, qsl, 0.3,
                                      window=16)
    oracle = _oracle(reference.rotary_embedding(positions, qf, k, cos_sin, d)[0].view(t, hq, d), kr, vr, tables,
                     lens_t, qsl, 0.3, 16)
    torch.testing.assert_close(want.float(), oracle, atol=2e-5, rtol=2e-5)
    kt, vt = kc.clone(), vc.clone()
    got = attention.decode_attention(positions, qf, k, v, cos_sin, d, kt, vt, slots, tables, lens_t, qsl, 0.3,
                                     parts=parts, window=16)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------- models
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=96, vocab_size=512, eos_token_id=2, pad_token_id=0)
FAMILIES = {  # model type, config: a window of 16, on every layer or on some
    "mistral": ("mistral", dict(sliding_window=16)),
    "phi3": ("phi3", dict(sliding_window=16)),
    "qwen2-layer-1-slides": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "qwen3-every-layer": ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0,
                                        head_dim=32)),
    "gemma2-even-layers": ("gemma2", dict(head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                          final_logit_softcapping=1.5, sliding_window=16,
                                          tie_word_embeddings=False)),
}
ARCH = {"mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}


def build(folder, family: str, seed: int = 0):
    """A random model folder of `family` (float32, norms and biases random) with the tiny-llama tokenizer, and
    transformers' model of it (eager attention)."""
    model_type, config = FAMILIES[family]
    return save_random_model(folder, model_type, ARCH[model_type], {**SMALL, **config}, seed,
                             norms_and_biases_shifted)


hf_greedy = greedy_each


def _generate(llm, prompts, n):
    from infer import SamplingParams
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_past_the_window_equal_transformers(tmp_path, family):
    """Prompts of 5, 30 and 50 tokens and 40 generated: up to 90 of the 96 positions, far past the window of 16;
    the context is max_position_embeddings (no cap), the tokens transformers'. Then chunked prefill (steps of 12
    tokens: chunk boundaries inside each window) and the same tokens."""
    from infer import LLM
    hf = build(tmp_path, family)
    prompts = random_prompts((5, 30, 50))
    want = hf_greedy(hf, prompts, 40)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert llm.engine.max_model_len == 96
        model = llm.engine.runner.model
        windows = [layer.self_attn.window for layer in model.layers]
        assert windows == {"qwen2-layer-1-slides": [0, 16], "gemma2-even-layers": [16, 0]}.get(family, [16, 16])
        assert _generate(llm, prompts, 40) == want
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=12, max_num_seqs=2,
             enable_prefix_caching=False) as llm:
        assert _generate(llm, prompts, 40) == want


def random_prompts(lengths, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def test_speculative_verify_rows_beam_search_and_prefix_caching_within_the_window(tmp_path):
    """n-gram speculative decoding (its verify rows attend in the window) gives transformers' greedy tokens; a
    prompt whose first blocks are cached (prefix caching keeps every block) too; beam search runs past the window
    and its best beam's first token is the greedy one."""
    from infer import LLM, BeamSearchParams
    hf = build(tmp_path, "gemma2-even-layers")
    prompts = random_prompts((30, 50), seed=5)
    prompts.append(prompts[1][:40] + [7, 8, 9])  # its first 40 tokens' blocks cached by the one before
    prompts = [p[:20] + p[:20] if i == 0 else p for i, p in enumerate(prompts)]  # repeats for the n-gram drafter
    want = hf_greedy(hf, prompts, 30)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    with LLM(str(tmp_path), block_size=4, speculative_config=spec) as llm:
        assert _generate(llm, prompts[:2], 30) == want[:2]
        assert _generate(llm, prompts[2:], 30) == want[2:]
        beams = llm.beam_search([prompts[1]], BeamSearchParams(beam_width=2, max_tokens=20))
        assert len(beams[0].sequences[0].tokens) > 50


@pytest.mark.parametrize("family", ["gemma2-even-layers", "phi3"])
def test_the_gpu_path_past_the_window_equals_transformers(tmp_path, monkeypatch, family):
    """The GPU code path on CPU (every op its Triton kernel, interpreted; decode steps through emulated CUDA graphs,
    the others piecewise; the overlapped step): the unified kernel over chunks of 12 tokens with chunk boundaries
    inside the window, the decode kernel over the last 16 keys; the sliding and the full layers of Gemma 2 each
    with their own kernels. Tokens equal transformers'."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels")
    from infer import LLM
    from quant_helpers import int4_kernel_path
    hf = build(tmp_path, family)
    prompts = random_prompts((5, 30), seed=7)
    want = hf_greedy(hf, prompts, 30)
    int4_kernel_path(monkeypatch)
    with LLM(str(tmp_path), block_size=4, max_num_batched_tokens=12, max_num_seqs=2, overlap=True,
             cuda_graph_max_tokens=4) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        assert _generate(llm, prompts, 30) == want
        assert sum(llm.engine.runner.graphs.replays.values()) > 0


def test_engine_start_compiles_the_decode_attention_of_each_window(tmp_path, monkeypatch):
    """warm_kernels compiles the decode attention's variants on one layer of each window (Gemma 2: the sliding
    layer's and the full layer's: they are kernels of their own), and the qkv layers' LoRA variants (whose decode
    step's expand the decode attention adds) once per window too."""
    from infer import LLM, kernels
    from infer.models.llama import Attention
    build(tmp_path, "gemma2-even-layers")
    with LLM(str(tmp_path), block_size=4, enable_lora=True, max_lora_rank=8) as llm:
        compiled = []
        monkeypatch.setattr(kernels, "use_triton", lambda t: True)
        monkeypatch.setattr(Attention, "compile_decode", lambda self, delta=None: compiled.append(self.window))
        llm.engine._warm_decode_attention()
        assert sorted(compiled) == [0, 16]
        manager = llm.engine.runner.lora_manager
        keys = {layer.compile_key(linear) for linear, layer in zip(manager.linears, manager.layers)
                if linear.lora_consumer is not None and hasattr(linear.lora_consumer, "attention")}
        assert len(keys) == 2  # the sliding layer's qkv and the full layer's


@pytest.mark.parametrize("lens", [[40, 40, 40], [45, 38, 41]])
def test_decodes_never_read_the_blocks_before_the_window(attention, lens):
    """Every block is kept (none freed outside the window), but a decode reads only its window's: blocks wholly
    before every row's window hold NaN here (what a cache may hold) and the outputs are still the oracle's, on
    the CPU decode batch, the per-sequence decodes and the Triton decode kernel (1 and 3 partitions)."""
    q, kc, vc, tables, lens_t, qsl = _batch(lens, [1] * len(lens), seed=9)
    want = _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 16)
    bs = kc.shape[1]
    for b, n in enumerate(lens):
        for i in range((min(lens) - 16) // bs):  # (the batch gathers from the shortest row's window on)
            kc[int(tables[b, i])] = float("nan")
            vc[int(tables[b, i])] = float("nan")
    got = reference.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, 1, window=16)
    torch.testing.assert_close(got.float(), want, atol=2e-5, rtol=2e-5)
    for parts in (1, 3):
        got = torch.empty_like(q)
        attention._decode(q, kc, vc, tables, lens_t, qsl, 0.3 * attention.LOG2E, got,
                          attention._meta(q, kc, 0.0, 16), parts=parts)
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)


def test_reference_per_sequence_decodes_never_read_the_blocks_before_the_window(monkeypatch):
    monkeypatch.setattr(reference, "PER_SEQUENCE_LEN", 8)
    q, kc, vc, tables, lens_t, qsl = _batch([45, 30, 41], [1, 1, 1], seed=10)
    want = _oracle(q, kc, vc, tables, lens_t, qsl, 0.3, 16)
    for b, n in enumerate([45, 30, 41]):
        for i in range((n - 16) // kc.shape[1]):
            kc[int(tables[b, i])] = vc[int(tables[b, i])] = float("nan")
    got = reference.paged_attention(q, kc, vc, tables, lens_t, qsl, 0.3, 1, window=16)
    torch.testing.assert_close(got.float(), want, atol=2e-5, rtol=2e-5)
