"""EAGLE-3 speculative decoding (vLLM's speculative_config {"method": "eagle3", "model": HEAD, ...}): a tiny random
head saved in the EAGLE repo's on-disk layout drives a tiny Llama target. Its proposals equal an independent torch
reference of the head written here from the checkpoint tensors (the target's aux states from transformers), greedy
output equals a run without speculation (batched, chunked, preempted, prefix-cached), the counters count, and bad
heads are refused up front."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.speculative import parse_speculative_config
from infer.errors import ConfigError, InferError

from helpers import random_prompts, save_random_model

H, HEADS, KV, D, INTER, VOCAB, DRAFT_VOCAB, LAYERS = 64, 4, 2, 16, 128, 512, 256, 8
TARGET = dict(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
              num_key_value_heads=KV, head_dim=D, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)


def save_eagle3(folder, seed: int = 0, aux_ids=None, drop=(), config=None, zero_norm: bool = False,
                d2t_first: int | None = None) -> dict:
    """A random EAGLE-3 head in the checkpoint layout of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (config.json and
    model.safetensors: fc, midlayer.*, norm, lm_head, d2t, t2d); returns its tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.15):
        return torch.randn(*shape, generator=g) * scale

    def norm():
        return 1 + rnd(H, scale=0.3)
    t = {"fc.weight": rnd(H, 3 * H, scale=0.08),
         "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
         "midlayer.self_attn.q_proj.weight": rnd(HEADS * D, 2 * H),
         "midlayer.self_attn.k_proj.weight": rnd(KV * D, 2 * H),
         "midlayer.self_attn.v_proj.weight": rnd(KV * D, 2 * H), "midlayer.self_attn.o_proj.weight": rnd(H, HEADS * D),
         "midlayer.post_attention_layernorm.weight": norm(), "midlayer.mlp.gate_proj.weight": rnd(INTER, H),
         "midlayer.mlp.up_proj.weight": rnd(INTER, H), "midlayer.mlp.down_proj.weight": rnd(H, INTER),
         "norm.weight": torch.zeros(H) if zero_norm else norm(), "lm_head.weight": rnd(DRAFT_VOCAB, H, scale=0.5)}
    ids = torch.sort(torch.randperm(VOCAB - 3, generator=g)[:DRAFT_VOCAB] + 3).values  # draft id -> target id
    if d2t_first is not None:
        ids[0] = d2t_first
    t["d2t"] = ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    for name in drop:
        del t[name]
    save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D,
           "num_hidden_layers": 1, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 512, "hidden_act": "silu", "torch_dtype": "float32",
           "tie_word_embeddings": False}
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    cfg.update(config or {})
    (folder / "config.json").write_text(json.dumps(cfg))
    return t


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle_target")
    hf = save_random_model(folder, "llama", "LlamaForCausalLM", TARGET, seed=3)
    return folder, hf


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle_head") / "h"
    return folder, save_eagle3(folder, seed=1)


def spec(folder, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": k}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


# ------------------------------------------------------------------ the independent reference
def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + half * sin


def _layer(t, emb, hid):
    """The head's decoder layer over a whole sequence, causal, from scratch: (normed, pre-norm)."""
    n = emb.shape[0]
    x = torch.cat([_rms(emb, t["midlayer.input_layernorm.weight"]), _rms(hid, t["midlayer.hidden_norm.weight"])], -1)
    pos = torch.arange(n)
    q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, D), pos)
    k = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, KV, D), pos)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, KV, D)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, HEADS * D) @ t["midlayer.self_attn.o_proj.weight"].T
    res = o + hid
    y = _rms(res, t["midlayer.post_attention_layernorm.weight"])
    gate, up = y @ t["midlayer.mlp.gate_proj.weight"].T, y @ t["midlayer.mlp.up_proj.weight"].T
    y = (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T
    pre = y + res
    return _rms(pre, t["norm.weight"]), pre


def reference_drafts(hf, t, tokens: list[int], k: int, aux_ids) -> list[int]:
    """EAGLE-3's k greedy drafts after `tokens` (the last one sampled, not yet through the target): position p
    pairs token p + 1 with the target's residual stream entering layers aux_ids at p (fc of their concat), then
    each draft with the head's own pre-norm output."""
    with torch.no_grad():
        states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        hid = torch.cat([states[i][0] for i in aux_ids], -1) @ t["fc.weight"].T
        embed = hf.model.embed_tokens.weight
        toks, out = list(tokens[1:]), []
        for _ in range(k):
            normed, pre = _layer(t, embed[torch.tensor(toks)], hid)
            d = int((normed[-1] @ t["lm_head.weight"].T).argmax())
            out.append(d + int(t["d2t"][d]))
            toks.append(out[-1])
            hid = torch.cat([hid, pre[-1:]])
    return out


def _record(monkeypatch):
    from infer.engine.eagle import EagleRunner
    seen, real = [], EagleRunner.propose

    def propose(self, batch):
        real(self, batch)
        for s in batch.seqs:
            if s.draft_token_ids:
                seen.append((list(s.all_token_ids), list(s.draft_token_ids)))
    monkeypatch.setattr(EagleRunner, "propose", propose)
    return seen


@pytest.mark.parametrize("aux_ids", [None, (5, 1, 6)])
def test_the_heads_proposals_equal_an_independent_reference(tmp_path, target, monkeypatch, aux_ids):
    """Every draft the engine proposed equals the reference's, computed from the checkpoint tensors and
    transformers' hidden states (a wrong aux layer, concat order, norm or d2t changes them)."""
    folder, hf = target
    t = save_eagle3(tmp_path / "h", seed=7, aux_ids=aux_ids)
    seen = _record(monkeypatch)
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
              speculative_config=spec(tmp_path / "h"))
    prompts = random_prompts(VOCAB, (9, 14), seed=4)
    llm.generate(prompts, greedy(10))
    ids = aux_ids or (2, LAYERS // 2, LAYERS - 3)
    assert len(seen) >= 10
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, t, tokens, len(drafts), ids), tokens
    s = llm.engine.stats()
    assert s["spec_decode_num_drafts"] == len(seen)
    assert s["spec_decode_num_draft_tokens"] == sum(len(d) for _, d in seen)


