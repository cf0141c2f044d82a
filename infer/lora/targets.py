"""--lora-target-modules (vLLM's LoRAConfig.target_modules): which of a model's layers get adapter slots.

Names are the checkpoint's (peft's target_modules) projection names, q_proj .. down_proj (StarCoder2's MLP: c_fc,
c_proj; an MLP without gate, Arcee's, Nemotron's and Apertus's: up_proj and down_proj, each a layer of its own;
Granite 4.0's and GraniteMoeShared's shared MLP: input_linear (gate|up) and output_linear), or
infer's fused layers:
qkv_proj (q_proj, k_proj and v_proj, which infer computes as one layer whose slots hold all three), gate_up_proj
(gate_proj and up_proj); `experts` is a mixture of experts' stacked experts (peft's target_parameters
mlp.experts.gate_up_proj / down_proj: one unit of slots), `shared_expert` a sparse layer's shared expert (Qwen2-MoE's
shared_expert, GLM-4.5's shared_experts, Hunyuan MoE's shared_mlp: its three layers; its gate_up_proj and down_proj
are also selected by those names, as peft's suffix match adapts them). A fused layer
is selected whole: naming some of its projections but not all is refused, since its slots would hold the others too.
None: every layer (the default).
"""

from __future__ import annotations

from ..errors import ConfigError, LoRAError

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERTS, SHARED = "experts", "shared_expert"
FLAG = "--lora-target-modules"
ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
STARCODER2_MLP = ("c_fc", "c_proj")  # StarCoder2's MLP (no gate)
UNGATED_MLP = ("up_proj", "down_proj")  # Arcee's, Nemotron's and Apertus's MLP (no gate)
# the names whose layers memory.sizes counts as a dense MLP's gate_up_proj and down_proj (an MLP without gate's up
# and down layers: within those widths; Granite's shared MLP: memory.sizes.lora_mlp_width)
_SLOTS_AS = {"gate_up_proj": ("gate_up_proj", "up_proj", "c_fc", "input_linear"),
             "down_proj": ("down_proj", "c_proj", "output_linear")}
MLA_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")  # DeepSeek's (models.deepseek), with q_proj, o_proj
# LFM2's (models.lfm2): its attention's out_proj, its short convs' in_proj and out_proj (one name for both kinds of
# out_proj, as peft's suffix match adapts both), its feed_forward's w1 and w3 (one fused layer: gate_up_proj) and w2
LFM2_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "out_proj", "in_proj", "w1", "w3", "gate_up_proj", "w2")
LFM2_FUSED = {"qkv_proj": FUSED["qkv_proj"], "gate_up_proj": ("w1", "w3")}
# Granite 4.0's and GraniteMoeShared's shared MLP (models.granite4, models.moe): gate|up stored as one input_linear,
# down as output_linear (each one layer of slots)
SHARED_MLP = ("input_linear", "output_linear")
# every name some model takes (LFM2's own aside: a llama's --lora-target-modules w1 is an unknown name)
ALL_NAMES = (*ATTENTION, *MLA_ATTENTION, *MLP, *STARCODER2_MLP, EXPERTS, SHARED, *SHARED_MLP)
# a hybrid model's linear-attention (Gated DeltaNet: models.qwen3_5) projections, which adapters do not adapt (yet)
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "in_proj_qkvz", "in_proj_ba")


