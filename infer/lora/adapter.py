"""Read a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors or .bin) and check it.

`read_adapter` fails only when the folder cannot be read at all; everything else it finds that infer cannot serve
(DoRA, LoRA bias, embedding/lm_head targets, modules_to_save, unpaired or mismatched A/B, non-finite weights or a
B @ A x scaling that overflows float32) is recorded as a `Problem`. `LoRAAdapter.validate_against(base_config)` adds
what does not fit the base model and returns the whole list (what `infer lora-validate` prints); `load_adapter` raises
the first one as a LoRAError.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import LoRAError, bom_error, json_problem
from ..models.moe import expert_size, is_moe, is_sparse, num_experts, shared_name, shared_width
from ..models.multimodal import VISION_PREFIXES, WRAPPERS, is_multimodal, text_name
from ..models.registry import COHERE, GLM, HUNYUAN, LFM2, UNGATED, is_hybrid
from ..models.shapes import ModelShapes, is_mla
from .targets import LINEAR_ATTENTION

ATTN, MLP = "self_attn", "mlp"
LLAMA_PROJECTIONS = {"q_proj": ATTN, "k_proj": ATTN, "v_proj": ATTN, "o_proj": ATTN,
                     "gate_proj": MLP, "up_proj": MLP, "down_proj": MLP}
# Phi-3's checkpoints (and so its adapters) have q|k|v as one qkv_proj and gate|up as one gate_up_proj
PHI3_PROJECTIONS = {"qkv_proj": ATTN, "o_proj": ATTN, "gate_up_proj": MLP, "down_proj": MLP}
# StarCoder2's MLP (transformers' Starcoder2MLP): c_fc, then c_proj, no gate
STARCODER2_PROJECTIONS = {"c_fc": MLP, "c_proj": MLP}
# DeepSeek's multi-head latent attention (models.deepseek: q_proj where q_lora_rank is null, o_proj; kv_b_proj is
# absorbed, its adapters refused: _absorbed_problems)
MLA_PROJECTIONS = {"q_a_proj": ATTN, "q_b_proj": ATTN, "kv_a_proj_with_mqa": ATTN, "kv_b_proj": ATTN}
PROJECTIONS = {**LLAMA_PROJECTIONS, **PHI3_PROJECTIONS, **STARCODER2_PROJECTIONS,
               **MLA_PROJECTIONS}  # every name some base adapts
# LFM2's (models.lfm2): its attention's out_proj, its short convs' in_proj and out_proj, its feed_forward's w1 (gate),
# w3 (up) and w2 (down), by (parent, projection): out_proj is both an attention's and a short conv's
LFM2_MODULES = {("self_attn", "out_proj"), ("conv", "in_proj"), ("conv", "out_proj"), ("feed_forward", "w1"),
                ("feed_forward", "w3"), ("feed_forward", "w2")}
LFM2_NAMES = ("out_proj", "in_proj", "w1", "w3", "w2")
# Nemotron 3 Super's latent projections around its experts (models.moe: no adapter slots; _moe_problems refuses them)
LATENT_NAMES = ("fc1_latent_proj", "fc2_latent_proj")
# The Mamba-2 mixers' in_proj (z | x B C | dt) and out_proj, by (parent, projection): Bamba's both (models.bamba),
# Falcon-H1's in_proj alone (before the mup vector: models.falcon_h1; its out_proj is refused by FALCON_H1_UNADAPTED),
# Granite 4.0's both (models.granite4) and Nemotron-H's in_proj under its blocks' mixer (models.nemotron_h; peft
# refuses its out_proj, as Falcon-H1's)
MAMBA_MODULES = {("mamba", "in_proj"), ("mamba", "out_proj"), ("mixer", "in_proj")}
# Granite 4.0's and GraniteMoeShared's dense shared MLP (transformers' GraniteMoeHybridMLP: input_linear, gate rows
# then up rows, and output_linear; models.granite4, models.moe), whose Linear layers peft adapts as they are
SHARED_MLP = ("input_linear", "output_linear")
SHARED_MLP_MODULES = {("shared_mlp", p) for p in SHARED_MLP}
SHARED_MLP_BASES = ("granitemoehybrid", "granitemoeshared")
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def base_targets(model_type: str | None, targets: list[str], q_lora: bool = True) -> list[str]:
    """Llama's projection names `targets` as the modules of a base of `model_type` (the ones peft adapts there):
    DeepSeek's multi-head latent attention's q_a_proj and q_b_proj in place of q (q_proj where its q_lora_rank is
    null: `q_lora` False) and kv_a_proj_with_mqa of k and v (its kv_b_proj, which infer absorbs, never);
    Phi-3's fused qkv_proj and gate_up_proj in place of q/k/v and gate/up (GLM-4's gate_up_proj in place of
    gate/up; StarCoder2's c_fc in place of gate/up and c_proj of down; an MLP without gate's up_proj in place of
    gate/up; LFM2's out_proj, w1, w3, w2 in place of o, gate, up, down; Granite 4.0's and GraniteMoeShared's
    shared_mlp.input_linear in place of gate/up and shared_mlp.output_linear of down; Mixtral's and MiniMax-M2's
    w1, w3, w2 in place of gate, up, down; none of them on Granite MoE, Phi-3.5-MoE and gpt-oss, whose MLP is their
    experts), each once."""
    if model_type in ("deepseek_v3", "deepseek_v2"):  # (models.deepseek; lora.targets.MLA_ATTENTION)
        names = {"q_proj": ("q_a_proj", "q_b_proj") if q_lora else ("q_proj",), "k_proj": ("kv_a_proj_with_mqa",),
                 "v_proj": ("kv_a_proj_with_mqa",)}
        return list(dict.fromkeys(m for t in targets for m in names.get(t, (t,))))
    if model_type == "starcoder2":
        mlp = {"gate_proj": "c_fc", "up_proj": "c_fc", "down_proj": "c_proj"}
        return list(dict.fromkeys(mlp.get(t, t) for t in targets))
    if model_type in LFM2:  # (LFM2's attention's out_proj, its feed_forward's w1, w3, w2: models.lfm2)
        names = {"o_proj": "out_proj", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
        return list(dict.fromkeys(names.get(t, t) for t in targets))
    if model_type in ("mixtral", "minimax_m2"):  # (their experts' w1, w3, w2, which peft turns into the stacked
        # experts' parameters, as gate_proj, up_proj and down_proj on the others)
        names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
        return list(dict.fromkeys(names.get(t, t) for t in targets))
    if model_type in EXPERTS_ONLY:  # (no MLP but its experts, which peft adapts through target_parameters alone)
        return [t for t in targets if t not in ("gate_proj", "up_proj", "down_proj")]
    if model_type in SHARED_MLP_BASES:  # (Granite 4.0's shared MLP: gate and up rows in input_linear; named under
        # shared_mlp, which a mixture of experts' block_sparse_moe.input_linear, experts peft does not adapt, is not)
        names = {"gate_proj": "shared_mlp.input_linear", "up_proj": "shared_mlp.input_linear",
                 "down_proj": "shared_mlp.output_linear"}
        return list(dict.fromkeys(names.get(t, t) for t in targets))
    if model_type in UNGATED:  # (Arcee, Nemotron, Apertus: up_proj, down_proj)
        return list(dict.fromkeys("up_proj" if t == "gate_proj" else t for t in targets))
    if model_type in GLM:
        return list(dict.fromkeys("gate_up_proj" if t in ("gate_proj", "up_proj") else t for t in targets))
    if model_type != "phi3":
        return list(targets)
    return list(dict.fromkeys(_FUSED.get(t, t) for t in targets))
# the mixtures of experts whose every MLP is its experts, which peft does not reach through target_modules naming
# gate/up/down (Granite MoE's block_sparse_moe, Phi-3.5-MoE's w1/w3/w2 it does not convert, gpt-oss's stacked
# experts with biases): target_parameters only
EXPERTS_ONLY = ("granitemoe", "phimoe", "gpt_oss")
EMBEDDINGS = ("embed_tokens", "lm_head")
# a mixture of experts' modules (models.moe) an adapter's target_modules may name that infer does not adapt: the
# router (gate), Qwen2-MoE's shared_expert_gate (1 output), per-expert modules (transformers 5 stacks the experts:
# peft adapts them through target_parameters), whole blocks
MOE_TARGETS = ("gate_up_proj", "w1", "w2", "w3", "gate", "experts", "mlp", "block_sparse_moe", "shared_expert",
               "shared_expert_gate")
# the stacked expert parameters (transformers 5's names) an adapter's target_parameters may name (peft's ParamWrapper)
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "up_proj")  # (up_proj: Nemotron 3's experts, relu² without gate)
_HINT_EXPERTS = ("to adapt the experts, train with target_parameters=[\"mlp.experts.gate_up_proj\", "
                 "\"mlp.experts.down_proj\"] (peft >= 0.17, transformers 5's stacked experts); the attention, a dense "
                 "layer's MLP and Qwen2-MoE's shared_expert take target_modules")
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?"
                     r"\.(?P<param>weight|bias)$")
# a decoder layer's module as the base names it (model.layers.N..., or layers.N... for an adapter saved on the bare
# decoder): another path that ends the same way (a VLM's language_model.layers.N..., a vision tower's) is another
# module, which peft would not load into this base
_MODULE = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[A-Za-z_]+(?:\.shared_experts?|\.shared_mlp)?)"
                     r"\.(?P<proj>[A-Za-z0-9_]+)$")
# a sparse layer's stacked experts as peft's ParamWrapper saves their LoRA (one wrapper per targeted parameter,
# nested: the first target's tensors under experts.base_layer, the next's under experts)
_EXPERTS = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>mlp|block_sparse_moe|mixer)\.experts"
                      r"(?P<nest>(?:\.base_layer)*)$")
# an expert's own projection as transformers 4 named it (adapters trained then: peft converts them when it loads
# them on transformers 5's stacked experts), by the stacked parameter it is part of
_EXPERT_MODULE = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                            r"(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
# Llama 4's and LFM2-MoE's experts and routers (under feed_forward, beside their dense MLPs' projections)
_FEED_FORWARD_MOE = re.compile(r"\.feed_forward\.(?:experts|gate|router)(?:\.|$)")
_V4_EXPERT_PARTS = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
# the target_modules peft (>= 0.22, on transformers 5) turns into the stacked experts' parameters as well, by base
# model_type (peft's _MOE_TARGET_MODULE_MAPPING): the Linear layers those names reach stay adapted beside them (a dense
# layer's MLP, Qwen2-MoE's shared_expert, GLM-4.5's shared_experts, Hunyuan MoE's shared_mlp); peft 0.21 turned them
# into the experts' parameters alone
V4_EXPERT_TARGETS = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2"),
                     "glm4_moe": ("gate_proj", "up_proj", "down_proj"), "olmoe": ("gate_proj", "up_proj", "down_proj"),
                     "ernie4_5_moe": ("gate_proj", "up_proj", "down_proj"),
                     "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
                     "deepseek_v2": ("gate_proj", "up_proj", "down_proj"),
                     "glm4_moe_lite": ("gate_proj", "up_proj", "down_proj"),
                     # (peft reads dots.llm1 as Qwen2-MoE, MiniMax-M2 as Mixtral: transformers' conversion patterns)
                     "dots1": ("gate_proj", "up_proj", "down_proj"), "minimax_m2": ("w1", "w3", "w2"),
                     "hunyuan_v1_moe": ("gate_proj", "up_proj", "down_proj"),
                     "flex_olmo": ("gate_proj", "up_proj", "down_proj"),  # (FlexOlmo: as Qwen2-MoE too)
                     "qwen3_next": ("gate_proj", "up_proj", "down_proj"),  # (Qwen3-Next: as Qwen2-MoE too)
                     "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}
_HINT_TARGETS = ("retrain with target_modules among q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj "
                 "(Phi-3: qkv_proj,o_proj,gate_up_proj,down_proj; StarCoder2: q_proj,k_proj,v_proj,o_proj,c_fc,c_proj; "
                 "Arcee, Nemotron, Apertus: q_proj,k_proj,v_proj,o_proj,up_proj,down_proj; DeepSeek: q_proj or "
                 "q_a_proj,q_b_proj, kv_a_proj_with_mqa,o_proj)")
# what peft adapts when adapter_config.json gives no target_modules: its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_
# MAPPING entry, the same for the Llama architectures infer serves (llama, mistral, qwen2, qwen3); that mapping has no
# phi3, granite, olmo2, olmo3, glm, glm4, cohere, cohere2, exaone4, starcoder2, smollm3, seed_oss, ernie4_5, arcee,
# nemotron, apertus, internlm3, helium, hunyuan_v1_dense or granite_swa entry, and peft refuses such an adapter on
# those bases ("Please specify `target_modules`")
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")
PEFT_NO_DEFAULT = ("phi3", "granite", "olmo2", "olmo3", *GLM, *COHERE, "exaone4", "starcoder2", "smollm3", "seed_oss",
                   "ernie4_5", "arcee", "nemotron", "apertus", "internlm3", "helium", "hunyuan_v1_dense",
                   "granite_swa")
# nor Ministral 3's, nor a multimodal model's (peft reads the wrapper's model_type: gemma3, mistral3; peft_model_type)
PEFT_NO_DEFAULT += ("ministral3", *WRAPPERS.values())
PEFT_NO_DEFAULT += ("deepseek_v3", "deepseek_v2", "glm4_moe_lite")  # (nor DeepSeek's, GLM-4.7-Flash's)
PEFT_NO_DEFAULT += ("dots1", "minimax_m2")  # (nor dots.llm1's, MiniMax-M2's)
PEFT_NO_DEFAULT += ("hunyuan_v1_moe",)  # (nor Hunyuan MoE's)
PEFT_NO_DEFAULT += ("phimoe", "flex_olmo")  # (nor Phi-3.5-MoE's, FlexOlmo's)
PEFT_NO_DEFAULT += LFM2  # (nor LFM2's, LFM2-MoE's)
PEFT_NO_DEFAULT += ("falcon_h1",)  # (nor Falcon-H1's)
_NO_TARGETS = "no target_modules, so peft adapts only its default"
# tensors of LoRA variants that only training reads: peft's eval forward is plain LoRA (config key -> tensor marker)
_TRAINING_ONLY = {"velora_config": ".lora_velora_", "monteclora_config": ".lora_monteclora_"}


@dataclass
class Problem:
    message: str
    hint: str
    merges: bool = False  # only serving it fails: peft's merge_and_unload folds it in (infer convert --merge-lora)

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})"


@dataclass
class LoRAModule:
    """One adapted projection: delta_y = scaling * x @ lora_a^T @ lora_b^T. A sparse layer's stacked experts
    (proj "experts.gate_up_proj" / "experts.down_proj", from peft's target_parameters) hold one pair per expert:
    lora_a [E, r, in], lora_b [E, out, r], the delta of a token's pair with expert e made with pair e."""

    name: str  # base module path, e.g. model.layers.0.self_attn.q_proj (the experts: model.layers.0.mlp.experts.X)
    layer: int
    proj: str
    lora_a: torch.Tensor  # [r, in] ([E, r, in] for the experts)
    lora_b: torch.Tensor  # [out, r] ([E, out, r])
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-2]

    @property
    def in_features(self) -> int:
        return self.lora_a.shape[-1]

    @property
    def out_features(self) -> int:
        return self.lora_b.shape[-2]

    @property
    def experts(self) -> bool:
        return self.proj.startswith("experts.")


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    config: dict
    modules: dict[str, LoRAModule] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    stamp: tuple = ()  # folder_stamp(path) when it was read
    mlp_modules: list[str] = field(default_factory=list)  # the modules it adapts under a layer's MLP (read_adapter)
    # the module it adapts first under a multimodal model's language model (model.language_model.layers.N..., or
    # language_model.model.layers.N...: models.multimodal), else None: trained on such a model, not a text model
    language_model: str | None = None

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of its A and B weights."""
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in (m.lora_a, m.lora_b))

    def to(self, dtype: torch.dtype) -> "LoRAAdapter":
        """Cast the weights (in place) to the dtype the base model computes in; returns self. LoRAError when a
        weight is beyond that dtype's range (a float32 or bfloat16 adapter on a float16 base): cast, it would be
        inf, and every token of the adapter's requests NaN."""
        for m in self.modules.values():
            a, b = m.lora_a.to(dtype).contiguous(), m.lora_b.to(dtype).contiguous()
            for kind, old, new in (("lora_A", m.lora_a, a), ("lora_B", m.lora_b, b)):
                if new.is_floating_point() and not _finite(new) and _finite(old):
                    largest = old.double().abs().max().item()
                    limit = torch.finfo(dtype).max
                    raise _fail(self.name, self.path, f"{m.name}: {kind} holds values up to {largest:.3g}, beyond "
                                f"{str(dtype).removeprefix('torch.')}'s range ({limit:.5g}) that the model computes in",
                                ("serve it with --dtype bfloat16 or float32, or use an adapter saved with smaller "
                                 "weights") if dtype == torch.float16 else "use an adapter saved with smaller weights")
            m.lora_a, m.lora_b = a, b
        return self

    def validate_against(self, base_config, max_rank: int | None = None) -> list[Problem]:
        """Everything that keeps this adapter from running on `base_config` (a HF config); [] when it fits."""
        moe = [f"adapts {m}" for m in _moe_unmapped(self, base_config)]  # named by _moe_problems, not as absent
        problems = [p for p in _no_default_targets(self, base_config)
                    if not (p.message.startswith(tuple(moe)) and _ABSENT in p.message)]
        problems += _non_linear_targets(self.config, base_config)
        problems[:0] = _moe_problems(self, base_config)  # first: whatever else is wrong, this is why
        problems[:0] = _multimodal_problems(self, base_config)
        hybrid = _linear_attention_problems(self, base_config)  # first: the reason, not "absent" (the base has them)
        if hybrid:
            problems = hybrid + _without_absent(problems, self, UNADAPTED.get(base_config.model_type, LINEAR_ATTENTION))
        shapes = expected_shapes(base_config)
        num_layers = layer_count(self.config, base_config)
        foreign = _foreign_projections(self, base_config, shapes)  # (a hybrid's unadapted names: said above)
        problems += _without_absent(foreign, self, UNADAPTED.get(base_config.model_type, LINEAR_ATTENTION)) \
            if hybrid else foreign
        problems += _absorbed_problems(self, base_config)
        for m in self.modules.values():
            if m.layer >= num_layers:
                problems.append(Problem(f"{m.name} is in layer {m.layer} but the base model has {num_layers} layers",
                                        "the adapter was trained for a different (deeper) base model"))
                continue
            if m.proj not in shapes:  # _foreign_projections named it
                continue
            misplaced = _misplaced(m, base_config)
            if misplaced:
                problems.append(misplaced)
                continue
            want_in, want_out = shapes[m.proj]
            got_in, got_out = m.in_features, m.out_features
            if m.experts and m.lora_a.shape[0] != num_experts(base_config):
                problems.append(Problem(f"{m.name} holds LoRA weights for {m.lora_a.shape[0]} experts but the base "
                                        f"model's layers have {num_experts(base_config)}",
                                        "the adapter was trained for a base model with another number of experts"))
            elif (got_in, got_out) != (want_in, want_out):
                problems.append(Problem(f"{m.name} maps {got_in} -> {got_out} features but the base model's "
                                        f"{m.proj} maps {want_in} -> {want_out}",
                                        "the adapter was trained for a base model with other sizes"))
        if max_rank is not None and self.rank > max_rank:
            problems.append(Problem(f"rank {self.rank} is larger than --max-lora-rank {max_rank}",
                                    f"raise --max-lora-rank to at least {self.rank}"))
        return problems