KW = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=24, max_model_len=64)


@pytest.fixture(scope="module")
def plain(target):
    return LLM(str(target[0]), **KW)


@pytest.fixture(scope="module")
def eagle(target, head):
    return LLM(str(target[0]), speculative_config=spec(head[0]), **KW)


def test_greedy_equals_plain_batched_chunked_and_preempted(plain, eagle):
    """Prompts of several seeds in one batch: chunked prefills beside decodes, preemptions (24 blocks of 4)."""
    prompts = [p for seed in (0, 1, 2) for p in random_prompts(VOCAB, (5, 19), seed=seed)]
    want = [o.token_ids for o in plain.generate(prompts, greedy(16))]
    before = eagle.engine.stats()
    assert [o.token_ids for o in eagle.generate(prompts, greedy(16))] == want
    s = eagle.engine.stats()
    assert s["num_preemptions"] > before["num_preemptions"]
    assert s["spec_decode_num_draft_tokens"] > before["spec_decode_num_draft_tokens"]
    assert eagle.engine.block_manager.num_used_blocks == 0


def test_prefix_cache_hits_change_nothing(plain, eagle):
    prompt = random_prompts(VOCAB, (10,), seed=13)[0]
    first = eagle.generate([prompt], greedy(14))[0]
    assert first.token_ids == plain.generate([prompt], greedy(14))[0].token_ids
    again = [prompt + first.token_ids[:10], prompt[:9]]
    hits = eagle.engine.stats()["prefix_cache_hits"]
    assert [o.token_ids for o in eagle.generate(again, greedy(12))] == \
        [o.token_ids for o in plain.generate(again, greedy(12))]
    assert eagle.engine.stats()["prefix_cache_hits"] > hits


def test_every_draft_of_a_head_that_agrees_is_accepted_and_counted(tmp_path):
    """A target whose final norm is zero always emits token 0; a head whose final norm is zero always drafts draft
    id 0, mapped by d2t to token 0: every draft is accepted, and the counters say so by position."""
    folder = tmp_path / "t"

    def perturb(name, p):
        if name == "model.norm.weight":
            p.zero_()
    save_random_model(folder, "llama", "LlamaForCausalLM", TARGET, seed=5, perturb=perturb)
    save_eagle3(tmp_path / "h", seed=2, zero_norm=True, d2t_first=0)
    llm = LLM(str(folder), block_size=4, speculative_config=spec(tmp_path / "h", 3))
    out = llm.generate(random_prompts(VOCAB, (6, 11), seed=1), greedy(13))
    assert all(o.token_ids == [0] * 13 for o in out)
    s = llm.engine.stats()
    # each request: its prefill's token, then 3 steps of 3 accepted drafts and the target's own token
    assert s["spec_decode_num_draft_tokens"] == s["spec_decode_num_accepted_tokens"] == 18
    assert s["spec_decode_num_accepted_tokens_per_pos"] == [6, 6, 6] and s["spec_decode_num_drafts"] == 6


