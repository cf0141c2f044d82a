"""Review of EAGLE speculative decoding (session 56) against vLLM's llama_eagle3 / llama_eagle and the heads' on-disk
layouts: what a head's config.json says is read as vLLM reads it."""

from __future__ import annotations

import pytest
import torch

from infer import LLM
from infer.engine.config import EngineConfig

from helpers import random_prompts
from test_probes_session56_eagle import (H, KW, LAYERS, VOCAB, _record, greedy, reference_drafts,  # noqa: F401
                                         save_eagle3, spec, target)  # (target: a fixture)


def test_top_level_aux_layer_ids_are_read_as_vllm_reads_them(tmp_path, target, monkeypatch):
    """vLLM reads the head config's top-level eagle_aux_hidden_state_layer_ids (the speculators' heads store them
    there): the target's layers (5, 1, 6) feed the head, not the default (2, L // 2, L - 3)."""
    folder, hf = target
    t = save_eagle3(tmp_path / "h", seed=7, config={"eagle_aux_hidden_state_layer_ids": [5, 1, 6]})
    seen = _record(monkeypatch)
    llm = LLM(str(folder), speculative_config=spec(tmp_path / "h"), **KW)
    assert llm.engine.drafter.model.aux_layers == (5, 1, 6)
    llm.generate(random_prompts(VOCAB, (9, 12), seed=4), greedy(6))
    assert seen
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, t, tokens, len(drafts), (5, 1, 6))
    assert (5, 1, 6) != (2, LAYERS // 2, LAYERS - 3)


def _reference_norm_before_residual(hf, t, tokens: list[int], k: int) -> list[int]:
    """reference_drafts (test_probes_session56_eagle) with the residual taken after hidden_norm (vLLM's
    norm_before_residual): the layer's attention sees the same input, its output adds to the normed hidden state."""
    import test_probes_session56_eagle as ref
    real = ref._layer

    def layer(t, emb, hid):
        n = emb.shape[0]
        normed = ref._rms(hid, t["midlayer.hidden_norm.weight"])
        x = torch.cat([ref._rms(emb, t["midlayer.input_layernorm.weight"]), normed], -1)
        pos = torch.arange(n)
        heads, kv, d = ref.HEADS, ref.KV, ref.D
        q = ref._rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), pos)
        kk = ref._rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d), pos)
        v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d)
        kk, v = kk.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) / d ** 0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, heads * d)
        res = o @ t["midlayer.self_attn.o_proj.weight"].T + normed
        y = ref._rms(res, t["midlayer.post_attention_layernorm.weight"])
        gate, up = y @ t["midlayer.mlp.gate_proj.weight"].T, y @ t["midlayer.mlp.up_proj.weight"].T
        pre = (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T + res
        return ref._rms(pre, t["norm.weight"]), pre
    ref._layer = layer
    try:
        return ref.reference_drafts(hf, t, tokens, k, (2, LAYERS // 2, LAYERS - 3))
    finally:
        ref._layer = real


def test_norm_before_residual_takes_the_normed_hidden_state_as_the_residual(tmp_path, target, monkeypatch):
    """A head whose config says norm_before_residual (the speculators' EAGLE-3 heads, read by vLLM's
    llama_eagle3): the attention's output adds to hidden_norm(hidden), not to the raw hidden state."""
    folder, hf = target
    t = save_eagle3(tmp_path / "h", seed=9, config={"norm_before_residual": True})
    seen = _record(monkeypatch)
    llm = LLM(str(folder), speculative_config=spec(tmp_path / "h"), **KW)
    llm.generate(random_prompts(VOCAB, (9, 12), seed=6), greedy(6))
    assert seen
    for tokens, drafts in seen:
        assert drafts == _reference_norm_before_residual(hf, t, tokens, len(drafts)), tokens



def test_a_prefix_hit_does_not_reuse_the_heads_state_of_another_next_token(tmp_path, target, monkeypatch):
    """The head's KV at a block's last position pairs it with the next block's first token, which the block's hash
    does not cover: a request whose prompt shares whole blocks with an earlier one, then goes on with another token,
    must not read that position as the earlier request wrote it (vLLM drops the last block of an EAGLE prefix hit
    and recomputes it). Its drafts equal the reference's, computed from its own tokens."""
    folder, hf = target
    t = save_eagle3(tmp_path / "h", seed=7)
    llm = LLM(str(folder), speculative_config=spec(tmp_path / "h"), **KW)
    shared = random_prompts(VOCAB, (12,), seed=30)[0]  # three whole blocks of 4
    firsts = [p + [100 + i] + random_prompts(VOCAB, (3,), seed=31 + i)[0] for i, p in enumerate([shared] * 3)]
    llm.generate(firsts[:1], greedy(6))
    hits = llm.engine.stats()["prefix_cache_hits"]
    seen = _record(monkeypatch)
    llm.generate(firsts[1:], greedy(8))
    assert llm.engine.stats()["prefix_cache_hits"] > hits
    assert seen
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, t, tokens, len(drafts), (2, LAYERS // 2, LAYERS - 3)), tokens


def test_a_preempted_request_drafts_from_its_recomputed_states(tmp_path, target, monkeypatch):
    """A request preempted (recompute) while the head had not been fed the target's states of its last positions:
    those states are of KV that is gone. After its recompute its drafts equal the reference's (they were drafted
    from a head KV never written: the stale rows pushed its feed past the positions it recomputed)."""
    folder, hf = target
    t = save_eagle3(tmp_path / "h", seed=1)
    seen = _record(monkeypatch)
    llm = LLM(str(folder), speculative_config=spec(tmp_path / "h"), **KW)
    prompts = [p for seed in (0, 1, 2) for p in random_prompts(VOCAB, (5, 19), seed=seed)]
    llm.generate(prompts, greedy(16))
    assert llm.engine.stats()["num_preemptions"] > 0
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, t, tokens, len(drafts), (2, LAYERS // 2, LAYERS - 3)), tokens


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_warmup_measures_and_estimates_an_eagle_head(tmp_path, target, method):
    """infer warmup with an EAGLE head: the measured plan runs the worst case through the engine's EagleRunner (was:
    a DraftRunner calling the head without its hidden states, TypeError), and the estimate counts the head's weights
    (was: none of them) as the measured plan does, give or take the CPU's prepacked copy of its lm_head."""
    from infer.cli.warmup_plan import estimate_plan, measured_plan
    from test_probes_session56_eagle import save_eagle1
    folder = target[0]
    if method == "eagle3":
        save_eagle3(tmp_path / "h", seed=1)
    else:
        save_eagle1(tmp_path / "h", seed=1)
    plain = EngineConfig(str(folder), block_size=4)
    cfg = EngineConfig(str(folder), block_size=4, speculative_config={
        "method": method, "model": str(tmp_path / "h"), "num_speculative_tokens": 3})
    base = estimate_plan(plain, 128, 2)[0].weights_bytes
    est, measured = estimate_plan(cfg, 128, 2)[0], measured_plan(cfg, 128, 2)[0]
    assert measured.weights_bytes > measured_plan(plain, 128, 2)[0].weights_bytes
    assert measured.weights_bytes <= est.weights_bytes <= measured.weights_bytes + H * 256 * 4 + VOCAB
    assert est.weights_bytes > base
    assert measured.activation_peak_bytes > 0
