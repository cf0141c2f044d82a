"""EAGLE draft heads (vLLM's speculative methods "eagle3" and "eagle"; the EAGLE repo's checkpoints, e.g.
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, yuhuili/EAGLE-LLaMA3-Instruct-8B): one decoder layer that drafts from the target's
own hidden states.

Checkpoint layout (config.json: LlamaForCausalLMEagle3, hidden_size the target's, draft_vocab_size, optionally
eagle_config.eagle_aux_hidden_state_layer_ids):
  fc.weight [H, 3H]: the three aux hidden states of the target, concatenated in the order of the layer ids
      (the residual stream entering target layers (2, L // 2, L - 3) by default, vLLM's choice), projected to H
  midlayer.input_layernorm.weight [H] (the token's embedding), midlayer.hidden_norm.weight [H] (the hidden state)
  midlayer.self_attn.{q,k,v}_proj.weight [., 2H] over concat(normed embedding, normed hidden), o_proj [H, .]
  (the attention's output added to the hidden state, or to its normed self where config.json's norm_before_residual)
  midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight
  lm_head.weight [draft_vocab, H]; d2t [draft_vocab] (target id = draft id + d2t[draft id]); t2d [vocab] (unused)
  embed_tokens.weight [vocab, H] (optional: the target's embeddings otherwise)

EAGLE-1 (method "eagle"; config.json a Llama config of one layer): fc.weight [H, 2H] (and fc.bias) over
concat(the token's embedding, the target's last hidden state, after its final norm), layers.0.{self_attn, mlp,
post_attention_layernorm} (layer 0 has no input norm), no final norm: the output (the MLP's plus the residual) is the
next hidden state and goes through the target's lm_head; embed_tokens.weight optional (the target's otherwise).

Position p of the head's KV holds (the embedding of token p + 1, the hidden state of position p): the target's
projected aux states for the positions it computed, the head's own pre-norm output for the drafts after the first.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import ModelLoadError
from .context import ForwardContext
from .layers import MergedLinear
from .llama import MLP, Attention, RMSNorm, _DecodeConsumer
from .rope import build_cos_sin_cache, rope_layer_types

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# the dense Llama-family forwards that expose aux states (vLLM's SupportsEagle3 models among those infer runs: its
# Llama serves SmolLM3, InternLM3 and Ministral 3's language model, its Ernie4_5ForCausalLM is its Llama, its
# HunYuanDenseV1ForCausalLM keeps aux states of its own). Those of the other families infer runs are refused: vLLM
# taps none of them, and no head is trained for them
TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "ernie4_5", "ministral3", "internlm3",
                "hunyuan_v1_dense")
HINT = "use an EAGLE-3 head trained for this target model (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B for Llama 3.1 8B)"


def load_eagle3_config(path: Path):
    """The head's config.json as a transformers LlamaConfig (its extra keys kept); ModelLoadError when it is not
    an EAGLE-3 head's."""
    from transformers import LlamaConfig
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"EAGLE-3 head {path} has no config.json", "pass the head's folder")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}", HINT) from None
    archs = raw.get("architectures") or []
    if not any(a in EAGLE3_ARCHS for a in archs):
        raise ModelLoadError(f"{path} is not an EAGLE-3 head (architectures {archs}, expected one of "
                             f"{', '.join(EAGLE3_ARCHS)})", HINT)
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ModelLoadError(f"EAGLE-3 head {path} has num_hidden_layers {raw.get('num_hidden_layers')}: infer runs "
                             f"heads of one decoder layer (midlayer)", HINT)
    raw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    cfg = LlamaConfig(**raw)
    cfg.architectures = list(archs)
    return cfg


AUX_STATES = 3  # the target's hidden states an EAGLE-3 head reads (its fc: [H, 3H])