# ------------------------------------------------------------------ options and refusals
def test_the_method_parses_as_vllms():
    assert parse_speculative_config({"method": "eagle3", "model": "x", "num_speculative_tokens": 2}) == \
        {"method": "eagle3", "model": "x", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="needs \"model\""):
        EngineConfig("tiny-llama", speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    cfg = EngineConfig("tiny-llama", speculative_config={"method": "eagle3", "model": "x", "num_speculative_tokens": 2})
    assert not cfg.use_overlap()


@pytest.mark.parametrize("case, message", [
    ("hidden", "hidden_size 32, the target 64"),
    ("missing", "lacks midlayer.hidden_norm.weight"),
    ("extra", "no place for: midlayer.extra.weight"),
    ("layers", "reads the target's layers [2, 9, 1]"),
    ("arch", "is not an EAGLE-3 head"),
    ("d2t", "d2t maps draft ids outside"),
])
def test_a_bad_head_is_refused_naming_the_problem(tmp_path, target, case, message):
    folder, _ = target
    h = tmp_path / "h"
    if case == "hidden":
        save_eagle3(h, config={"hidden_size": 32})
    elif case == "missing":
        save_eagle3(h, drop=("midlayer.hidden_norm.weight",))
    elif case == "extra":
        t = save_eagle3(h)
        t["midlayer.extra.weight"] = torch.zeros(2)
        save_file({k: v.contiguous() for k, v in t.items()}, str(h / "model.safetensors"))
    elif case == "layers":
        save_eagle3(h, aux_ids=(2, 9, 1))
    elif case == "arch":
        save_eagle3(h, config={"architectures": ["LlamaForCausalLM"]})
    else:
        t = save_eagle3(h)
        t["d2t"][5] = VOCAB
        save_file({k: v.contiguous() for k, v in t.items()}, str(h / "model.safetensors"))
    with pytest.raises(InferError) as e:
        LLM(str(folder), speculative_config=spec(h))
    assert message in str(e.value) and e.value.hint


def test_a_target_of_another_family_is_refused(tmp_path, head):
    with pytest.raises(InferError, match="needs a target of the Llama family") as e:
        LLM("tiny-gemma", speculative_config=spec(head[0]))
    assert e.value.hint


def test_the_gpu_path_equals_the_cpu_path(target, monkeypatch):
    """The GPU code path on CPU (every op its Triton kernel, interpreted; graphs emulated where any are captured):
    the same drafts as the reference, the same tokens as the CPU path without speculation."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels")
    from quant_helpers import int4_kernel_path
    folder, hf = target
    prompts = random_prompts(VOCAB, (6, 9), seed=21)
    with LLM(str(folder), block_size=4) as cpu:
        want = [o.token_ids for o in cpu.generate(prompts, greedy(6))]
    t = save_eagle3(folder.parent / "gpu_head", seed=8)
    seen = _record(monkeypatch)
    int4_kernel_path(monkeypatch)
    # (max_num_batched_tokens 32: the piecewise graphs' buckets, each captured through the interpreted kernels, up to
    # the 15-token prefill and the verify steps, not the default budget's)
    with LLM(str(folder), block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
             speculative_config=spec(folder.parent / "gpu_head")) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        assert llm.engine.runner.graphs.aux == 3  # (the graphs keep the target's aux states: its steps replay)
        assert [o.token_ids for o in llm.generate(prompts, greedy(6))] == want
        s = llm.engine.stats()
        assert s["piecewise_graph_steps"] > 0 and s["draft_cuda_graph_replays"] > 0
    assert seen
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, t, tokens, len(drafts), (2, LAYERS // 2, LAYERS - 3))


def test_the_memory_plan_counts_the_heads_kv_and_weights(plain, eagle):
    from infer.memory.sizes import kv_bytes_per_token, weights_bytes
    p, q, head = plain.engine.memory_plan, eagle.engine.memory_plan, eagle.engine.drafter
    assert head.kv_cache.shape[0] == 1 and head.kv_cache.shape[2:4] == eagle.engine.runner.kv_cache.shape[2:4]
    assert q.kv_bytes_per_token == p.kv_bytes_per_token + kv_bytes_per_token(head.model_config, torch.float32)
    assert q.kv_bytes_per_token == p.kv_bytes_per_token * (LAYERS + 1) // LAYERS
    # its weights, not the target's embeddings it shares
    assert q.weights_bytes == p.weights_bytes + weights_bytes(head.model)
    from infer.engine.sleep import module_tensors  # (what sleep moves as the head's: not the target's table)
    assert all(tuple(t.shape) != (VOCAB, H) for t in module_tensors(head.model.modules()))


# ------------------------------------------------------------------ the CLI
def test_run_and_serve_take_an_eagle3_head(tmp_path, target, head, plain, monkeypatch):
    from typer.testing import CliRunner
    from infer.cli.main import app
    from infer.cli.warmup_plan import _draft_cfg
    runner, folder = CliRunner(), target[0]
    option = json.dumps(spec(head[0], 2))
    lines = [{"id": str(i), "prompt_token_ids": p, "max_new_tokens": 6, "ignore_eos": True}
             for i, p in enumerate(random_prompts(VOCAB, (5, 8), seed=3))]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = runner.invoke(app, ["run", str(folder), str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                              "-q", "--block-size", "4", "--speculative-config", option])
    assert res.exit_code == 0, res.output
    got = {r["id"]: r["token_ids"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    want = plain.generate([x["prompt_token_ids"] for x in lines], greedy(6))
    assert [got[x["id"]] for x in lines] == [o.token_ids for o in want]
    seen = {}
    monkeypatch.setattr("infer.cli.serve._serve", lambda engine, *a, **kw: seen.update(engine=engine))
    res = runner.invoke(app, ["serve", str(folder), "--port", "0", "--speculative-config", option])
    assert res.exit_code == 0, res.output
    assert seen["engine"].speculative_config == spec(head[0], 2)
    # warmup's estimate counts the head's one layer of KV (memory.plan's draft share)
    assert _draft_cfg(seen["engine"]).num_hidden_layers == 1
    bad = tmp_path / "bad"
    save_eagle3(bad, config={"hidden_size": 32})
    res = runner.invoke(app, ["run", str(folder), str(tmp_path / "in.jsonl"), "-o", "-", "-q",
                              "--speculative-config", json.dumps(spec(bad))])
    assert res.exit_code != 0 and "hidden_size 32, the target 64" in res.output


# ------------------------------------------------------------------ EAGLE-1 heads (method "eagle")
def save_eagle1(folder, seed: int = 0, embed: bool = False, drop=(), config=None) -> dict:
    """A random EAGLE-1 head in the EAGLE repo's layout (a Llama config of one layer; pytorch_model.bin with fc
    (and its bias), layers.0.* without an input norm, no final norm nor lm_head)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.15):
        return torch.randn(*shape, generator=g) * scale
    t = {"fc.weight": rnd(H, 2 * H, scale=0.1), "fc.bias": rnd(H, scale=0.1),
         "layers.0.self_attn.q_proj.weight": rnd(HEADS * D, H), "layers.0.self_attn.k_proj.weight": rnd(KV * D, H),
         "layers.0.self_attn.v_proj.weight": rnd(KV * D, H), "layers.0.self_attn.o_proj.weight": rnd(H, HEADS * D),
         "layers.0.post_attention_layernorm.weight": 1 + rnd(H, scale=0.3),
         "layers.0.mlp.gate_proj.weight": rnd(INTER, H), "layers.0.mlp.up_proj.weight": rnd(INTER, H),
         "layers.0.mlp.down_proj.weight": rnd(H, INTER)}
    if embed:
        t["embed_tokens.weight"] = rnd(VOCAB, H, scale=0.5)
    for name in drop:
        del t[name]
    torch.save(t, folder / "pytorch_model.bin")
    cfg = {**TARGET, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
           "hidden_act": "silu", "rope_theta": 10000.0, **(config or {})}
    (folder / "config.json").write_text(json.dumps(cfg))
    return t


