"""What `infer lora-validate` checks: every adapter's static fit to a base model, then its numbers against peft.

Static: `adapter_problems` (config, tensors, shapes, rank limit) plus a summary of rank, alpha, effective scaling,
rslora, targets and shapes. Numeric (only for adapters without static problems): infer's engine generates a few
greedy steps for fixed prompts with the adapter, keeping the last-token logits of every step; peft runs the same
tokens (teacher forcing) on a transformers float model of the base — the checkpoint itself for a float base, the
engine's own dequantized int4 weights for a GPTQ base — and the report gives max |infer - peft| over those logits
and whether every greedy token agrees.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError, LoRAError
from .adapter import PROJECTIONS, Problem, adapter_problems, expected_shapes, module_scaling, read_adapter

PROMPTS = ("The quick brown fox", "Hello, my name is", "1, 2, 3, 4,")


@dataclass
class NumericCheck:
    max_abs_diff: float  # max |infer - peft| over the last-token logits of every step and prompt
    tolerance: float
    tokens_agree: bool  # every greedy token of infer is peft's argmax too
    adapter_effect: float  # max |peft with adapter - peft without| on the same logits (0 = the check proves nothing)
    oracle: str

    @property
    def ok(self) -> bool:
        return self.tokens_agree and self.max_abs_diff <= self.tolerance


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
    problems: list[Problem] = field(default_factory=list)
    numeric: NumericCheck | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and (self.numeric is None or self.numeric.ok)

    def reasons(self) -> list[str]:
        out = [str(p) for p in self.problems]
        n = self.numeric
        if n is not None and not n.tokens_agree:
            out.append("greedy tokens differ from peft's (the adapter is not applied as peft applies it)")
        if n is not None and n.max_abs_diff > n.tolerance:
            out.append(f"logits differ from peft's by {n.max_abs_diff:.3g} (tolerance {n.tolerance:.3g})")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["problems"] = [str(p) for p in self.problems]
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
        out[name] = Path(path).expanduser()
    return out


def static_report(name: str, path: Path, base_config, max_rank: int | None) -> AdapterReport:
    prefix = f"LoRA adapter {name!r} ({Path(path).expanduser()}): "  # the report names the adapter already
    problems = [Problem(p.message.removeprefix(prefix), p.hint) for p in adapter_problems(name, path, base_config,
                                                                                          max_rank)]
    report = AdapterReport(name, str(path), problems=problems)
    try:
        adapter = read_adapter(name, path)
    except LoRAError:
        return report  # the reason is already among the problems
    cfg = adapter.config
    report.rank, report.alpha, report.rslora = cfg["r"], cfg["lora_alpha"], bool(cfg.get("use_rslora"))
    scalings = sorted({round(m.scaling, 6) for m in adapter.modules.values()}) or [module_scaling(cfg, "")[1]]
    report.scaling = f"{scalings[0]:g}" if len(scalings) == 1 else f"{scalings[0]:g}..{scalings[-1]:g}"
    found = {m.proj for m in adapter.modules.values()}
    report.targets = [p for p in PROJECTIONS if p in found] or _config_targets(cfg)
    report.shapes = shape_summary(adapter, base_config)
    return report


def _config_targets(cfg: dict) -> list[str]:
    t = cfg.get("target_modules") or []
    return [t] if isinstance(t, str) else [str(x) for x in t]


def shape_summary(adapter, base_config) -> str:
    """'ok', or the first projection whose in/out features (or layer) do not fit the base."""
    want = expected_shapes(base_config)
    layers = getattr(base_config, "num_hidden_layers", None)
    for m in adapter.modules.values():
        if layers is not None and m.layer >= layers:
            return f"layer {m.layer} >= base's {layers}"
        got = (m.lora_a.shape[1], m.lora_b.shape[0])
        if got != want[m.proj]:
            return f"{m.proj} {got[0]}->{got[1]}, base {want[m.proj][0]}->{want[m.proj][1]}"
    return "ok"


# ---------------------------------------------------------------------------------------------- numeric check
@contextmanager
def _captured_logits(model):
    """Record every `compute_logits` result of the engine's model while the block runs."""
    seen: list[torch.Tensor] = []
    original = model.compute_logits

    def capture(hidden):
        logits = original(hidden)
        seen.append(logits.detach().float().cpu())
        return logits

    model.compute_logits = capture
    try:
        yield seen
    finally:
        del model.compute_logits  # back to the class's method


def _prompt_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    return [p for p in ids if p] or [[1, 2, 3, 4]]


def engine_for(base_path: Path, adapters: dict[str, Path], max_rank: int, steps: int, device: str):
    """infer's LLM with the adapters registered, sized for the check's short prompts (float32)."""
    from ..engine.llm import LLM
    need = 64 + steps
    return LLM(str(base_path), loras={n: str(p) for n, p in adapters.items()}, max_loras=max(1, len(adapters)),
               max_lora_rank=max_rank, dtype="float32", device=device, max_model_len=need,
               num_kv_blocks=2 * math.ceil(need / 16) + 2, max_num_seqs=2, enable_prefix_caching=False)


def infer_logits(llm, name: str, prompts: list[list[int]], steps: int) -> list[tuple[list[int], torch.Tensor]]:
    """(greedy tokens, [steps, V] last-token logits) for every prompt, run by infer's engine with adapter `name`."""
    from ..engine.sampling_params import SamplingParams
    out = []
    for p in prompts:
        with _captured_logits(llm.engine.runner.model) as seen:
            res = llm.generate([p], SamplingParams(max_new_tokens=steps, ignore_eos=True), lora=name)[0]
        assert all(t.shape[0] == 1 for t in seen) and len(seen) == steps, "one logits row per step expected"
        out.append((res.token_ids, torch.cat(seen)))
    return out


