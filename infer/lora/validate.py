"""What `infer lora-validate` checks statically: every adapter's fit to a base model, without running either.

`static_reports` reads the base and every adapter and gives one `AdapterReport` each: rank, alpha, effective
scaling, rslora, targets, a shape summary, every problem (config, tensors, rank limit), and a warning when the
adapter names another base model. Shape mismatches (an adapter made for another base) are kept apart and summarised
in one line per adapter; `reasons(verbose=True)` lists every module. The numeric check (infer's engine against
peft) runs the engine, so it lives beside the command, in `infer.cli.lora_check`; its result lands in `numeric`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ConfigError, LoRAError
from ..models.registry import UNGATED
from .adapter import PROJECTIONS, Problem, expected_shapes, layer_count, module_scaling, read_adapter
from .targets import check_adapter_targets, check_target_modules

# projections whose input is the hidden state (Phi-3's fused ones too)
_HIDDEN_IN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
_QUANT_SUFFIX = re.compile(r"[-_.](gptq|awq|int4|int8|4bit|8bit|w4a16|quantized|v\d+)$")


@dataclass
class NumericCheck:
    max_abs_diff: float  # max |infer - peft| over the last-token logits of every step and prompt
    tolerance: float
    tokens_agree: bool  # every greedy token of infer is peft's argmax too
    adapter_effect: float  # max |peft with adapter - peft without| on the same logits (0 = the check proves nothing)
    oracle: str
    non_finite: str | None = None  # whose logits held NaN/inf ("infer's", "peft's", "infer's and peft's"), if any

    @property
    def ok(self) -> bool:
        return self.non_finite is None and self.tokens_agree and self.max_abs_diff <= self.tolerance


@dataclass
class AdapterReport:
    name: str
    path: str
    rank: int | None = None
    alpha: float | None = None
    scaling: str = "-"
    rslora: bool | None = None
    targets: list[str] = field(default_factory=list)
    shapes: str = "-"
    problems: list[Problem] = field(default_factory=list)  # everything but the per-module size mismatches
    size_problems: list[Problem] = field(default_factory=list)  # one per module whose sizes do not fit the base
    size_mismatch: str | None = None  # those, in one line
    warnings: list[str] = field(default_factory=list)
    numeric: NumericCheck | None = None

    @property
    def static_ok(self) -> bool:
        return not self.problems and not self.size_problems

    @property
    def ok(self) -> bool:
        return self.static_ok and (self.numeric is None or self.numeric.ok)

    def reasons(self, verbose: bool = False) -> list[str]:
        """Why it fails, one line each; a size mismatch is one line unless `verbose`."""
        out = [str(p) for p in self.problems]
        if self.size_problems:
            out += [str(p) for p in self.size_problems] if verbose else [self.size_mismatch]
        n = self.numeric
        if n is not None and n.non_finite:  # the numbers below would compare NaN with NaN: say this alone
            return out + [f"{n.non_finite} logits with the adapter are not finite (NaN/inf): its weights overflow "
                          "the model's activations; use another checkpoint"]
        if n is not None and not n.ok and n.adapter_effect == 0.0:  # peft's adapter changed nothing: it read no weights
            out.append("peft loaded none of its weights (with the adapter on, peft's logits equal the base's): "
                       "tensor names peft does not expect (e.g. lora_A.default.weight, or no base_model.model. "
                       "prefix); save the adapter again with peft")
        if n is not None and not n.tokens_agree:
            out.append("greedy tokens differ from peft's (the adapter is not applied as peft applies it)")
        if n is not None and n.max_abs_diff > n.tolerance:
            out.append(f"logits differ from peft's by {n.max_abs_diff:.3g} (tolerance {n.tolerance:.3g})")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["problems"] = [str(p) for p in self.problems + self.size_problems]
        del d["size_problems"]
        d["ok"], d["reasons"] = self.ok, self.reasons()
        return d


def parse_adapter_args(items: list[str]) -> dict[str, Path]:
    """NAME=PATH or PATH (the name is the folder's name) -> {name: path}."""
    out: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or Path(item).exists():
            name, path = Path(item).expanduser().resolve().name, item
        if not name or not path:
            raise ConfigError(f"adapter {item!r} is not NAME=PATH or PATH", "e.g. support=./adapters/support")
        if name in out:
            raise ConfigError(f"adapter name {name!r} is given twice", "name them: NAME=PATH")
        # a path typed with ./ or ../ is local: absolute, so that a missing one is not read as a hub id ORG/NAME
        # (Path("./adapters/x") drops the ./)
        local = path.startswith(("./", "../", ".\\", "..\\"))
        out[name] = Path(os.path.abspath(path)) if local else Path(path).expanduser()
    return out


def static_report(name: str, path: Path, base_config, max_rank: int | None, base: "BaseInfo | None" = None,
                  given: str | None = None, target_modules: list[str] | None = None) -> AdapterReport:
    """Everything `lora-validate` can say about one adapter without running it (`base`/`given`: for the warning
    about an adapter that names another base model; `target_modules`: --lora-target-modules, whose slots it must
    fit in)."""
    report = AdapterReport(name, str(path))
    try:
        adapter = read_adapter(name, path)
    except LoRAError as e:
        prefix = f"LoRA adapter {name!r} ({Path(path).expanduser()}): "  # the report names the adapter already
        report.problems = [Problem(e.message.removeprefix(prefix), e.hint or "")]
        return report
    spelled = adapter.config.get("peft_type")
    if spelled != "LORA":  # infer reads "lora" too; peft's PEFT_TYPE_TO_CONFIG_MAPPING only "LORA" (a KeyError)
        report.problems.append(Problem(f"peft_type is {json.dumps(spelled)}: peft reads only \"LORA\" and cannot "
                                       "load it", 'write "peft_type": "LORA" in adapter_config.json'))
    misfits = _misfit_modules(adapter, base_config)
    for p in adapter.validate_against(base_config, max_rank):
        is_size = any(p.message.startswith(f"{m} ") for m in misfits)
        (report.size_problems if is_size else report.problems).append(p)
    if report.size_problems:
        report.size_mismatch = size_mismatch_line(adapter, base_config, len(report.size_problems))
    try:
        check_adapter_targets(name, adapter.modules, check_target_modules(target_modules, base_config),
                              target_modules, getattr(base_config, "model_type", None) in UNGATED)
    except LoRAError as e:
        report.problems.append(Problem(e.message.removeprefix(f"LoRA adapter {name!r} "), e.hint or ""))
    cfg = adapter.config
    # the largest rank over its modules (rank_pattern may raise it above r): what --max-lora-rank must hold
    report.rank, report.alpha, report.rslora = adapter.rank or cfg["r"], cfg["lora_alpha"], bool(cfg.get("use_rslora"))
    scalings = sorted({round(m.scaling, 6) for m in adapter.modules.values()}) or [module_scaling(cfg, "")[1]]
    report.scaling = f"{scalings[0]:g}" if len(scalings) == 1 else f"{scalings[0]:g}..{scalings[-1]:g}"
    found = {m.proj for m in adapter.modules.values()}
    # (a mixture of experts' shared expert and stacked experts after the projections: shared_expert.gate_proj, ...)
    report.targets = [p for p in PROJECTIONS if p in found] + sorted(found - set(PROJECTIONS)) or _config_targets(cfg)
    report.shapes = shape_summary(adapter, base_config)
    if base is not None:
        warnings = [base_name_warning(name, cfg, base, given or str(base.path)), range_warning(adapter, base)]
        report.warnings = [w for w in warnings if w]
    return report


def served_dtype(base: "BaseInfo"):
    """The dtype a GPU engine serves BASE in with --dtype auto: the checkpoint's float16/bfloat16, else float16
    (as engine.config.EngineConfig.torch_dtype on a CUDA device)."""
    import torch
    d = getattr(base.config, "dtype", None) or getattr(base.config, "torch_dtype", None)
    d = getattr(torch, d, None) if isinstance(d, str) else d
    return d if d in (torch.float16, torch.bfloat16) else torch.float16


def range_warning(adapter, base: "BaseInfo") -> str | None:
    """A warning when a weight of the adapter is beyond the range of the dtype a GPU serves BASE in (a float32
    adapter on a float16 base): `--lora` refuses it there (cast, it would be inf), while the numeric check here runs
    in float32 and passes."""
    import torch
    dtype = served_dtype(base)
    limit = torch.finfo(dtype).max
    for m in adapter.modules.values():
        for kind, t in (("lora_A", m.lora_a), ("lora_B", m.lora_b)):
            if not t.is_floating_point() or t.numel() == 0:
                continue
            largest = t.float().abs().max().item() if t.element_size() == 1 else t.abs().max().item()
            if largest > limit:
                name = str(dtype).removeprefix("torch.")
                return (f"adapter {adapter.name!r}: {m.name}: {kind} holds values up to {largest:.3g}, beyond "
                        f"{name}'s range ({limit:.5g}): a GPU engine serves this base in {name} (--dtype auto) and "
                        "refuses the adapter there; serve it with --dtype "
                        f"{'bfloat16 or float32' if dtype == torch.float16 else 'float32'}")
    return None


def _config_targets(cfg: dict) -> list[str]:
    t = cfg.get("target_modules") or []
    return [t] if isinstance(t, str) else [str(x) for x in t]


def _misfit_modules(adapter, base_config) -> set[str]:
    want = expected_shapes(base_config)
    layers = layer_count(adapter.config, base_config) if hasattr(base_config, "num_hidden_layers") else None
    return {m.name for m in adapter.modules.values()
            if (layers is not None and m.layer >= layers) or (m.in_features, m.out_features) != want.get(m.proj)}


def shape_summary(adapter, base_config) -> str:
    """'ok', or the first projection whose in/out features (or layer) do not fit the base."""
    want = expected_shapes(base_config)
    layers = layer_count(adapter.config, base_config) if hasattr(base_config, "num_hidden_layers") else None
    for m in adapter.modules.values():
        if layers is not None and m.layer >= layers:
            return f"layer {m.layer} >= base's {layers}"
        got = (m.in_features, m.out_features)
        if m.proj not in want:
            return f"{m.proj}: the base has none"
        if got != want[m.proj]:
            return f"{m.proj} {got[0]}->{got[1]}, base {want[m.proj][0]}->{want[m.proj][1]}"
    return "ok"


def size_mismatch_line(adapter, base_config, count: int) -> str:
    """One line for an adapter made for a base of other sizes, e.g. 'r=16 adapter expects hidden 2048, base has 64
    (18 modules)'."""
    hidden = inter = None
    deepest = max((m.layer for m in adapter.modules.values()), default=-1)
    for m in adapter.modules.values():
        if m.proj.startswith(("experts.", "shared_expert.")):  # (widths of their own: expert_size, shared)
            continue
        a_in, b_out = m.in_features, m.out_features
        hidden = hidden or (a_in if m.proj in _HIDDEN_IN else b_out)
        if m.proj in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"):
            inter = inter or {"down_proj": a_in, "gate_up_proj": b_out // 2}.get(m.proj, b_out)
    base_hidden = getattr(base_config, "hidden_size", None)
    base_inter = getattr(base_config, "intermediate_size", None)
    base_layers = getattr(base_config, "num_hidden_layers", None)
    parts = [f"hidden {hidden}, base has {base_hidden}"] if hidden != base_hidden else []
    if inter is not None and inter != base_inter:
        parts.append(f"intermediate {inter}, base has {base_inter}")
    if base_layers is not None and deepest >= base_layers:
        parts.append(f"{deepest + 1} layers, base has {base_layers}")
    what = "; ".join(parts) or f"other projection sizes ({shape_summary(adapter, base_config)})"
    return (f"r={adapter.rank} adapter expects {what} ({count} modules): it was made for another base model "
            f"(--verbose lists every module)")


def _model_key(name: str) -> str:
    """'org/Llama-2-7b-GPTQ' and '/models/llama-2-7b' -> 'llama-2-7b': the model's name without folder,
    quantization or built-in version suffix."""
    key = name.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1].lower()
    while _QUANT_SUFFIX.search(key):
        key = _QUANT_SUFFIX.sub("", key)
    return key


def _same_folder(named: str, path: str | Path) -> bool:
    try:
        return Path(named).expanduser().resolve() == Path(path).expanduser().resolve()
    except OSError:
        return False


def base_name_warning(name: str, cfg: dict, base: "BaseInfo", given: str) -> str | None:
    """A warning when the adapter's base_model_name_or_path names another model than BASE (None when it names
    nothing, the same folder, the same model under a quantized or versioned name, or the model a GPTQ or AWQ BASE
    records it was quantized from)."""
    from ..quant.convert import recorded_source
    named = cfg.get("base_model_name_or_path")
    if not isinstance(named, str) or not named.strip():
        return None
    source = recorded_source(base.path)  # the model a GPTQ/AWQ base was quantized from: its weights, an adapter's base
    if _same_folder(named, base.path) or (source and _same_folder(named, source)):
        return None
    if _model_key(named) in {_model_key(n) for n in (given, str(base.path), source) if n}:
        return None
    return (f"adapter {name!r} was trained on {named!r}, not on {given}: its sizes may fit, but its weights were "
            f"learned for another model")


@dataclass
class BaseInfo:
    path: Path
    config: object  # the transformers config
    gptq: str | None  # e.g. "GPTQ 4-bit, group 128" ("AWQ ..." for an AWQ base); None for a float base
    name: str = ""  # what a title names: a built-in or hub id as typed, a local folder's name (default: path's name)


def read_base(base: str, quantized: bool = False) -> BaseInfo:
    """The base model folder (or built-in name), its config and quantization; ModelLoadError/ConfigError (exit 2)."""
    from ..models.loader import load_config
    from ..models.resolve import resolve_model, typed_name
    from ..quant.config import GPTQConfig
    path = resolve_model(base)
    cfg = load_config(path)
    q = GPTQConfig.from_model_dir(path)
    if quantized and q is None:
        raise ConfigError(f"--quantized: {path} is a float model (config.json has no quantization_config)",
                          f"quantize it first (infer quantize {base} -o BASE-gptq) and validate against that folder")
    label = None if q is None else f"{'AWQ' if q.quant_method == 'awq' else 'GPTQ'} {q.bits}-bit, group {q.group_size}"
    return BaseInfo(path, cfg, label, typed_name(base) or path.name)


def static_reports(base: str, adapter_args: list[str], quantized: bool = False, max_rank: int = 64,
                   target_modules: list[str] | None = None):
    """(BaseInfo, one static AdapterReport per adapter, {name: path}); ConfigError (exit 2) for --lora-target-modules
    the base has no layers of."""
    info = read_base(base, quantized)
    check_target_modules(target_modules, info.config)
    adapters = parse_adapter_args(adapter_args)
    reports = [static_report(n, p, info.config, max_rank, info, base, target_modules=target_modules)
               for n, p in adapters.items()]
    return info, reports, adapters