def reference_eagle1(hf, t, tokens: list[int], k: int) -> list[int]:
    """EAGLE-1's k greedy drafts: position p pairs token p + 1 with the target's last (normed) hidden state at p;
    fc of concat(embedding, state), one layer without input norm, the output fed back and through the target's
    lm_head."""
    with torch.no_grad():
        hid = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        embed = t["embed_tokens.weight"] if "embed_tokens.weight" in t else hf.model.embed_tokens.weight
        toks, out = list(tokens[1:]), []
        for _ in range(k):
            x = torch.cat([embed[torch.tensor(toks)], hid], -1) @ t["fc.weight"].T + t["fc.bias"]
            n, pos = x.shape[0], torch.arange(x.shape[0])
            q = _rope((x @ t["layers.0.self_attn.q_proj.weight"].T).view(n, HEADS, D), pos)
            kk = _rope((x @ t["layers.0.self_attn.k_proj.weight"].T).view(n, KV, D), pos)
            v = (x @ t["layers.0.self_attn.v_proj.weight"].T).view(n, KV, D)
            kk, v = kk.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
            s = torch.einsum("qhd,khd->hqk", q, kk) / D ** 0.5
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, HEADS * D)
            res = o @ t["layers.0.self_attn.o_proj.weight"].T + x
            y = _rms(res, t["layers.0.post_attention_layernorm.weight"])
            gate, up = y @ t["layers.0.mlp.gate_proj.weight"].T, y @ t["layers.0.mlp.up_proj.weight"].T
            o = (torch.nn.functional.silu(gate) * up) @ t["layers.0.mlp.down_proj.weight"].T + res
            out.append(int((o[-1] @ hf.lm_head.weight.T).argmax()))
            toks.append(out[-1])
            hid = torch.cat([hid, o[-1:]])
    return out