def _absorbed_problems(adapter: "LoRAAdapter", base_config) -> list[Problem]:
    """An adapter of DeepSeek's kv_b_proj, which infer's multi-head latent attention absorbs (models.deepseek: its
    W_UK into the query, its W_UV after the attention; a delta of its output has no place there): refused naming
    the module, mergeable (peft's merge_and_unload folds it into the weights)."""
    absorbed = [m.name for m in adapter.modules.values() if is_mla(base_config) and m.proj == "kv_b_proj"]
    if not absorbed:
        return []
    more = f" (and {len(absorbed) - 1} more modules)" if len(absorbed) > 1 else ""
    return [Problem(f"adapts {absorbed[0]}{more}, which infer's multi-head latent attention absorbs into the query "
                    "and the output (kv_b_proj's W_UK and W_UV): an adapter of it is not served",
                    "merge the adapter into the base (infer convert --merge-lora, or peft's merge_and_unload) and "
                    "serve that, or train it without kv_b_proj (q_proj / q_a_proj, q_b_proj, kv_a_proj_with_mqa, "
                    "o_proj take adapters)", merges=True)]


def _multimodal_problems(adapter: "LoRAAdapter", base_config) -> list[Problem]:
    """An adapter trained on a multimodal model's language model (its modules under model.language_model) on a text
    base, or one trained on a text model on a multimodal base: peft would load neither's weights (their module names
    are not the base's) and leave the base as it is."""
    base = getattr(base_config, "multimodal_architecture", None)
    if adapter.language_model is not None and not is_multimodal(base_config):
        return [Problem(f"adapts {adapter.language_model}, a multimodal model's language model, but the base is a "
                        "text model: peft would not load these weights into it",
                        "use an adapter trained on this base (or serve the multimodal checkpoint it was trained on)")]
    if adapter.language_model is None and base and adapter.modules:
        first = next(iter(adapter.modules))
        return [Problem(f"adapts {first}, a text model's module, but the base is a multimodal {base} whose layers "
                        "sit under model.language_model: peft would not load these weights into it",
                        f"use an adapter trained on the {base} checkpoint (its text model's adapters fit its text "
                        "model's checkpoint)")]
    return []