def oracle_model(base_path: Path, gptq: bool, engine_model=None):
    """The transformers float32 model peft runs on: the checkpoint itself, or for a GPTQ base a model built from its
    config whose weights are the engine's dequantized int4 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if not gptq:
        return AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, local_files_only=True).eval()
    cfg = copy.deepcopy(AutoConfig.from_pretrained(base_path, local_files_only=True))
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    copy_dequantized(engine_model, model)
    return model


def dequantized_state(engine_model) -> dict[str, torch.Tensor]:
    """The engine model's weights under Hugging Face names, merged layers split and int4 weights dequantized."""
    from ..models.layers import MergedLinear
    state: dict[str, torch.Tensor] = {}
    merged = {n for n, m in engine_model.named_modules() if isinstance(m, MergedLinear)}
    for mod in engine_model.modules():
        if isinstance(mod, MergedLinear):
            w = mod.dequantized_weight().float().cpu()
            b = mod.bias.float().cpu() if mod.bias is not None else None
            for i, (name, size) in enumerate(zip(mod.names, mod.out_sizes)):
                start = mod.shard_offset(i)
                state[f"{name}.weight"] = w[start:start + size]
                if b is not None:
                    state[f"{name}.bias"] = b[start:start + size]
    for key, p in engine_model.named_parameters():
        if key.rpartition(".")[0] not in merged:
            state[key if key.startswith("lm_head.") else f"model.{key}"] = p.float().cpu()
    return state


def copy_dequantized(engine_model, hf_model) -> None:
    state = dequantized_state(engine_model)
    params = dict(hf_model.named_parameters())
    if "lm_head.weight" not in state and "lm_head.weight" in params:  # tied embeddings
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(params) - set(state))
    if missing:
        raise LoRAError(f"cannot build the float oracle: no weight for {missing[0]}",
                        "this architecture's layout is not supported by lora-validate")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(state[k].view_as(p))


def peft_check(oracle, name: str, path: Path, runs, tol_scale: float, label: str) -> NumericCheck:
    """Teacher-force infer's tokens through peft (adapter on, then off) and compare the logits of every step."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(oracle, str(path), adapter_name=name).eval()
    diff = effect = 0.0
    agree, scale = True, 1.0
    try:
        with torch.no_grad():
            for (prompt, tokens), ours in runs:
                ids = torch.tensor([prompt + tokens[:-1]])
                pos = slice(len(prompt) - 1, len(prompt) - 1 + len(tokens))
                ref = model(input_ids=ids).logits[0, pos].float()
                with model.disable_adapter():
                    base = model(input_ids=ids).logits[0, pos].float()
                diff = max(diff, (ours - ref).abs().max().item())
                effect = max(effect, (ref - base).abs().max().item())
                scale = max(scale, ref.abs().max().item())
                agree = agree and ref.argmax(-1).tolist() == tokens
    finally:
        model.unload()  # the oracle gets its plain layers back for the next adapter
    return NumericCheck(diff, tol_scale * scale, agree, effect, label)


def numeric_checks(base_path: Path, gptq: bool, adapters: dict[str, Path], max_rank: int, steps: int = 8,
                   device: str = "auto") -> dict[str, NumericCheck]:
    """infer vs peft for every adapter (all must have passed the static checks)."""
    if not adapters:
        return {}
    llm = engine_for(base_path, adapters, max_rank, steps, device)
    prompts = _prompt_ids(llm.tokenizer)
    runs = {name: [((p, toks), logits) for p, (toks, logits) in zip(prompts, infer_logits(llm, name, prompts, steps))]
            for name in adapters}
    oracle = oracle_model(base_path, gptq, llm.engine.runner.model)
    label = "peft on the dequantized int4 base" if gptq else "peft on the float base"
    tol = 1e-3 if llm.engine.device.type == "cpu" else 1e-2  # GPU kernels may use TF32 products
    return {name: peft_check(oracle, name, path, runs[name], tol, label) for name, path in adapters.items()}


@dataclass
class BaseInfo:
    path: Path
    config: object  # the transformers config
    gptq: str | None  # e.g. "GPTQ 4-bit, group 128"; None for a float base


def read_base(base: str, quantized: bool = False) -> BaseInfo:
    """The base model folder (or built-in name), its config and quantization; ModelLoadError/ConfigError (exit 2)."""
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    from ..quant.config import GPTQConfig
    path = resolve_model(base)
    cfg = load_config(path)
    q = GPTQConfig.from_model_dir(path)
    if quantized and q is None:
        raise ConfigError(f"--quantized: {path} is a float model (config.json has no quantization_config)",
                          f"quantize it first (infer quantize {base} -o BASE-gptq) and validate against that folder")
    label = None if q is None else f"GPTQ {q.bits}-bit, group {q.group_size}"
    return BaseInfo(path, cfg, label)


def validate(base: str, adapter_args: list[str], quantized: bool = False, max_rank: int = 64, steps: int = 8,
             device: str = "auto") -> tuple[BaseInfo, list[AdapterReport]]:
    """Static checks for every adapter, then the numeric check for those without problems (steps=0 skips it)."""
    info = read_base(base, quantized)
    adapters = parse_adapter_args(adapter_args)
    reports = [static_report(n, p, info.config, max_rank) for n, p in adapters.items()]
    clean = {r.name: adapters[r.name] for r in reports if not r.problems}
    if steps > 0:
        checks = numeric_checks(info.path, info.gptq is not None, clean, max_rank, steps, device)
        for r in reports:
            r.numeric = checks.get(r.name)
    return info, reports