def aux_layer_ids(head_cfg, target_cfg) -> tuple[int, ...]:
    """The target layers whose input (the residual stream) the head reads: the config's
    eagle_aux_hidden_state_layer_ids (where vLLM reads them, e.g. the speculators' heads) or eagle_config's (the
    EAGLE repo's and ModelOpt's), or vLLM's default (2, L // 2, L - 3); ModelLoadError for ids the target has not."""
    n = target_cfg.num_hidden_layers
    eagle = getattr(head_cfg, "eagle_config", None) or {}
    ids = getattr(head_cfg, "eagle_aux_hidden_state_layer_ids", None) or \
        (eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None)
    ids = tuple(int(i) for i in ids) if ids else (2, n // 2, n - 3)
    if len(ids) != AUX_STATES or any(i < 0 or i >= n for i in ids):
        raise ModelLoadError(f"the EAGLE-3 head reads the target's layers {list(ids)}, which a target of {n} layers "
                             f"does not have (three ids in 0..{n - 1})",
                             "set eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json, or use "
                             "the head trained for this target")
    return ids


def check_target(head_cfg, target_cfg, target_model, path, kind_name: str = "EAGLE-3") -> None:
    """Refuse a head the target cannot drive: another family, another hidden size or vocabulary."""
    from .llama import LlamaForCausalLM
    kind = getattr(target_cfg, "model_type", None)
    if kind not in TARGET_TYPES or (target_model is not None and
                                    type(target_model).forward is not LlamaForCausalLM.forward):
        raise ModelLoadError(f"{kind_name} speculation needs a target of the Llama family "
                             f"({', '.join(TARGET_TYPES)}), not model_type {kind!r}",
                             "use draft-model or n-gram speculation with this model")
    if head_cfg.hidden_size != target_cfg.hidden_size:
        raise ModelLoadError(f"{kind_name} head {path} has hidden_size {head_cfg.hidden_size}, the target "
                             f"{target_cfg.hidden_size}: it was trained for another model", HINT)
    if head_cfg.vocab_size != target_cfg.vocab_size:
        raise ModelLoadError(f"{kind_name} head {path} has vocab_size {head_cfg.vocab_size}, the target "
                             f"{target_cfg.vocab_size}: it was trained for another model", HINT)


class Eagle3Head(nn.Module):
    """The head (vLLM's Eagle3LlamaForCausalLM): fc, one decoder layer over concat(embedding, hidden), the final
    norm, its lm_head over the draft vocabulary and d2t."""

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int | None):
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.draft_vocab = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        # the residual the attention's output adds to: the normed hidden state (the speculators' heads,
        # norm_before_residual: true), else the hidden state itself (the EAGLE repo's), as vLLM's Eagle3 layer
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))
        self.fc = nn.Linear(3 * h, h, bias=False, dtype=dtype)
        self.fc.weight.requires_grad_(False)
        no_method = (lambda names: None)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        attn = Attention(cfg, "midlayer.self_attn", no_method, dtype)
        attn.qkv_proj = MergedLinear(2 * h, [attn.q_size, attn.kv_size, attn.kv_size],
                                     [f"midlayer.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")], False,
                                     None, dtype)
        attn.qkv_proj.lora_consumer = _DecodeConsumer(attn)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, "midlayer.mlp", no_method, dtype)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(h, self.draft_vocab, bias=False, dtype=dtype)
        self.lm_head.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long), persistent=False)
        self.embed_tokens = None  # its own embeddings (nn.Embedding) where the checkpoint stores them
        # else the target's table, looked up at each use (not a tensor of the head's: sleep and reload_weights handle
        # it with the target's)
        self._target_embed = None
        self.aux_layers: tuple[int, ...] = ()
        types = rope_layer_types(cfg)
        self.register_buffer("cos_sin", build_cos_sin_cache(
            cfg, max_positions, "full_attention" if "full_attention" in types else types[0]), persistent=False)
        attn.rot_dim = self.cos_sin.shape[-1]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens.weight if self.embed_tokens is not None else self._target_embed()
        return nn.functional.embedding(ids, table)

    def combine(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """The target's aux hidden states (in aux_layers' order) projected to the head's hidden size."""
        return self.fc(torch.cat(aux, dim=-1))

    def forward(self, input_ids, positions, ctx: ForwardContext, hidden: torch.Tensor):
        """(the normed output for the logits, the pre-norm output fed back as the next draft's hidden state)."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(self.embed(input_ids)), normed], dim=-1)
        o, delta = self.self_attn(positions, x, ctx, self.cos_sin)
        x, residual = self.post_attention_layernorm(o, normed if self.norm_before_residual else hidden, delta)
        x, delta = self.mlp(x, ctx)
        return self.norm(x, residual, delta)

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row, as a target token id (through d2t)."""
        best = nn.functional.linear(normed, self.lm_head.weight).float().argmax(-1)
        return best + self.d2t.index_select(0, best)


_NORMS = {"midlayer.input_layernorm.weight": "input_layernorm", "midlayer.hidden_norm.weight": "hidden_norm",
          "midlayer.post_attention_layernorm.weight": "post_attention_layernorm", "norm.weight": "norm"}
_SHARDS = {"q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
           "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
           "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
           "down_proj": ("mlp", "down_proj", 0)}


def own_embedding(vocab: int, hidden: int, dtype, device) -> nn.Embedding:
    """A head's own embedding table (where its checkpoint stores one; else it reads the target's), frozen."""
    table = nn.Embedding(vocab, hidden, dtype=dtype, device=device)
    table.weight.requires_grad_(False)
    return table


def load_eagle3(path: Path, target_model, target_cfg, dtype: torch.dtype, device: torch.device,
                max_positions: int | None):
    """(the head, its config), checked against the target and loaded on `device` in `dtype`; sets nothing on the
    target (the engine turns its aux states on: LlamaForCausalLM.aux_layers)."""
    from .loader import iter_tensors, weight_files
    from .rope import check_rope
    path = Path(path)
    cfg = load_eagle3_config(path)
    check_rope(cfg)
    check_target(cfg, target_cfg, target_model, path)
    with torch.device(device):
        head = Eagle3Head(cfg, dtype, max_positions)
    head.aux_layers = aux_layer_ids(cfg, target_cfg)
    h, vocab, draft_vocab = cfg.hidden_size, target_cfg.vocab_size, head.draft_vocab
    seen: set[str] = set()
    d2t = None

    def put(param: torch.Tensor, name: str, t: torch.Tensor) -> None:
        if tuple(param.shape) != tuple(t.shape):
            raise ModelLoadError(f"EAGLE-3 head {path}: {name} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(param.shape)} (hidden_size {h}, draft_vocab_size {draft_vocab})", HINT)
        param.data.copy_(t.to(dtype))

    for name, t in iter_tensors(weight_files(path)):
        key = name[6:] if name.startswith("model.") else name
        if key == "d2t":
            d2t = t
        elif key == "t2d":
            pass  # target id -> whether the draft vocabulary has it: the drafts never need it
        elif key == "fc.weight":
            put(head.fc.weight, name, t)
        elif key in _NORMS:
            put(getattr(head, _NORMS[key]).weight, name, t)
        elif key == "lm_head.weight":
            put(head.lm_head.weight, name, t)
        elif key == "embed_tokens.weight":
            head.embed_tokens = own_embedding(vocab, h, dtype, device)
            put(head.embed_tokens.weight, name, t)
        elif key.startswith("midlayer.") and key.endswith(".weight") and key.split(".")[-2] in _SHARDS:
            block, layer, shard = _SHARDS[key.split(".")[-2]]
            linear = getattr(getattr(head, block), layer)
            width = linear.in_features
            if tuple(t.shape) != (linear.out_sizes[shard], width):
                raise ModelLoadError(f"EAGLE-3 head {path}: {name} has shape {tuple(t.shape)}, expected "
                                     f"{(linear.out_sizes[shard], width)} (hidden_size {h})", HINT)
            linear.load_shard("weight", shard, t.to(dtype))
        else:
            raise ModelLoadError(f"EAGLE-3 head {path} has a tensor infer has no place for: {name}", HINT)
        seen.add(key)
    need = ["fc.weight", *_NORMS, *(f"midlayer.{b}.{p}.weight" for p, (b, _, _) in _SHARDS.items())]
    if draft_vocab != vocab:
        need += ["d2t"]
    if draft_vocab != vocab or "lm_head.weight" not in seen:
        need += ["lm_head.weight"]
    missing = [n for n in need if n not in seen]
    if missing:
        raise ModelLoadError(f"EAGLE-3 head {path} lacks {missing[0]}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""), HINT)
    if d2t is not None:
        if tuple(d2t.shape) != (draft_vocab,):
            raise ModelLoadError(f"EAGLE-3 head {path}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)",
                                 HINT)
        d2t = d2t.to(torch.long)
        mapped = d2t + torch.arange(draft_vocab)
        if int(mapped.min()) < 0 or int(mapped.max()) >= vocab:
            raise ModelLoadError(f"EAGLE-3 head {path}: d2t maps draft ids outside the target's vocabulary "
                                 f"(0..{vocab - 1})", HINT)
        head.d2t.copy_(d2t)
    for m in head.modules():
        if isinstance(m, MergedLinear):
            m.finish_loading()
    if head.embed_tokens is None:
        head._target_embed = lambda: target_model.embed_tokens.weight
    head.eval()
    return head, cfg


class Eagle1Head(nn.Module):
    """An EAGLE-1 head (vLLM's EagleLlamaForCausalLM): fc over concat(embedding, the target's last hidden state), one
    decoder layer without its input norm, the target's lm_head."""

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int | None, fc_bias: bool):
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.draft_vocab = cfg.vocab_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias, dtype=dtype)
        for p in self.fc.parameters():
            p.requires_grad_(False)
        no_method = (lambda names: None)
        self.self_attn = Attention(cfg, "layers.0.self_attn", no_method, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, "layers.0.mlp", no_method, dtype)
        self.embed_tokens = None
        self._target_embed = None  # (as Eagle3Head's)
        self._target_logits = None  # the target's compute_logits
        self.aux_layers: tuple[int, ...] = ()  # (none: the target's output is its hidden state)
        types = rope_layer_types(cfg)
        self.register_buffer("cos_sin", build_cos_sin_cache(
            cfg, max_positions, "full_attention" if "full_attention" in types else types[0]), persistent=False)
        self.self_attn.rot_dim = self.cos_sin.shape[-1]

    embed = Eagle3Head.embed

    def combine(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return aux[0]

    def forward(self, input_ids, positions, ctx: ForwardContext, hidden: torch.Tensor):
        """(the output, the same fed back as the next draft's hidden state)."""
        x = self.fc(torch.cat([self.embed(input_ids), hidden], dim=-1))
        o, delta = self.self_attn(positions, x, ctx, self.cos_sin)
        y, residual = self.post_attention_layernorm(o, x, delta)
        y, delta = self.mlp(y, ctx)
        out = y + residual
        return out, out

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        return self._target_logits(out).argmax(-1)


_EAGLE1_SHARDS = {f"layers.0.{b}.{p}.weight": v for (p, v) in _SHARDS.items() for b in (v[0],)}


def load_eagle1(path: Path, target_model, target_cfg, dtype: torch.dtype, device: torch.device,
                max_positions: int | None):
    """(the EAGLE-1 head, its config), checked against the target and loaded as load_eagle3 loads a head."""
    from transformers import LlamaConfig
    from .loader import iter_tensors, weight_files
    from .rope import check_rope
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"EAGLE head {path} has no config.json", "pass the head's folder")
    raw = json.loads(file.read_text())
    archs = raw.get("architectures") or []
    if any(a in EAGLE3_ARCHS for a in archs):
        raise ModelLoadError(f"{path} is an EAGLE-3 head ({archs[0]}), given with method \"eagle\"",
                             'give "method": "eagle3"')
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ModelLoadError(f"EAGLE head {path} has num_hidden_layers {raw.get('num_hidden_layers')}: infer runs "
                             f"heads of one decoder layer", HINT)
    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    cfg.architectures = list(archs)
    check_rope(cfg)
    check_target(cfg, target_cfg, target_model, path, "EAGLE")
    tensors = [(n[6:] if n.startswith("model.") else n, t) for n, t in iter_tensors(weight_files(path))]
    with torch.device(device):
        head = Eagle1Head(cfg, dtype, max_positions, fc_bias=any(n == "fc.bias" for n, _ in tensors))
    h, vocab, seen = cfg.hidden_size, target_cfg.vocab_size, set()

    def put(param, name, t):
        if tuple(param.shape) != tuple(t.shape):
            raise ModelLoadError(f"EAGLE head {path}: {name} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(param.shape)} (hidden_size {h})", HINT)
        param.data.copy_(t.to(dtype))
    for key, t in tensors:
        if key == "fc.weight":
            put(head.fc.weight, key, t)
        elif key == "fc.bias":
            put(head.fc.bias, key, t)
        elif key == "layers.0.post_attention_layernorm.weight":
            put(head.post_attention_layernorm.weight, key, t)
        elif key == "embed_tokens.weight":
            head.embed_tokens = own_embedding(vocab, h, dtype, device)
            put(head.embed_tokens.weight, key, t)
        elif key in _EAGLE1_SHARDS:
            block, layer, shard = _EAGLE1_SHARDS[key]
            linear = getattr(getattr(head, block), layer)
            if tuple(t.shape) != (linear.out_sizes[shard], linear.in_features):
                raise ModelLoadError(f"EAGLE head {path}: {key} has shape {tuple(t.shape)}, expected "
                                     f"{(linear.out_sizes[shard], linear.in_features)} (hidden_size {h})", HINT)
            linear.load_shard("weight", shard, t.to(dtype))
        else:
            raise ModelLoadError(f"EAGLE head {path} has a tensor infer has no place for: {key}", HINT)
        seen.add(key)
    missing = [n for n in ["fc.weight", "layers.0.post_attention_layernorm.weight", *_EAGLE1_SHARDS] if n not in seen]
    if missing:
        raise ModelLoadError(f"EAGLE head {path} lacks {missing[0]}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""), HINT)
    for m in head.modules():
        if isinstance(m, MergedLinear):
            m.finish_loading()
    if head.embed_tokens is None:
        head._target_embed = lambda: target_model.embed_tokens.weight
    head._target_logits = target_model.compute_logits
    head.eval()
    return head, cfg