def _linear_attention_problems(adapter: "LoRAAdapter", base_config) -> list[Problem]:
    """An adapter of a hybrid model's linear-attention projections (Qwen3.5's Gated DeltaNet: models.qwen3_5), which
    infer does not adapt (yet): refused naming them (its attention's and MLP's projections are adapted)."""
    if base_config.model_type == "granitemoehybrid":
        return _granite4_problems(adapter)
    if base_config.model_type == "nemotron_h":
        return _unadapted_problems(adapter, NEMOTRON_H_UNADAPTED, "nemotron_h (Nemotron-H) adapt the attention's, "
                                   "the MLP's and the Mamba-2 mixers' in_proj, not the mixers' out_proj or conv1d "
                                   "(peft refuses both on Nemotron-H)", "q_proj, k_proj, v_proj, o_proj, up_proj, "
                                   "down_proj, in_proj")
    if base_config.model_type == "falcon_h1":
        return _unadapted_problems(adapter, FALCON_H1_UNADAPTED, "falcon_h1 (Falcon-H1) adapt the attention's, the "
                                   "MLP's and the Mamba-2 mixers' in_proj, not the mixers' out_proj or conv1d (peft "
                                   "refuses both on Falcon-H1)", "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                                   "down_proj, in_proj")
    if base_config.model_type == "bamba":
        return _unadapted_problems(adapter, BAMBA_UNADAPTED, "bamba (Bamba) adapt the attention's, the MLP's and "
                                   "the Mamba-2 mixers' projections, not the mixers' depthwise conv (conv1d)",
                                   "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, in_proj, out_proj")
    if base_config.model_type in LFM2:  # (LFM2-MoE's experts and router: _moe_problems)
        what = "lfm2 (LFM2)" if base_config.model_type == "lfm2" else "lfm2_moe (LFM2-MoE)"
        return _unadapted_problems(adapter, LFM2_UNADAPTED, f"{what} adapt the attention's, the short convs' "
                                   "and the MLP's projections, not the short convs' depthwise conv (conv.conv)",
                                   "q_proj, k_proj, v_proj, out_proj, in_proj, w1, w3, w2")
    if not is_hybrid(base_config):
        return []
    listed = sorted(_target_names(adapter) & set(LINEAR_ATTENTION))
    if not listed:
        return []
    return [Problem(f"targets {listed}, the projections of {base_config.model_type}'s linear-attention (Gated "
                    "DeltaNet) layers, which infer's adapters do not adapt", "retrain with target_modules among the "
                    "attention's and the MLP's projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                    "down_proj)")]


# Granite 4.0's modules infer does not adapt (models.granite4): the Mamba-2 mixers' depthwise conv1d, the whole
# blocks (peft adapts Linear layers, not the shared MLP or the mixer as a module), the experts' router (its
# block_sparse_moe.experts take target_parameters: _moe_problems)
GRANITE4_UNADAPTED = ("conv1d", "shared_mlp", "mamba", "router", "layer", "block_sparse_moe")


# Nemotron-H's modules infer does not adapt (models.nemotron_h): the Mamba-2 mixers' out_proj and conv1d (peft refuses
# both on it) and the whole mixers (its attention's and MLP's projections and the mixers' in_proj are adapted)
NEMOTRON_H_UNADAPTED = ("out_proj", "conv1d", "mixer", "layers")
# Bamba's (models.bamba): the Mamba-2 mixers' depthwise conv1d (peft adapts a Conv1d) and the whole blocks (its
# attention's, feed_forward's and mixers' projections are adapted)
BAMBA_UNADAPTED = ("conv1d", "mamba", "feed_forward", "self_attn", "layers")


def _granite4_problems(adapter: "LoRAAdapter") -> list[Problem]:
    """An adapter of Granite 4.0's Mamba-2 conv, router or whole blocks, which infer does not adapt: refused naming
    them (its attention's, Mamba-2 mixers' and shared MLP's projections are adapted, and its stacked experts)."""
    return _unadapted_problems(adapter, GRANITE4_UNADAPTED, "granitemoehybrid (Granite 4.0) adapt the attention's, "
                               "the Mamba-2 mixers' (in_proj, out_proj) and the shared MLP's (input_linear, "
                               "output_linear) projections and the stacked experts, not the mixers' conv1d, the "
                               "router or a whole block", "q_proj, k_proj, v_proj, o_proj, in_proj, out_proj, "
                               "input_linear, output_linear")


def _unadapted_problems(adapter: "LoRAAdapter", unadapted, what: str, adapted: str) -> list[Problem]:
    """The adapter's targets among `unadapted` (a hybrid's modules infer does not adapt) refused, naming them, `what`
    infer adapts of the base and the `adapted` names to retrain with."""
    listed = sorted(_target_names(adapter) & set(unadapted))
    if not listed:
        return []
    return [Problem(f"targets {listed}: infer's adapters of {what}", f"retrain with target_modules among {adapted}")]


# Falcon-H1's modules infer does not adapt (models.falcon_h1): the Mamba-2 mixers' out_proj and conv1d, the whole
# blocks
FALCON_H1_UNADAPTED = ("out_proj", "conv1d", "mamba", "self_attn", "feed_forward", "layers")


# LFM2's modules infer does not adapt (models.lfm2): the short convs' depthwise conv (peft adapts a Conv1d) and the
# whole blocks
LFM2_UNADAPTED = ("conv", "feed_forward", "self_attn", "layers")
UNADAPTED = {"granitemoehybrid": GRANITE4_UNADAPTED, "nemotron_h": NEMOTRON_H_UNADAPTED, "lfm2": LFM2_UNADAPTED,
             "lfm2_moe": LFM2_UNADAPTED, "falcon_h1": FALCON_H1_UNADAPTED, "bamba": BAMBA_UNADAPTED}


def _target_names(adapter: "LoRAAdapter") -> set[str]:
    """The module names an adapter targets (target_modules' last parts) and adapts (its modules' projections)."""
    targets = adapter.config.get("target_modules")
    names = {str(t).split(".")[-1] for t in targets} if isinstance(targets, list) else set()
    return names | {m.proj for m in adapter.modules.values()}


def _without_absent(problems: list[Problem], adapter: "LoRAAdapter", unadapted) -> list[Problem]:
    """`problems` less the ones that name modules among `unadapted` (a hybrid's modules infer does not adapt, which
    a problem first in the list names) as ones the base model does not have: it has them. Kept where the adapter's
    target_modules (a list) name another module no base has, which such a problem may be about."""
    targets = adapter.config.get("target_modules")
    # (the Mamba-2 mixers' in_proj and out_proj: adapted on Bamba, Granite 4.0, Falcon-H1's and Nemotron-H's in_proj)
    known = (*PROJECTIONS, *EMBEDDINGS, *V4_EXPERT_TARGETS["mixtral"], *unadapted, *(p for _, p in MAMBA_MODULES),
             *SHARED_MLP)
    if not isinstance(targets, list) or any(str(t).split(".")[-1] not in known for t in targets):
        return problems
    return [p for p in problems if _ABSENT not in p.message]


def _foreign_projections(adapter: "LoRAAdapter", base_config, shapes: dict) -> list[Problem]:
    """Modules (or listed target_modules) of a projection the base's architecture does not have: Llama's q_proj on
    a Phi-3 base (whose q|k|v is one qkv_proj), Phi-3's qkv_proj on a Llama one. One problem for all of them."""
    have = f"its {getattr(base_config, 'model_type', '?')} layers have {', '.join(shapes)}"
    hint = "the adapter was trained for another architecture"
    foreign = [m.name for m in adapter.modules.values() if m.proj not in shapes]
    if foreign:
        more = f" (and {len(foreign) - 1} more modules)" if len(foreign) > 1 else ""
        return [Problem(f"adapts {foreign[0]}{more}, which the base model does not have ({have})", hint)]
    targets = adapter.config.get("target_modules")
    v4 = V4_EXPERT_TARGETS.get(getattr(base_config, "model_type", None), ())  # peft makes them the experts' params
    known = (*PROJECTIONS, *V4_EXPERT_TARGETS["mixtral"], *LFM2_NAMES, *SHARED_MLP)
    # (gate_proj, up_proj, down_proj name a shared expert's layers too: peft adapts them where every layer is sparse)
    shared = [p.removeprefix("shared_expert.") for p in shapes if p.startswith("shared_expert.")]
    listed = [t for t in targets if str(t).split(".")[-1] in known
              and str(t).split(".")[-1] not in (*shapes, *v4, *shared)] if isinstance(targets, list) else []
    return [Problem(f"targets {listed}, which the base model does not have ({have})", hint)] if listed else []


def _moe_problems(adapter: "LoRAAdapter", base_config) -> list[Problem]:
    """What an adapter asks of a mixture of experts that infer does not adapt (its router, Qwen2-MoE's 1-output
    shared_expert_gate, per-expert modules, a parameter other than the stacked experts'), or target_parameters on a
    base without experts."""
    params = adapter.config.get("target_parameters")
    params = [str(p) for p in params] if isinstance(params, list) else [str(params)] if params else []
    if not is_moe(base_config):
        return [Problem(f"targets parameters, not modules (target_parameters: {json.dumps(params)})",
                        "train with target_modules instead (infer adapts parameters only as a mixture of experts' "
                        "stacked experts)")] if params else []
    problems = []
    experts = [m for m in adapter.mlp_modules if _EXPERTS.match(m) or _EXPERT_MODULE.match(m)]
    if base_config.model_type == "gpt_oss" and (params or experts):
        # gpt-oss's experts: gate_up_proj [E, H, 2I] (x @ W, gate and up columns interleaved) and their biases,
        # which infer's expert slots (lora.experts: Qwen's and Mixtral's [E, 2I, H] layout) do not lay out
        what = f"target_parameters {json.dumps(params)}" if params else f"adapts {experts[0]}"
        return [Problem(f"{what}: infer does not adapt gpt-oss's experts (or its router)",
                        "train the adapter with target_modules on the attention (q_proj, k_proj, v_proj, o_proj), "
                        "or merge the experts' adapter into the weights (peft's merge_and_unload) and serve that")]
    llama4 = [m for m in adapter.mlp_modules if ".feed_forward.experts" in m or ".feed_forward.router" in m]
    targets = adapter.config.get("target_modules")  # (peft adapts the router, a Linear, where they name it)
    router = [str(t) for t in targets if str(t).split(".")[-1] == "router"] if isinstance(targets, list) else []
    if base_config.model_type == "llama4_text" and (params or llama4 or router):
        # Llama 4's experts: gate_up_proj [E, H, 2I] and down_proj [E, I, H] (x @ W) whose input the router's score
        # scales, which infer's expert slots (lora.experts: Qwen's and Mixtral's [E, 2I, H] layout, the score on the
        # output) do not lay out; its router (feed_forward.router) infer's routers take no adapter
        what = f"target_parameters {json.dumps(params)}" if params else f"adapts {llama4[0]}" if llama4 else \
            f"targets {router} (feed_forward.router)"
        return [Problem(f"{what}: infer does not adapt Llama 4's experts or router (feed_forward.experts."
                        "gate_up_proj, down_proj; feed_forward.router)", "train the adapter with target_modules on "
                        "the attention (q_proj, k_proj, v_proj, o_proj) and the MLPs (gate_proj, up_proj, down_proj: "
                        "the dense layers' and the shared experts'), or merge it into the weights (peft's "
                        "merge_and_unload) and serve that")]
    if base_config.model_type == "lfm2_moe":
        return _lfm2_moe_problems(adapter, params)
    # (Nemotron 3 Super's latent projections; its shared experts take adapters, peft's up_proj and down_proj, and its
    # stacked experts, target_parameters mixer.experts.up_proj / down_proj)
    moe_layer = [m for m in adapter.mlp_modules if m.endswith(LATENT_NAMES)]
    if base_config.model_type == "nemotron_h" and moe_layer:
        return [Problem(f"adapts {moe_layer[0]}: infer does not adapt Nemotron 3's latent projections "
                        "(mixer.fc1_latent_proj, mixer.fc2_latent_proj)", "train the adapter with target_modules on "
                        "the attention (q_proj, k_proj, v_proj, o_proj), the MLPs and the shared experts (up_proj, "
                        "down_proj) and the Mamba-2 mixers (in_proj), and target_parameters on the experts "
                        "(mixer.experts.up_proj, mixer.experts.down_proj), or merge it into the weights (peft's "
                        "merge_and_unload) and serve that")]
    targets = adapter.config.get("target_modules")
    targets = [str(t) for t in targets] if isinstance(targets, list) else []
    # (peft converts target_modules naming the experts' projections of transformers 4 (gate_proj, up_proj,
    # down_proj; Mixtral's w1, w3, w2) into the bare parameter names, gate_up_proj at twice the rank)
    unmapped = _moe_unmapped(adapter, base_config)
    named = {m.split(".")[-1] for m in unmapped}  # peft turns target_modules "gate" (the router) into "gate.weight"
    odd = [p for p in params if p.split(".")[-1] not in EXPERT_PARAMS and p.split(".")[-2:] not in
           [[n, "weight"] for n in named]]
    if odd:
        problems.append(Problem(f"targets parameters {odd}: infer adapts a mixture of experts' stacked experts "
                                f"({', '.join('experts.' + p for p in EXPERT_PARAMS)}) only", _HINT_EXPERTS))
    v4 = V4_EXPERT_TARGETS.get(base_config.model_type, ())
    listed = [t for t in targets if t.split(".")[-1] in MOE_TARGETS and t.split(".")[-1] not in v4]
    named = {t.split(".")[-1] for t in targets} & set(v4[:2])
    if len(named) == 1:  # peft: "Cannot convert PEFT target(s) ... because they are fused into gate_up_proj"
        other = (set(v4[:2]) - named).pop()
        problems.append(Problem(f"targets {named.pop()} without {other}: peft cannot load it on transformers 5, "
                                f"whose {base_config.model_type} experts hold both in one gate_up_proj",
                                f"target both, or target_parameters; {_HINT_EXPERTS}"))
    if unmapped or listed:
        more = f" (and {len(unmapped) - 1} more modules)" if len(unmapped) > 1 else ""
        what = f"adapts {unmapped[0]}{more}" if unmapped else f"targets {listed}"
        problems.insert(0, Problem(
            f"{what}: infer adapts a mixture of experts' attention, dense layers' MLPs, shared expert and stacked "
            "experts, not its router (gate), shared_expert_gate or another module of its MLP", _HINT_EXPERTS))
    return problems


_ABSENT = "which the base model does not have"


def _lfm2_moe_problems(adapter: "LoRAAdapter", params: list[str]) -> list[Problem]:
    """An adapter of LFM2-MoE's experts (feed_forward.experts: target_parameters on the stacked gate_up_proj and
    down_proj, or transformers 4's per-expert w1, w3, w2) or router (feed_forward.gate, not a Linear layer): refused
    naming them; infer gives its experts no adapter slots (models.moe.experts_adapted). Its target_modules w1, w3, w2
    are the dense layers' MLPs' (peft has no lfm2_moe mapping that turns them into the experts' parameters)."""
    targets = adapter.config.get("target_modules")
    targets = [str(t) for t in targets] if isinstance(targets, list) else []
    named = [t for t in targets if t.split(".")[-1] in ("experts", "gate") or ".experts." in t]
    modules = [m for m in adapter.mlp_modules if _FEED_FORWARD_MOE.search(m)]
    if not (params or named or modules):
        return []
    what = (f"target_parameters {json.dumps(params)}" if params else f"targets {named}" if named
            else f"adapts {modules[0]}" + (f" (and {len(modules) - 1} more modules)" if len(modules) > 1 else ""))
    return [Problem(f"{what}: infer does not adapt LFM2-MoE's experts or router (feed_forward.experts, "
                    "feed_forward.gate)", "train the adapter with target_modules on the attention (q_proj, k_proj, "
                    "v_proj, out_proj), the short convs (in_proj, out_proj) and the dense layers' MLPs (w1, w3, w2), "
                    "or merge it into the weights (peft's merge_and_unload) and serve that")]


def _moe_unmapped(adapter: "LoRAAdapter", base_config) -> list[str]:
    """The modules an adapter adapts under a mixture of experts' MLP that infer does not adapt (its router, Qwen2-MoE's
    shared_expert_gate); [] for a base without experts."""
    if not is_moe(base_config):
        return []
    return [m for m in adapter.mlp_modules if _module_of(m) is None and _EXPERTS.match(m) is None
            and _EXPERT_MODULE.match(m) is None]


def _misplaced(m: LoRAModule, base_config) -> Problem | None:
    """A module of a mixture of experts in a layer that has no such module: a dense MLP's projection in a sparse
    layer, the shared expert's or the experts' in a dense one."""
    if not is_moe(base_config) or m.proj not in MOE_LAYER_PROJECTIONS[True] + MOE_LAYER_PROJECTIONS[False]:
        return None
    sparse = is_sparse(base_config, m.layer)
    if sparse == (m.proj in MOE_LAYER_PROJECTIONS[True]):
        return None
    kind = "a sparse layer (its MLP is the experts)" if sparse else "a dense layer (mlp_only_layers / " \
        "decoder_sparse_step: no experts)"
    return Problem(f"{m.name} is in layer {m.layer}, which in the base model is {kind}: it has no "
                   f"{m.proj}", "the adapter was trained for a base model whose layers are laid out otherwise")


def peft_model_type(base_config) -> str | None:
    """The model_type peft reads its default target_modules by: a multimodal checkpoint's own (its wrapper's, not
    its text model's: models.multimodal), else the base's."""
    return WRAPPERS.get(getattr(base_config, "multimodal_architecture", None)) or getattr(base_config, "model_type",
                                                                                         None)


def _no_default_targets(adapter: "LoRAAdapter", base_config) -> list[Problem]:
    """The adapter's read problems, or for a config without target_modules on a base peft has no default for (Phi-3:
    peft refuses it, "Please specify `target_modules`") that problem, naming the base's modules, in place of the ones
    read against Llama's default (q_proj, v_proj), which such a base does not have."""
    model_type = peft_model_type(base_config)
    if adapter.config.get("target_modules") is not None or model_type not in PEFT_NO_DEFAULT:
        return list(adapter.problems)
    modules = ", ".join(expected_shapes(base_config))
    return [Problem(f"{CONFIG_FILE} gives no target_modules, and peft has no default for a {model_type} base: peft "
                    "refuses it (\"Please specify `target_modules`\")",
                    f"give target_modules in {CONFIG_FILE}: the {model_type} modules the adapter trained, among "
                    f"{modules}")] + [p for p in adapter.problems if _NO_TARGETS not in p.message]


def layer_count(config: dict, base_config) -> int:
    """The decoder layers the adapter's modules sit in: the base's, or as many as its layer_replication stacks (peft
    builds that deeper model; the adapter is refused for it, and its deeper layers are no sign of another base)."""
    layers = base_config.num_hidden_layers
    ranges = config.get("layer_replication")
    if (isinstance(ranges, list) and ranges and all(isinstance(r, list) and len(r) == 2 and all(_one(i, int) for i in r)
                                                    for r in ranges)):
        return max(layers, sum(max(0, end - start) for start, end in ranges))
    return layers


def _non_linear_targets(config: dict, base_config) -> list[Problem]:
    """A target_modules regex that selects a module of the base that is not a Linear layer (Qwen3's q_norm, a whole
    mlp, Phi-3's mlp.activation_fn): peft refuses the adapter ("Target module ... is not supported"). Lists are
    checked in config_problems."""
    targets = config.get("target_modules")
    if not isinstance(targets, str) or _all_linear(targets) or _regex_error(targets):
        return []
    layers = getattr(base_config, "num_hidden_layers", 0) or 0
    names = ["model", "model.layers", "model.norm", "model.rotary_emb"]
    model_type = getattr(base_config, "model_type", "")
    phi3 = model_type == "phi3"  # transformers' Phi3MLP names its activation activation_fn; its layers have dropouts
    # (and so does Glm4MLP)
    # (no input_layernorm: OLMo's and EXAONE 4's norms come after the attention and the MLP)
    olmo = model_type in ("olmo2", "olmo3", "exaone4")
    act = ".mlp.activation_fn" if phi3 or model_type in GLM else ".mlp.act" if model_type == "starcoder2" else \
        ".mlp.act_fn"  # (StarCoder2's Starcoder2MLP: act)
    per_layer = ["", ".self_attn", ".mlp", act,
                 *([] if olmo or model_type == "apertus" else [".input_layernorm"]),
                 *([] if model_type in (*COHERE, "apertus") else [".post_attention_layernorm"])]
    if model_type == "apertus":  # (Llama's two norms under its names; q and k normed per head)
        per_layer += [".attention_layernorm", ".feedforward_layernorm", ".self_attn.q_norm", ".self_attn.k_norm"]
    if model_type == "cohere" and getattr(base_config, "use_qk_norm", False):  # (Cohere: its one norm a layer)
        per_layer += [".self_attn.q_norm", ".self_attn.k_norm"]
    if phi3:
        per_layer += [".resid_attn_dropout", ".resid_mlp_dropout"]
    if model_type in ("qwen3", "gemma3_text", "olmo2", "olmo3", "exaone4", "dots1", "minimax_m2"):
        per_layer += [".self_attn.q_norm", ".self_attn.k_norm"]
    if model_type in ("gemma2", "gemma3_text"):  # their four norms a layer
        per_layer += [".pre_feedforward_layernorm", ".post_feedforward_layernorm"]
    if olmo:
        per_layer += [".post_feedforward_layernorm"]
    if model_type == "glm4":
        per_layer += [".post_self_attn_layernorm", ".post_mlp_layernorm"]
    if model_type in HUNYUAN:
        per_layer += [".self_attn.query_layernorm", ".self_attn.key_layernorm"]
    if model_type in LFM2:  # (models.lfm2: its operator blocks, feed_forward, norms; the final embedding_norm)
        names[2] = "model.embedding_norm"
        per_layer = ["", ".self_attn", ".conv", ".feed_forward", ".operator_norm", ".ffn_norm",
                     ".self_attn.q_layernorm", ".self_attn.k_layernorm"]
    names += [f"model.layers.{i}{s}" for i in range(layers) for s in per_layer] + [""]
    if model_type == "lfm2_moe":  # (its sparse layers' experts and router: not Linear layers, models.moe)
        names[-1:-1] = [f"model.layers.{i}.feed_forward.{m}" for i in range(layers) if is_sparse(base_config, i)
                        for m in ("experts", "gate")]
    if model_type == "granite_swa":  # (its rotary embeddings, one a non-zero base of layer_rope_theta)
        bases = {t for t in (getattr(base_config, "layer_rope_theta", None) or []) if t}
        names += ["model.rotary_embs", *(f"model.rotary_embs.{i}" for i in range(len(bases)))]
    exclude = config.get("exclude_modules")
    hit = next((n for n in names if re.fullmatch(targets, n)
                and not (exclude and _matches(exclude, n, False))), None)
    if hit is None:
        return []
    return [Problem(f"target_modules {json.dumps(targets)} selects {hit or 'the whole model'}, which is not a "
                    "Linear layer: peft cannot load this adapter", _HINT_TARGETS)]


# the families whose attention is gated (models.qwen3_5): q_proj's output is each head's query and its gate, twice
# the plain width (Granite 4.0, hybrid too, has Llama's q_proj)
GATED_Q = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")


def mla_shapes(c) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of the projections of DeepSeek's multi-head latent attention (models.deepseek):
    q_proj, or q_a_proj and q_b_proj where q_lora_rank is set; kv_a_proj_with_mqa, kv_b_proj (absorbed: refused,
    `_absorbed_problems`), o_proj."""
    h, hidden, qk = c.num_attention_heads, c.hidden_size, c.qk_nope_head_dim + c.qk_rope_head_dim
    rank = getattr(c, "q_lora_rank", None)
    out = {"q_a_proj": (hidden, rank), "q_b_proj": (rank, h * qk)} if rank else {"q_proj": (hidden, h * qk)}
    return {**out, "kv_a_proj_with_mqa": (hidden, c.kv_lora_rank + c.qk_rope_head_dim),
            "kv_b_proj": (c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim)),
            "o_proj": (h * c.v_head_dim, hidden)}


def expected_shapes(base_config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every projection of a Llama-family base model (a HF config): Phi-3's fused
    qkv_proj and gate_up_proj in place of q/k/v and gate/up, StarCoder2's c_fc and c_proj in place of the MLP's;
    Granite 4.0's Mamba-2 mixers' in_proj and out_proj (Nemotron-H's in_proj) beside their attention's and MLP's;
    Granite 4.0's and GraniteMoeShared's shared MLP's input_linear and output_linear."""
    out = _family_shapes(base_config)
    if getattr(base_config, "model_type", None) == "granitemoehybrid":
        if set(getattr(base_config, "layer_types", None) or ()) & {"mamba", "linear_attention"}:  # (as config.json
            out = {**out, **_mamba_shapes(base_config)}  # names them, and as infer's config does)
        if not is_moe(base_config):  # (granite-4.0-micro's: the shared MLP is its MLP; no gate_proj ...)
            out = {p: shape for p, shape in out.items() if p not in LLAMA_PROJECTIONS or LLAMA_PROJECTIONS[p] != MLP}
    width = int(getattr(base_config, "shared_intermediate_size", 0) or 0)
    if getattr(base_config, "model_type", None) in SHARED_MLP_BASES and width:  # (its shared MLP: gate | up, down)
        out = {**out, "input_linear": (base_config.hidden_size, 2 * width),
               "output_linear": (width, base_config.hidden_size)}
    if getattr(base_config, "model_type", None) == "nemotron_h":  # (its out_proj's adapters refused)
        out = {**out, "in_proj": _mamba_shapes(base_config)["in_proj"]}
    return out


def _family_shapes(base_config) -> dict[str, tuple[int, int]]:
    """expected_shapes of the attention and the MLP of each family."""
    shapes = ModelShapes.from_config(base_config)
    hidden, inter, q, kv = shapes.hidden_size, base_config.intermediate_size, shapes.q_size, shapes.kv_size
    if getattr(base_config, "model_type", None) == "llama4_text":  # (its dense layers' MLP: models.llama4)
        inter = int(base_config.intermediate_size_mlp)
    if getattr(base_config, "model_type", None) == "lfm2_moe":  # (LFM2's; its experts not adapted: _moe_problems)
        return _lfm2_shapes(base_config, hidden, q, kv)
    if is_moe(base_config):
        return _moe_shapes(base_config, hidden, inter, q, kv)
    if getattr(base_config, "model_type", None) == "lfm2":
        return _lfm2_shapes(base_config, hidden, q, kv)
    if getattr(base_config, "model_type", None) == "falcon_h1":  # (Llama's, and the mixers' in_proj: models.falcon_h1)
        from ..models.falcon_h1 import mup_vector
        return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
                "in_proj": (hidden, len(mup_vector(base_config)))}
    if getattr(base_config, "model_type", None) == "bamba":  # (its Mamba-2 mixers' too: models.granite4.Mamba2Mixer)
        return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
                **_mamba_shapes(base_config)}
    if getattr(base_config, "model_type", None) == "phi3":
        return {"qkv_proj": (hidden, q + 2 * kv), "o_proj": (q, hidden), "gate_up_proj": (hidden, 2 * inter),
                "down_proj": (inter, hidden)}
    if getattr(base_config, "model_type", None) == "starcoder2":  # c_fc, c_proj: its MLP without gate
        return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                "c_fc": (hidden, inter), "c_proj": (inter, hidden)}
    if getattr(base_config, "model_type", None) in UNGATED:  # up_proj, down_proj: an MLP without gate
        return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    if getattr(base_config, "model_type", None) in GLM:  # q, k and v apart, gate|up one module
        return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}
    # Qwen3.5's gated attention: q_proj's output is each head's query and its gate (models.qwen3_5)
    wide = 2 if base_config.model_type in GATED_Q else 1
    return {"q_proj": (hidden, wide * q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _mamba_shapes(base_config) -> dict[str, tuple[int, int]]:
    """The Mamba-2 mixers' in_proj (z | x B C | dt) and out_proj (models.granite4.Mamba2Mixer: Granite 4.0's, Bamba's,
    Nemotron-H's under its fields' names)."""
    from ..models.granite4 import mamba2_fields
    c = mamba2_fields(base_config)
    width = int(c.mamba_expand * c.hidden_size)
    projected = 2 * width + 2 * c.mamba_n_groups * c.mamba_d_state + c.mamba_n_heads
    return {"in_proj": (c.hidden_size, projected), "out_proj": (width, c.hidden_size)}


def _moe_shapes(base_config, hidden: int, inter: int, q: int, kv: int) -> dict[str, tuple[int, int]]:
    """expected_shapes of a mixture of experts: its attention, and what its layers' MLPs have (models.moe)."""
    # (Qwen3-Next's and Qwen3.5 MoE's gated attention: q_proj's output each head's query and its gate)
    wide = 2 if base_config.model_type in GATED_Q else 1
    out = {"q_proj": (hidden, wide * q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    if is_mla(base_config):
        out = mla_shapes(base_config)
    layers = [is_sparse(base_config, i) for i in range(base_config.num_hidden_layers)]
    if not all(layers):
        out.update({"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)})
    if any(layers):
        # (Qwen2-MoE's shared_expert, GLM-4.5's shared_experts, Nemotron 3's relu² shared experts without gate;
        # GraniteMoeShared's shared_mlp: expected_shapes)
        nemotron = base_config.model_type == "nemotron_h"
        shared = shared_width(base_config) if shared_name(base_config) or nemotron else 0
        if shared:
            out.update({"shared_expert.up_proj": (hidden, shared), "shared_expert.down_proj": (shared, hidden),
                        **({} if nemotron else {"shared_expert.gate_proj": (hidden, shared)})})
        width = expert_size(base_config)
        if nemotron:  # (relu² experts without gate, on Super's latent where it has one)
            latent = int(getattr(base_config, "moe_latent_size", None) or hidden)
            out.update({"experts.up_proj": (latent, width), "experts.down_proj": (width, latent)})
        else:
            out.update({"experts.gate_up_proj": (hidden, 2 * width), "experts.down_proj": (width, hidden)})
    return out


def _lfm2_shapes(base_config, hidden: int, q: int, kv: int) -> dict[str, tuple[int, int]]:
    """LFM2's and LFM2-MoE's projections (models.lfm2): the attention's, the short convs' in_proj (B | C | x) and
    out_proj, the MLP's w1, w3, w2 (LFM2's adjusted width; LFM2-MoE's dense layers' intermediate_size, none where
    every layer has experts)."""
    from ..models.moe import is_sparse
    from ..quant.config import ffn_width
    inter = ffn_width(base_config)
    out = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "out_proj": (q, hidden),
           "in_proj": (hidden, 3 * hidden)}
    if all(is_sparse(base_config, i) for i in range(base_config.num_hidden_layers)):
        return out
    return {**out, "w1": (hidden, inter), "w3": (hidden, inter), "w2": (inter, hidden)}


def _fail(name: str, path: Path, message: str, hint: str) -> LoRAError:
    return LoRAError(f"LoRA adapter {name!r} ({path}): {message}", hint)


def not_found_hint(path: Path, typed: str | None = None) -> str:
    """What to pass instead of a folder that is not there: a hub id (vLLM downloads one) is fetched first. `typed`:
    the path as the user wrote it, where Path dropped its `./` (`./adapters/x` is a local path, no hub id)."""
    from ..models.resolve import is_hub_id, missing_folder_hint
    text = str(path)
    local = missing_folder_hint(text)  # a typo under an existing folder: the folder's closest entry first
    if not local and not path.is_absolute() and is_hub_id(text) and is_hub_id(typed or text):
        local = "./" + text.split("/")[1]
        return (f"{text!r} reads as a Hugging Face hub id, and infer reads adapters from local folders only "
                f"(nothing is downloaded): fetch it first, `hf download {text} --local-dir {local}`, "
                f"and pass {local}")
    relative = "" if path.is_absolute() else f" (a relative path is read from {Path.cwd()})"
    where = f"pass the folder peft's save_pretrained wrote{relative}"
    return f"{where} ({local})" if local else where


def file_given_hint(path: Path) -> str:
    """What to pass instead of a file given as an adapter (its adapter_model.safetensors, say): the folder."""
    if (path.parent / CONFIG_FILE).is_file():
        return f"pass the adapter's folder, {path.parent}, not a file in it"
    return "pass the folder save_pretrained wrote (the one that holds adapter_config.json), not a file"


def read_config(name: str, path: Path, typed: str | None = None) -> dict:
    """The adapter's adapter_config.json (`typed`: the path as the user wrote it, for the hint when it is missing)."""
    if path.exists() and not path.is_dir():
        raise _fail(name, path, "is a file, not a folder", file_given_hint(path))
    if not path.is_dir():
        raise _fail(name, path, "folder not found", not_found_hint(path, typed))
    file = path / CONFIG_FILE
    if not file.is_file():
        try:  # peft's save_pretrained writes an adapter not named "default" into a subfolder of that name
            inner = sorted(d.name for d in path.iterdir() if (d / CONFIG_FILE).is_file())
        except OSError:
            inner = []
        if inner:
            raise _fail(name, path, f"{CONFIG_FILE} is missing; the subfolder{'s' if len(inner) > 1 else ''} "
                        f"{', '.join(inner)} hold{'' if len(inner) > 1 else 's'} one",
                        f"pass the adapter's own folder, e.g. {path / (name if name in inner else inner[0])} "
                        "(peft's save_pretrained puts an adapter not named default in a subfolder of its name)")
        if (path / "config.json").is_file():  # a model (a merged one too), passed where an adapter was expected
            raise _fail(name, path, f"is a full model (config.json, no {CONFIG_FILE}), not a PEFT LoRA adapter",
                        "pass it as the base model, or pass the adapter folder peft's save_pretrained wrote")
        raise _fail(name, path, f"{CONFIG_FILE} is missing", "a PEFT adapter folder holds adapter_config.json")
    bom = bom_error(file)
    if bom is not None:  # (peft cannot read it either)
        raise _fail(name, path, f"{CONFIG_FILE} starts with a UTF-8 byte-order mark (BOM), which peft cannot read as "
                    "JSON", bom.hint)
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as e:  # (ValueError: bad JSON, not UTF-8, a 5000-digit integer)
        raise _fail(name, path, f"{CONFIG_FILE} is not valid JSON: {json_problem(e)}",
                    "re-save the adapter with peft") from None
    if not isinstance(config, dict):
        raise _fail(name, path, f"{CONFIG_FILE} is not a JSON object", "re-save the adapter with peft")
    if config.get("peft_type") is None:  # peft reads the adapter's kind from it: a KeyError without it
        raise _fail(name, path, f'{CONFIG_FILE} has no peft_type (expected "LORA")',
                    'add "peft_type": "LORA" to it (peft cannot load the adapter without it), or save the adapter '
                    "again with peft")
    peft_type = str(config["peft_type"]).upper()
    if peft_type != "LORA":
        raise _fail(name, path, f"peft_type is {peft_type}, not LORA", "only LoRA adapters are supported")
    _check_types(name, path, config)
    for key, kind in (("r", int), ("lora_alpha", (int, float))):
        if not _positive(config.get(key), kind):
            raise _fail(name, path, f"{CONFIG_FILE} has no valid {key!r} (got {config.get(key)!r})",
                        "a LoRA config needs a positive rank r and a positive, finite lora_alpha")
    for key, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        patterns = config.get(key) or {}
        bad = {k: v for k, v in patterns.items() if not _positive(v, kind)} if isinstance(patterns, dict) else patterns
        if bad:
            raise _fail(name, path, f"{CONFIG_FILE} has invalid {key} values {bad!r}",
                        f"every {key} value must be a positive{' integer' if kind is int else ', finite number'}")
        for pattern in patterns:  # peft matches each key as a regex (pattern_value): re.error when it loads
            try:
                re.compile(pattern)
                re.compile(rf"(.*\.)?({pattern})$")
            except re.error as e:
                raise _fail(name, path, f"{CONFIG_FILE} has the {key} key {json.dumps(pattern)}, not a valid "
                            f"regular expression ({e}): peft cannot load this adapter",
                            f"fix the key in {key}: peft reads each key as a regular expression matched against the "
                            "end of a module's name (e.g. v_proj)") from None
    return config


# adapter_config.json fields whose type infer relies on: peft's LoraConfig types (null: not given)
_FIELD_TYPES = {"target_modules": (str, "a string (a regex) or a list of module names"),
                "exclude_modules": (str, "a string (a regex) or a list of module names"),
                "layers_to_transform": (int, "an integer or a list of integers"),
                "layers_pattern": (str, "a string or a list of strings")}
# its flags: peft reads them by truth (a "false" turns rslora on), so only true, false or null is taken
_FLAGS = ("use_rslora", "use_dora", "lora_bias", "use_qalora")
_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "an object"}


def _check_types(name: str, path: Path, config: dict) -> None:
    """A field of another type than peft's LoraConfig gives it (target_modules: 5) is named, not a TypeError later."""
    for key, (kind, expected) in _FIELD_TYPES.items():
        if not _of_type(config.get(key), kind):
            raise _fail(name, path, f"{CONFIG_FILE} has {key} {json.dumps(config[key])} "
                        f"({_json_type(config[key], kind)}), but peft's LoraConfig takes {expected}",
                        f"fix {key} in {CONFIG_FILE}, or save the adapter again with peft")
    for key in _FLAGS:
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise _fail(name, path, f"{CONFIG_FILE} has {key} {json.dumps(config[key])} "
                        f"({_json_type(config[key], bool)}), but peft's LoraConfig takes true or false",
                        f"write {key}: true or false in {CONFIG_FILE} (peft reads any other value by its truth: "
                        '"false" would turn it on)')


def _one(value, kind: type) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)  # a bool is no integer


def _of_type(value, kind: type) -> bool:
    """None, a `kind` or a list of them."""
    return value is None or _one(value, kind) or isinstance(value, list) and all(_one(v, kind) for v in value)


def _json_type(value, kind: type) -> str:
    """What JSON calls `value` (for a list: what its first item that is not a `kind` is)."""
    if isinstance(value, list):
        other = next(v for v in value if not _one(v, kind))
        return f"a list holding {_JSON_TYPES.get(type(other), 'null')}"
    return _JSON_TYPES.get(type(value), "null")


def _positive(value, kind) -> bool:
    """A positive number of `kind` that float32 holds (a scaling of 1e300 or NaN turns every output into NaN)."""
    if not isinstance(value, kind) or isinstance(value, bool):
        return False
    try:  # an integer of 400 digits (JSON has no limit) is no float: OverflowError
        return math.isfinite(value) and 0 < value < torch.finfo(torch.float32).max
    except OverflowError:
        return False


def read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    file = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if file is None:
        raise _fail(name, path, f"no weights ({' or '.join(WEIGHT_FILES)})", "copy the adapter's weight file too")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(file))
        tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or truncated file: any loader error means the same thing to the user
        raise _fail(name, path, f"cannot read {file.name}: {e}", "the file is damaged; copy it again") from e
    # a .bin may pickle anything: a tensor, a list, a dict of numbers (safetensors holds named tensors only)
    bad = (f"a {type(tensors).__name__}" if not isinstance(tensors, dict) else
           next((f"{k!r}: a {type(v).__name__}" for k, v in tensors.items()
                 if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None))
    if bad is not None:
        raise _fail(name, path, f"{file.name} is not a state dict of named tensors (it holds {bad})",
                    "save the adapter with peft's save_pretrained")
    return tensors


_MERGE = "infer convert --merge-lora"
_HINT_MERGE_TARGETS = f"{_HINT_TARGETS}, or merge it into the base model ({_MERGE})"
_UNSUPPORTED = {  # adapter_config.json key (when set) -> (what it means, hint)
    "use_dora": ("uses DoRA", f"merge the DoRA adapter into the base model ({_MERGE}), or train plain LoRA"),
    "lora_bias": ("trains a LoRA bias", "train the adapter with lora_bias=False"),
    "modules_to_save": ("has modules_to_save",
                        f"fully trained modules cannot be swapped per request; merge them ({_MERGE})"),
    "trainable_token_indices": ("trains embedding rows", f"merge them into the base model ({_MERGE})"),
    "layer_replication": ("replicates layers (its copies of a layer share the base's weights, each with its own "
                          "LoRA)", "peft cannot merge it either (\"Cannot merge LORA layers when base model layers "
                          "are replicated\"): serve it with peft, or train the adapter without layer_replication"),
    "alora_invocation_tokens": ("is an activated LoRA (aLoRA)", "train a plain LoRA adapter"),
    "use_qalora": ("is a QA-LoRA adapter", "train a plain LoRA adapter"),
    "kasa_config": ("is a KaSA adapter (peft truncates the base weights by SVD and scales by lora_diag)",
                    "train a plain LoRA adapter"),
    "arrow_config": ("routes among adapters (Arrow)", "load the task adapters as plain LoRA adapters"),
}


# what peft's merge_and_unload folds into the weights of the base (the others it cannot merge, or merges wrongly)
MERGEABLE = ("use_dora", "modules_to_save", "trainable_token_indices")


# init_lora_weights that subtract the initial adapter from the base weight (peft redoes it when it loads the adapter)
# (peft 0.22's Astra too: a residual base it rebuilds from the adapter's eigendecomposition)
BASE_CHANGING_INITS = ("olora", "corda", "loftq", "lora_ga", "astra")


def _is_set(config: dict, key: str) -> bool:
    """Whether peft turns the feature on: a true flag or a non-empty list, and for a sub-config (kasa_config,
    arrow_config) any value but null: peft builds the variant from {} with its defaults."""
    value = config.get(key)
    return bool(value) or (key.endswith("_config") and isinstance(value, dict))


def config_problems(config: dict) -> list[Problem]:
    problems = [Problem(f"{what} ({key}: {json.dumps(config[key])})", hint, merges=key in MERGEABLE)
                for key, (what, hint) in _UNSUPPORTED.items() if _is_set(config, key)]
    init = config.get("init_lora_weights")
    if isinstance(init, str) and (init.startswith("pissa") or init.lower() in BASE_CHANGING_INITS):
        problems.append(Problem(f"was initialised with {init} (init_lora_weights: {init!r}), which changes the base "
                                "weights too: peft rebuilds that residual base at load, infer serves the plain base",
                                "save it with peft's path_initial_model_for_weight_conversion, which turns it into "
                                "a plain LoRA adapter of the original base"))
    for key in ("target_modules", "exclude_modules"):
        error = _regex_error(config.get(key))
        if error:  # peft refuses the adapter (re.error when it matches modules); infer matched nothing or everything
            problems.append(Problem(f"{key} {json.dumps(config[key])} is not a valid regular expression ({error})",
                                    f"peft cannot load this adapter: give {key} as a list of module names, or a "
                                    "regex that compiles"))
    lp = config.get("layers_pattern")
    for pattern in [lp] if isinstance(lp, str) else lp if isinstance(lp, list) else []:
        error = _regex_error(pattern) or _regex_error(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.")  # as peft reads it
        if error:  # peft: re.error; the layer of every module looked unselected ("peft would leave them out")
            problems.append(Problem(f"layers_pattern {json.dumps(pattern)} is not a valid regular expression "
                                    f"({error}): peft cannot load this adapter",
                                    'give the name of the layers\' container, e.g. "layers"'))
    targets = config.get("target_modules")
    if isinstance(targets, str):  # "all-linear" too: peft's LoraConfig refuses these beside a target string
        for key in ("layers_to_transform", "layers_pattern"):
            if config.get(key) is not None:
                problems.append(Problem(f"gives {key} ({json.dumps(config[key])}) with target_modules "
                                        f"{json.dumps(targets)}, a string: peft cannot load it",
                                        f"give target_modules as a list of module names to use {key}"))
    if config.get("layers_pattern") and config.get("layers_to_transform") is None:
        problems.append(Problem(f"gives layers_pattern ({json.dumps(config['layers_pattern'])}) without "
                                "layers_to_transform: peft cannot load it", "set layers_to_transform too, or neither"))
    targets = targets or []
    for emb in EMBEDDINGS:
        if _targets(targets, emb):
            problems.append(Problem(f"targets {emb}", _HINT_MERGE_TARGETS, merges=True))
    if isinstance(targets, (list, tuple)):
        # (Mixtral's experts' w1, w3, w2 of transformers 4: validate_against checks them against the base)
        unknown = [t for t in targets if str(t).split(".")[-1] not in (*PROJECTIONS, *EMBEDDINGS,
                                                                      *V4_EXPERT_TARGETS["mixtral"], *LFM2_NAMES,
                                                                      *LATENT_NAMES, *SHARED_MLP)]
        if unknown:
            problems.append(Problem(f"targets {unknown}, which the base model does not have", _HINT_TARGETS))
    return problems


def _all_linear(targets) -> bool:
    """Whether target_modules is peft's "all-linear" shorthand, which peft reads in any case ("ALL-LINEAR" too):
    every Linear layer but the output layer."""
    return isinstance(targets, str) and targets.lower() == "all-linear"


def _regex_error(value) -> str | None:
    """Why a target_modules / exclude_modules string (a regex to peft) does not compile; None when it does."""
    if not isinstance(value, str) or _all_linear(value):
        return None
    try:
        re.compile(value)
    except re.error as e:
        return str(e)
    return None


def _targets(targets, module: str) -> bool:
    """Whether PEFT's target_modules (a list of name suffixes, or a regex string) selects `module`."""
    if isinstance(targets, str):
        try:
            return any(re.fullmatch(targets, m) for m in (module, f"model.{module}"))
        except re.error:
            return False
    return any(str(t) == module or str(t).endswith("." + module) for t in targets)


def _matches(names, module: str, bad_regex: bool) -> bool:
    """PEFT's module matching: a regex string matches the whole module path, a list entry the path or its end.
    A regex Python cannot compile gives `bad_regex` (peft fails on it; lora-validate says so)."""
    if isinstance(names, str):  # peft: re.fullmatch(names, key), key the full path (model.layers.N...)
        try:
            return re.fullmatch(names, module) is not None
        except re.error:
            return bad_regex
    return any(module == str(t) or module.endswith("." + str(t)) for t in names)


def _unselected(config: dict, module: str, layer: int) -> str | None:
    """Why PEFT's config does not put a LoRA layer on `module` (model.layers.N...), or None when it does: peft builds
    only the layers target_modules, exclude_modules and layers_to_transform select, and ignores other weights
    (peft's check_target_module_exists)."""
    targets = config.get("target_modules")
    if targets is None:  # peft adapts its per-architecture default, not every module with weights
        if not _matches(list(PEFT_DEFAULT_TARGETS), module, True):
            return f"{_NO_TARGETS} {', '.join(PEFT_DEFAULT_TARGETS)}"
        targets = list(PEFT_DEFAULT_TARGETS)
    if not _all_linear(targets) and not _matches(targets, module, True):
        return f"target_modules {json.dumps(targets)}"
    exclude = config.get("exclude_modules")
    if exclude and _matches(exclude, module, False):
        return f"exclude_modules {json.dumps(exclude)}"
    layers = config.get("layers_to_transform")
    # peft filters layers only for a list of targets matched by suffix (a full path in the list is taken as is),
    # and an empty list filters nothing
    if (layers is None or layers == [] or isinstance(targets, str)
            or (not isinstance(targets, str) and module in [str(t) for t in targets])):
        return None
    index = _peft_layer_index(module, config.get("layers_pattern"))
    if index is None:
        return f"layers_pattern {json.dumps(config.get('layers_pattern'))}"
    if index not in ([layers] if isinstance(layers, int) else list(layers)):
        return f"layers_to_transform {json.dumps(layers)}"
    return None


def _peft_layer_index(module: str, layers_pattern) -> int | None:
    """The layer index peft reads from a module path for layers_to_transform (None: its layers_pattern does not
    match, and peft adapts nothing there)."""
    if not layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        m = None
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            try:
                m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
            except re.error:
                m = None
            if m is not None:
                break
    return None if m is None else int(m["idx"])


def pattern_key(patterns: dict, module: str) -> str | None:
    """PEFT's rank_pattern / alpha_pattern lookup (get_pattern_key): the first key that matches the end of the module
    path; None when none does."""
    return next((key for key in patterns or {} if re.match(rf"(.*\.)?({key})$", module)), None)


def pattern_value(patterns: dict, module: str, default):
    """The value of pattern_key's key for `module`, else `default`."""
    key = pattern_key(patterns, module)
    return default if key is None else patterns[key]


def module_scaling(config: dict, module: str) -> tuple[int, float]:
    """(rank r the config gives this module, scaling alpha/r, or alpha/sqrt(r) with use_rslora)."""
    r = pattern_value(config.get("rank_pattern"), module, config["r"])
    alpha = pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
    return r, alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _classify(tensor_name: str) -> tuple[str, str] | Problem:
    """(module path, 'lora_A' | 'lora_B') for a LoRA weight, or the Problem with this tensor."""
    if "lora_magnitude_vector" in tensor_name:
        return Problem(f"has DoRA magnitude tensors ({tensor_name})", "train plain LoRA (use_dora=False)", True)
    if "modules_to_save" in tensor_name:
        return Problem(f"has modules_to_save tensors ({tensor_name})", f"merge them into the base model ({_MERGE})",
                       True)
    if "lora_embedding" in tensor_name or any(f".{e}." in tensor_name for e in EMBEDDINGS):
        return Problem(f"adapts an embedding ({tensor_name})", _HINT_MERGE_TARGETS, True)
    if tensor_name.endswith(".bias") and "lora_" not in tensor_name:  # bias="all" / "lora_only" on a base with biases
        return Problem(f"trains the base model's biases ({tensor_name})",
                       f"train the adapter with bias='none', or merge it into the base model ({_MERGE})", True)
    m = _TENSOR.match(tensor_name)
    if m is None:
        return Problem(f"has an unexpected tensor {tensor_name}", "only lora_A/lora_B weights are supported")
    if m["param"] == "bias":
        return Problem(f"has a LoRA bias ({tensor_name})", "train the adapter with lora_bias=False")
    return m["module"], m["kind"]


def _pair_problem(module: str, a: torch.Tensor | None, b: torch.Tensor | None, r_cfg: int,
                  scaling: float = 1.0) -> Problem | None:
    if a is None or b is None:
        return Problem(f"{module} has lora_{'A' if a is None else 'B'} missing", "the weight file is incomplete")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        return Problem(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not share a rank",
                       "the weight file is damaged or not a LoRA adapter")
    if a.shape[0] != r_cfg:
        return Problem(f"{module} has rank {a.shape[0]} but {CONFIG_FILE} gives r={r_cfg}",
                       "the config and the weights come from different adapters")
    odd = next(((k, t) for k, t in (("lora_A", a), ("lora_B", b)) if not t.is_floating_point()), None)
    if odd is not None:  # cast to the model's dtype, an int8 / bool / complex tensor would become other numbers
        return Problem(f"{module}: {odd[0]} holds {str(odd[1].dtype).removeprefix('torch.')} values, not floating "
                       "point ones", "LoRA weights are floats (float32, bfloat16, float16): save the adapter again "
                       "with peft, not quantized")
    if not (_finite(a) and _finite(b)):
        return Problem(f"{module} has non-finite (NaN/inf) weights",
                       "the adapter's training diverged; use another checkpoint")
    largest = _delta_bound(a, b, scaling)
    if largest >= FLOAT32_MAX:
        return Problem(f"{module}: lora_B @ lora_A x scaling {scaling:g} overflows float32 (entries up to "
                       f"{largest:.3g}): its outputs would be inf/NaN", "the adapter's weights are far too large (its "
                       "training diverged, or it was saved scaled); use another checkpoint")
    return None


FLOAT32_MAX = torch.finfo(torch.float32).max


def _finite(t: torch.Tensor) -> bool:
    """No NaN/inf in t; float8 tensors (torch has no isfinite for float8_e4m3fn) are read as float32."""
    return bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all())


def _delta_bound(a: torch.Tensor, b: torch.Tensor, scaling: float) -> float:
    """The largest |entry| of scaling * B @ A, computed in float64 (where float32's overflow is finite). Bounded
    first by |row of B| x |column of A| (Cauchy-Schwarz: reading the weights once); the product itself is formed
    only when that bound reaches float32's limit, which a trained adapter is many orders of magnitude below."""
    if a.numel() == 0 or b.numel() == 0:
        return 0.0
    a64, b64 = a.double(), b.double()
    bound = abs(scaling) * b64.norm(dim=1).max().item() * a64.norm(dim=0).max().item()
    if bound < FLOAT32_MAX:
        return bound
    return abs(scaling) * (b64 @ a64).abs().max().item()


# the projections of a mixture of experts' layers: a sparse layer's (True) and a dense one's (False)
MOE_LAYER_PROJECTIONS = {True: ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                                "experts.gate_up_proj", "experts.down_proj"),
                         False: ("gate_proj", "up_proj", "down_proj")}


def _module_of(path: str) -> tuple[str, int, str] | None:
    """(the base's module path, its layer, its projection as expected_shapes names it) of an adapted module; None for
    a module infer does not adapt. Qwen2-MoE's shared expert is "shared_expert.gate_proj" ..., and so are GLM-4.5's
    shared experts (mlp.shared_experts.gate_proj ...)."""
    m = _MODULE.match(path)
    if m is None:
        return None
    parent, proj = m["parent"], m["proj"]
    if parent in ("mlp.shared_expert", "mlp.shared_experts", "feed_forward.shared_expert", "mixer.shared_experts",
                  "mlp.shared_mlp") and proj in LLAMA_PROJECTIONS and LLAMA_PROJECTIONS[proj] == MLP:  # (Llama 4's:
        # feed_forward's; Nemotron 3's: its moe blocks' mixer's, up_proj and down_proj; Hunyuan MoE's shared_mlp)
        proj = f"shared_expert.{proj}"
    elif parent == "feed_forward" and LLAMA_PROJECTIONS.get(proj) == MLP:  # (Llama 4's dense MLP: models.llama4)
        pass
    elif PROJECTIONS.get(proj) != parent and not (parent == "mixer" and proj in PROJECTIONS) \
            and (parent, proj) not in LFM2_MODULES and (parent, proj) not in MAMBA_MODULES \
            and (parent, proj) not in SHARED_MLP_MODULES:
        return None  # (Nemotron-H's attention and MLP projections: under its blocks' mixer, models.nemotron_h)
    return f"model.layers.{int(m['layer'])}.{parent}.{m['proj']}", int(m["layer"]), proj


def build_modules(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, LoRAModule], list[Problem]]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    problems: list[Problem] = []
    first: dict[tuple[str, str], str] = {}  # (module, lora_A | lora_B) -> the tensor that gave it
    alike: dict[tuple[str, str], list] = {}  # one problem for all the tensors of one kind (a DoRA vector per module)
    for tensor_name, tensor in tensors.items():
        if any(config.get(key) is not None and mark in tensor_name for key, mark in _TRAINING_ONLY.items()):
            continue  # VeLoRA's activation embedding, MonteCLoRA's sampler: unused by peft's eval forward
        kind = _classify(tensor_name)
        if isinstance(kind, Problem):
            alike.setdefault((kind.message.replace(tensor_name, ""), kind.hint), []).append((tensor_name, kind))
            continue
        where = _module_of(kind[0])
        module = where[0] if where else kind[0]
        if (module, kind[1]) in first:  # one silently replaced the other (with or without base_model.model., ...)
            problems.append(Problem(f"has two {kind[1]} tensors for {module} ({first[module, kind[1]]} and "
                                    f"{tensor_name})", "the weight file mixes two adapters' tensors: save the "
                                    "adapter again with peft"))
            continue
        first[module, kind[1]] = tensor_name
        pairs.setdefault(kind[0], {})[kind[1]] = tensor
    for group in alike.values():
        (tensor_name, problem), more = group[0], len(group) - 1
        if more:
            problem.message = problem.message.replace(tensor_name, f"{tensor_name} and {more} more like it")
        problems.append(problem)
    modules = {}
    unselected: dict[str, list[str]] = {}  # why its config leaves a module out -> the modules
    per_module: list[tuple[str, Problem]] = []  # (module, its problem): alike ones are one problem
    stacked: dict[int, dict[int, dict]] = {}  # a sparse layer -> its experts' pairs by nesting depth
    per_expert: dict[int, dict[int, dict]] = {}  # a sparse layer -> part (0 gate, 1 up, 2 down) -> expert -> pair
    v4_names: dict[int, str] = {}  # part -> the adapter's name of it (gate_proj or w1, ...)
    for path, pair in pairs.items():
        nested = _EXPERTS.match(path)
        if nested is not None:
            stacked.setdefault(int(nested["layer"]), {})[nested["nest"].count(".base_layer")] = pair
            continue
        own = _EXPERT_MODULE.match(path)
        if own is not None:
            module = f"model.layers.{int(own['layer'])}.mlp.experts.{int(own['expert'])}.{own['proj']}"
            # peft turns them into target_parameters, which adapt every layer's experts: no layers_to_transform,
            # and no exclude_modules where target_modules is a list (peft maps its names; a regex it resolves
            # against the model, exclude_modules too)
            listed = not isinstance(config.get("target_modules"), str)
            why = _unselected({**config, "layers_to_transform": None,
                               **({"exclude_modules": None} if listed else {})}, module, int(own["layer"]))
            if why:
                unselected.setdefault(why, []).append(module)
                continue
            part = _V4_EXPERT_PARTS[own["proj"]]
            per_expert.setdefault(int(own["layer"]), {}).setdefault(part, {})[int(own["expert"])] = pair
            v4_names[part] = own["proj"]
            continue
        plain = text_name(path)  # a multimodal model's language model's module as a text model's (models.multimodal)
        if plain is None:
            top = next(p for p in VISION_PREFIXES if path.startswith(p)).rstrip(".")
            per_module.append((path, Problem(
                f"adapts {path} of a multimodal model's vision tower or projector, which infer never loads",
                f"its layers sit under {top}: it was made for another model part (infer serves a multimodal "
                "checkpoint's text model alone); train the adapter on the language model's layers only, e.g. "
                "target_modules=r'.*language_model.*\\.(q_proj|v_proj)'")))
            continue
        where = _module_of(plain)
        if where is None:
            tail = re.search(r"\.(?:model\.)?layers\.\d+\.[A-Za-z_]+\.[A-Za-z0-9_]+$", path)
            other = tail is not None and path[:tail.start()] != "model"  # (model.layers.N...: this base's layers)
            hint = (f"its layers sit under {path[:tail.start()]}: it was made for another model (e.g. a multimodal "
                    "one); use an adapter trained on this base") if other else _HINT_TARGETS
            per_module.append((path, Problem(f"adapts {path}, {_ABSENT}", hint)))
            continue
        # (a multimodal model's module: its config selects it as peft names it in that model)
        why = _unselected(config, path if plain != path else where[0], where[1])
        if why:  # one problem per reason, not one per module (every module of the adapter, often)
            unselected.setdefault(why, []).append(where[0])
            continue
        r_cfg, scaling = module_scaling(config, where[0])
        bad = _block_diagonal(config, where[0], pair) or _pair_problem(where[0], pair.get("lora_A"),
                                                                       pair.get("lora_B"), r_cfg, scaling)
        if bad:
            per_module.append((where[0], bad))
            continue
        modules[where[0]] = LoRAModule(where[0], where[1], where[2], pair["lora_A"], pair["lora_B"], scaling)
    for layer, levels in stacked.items():
        for module in _expert_modules(config, layer, levels, per_module):
            modules[module.name] = module
    for layer, parts in per_expert.items():
        for module in _stacked_from_v4(config, layer, parts, per_module, v4_names):
            modules[module.name] = module
    problems += _one_per_kind(per_module)
    for why, names in unselected.items():
        more = f" and {len(names) - 1} more modules" if len(names) > 1 else ""
        problems.append(Problem(f"has weights for {names[0]}{more}, which its {CONFIG_FILE} does not adapt ({why}): "
                                "peft would leave them out", "the config and the weights come from different "
                                "adapters: save the adapter again with peft"))
    if not modules and not problems:
        problems.append(Problem("has no lora_A/lora_B weights", "the weight file is empty or not a LoRA adapter"))
    return modules, problems


def _expert_modules(config: dict, layer: int, levels: dict[int, dict], per_module: list) -> list[LoRAModule]:
    """A sparse layer's stacked experts' LoRA as peft's ParamWrapper saves it: lora_A [E * r, in] (expert e's A in
    rows e * r ..), lora_B [out, r * E] (expert e's B in columns e, e + E, ..), each targeted parameter a nesting
    level (peft wraps the experts' parameters in their order, gate_up_proj innermost: experts.base_layer, down_proj
    outside it: experts); one level is the parameter target_parameters names. Split into [E, r, in] and
    [E, out, r]; a problem appended to per_module for what does not read so."""
    params = config.get("target_parameters")
    params = [str(p) for p in params] if isinstance(params, list) else [str(params)] if params else []
    named = [p for p in EXPERT_PARAMS if any(t.split(".")[-1] == p for t in params)]
    up = "up_proj" if "up_proj" in named else "gate_up_proj"  # (Nemotron 3's experts: up_proj, no gate)
    order = {2: ["down_proj", up], 1: named if len(named) == 1 else []}.get(len(levels), [])
    path = f"model.layers.{layer}.mlp.experts"
    if len(order) != len(levels) or sorted(levels) != list(range(len(levels))):
        per_module.append((path, Problem(f"{path} has LoRA weights for {len(levels)} stacked parameters that "
                                         f"target_parameters {json.dumps(params)} does not name one by one",
                                         "save the adapter again with peft")))
        return []
    out = []
    for depth, param in enumerate(order):
        name, pair = f"{path}.{param}", levels[depth]
        r_cfg, scaling = module_scaling(config, name)
        a, b = pair.get("lora_A"), pair.get("lora_B")
        bad = _pair_problem(name, a, b, a.shape[0] if a is not None and a.dim() == 2 else r_cfg, scaling)
        if bad is None and a.shape[0] % r_cfg:
            bad = Problem(f"{name}: lora_A has {a.shape[0]} rows, not a multiple of r={r_cfg} (one rank-r A per "
                          "expert)", "the config and the weights come from different adapters")
        if bad is not None:
            per_module.append((name, bad))
            continue
        e = a.shape[0] // r_cfg
        a3 = a.reshape(e, r_cfg, a.shape[1])
        b3 = b.reshape(b.shape[0], r_cfg, e).permute(2, 0, 1).contiguous()
        out.append(LoRAModule(name, layer, f"experts.{param}", a3, b3, scaling))
    return out


V4_FUSED_KEY = r".*\.gate_up_proj"  # the rank_pattern / alpha_pattern key peft adds for the fused gate and up


def v4_converted(config: dict, fused: bool) -> dict:
    r"""`config` as peft (on transformers 5) converts a transformers 4 adapter's targets of the experts
    (_convert_peft_config_moe): when it targets both the gate and the up projections (`fused`: into gate_up_proj),
    rank_pattern and alpha_pattern get r".*\.gate_up_proj" at twice r and lora_alpha, after the adapter's own keys,
    which peft matches against the stacked parameters' names (model.layers.N.mlp.experts.gate_up_proj / down_proj)."""
    if not fused:
        return config
    return {**config, "rank_pattern": {**(config.get("rank_pattern") or {}), V4_FUSED_KEY: 2 * config["r"]},
            "alpha_pattern": {**(config.get("alpha_pattern") or {}), V4_FUSED_KEY: 2 * config["lora_alpha"]}}


def _stacked_from_v4(config: dict, layer: int, parts: dict[int, dict], per_module: list,
                     names: dict[int, str]) -> list[LoRAModule]:
    """A sparse layer's experts adapted one by one (transformers 4's experts.N.gate_proj / up_proj / down_proj,
    Mixtral's w1 / w3 / w2: `names`, by part) as peft converts them for transformers 5's stacked parameters:
    gate_up_proj's A of each expert its gate's A over its up's, its B the two B's block-diagonal, down_proj's as
    they are; the rank and scaling of each stacked parameter the ones peft gives it (v4_converted: gate_up_proj at 2r
    and 2 x lora_alpha). Every expert must have its pairs, and peft's scaling must be the one each expert's modules
    were trained with (_v4_scaling_problem: use_rslora, or alpha_pattern keys of the per-expert names)."""
    out = []
    path = f"model.layers.{layer}.mlp.experts"
    converted = v4_converted(config, 0 in parts and 1 in parts)  # (its weights: what a target regex selected)
    count = 1 + max(e for experts in parts.values() for e in experts)
    for param, members in (("gate_up_proj", (0, 1)), ("down_proj", (2,))):
        if not any(p in parts for p in members):
            continue
        name = f"{path}.{param}"
        missing = next((f"{path}.{e}.{('gate_proj', 'up_proj', 'down_proj')[p]}" for p in members for e in range(count)
                        if e not in parts.get(p, {})), None)
        if missing is not None:
            per_module.append((name, Problem(f"has LoRA weights for some experts' {param.split('_proj')[0]} "
                                             f"projections of layer {layer} but none for {missing}", "peft converts "
                                             "the experts' adapters for transformers 5 only whole: save the adapter "
                                             "again with peft")))
            continue
        r_cfg, scaling = module_scaling(converted, name)
        a_rows, b_rows = [], []
        for e in range(count):
            pairs = [parts[p][e] for p in members]
            bad = next((b for b in (_pair_problem(f"{path}.{e}.{('gate_proj', 'up_proj', 'down_proj')[p]}",
                                                  q.get("lora_A"), q.get("lora_B"), _rows(q.get("lora_A")), scaling)
                                    for p, q in zip(members, pairs)) if b is not None), None)
            rank = sum(q["lora_A"].shape[0] for q in pairs) if bad is None else r_cfg
            if rank != r_cfg:
                bad = _v4_rank_problem(converted, name, e, rank, r_cfg)
            if bad is not None:
                per_module.append((name, bad))
                break
            a_rows.append(torch.cat([q["lora_A"] for q in pairs]))
            b_rows.append(torch.block_diag(*[q["lora_B"] for q in pairs]))
        else:
            bad = _v4_scaling_problem(config, converted, name, {f"{path}.{e}.{names[p]}": _rows(parts[p][e]["lora_A"])
                                                                for p in members for e in range(count)}, r_cfg, scaling)
            if bad is not None:
                per_module.append((name, bad))
                continue
            out.append(LoRAModule(name, layer, f"experts.{param}", torch.stack(a_rows), torch.stack(b_rows), scaling))
    return out


def _v4_scaling_problem(config: dict, converted: dict, name: str, trained: dict[str, int], r_cfg: int,
                        scaling: float) -> Problem | None:
    """A Problem when peft's scaling of the stacked parameter `name` (`scaling`, at rank r_cfg) is not the one
    the per-expert modules `trained` (model.layers.N.mlp.experts.E.gate_proj, ...: their weights' rank) were
    trained with (their alpha_pattern alpha or lora_alpha, over their rank or its root with use_rslora): peft
    serves another model than the adapter. Its conversion means to keep the scaling (twice r and twice
    lora_alpha for the fused gate and up), but rslora's alpha / sqrt(r) at twice both scales sqrt(2) times as
    much, and alpha_pattern keys it matches against the stacked name, not the experts' (peft's TODO)."""
    root = math.sqrt if config.get("use_rslora") else float
    own = {module: pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"]) / root(rank)
           for module, rank in trained.items()}
    module, was = next(((m, v) for m, v in own.items() if not math.isclose(v, scaling, rel_tol=1e-6)), (None, 0))
    if module is None:
        return None
    fused = pattern_key(converted.get("rank_pattern"), name) == V4_FUSED_KEY
    if config.get("use_rslora") and fused:
        alpha, pattern = config["lora_alpha"] * math.sqrt(config["r"]), _alphas_without_rslora(config)
        why = ("use_rslora: peft fuses the gate and up at twice their rank and lora_alpha, which alpha / sqrt(r) "
               "scales sqrt(2) times as much")
        hint = (f"set use_rslora to false and lora_alpha to {alpha:g}"
                + (f", alpha_pattern to {json.dumps(pattern)}" if pattern else "")
                + " (each alpha x sqrt(its rank): the same scalings without rslora, which peft's conversion keeps), "
                "or train the adapter with peft on transformers 5 (target_parameters)")
    else:
        key = pattern_key(converted.get("alpha_pattern"), name)
        given = pattern_key(config.get("alpha_pattern"), module)
        why = (f"alpha_pattern key {json.dumps(given)} gives {module} its alpha, " if given is not None else "") + \
            (f"peft's key {json.dumps(key)} gives the stacked parameter its alpha" if key is not None else
             "no alpha_pattern key matches the stacked parameter's name")
        same = len({round(v, 9) for v in own.values()}) == 1
        short = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
        hint = ((f"key the alpha by the stacked parameter's name, as peft matches it: alpha_pattern "
                 f"{{\"{short}\": {was * (math.sqrt(r_cfg) if config.get('use_rslora') else r_cfg):g}}}, first of the "
                 "keys that match it (peft takes the first; the adapter's own come before the one peft adds), or ")
                if same else
                "the experts' modules were trained at different scalings, which one stacked parameter cannot "
                "hold: ") + "train the adapter with peft on transformers 5 (target_parameters)"
    return Problem(f"{name}: peft (on transformers 5) converts transformers 4's per-expert modules into it at "
                   f"scaling {scaling:g}, but {module} was trained at {was:g} ({why}): peft would serve another "
                   "model than the adapter's", hint)


def _alphas_without_rslora(config: dict) -> dict:
    """The alpha_pattern that keeps every module's use_rslora scaling without it: each key's alpha x sqrt(its rank),
    a rank_pattern key's alpha lora_alpha's unless alpha_pattern gives it (lora_alpha x sqrt(r) alone left a module
    of another rank at alpha x sqrt(r) / r', not alpha / sqrt(r'): a model the adapter never computed)."""
    r, ranks, alphas = config["r"], config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    return {k: round(alphas.get(k, config["lora_alpha"]) * math.sqrt(ranks.get(k, r)), 6) for k in {**alphas, **ranks}}


def _rows(a: torch.Tensor | None) -> int:
    """The rank a lora_A gives (its rows; 0 for a missing or not 2-d one, which _pair_problem names)."""
    return a.shape[0] if a is not None and a.dim() == 2 else 0


def _v4_rank_problem(converted: dict, name: str, expert: int, rank: int, r_cfg: int) -> Problem:
    """A transformers 4 adapter's experts whose rank is not the one peft gives the stacked parameter (a rank_pattern
    key peft does not match against the stacked names: peft fails on the weights' sizes)."""
    key = pattern_key(converted.get("rank_pattern"), name)
    why = f"rank_pattern key {json.dumps(key)}" if key is not None else f"r={converted['r']}: no rank_pattern key " \
        "matches it"
    parts = "gate and up projections have" if name.endswith("gate_up_proj") else "down projection has"
    return Problem(f"{name}: expert {expert}'s {parts} LoRA rank {rank}, but peft (on transformers 5) adapts the "
                   f"experts' stacked parameter at rank {r_cfg} ({why}): peft cannot load this adapter",
                   "peft matches rank_pattern keys against the stacked experts' names (experts.gate_up_proj, at twice "
                   "the gate projection's rank, and experts.down_proj): key the ranks so, or train the adapter with "
                   "peft on transformers 5 (target_parameters)")


def _one_per_kind(per_module: list[tuple[str, Problem]]) -> list[Problem]:
    """The same problem in many modules (every module of an adapter for another model, often hundreds) as one
    problem naming the first module and counting the others."""
    kinds: dict[tuple[str, str], list[tuple[str, Problem]]] = {}
    for module, problem in per_module:
        kinds.setdefault((problem.message.replace(module, ""), problem.hint), []).append((module, problem))
    out = []
    for group in kinds.values():
        module, problem = group[0]
        if len(group) > 1:
            problem.message = problem.message.replace(module, f"{module} (and {len(group) - 1} more modules)", 1)
        out.append(problem)
    return out


def _block_diagonal(config: dict, module: str, pair: dict) -> Problem | None:
    """BD-LoRA (use_bdlora): peft keeps a block-diagonal lora_A or lora_B as its nblocks diagonal blocks stacked
    ([out, in / nblocks]); expand it in place to the dense matrix peft multiplies by (torch.block_diag)."""
    bd = config.get("use_bdlora")
    if bd is None:
        return None
    lists = [bd.get(k) or [] for k in ("target_modules_bd_a", "target_modules_bd_b")] if isinstance(bd, dict) else []
    if (not isinstance(bd, dict) or not isinstance(bd.get("nblocks", 1), int) or bd.get("nblocks", 1) < 1
            or not all(isinstance(x, list) and all(isinstance(p, str) for p in x) for x in lists)):
        return Problem(f"has a use_bdlora infer cannot read ({json.dumps(bd)})", "train a plain LoRA adapter")
    nblocks = bd.get("nblocks", 1)
    in_a = any(p in module for p in bd.get("target_modules_bd_a") or [])
    in_b = any(p in module for p in bd.get("target_modules_bd_b") or [])
    if in_a and in_b:
        return Problem(f"use_bdlora makes both lora_A and lora_B of {module} block-diagonal: peft cannot load it",
                       "give each module in only one of target_modules_bd_a / target_modules_bd_b")
    if not (in_a or in_b) and bd.get("match_strict", True):
        return Problem(f"use_bdlora (match_strict) makes neither lora_A nor lora_B of {module} block-diagonal: peft "
                       "cannot load it", "list the module in target_modules_bd_a or target_modules_bd_b")
    kind = "lora_A" if in_a else "lora_B" if in_b else None
    w = pair.get(kind) if kind else None
    if nblocks > 1 and w is not None:
        if w.dim() != 2 or w.shape[0] % nblocks:
            return Problem(f"{module}: block-diagonal {kind} {list(w.shape)} does not split into use_bdlora's "
                           f"{nblocks} blocks", "the config and the weights come from different adapters")
        pair[kind] = torch.block_diag(*torch.chunk(w, nblocks, dim=0))
    return None


def folder_stamp(path: Path) -> tuple:
    """(file, size, modification time) of the adapter's config and weight files: whether the folder changed."""
    out = []
    for f in (CONFIG_FILE, *WEIGHT_FILES):
        try:
            st = (path / f).stat()
        except OSError:
            continue
        out.append((f, st.st_size, st.st_mtime_ns))
    return tuple(out)


def adapter_path(name: str, path: str | Path) -> Path:
    """`path`, its ~ expanded, or LoRAError for a path the file system refuses outright: ~user of no user
    (RuntimeError), a NUL byte in it (ValueError), a name longer than the file system allows, a folder it may not
    read (OSError). Path.expanduser, exists and is_dir raise those instead of saying False, which made a server's
    adapter load a 500; a path that is not there is read_config's "folder not found"."""
    if isinstance(path, bytes):  # os.fsdecode's reading: Path() takes no bytes
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)) or not str(path):  # Path(None) was a bare TypeError
        raise LoRAError(f"LoRA adapter {name!r}: its path must be a folder's path (a string), got {path!r}"[:300],
                        "pass the folder peft's save_pretrained wrote, e.g. add_lora('support', './adapters/support')")
    try:
        path = Path(path).expanduser()
    except RuntimeError as e:
        raise _fail(name, Path(path), f"cannot be read: {e}", "write the folder's path without ~user") from None
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        pass
    except (OSError, ValueError) as e:
        raise _fail(name, path, f"cannot be read: {e}", "pass the folder save_pretrained wrote") from None
    return path