@pytest.mark.parametrize("embed", [False, True])
def test_eagle1_proposals_equal_the_reference_and_greedy_equals_plain(tmp_path, target, plain, monkeypatch, embed):
    folder, hf = target
    t = save_eagle1(tmp_path / "h1", seed=11, embed=embed)
    seen = _record(monkeypatch)
    llm = LLM(str(folder), speculative_config={"method": "eagle", "model": str(tmp_path / "h1"),
                                               "num_speculative_tokens": 3}, **KW)
    prompts = random_prompts(VOCAB, (9, 6), seed=9 + embed)
    assert [o.token_ids for o in llm.generate(prompts, greedy(9))] == \
        [o.token_ids for o in plain.generate(prompts, greedy(9))]
    assert len(seen) >= 6
    for tokens, drafts in seen:
        assert drafts == reference_eagle1(hf, t, tokens, len(drafts)), tokens
    assert llm.engine.stats()["spec_decode_num_draft_tokens"] == sum(len(d) for _, d in seen)


@pytest.mark.parametrize("case, message", [
    ("missing", "lacks layers.0.mlp.down_proj.weight"),
    ("hidden", "hidden_size 32, the target 64"),
    ("eagle3", "is an EAGLE-3 head"),
])
def test_a_bad_eagle1_head_is_refused(tmp_path, target, case, message):
    h = tmp_path / "h"
    if case == "missing":
        save_eagle1(h, drop=("layers.0.mlp.down_proj.weight",))
    elif case == "hidden":
        save_eagle1(h, config={"hidden_size": 32})
    else:
        save_eagle3(h)
    with pytest.raises(InferError) as e:
        LLM(str(target[0]), speculative_config={"method": "eagle", "model": str(h), "num_speculative_tokens": 2})
    assert message in str(e.value) and e.value.hint


def check_eagle_heads_drive(tmp_path, monkeypatch, model_type: str, arch: str, config: dict, aux_ids=None):
    """A random target of `model_type` (`config` over TARGET's, its config.json naming `arch` as the family's
    checkpoints do) driven by an EAGLE-3 head reading layers aux_ids (None: vLLM's default) and by an EAGLE-1 head:
    each draft equals the independent reference over transformers' hidden states of the target, and greedy output
    (batched, chunked) equals the target's alone."""
    folder = tmp_path / "t"
    hf = save_random_model(folder, model_type, arch, {**TARGET, **config}, seed=3)
    saved = json.loads((folder / "config.json").read_text())  # (transformers saves InternLM3 as the Llama it runs)
    (folder / "config.json").write_text(json.dumps({**saved, "architectures": [arch]}))
    t = save_eagle3(tmp_path / "h", seed=7, aux_ids=aux_ids)
    seen = _record(monkeypatch)
    prompts = random_prompts(VOCAB, (9, 14), seed=4)
    kw = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    with LLM(str(folder), speculative_config=spec(tmp_path / "h"), **kw) as llm:
        assert llm.engine.runner.model.config.model_type == model_type
        got = [o.token_ids for o in llm.generate(prompts, greedy(10))]
    assert len(seen) >= 10
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, t, tokens, len(drafts), aux_ids or (2, LAYERS // 2, LAYERS - 3)), tokens
    with LLM(str(folder), **kw) as llm:
        assert got == [o.token_ids for o in llm.generate(prompts, greedy(10))]
    t1, seen[:] = save_eagle1(tmp_path / "h1", seed=11), []  # an EAGLE-1 head (the target's last hidden state)
    with LLM(str(folder), speculative_config={"method": "eagle", "model": str(tmp_path / "h1"),
                                              "num_speculative_tokens": 3}, **kw) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy(10))] == got
    assert len(seen) >= 6
    for tokens, drafts in seen:
        assert drafts == reference_eagle1(hf, t1, tokens, len(drafts)), tokens