def parse_target_modules(value) -> list[str] | None:
    """None (every module), or the names given (a list, or one string; each may be comma-separated), in order,
    once each; ConfigError for an empty list (the names are checked against the model: check_target_modules)."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise ConfigError(f"{FLAG} must be a list of module names, got {value!r}",
                          f"e.g. {FLAG} o_proj,qkv_proj (Python: lora_target_modules=['o_proj', 'qkv_proj'])")
    names = list(dict.fromkeys(n.strip() for item in items for n in item.split(",") if n.strip()))
    if not names:
        raise ConfigError(f"{FLAG} names no module", f"name some of {', '.join(ALL_NAMES)}, or leave it out "
                                                    "(None) for every module")
    return names


def model_target_names(model_config) -> list[str]:
    """The names --lora-target-modules takes for a model of `model_config` (those of the layers it has)."""
    from ..models.moe import is_sparse, shared_name
    layers = range(int(model_config.num_hidden_layers))
    sparse = [is_sparse(model_config, i) for i in layers]
    shared = shared_name(model_config) is not None and any(sparse)  # (Qwen2-MoE's, GLM-4.5's)
    names = list(ATTENTION)
    from ..models.shapes import is_mla
    if is_mla(model_config):  # (DeepSeek's multi-head latent attention: its own projections, kv_b_proj absorbed)
        rank = getattr(model_config, "q_lora_rank", None)
        names = [*(MLA_ATTENTION[:2] if rank else ("q_proj",)), MLA_ATTENTION[2], "o_proj"]
    if model_config.model_type == "lfm2" or (model_config.model_type == "lfm2_moe" and not all(sparse)):
        return list(LFM2_NAMES)  # (LFM2-MoE's dense layers' MLPs; its experts get no slots: moe.experts_adapted)
    if model_config.model_type == "lfm2_moe":  # (every layer with experts: no MLP of its own)
        return [n for n in LFM2_NAMES if n not in LFM2_FUSED["gate_up_proj"] + ("gate_up_proj", "w2")]
    if model_config.model_type == "bamba":  # (its Mamba-2 mixers' projections: models.bamba)
        return names + list(MLP) + ["in_proj", "out_proj"]
    if model_config.model_type == "falcon_h1":  # (its Mamba-2 mixers' in_proj; out_proj's adapters are refused)
        return names + list(MLP) + ["in_proj"]
    if model_config.model_type == "granitemoehybrid":  # (its Mamba-2 mixers' projections, its shared MLP's: its
        # MLP where it has no experts, granite-4.0-micro's)
        # (where it has Mamba-2 layers: layer_types "mamba" in config.json, "linear_attention" as infer reads it)
        kinds = set(getattr(model_config, "layer_types", None) or ())
        mamba = ["in_proj", "out_proj"] if kinds & {"mamba", "linear_attention"} else []
        return [n for n in _family_names(model_config, names, sparse, shared) if n not in MLP] + mamba + \
            shared_mlp_names(model_config)
    if model_config.model_type == "granitemoeshared":
        return _family_names(model_config, names, sparse, shared) + shared_mlp_names(model_config)
    if model_config.model_type == "nemotron_h":  # (its Mamba-2 mixers' in_proj too; out_proj's adapters refused;
        # Nemotron 3's experts)
        return _family_names(model_config, names, sparse, shared) + ["in_proj"] + ([EXPERTS] if any(sparse) else [])
    return _family_names(model_config, names, sparse, shared)


def shared_mlp_names(model_config) -> list[str]:
    """The shared MLP's names (SHARED_MLP) where the model has one (Granite 4.0's, GraniteMoeShared's
    shared_intermediate_size), else none."""
    if model_config.model_type in ("granitemoehybrid", "granitemoeshared") and \
            int(getattr(model_config, "shared_intermediate_size", 0) or 0):
        return list(SHARED_MLP)
    return []


def _family_names(model_config, names: list[str], sparse: list[bool], shared: bool) -> list[str]:
    """model_target_names of the attention and the MLPs of the other families."""
    from ..models.registry import UNGATED
    if model_config.model_type == "starcoder2":
        return names + list(STARCODER2_MLP)
    if model_config.model_type in UNGATED:
        return names + list(UNGATED_MLP)
    if not all(sparse) or shared:
        names += MLP
    if any(sparse):
        names.append(EXPERTS)
    if shared:
        names.append(SHARED)
    return names


def check_target_modules(targets: list[str] | None, model_config) -> frozenset[str] | None:
    """The selection of `targets` for this model (every name it selects, fused names and their projections
    alike), None for every module; ConfigError for a name the model has no layer of, or some of a fused layer's
    projections without the others."""
    if targets is None:
        return None
    targets = parse_target_modules(targets)
    valid = model_target_names(model_config)
    missing = [n for n in targets if n not in valid]
    if missing:
        what = "unknown module name" if any(n not in ALL_NAMES for n in missing) else "no layer of this model"
        from ..models.registry import is_hybrid
        if is_hybrid(model_config) and set(missing) <= set(LINEAR_ATTENTION):  # (they were "unknown")
            what = "linear-attention (Gated DeltaNet) projections, which infer's adapters do not adapt"
            if model_config.model_type in ("falcon_h1", "nemotron_h"):  # (its out_proj: adapters of it refused)
                what = "Mamba-2 mixer projections, which infer's adapters of this model do not adapt"
        raise ConfigError(f"{FLAG} {', '.join(missing)}: {what} ({model_config.model_type} has adapter slots for "
                          f"{', '.join(valid)})", f"name modules among {', '.join(valid)}, or leave {FLAG} out for "
                          "all of them")
    chosen = set(targets)
    from ..models.registry import UNGATED
    from ..models.shapes import is_mla
    for fused, parts in (LFM2_FUSED if model_config.model_type in ("lfm2", "lfm2_moe") else FUSED).items():
        if fused == "qkv_proj" and is_mla(model_config):  # (MLA's q_proj a layer of its own)
            continue
        if fused == "gate_up_proj" and model_config.model_type in UNGATED:  # (no fused MLP: up_proj a layer of its
            continue  # own; q, k and v still one fused layer)
        named = [p for p in parts if p in chosen]
        if fused in chosen:
            chosen.update(parts)
        elif named and len(named) < len(parts):
            rest = [p for p in parts if p not in chosen]
            raise ConfigError(f"{FLAG} names {', '.join(named)} but not {', '.join(rest)}: infer computes "
                              f"{', '.join(parts)} as one fused layer ({fused}) whose adapter slots hold all of them",
                              f"name all of {', '.join(parts)}, or {fused}")
        elif named:
            chosen.add(fused)
    return frozenset(chosen)


def slot_scope(targets: list[str] | None) -> str:
    """Where the adapter slots are, for a message: "every layer", or the --lora-target-modules layers."""
    return "every layer" if targets is None else f"the layers of {FLAG} {','.join(targets)}"


def selects(chosen: frozenset[str] | None, proj: str) -> bool:
    """Whether a selection (check_target_modules) gives slots to the projection `proj` as lora.adapter names it
    (q_proj, qkv_proj, shared_expert.gate_proj, experts.down_proj ...)."""
    if chosen is None:
        return True
    head, _, leaf = proj.rpartition(".")
    if head == EXPERTS:
        return EXPERTS in chosen
    return leaf in chosen or (head == SHARED and SHARED in chosen)


def selects_as(chosen: frozenset[str] | None, proj: str) -> bool:
    """selects(chosen, proj), where an MLP without gate's layers count as the dense MLP's (memory.sizes: a selected
    up_proj or c_fc as gate_up_proj, c_proj as down_proj), and Granite's shared MLP's too (input_linear as
    gate_up_proj, output_linear as down_proj), for the sizes of their slots and temporaries."""
    if chosen is None or proj.rpartition(".")[2] not in _SLOTS_AS:
        return selects(chosen, proj)
    head = proj.rpartition(".")[0]
    return any(selects(chosen, f"{head}.{p}" if head else p) for p in _SLOTS_AS[proj.rpartition(".")[2]])


def target_name(proj: str, ungated: bool = False) -> str:
    """The --lora-target-modules name that selects `proj` (the fused layer's, for a fused projection; `ungated`: of
    a model whose MLP has no gate, whose up_proj is a layer of its own)."""
    head, _, leaf = proj.rpartition(".")
    if head == EXPERTS:
        return EXPERTS
    if ungated and leaf not in FUSED["qkv_proj"]:  # (its up_proj a layer of its own; q, k, v fused as Llama's)
        return leaf
    return next((fused for fused, parts in FUSED.items() if leaf in parts), leaf)


def module_proj(name: str) -> str:
    """A base module path's projection as lora.adapter names it: model.layers.0.self_attn.q_proj -> q_proj,
    model.layers.1.mlp.shared_expert.up_proj -> shared_expert.up_proj (GLM-4.5's mlp.shared_experts.up_proj too, and
    Hunyuan MoE's mlp.shared_mlp.up_proj), model.layers.1.mlp.experts.down_proj -> experts.down_proj."""
    parts = name.split(".")
    # (Hunyuan MoE's mlp.shared_mlp; Granite's shared_mlp, a module of the layer itself, keeps input_linear's names)
    if len(parts) > 2 and parts[-2] == "shared_mlp" and parts[-3] == "mlp":
        return f"{SHARED}.{parts[-1]}"
    if len(parts) > 1 and parts[-2] == SHARED + "s":
        return f"{SHARED}.{parts[-1]}"
    return ".".join(parts[-2:]) if len(parts) > 1 and parts[-2] in (SHARED, EXPERTS) else parts[-1]


def check_adapter_targets(name: str, modules, chosen: frozenset[str] | None, given: list[str] | None,
                          ungated: bool = False) -> None:
    """LoRAError when adapter `name` has weights (its `modules`: base module path -> module) on a layer the
    selection gives no slots: served without them, it would compute other tokens than peft. `ungated`: the base's
    MLP has no gate (target_name)."""
    outside = [m for m in modules if not selects(chosen, module_proj(m))]
    if not outside:
        return
    order = {n: i for i, n in enumerate(ALL_NAMES)}  # (the projections in the order the flag's help lists them)
    projs = sorted(dict.fromkeys(module_proj(m) for m in outside),
                   key=lambda p: (order.get(target_name(p, ungated), 0), order.get(p.rpartition(".")[2], 0)))
    names = list(dict.fromkeys(target_name(p, ungated) for p in projs))
    raise LoRAError(f"LoRA adapter {name!r} has weights on {', '.join(projs)} ({len(outside)} module(s), e.g. "
                    f"{outside[0]}), which {FLAG} {','.join(given or [])} leaves without adapter slots",
                    f"add {', '.join(names)} to {FLAG}, or serve an adapter trained on those modules only")