def read_adapter(name: str, path: str | Path) -> LoRAAdapter:
    """Parse the folder; raises LoRAError only when it cannot be read (see the module docstring)."""
    typed = path if isinstance(path, str) else None  # (as written: Path drops a leading ./)
    path = adapter_path(name, path)
    stamp = folder_stamp(path)  # before reading: a change while it is read shows as a change later
    config = read_config(name, path, typed)
    tensors = read_tensors(name, path)
    modules, problems = build_modules(config, tensors)
    adapter = LoRAAdapter(name, path, config, modules, config_problems(config) + problems, stamp)
    found = (_TENSOR.match(n) for n in tensors)
    adapter.mlp_modules = sorted({m["module"].removeprefix("base_model.model.") for m in found
                                  if m and re.search(r"\.(mlp|block_sparse_moe|mixer\.shared_experts)\.|"
                                                     r"\.mixer\.fc[12]_latent_proj$", m["module"])
                                  or m and _FEED_FORWARD_MOE.search(m["module"])})
    found = (_TENSOR.match(n) for n in tensors)
    adapter.language_model = next((m["module"] for m in found if m and text_name(m["module"]) not in
                                   (None, m["module"])), None)
    return adapter


def adapter_problems(name: str, path: str | Path, base_config, max_rank: int | None = None) -> list[Problem]:
    """Every problem with the adapter at `path` for `base_config` ([] when it can be served)."""
    try:
        adapter = read_adapter(name, path)
    except LoRAError as e:
        return [Problem(e.message, e.hint or "")]
    return adapter.validate_against(base_config, max_rank)


def load_adapter(name: str, path: str | Path, base_config, max_rank: int | None = None,
                 dtype: torch.dtype | None = None, merging: bool = False) -> LoRAAdapter:
    """Read and validate; raises LoRAError naming the adapter for the first problem. `merging`: only the problems
    that keep peft's merge_and_unload from folding it into the base's weights count (DoRA, modules_to_save, ...
    merge: infer convert --merge-lora)."""
    adapter = read_adapter(name, path)
    problems = [p for p in adapter.validate_against(base_config, max_rank) if not (merging and p.merges)]
    if problems:
        rest = len(problems) - 1
        more = f" (and {rest} more problem{'s' if rest > 1 else ''}: `infer lora-validate` lists every one)" if rest \
            else ""
        raise _fail(name, adapter.path, problems[0].message + more, problems[0].hint)
    return adapter.to(dtype) if dtype is not None else adapter
