"""The numeric half of `infer lora-validate`: infer's engine against peft on the same base, adapter by adapter.

infer's engine generates a few greedy steps for fixed prompts with the adapter, keeping the last-token logits of
every step; peft runs the same tokens (teacher forcing) on a transformers float model of the base — the checkpoint
itself for a float base, the engine's own dequantized int4 weights for a GPTQ base — and the check gives
max |infer - peft| over those logits and whether every greedy token agrees. It lives beside its command because it
runs the engine: the library's `infer.lora.validate` keeps to the static checks.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import ConfigError, LoRAError
from ..lora.validate import NumericCheck

PROMPTS = ("The quick brown fox", "Hello, my name is", "1, 2, 3, 4,")


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


def engine_for(base_path: Path, adapters: dict[str, Path], max_rank: int, steps: int, device: str,
               target_modules: list[str] | None = None):
    """infer's LLM with the adapters registered, sized for the check's short prompts (float32). One device slot:
    the adapters run one after the other, so slots for all of them (float32, --max-lora-rank on every layer) would
    only take memory, and on a large base fail the start naming --max-loras, an option lora-validate has not.
    `target_modules`: --lora-target-modules, as it will be served."""
    from ..engine.llm import LLM
    from ..models.limits import layer_groups
    from ..models.loader import load_config
    need = context_for(base_path, steps)
    # a model of mixed layers (Gemma 2 and 3, OLMo 3) holds a sequence's blocks in each of its KV layer groups
    groups = layer_groups(load_config(base_path))
    blocks = (2 * math.ceil(need / 16) + 2) * (1 if groups is None else len(groups[1]))
    return LLM(str(base_path), loras={n: str(p) for n, p in adapters.items()}, max_loras=1,
               lora_target_modules=target_modules,
               max_lora_rank=max_rank, dtype="float32", device=device, max_model_len=need,
               num_kv_blocks=blocks, max_num_seqs=2, enable_prefix_caching=False)


def context_for(base_path: Path, steps: int) -> int:
    """The context the check's engine is sized for: room for its short prompts and `steps`, within the model's."""
    from ..engine.setup import context_limit
    from ..models.loader import load_config
    return min(64 + steps, context_limit(load_config(base_path))[0])  # a sliding_window or longrope cap included


def _check_room(prompts: list[list[int]], steps: int, context: int) -> None:
    """The prompts and `steps` within the engine's context (the model's, when it is short), or --steps named."""
    longest = max(map(len, prompts))
    if longest + steps > context:
        raise ConfigError(f"--steps {steps} after the check's prompts of up to {longest} tokens needs a context of "
                          f"{longest + steps} tokens, the base model has {context}",
                          f"use --steps {max(0, context - longest)} or less (0: the static checks only)")


def infer_logits(llm, name: str, prompts: list[list[int]], steps: int) -> list[tuple[list[int], torch.Tensor]]:
    """(greedy tokens, [steps, V] last-token logits) for every prompt, run by infer's engine with adapter `name`."""
    from ..engine.sampling_params import SamplingParams
    out = []
    for p in prompts:
        with _captured_logits(llm.engine.runner.model) as seen:
            res = llm.generate([p], SamplingParams(max_new_tokens=steps, ignore_eos=True), lora=name)[0]
        logits, toks = torch.cat(seen), list(res.token_ids)
        if res.finish_reason == "error" and seen and not bool(logits[-1].isfinite().all()):
            # the engine ends a request whose logits are not finite: the rest of the steps as NaN rows (the numeric
            # check then names them), teacher-forced with token 0
            logits = torch.cat([logits, logits.new_full((steps - len(seen), logits.shape[1]), math.nan)])
            toks += [0] * (steps - len(toks))
        assert all(t.shape[0] == 1 for t in seen) and logits.shape[0] == steps, "one logits row per step expected"
        out.append((toks, logits))
    return out


def oracle_model(base_path: Path, gptq: bool, engine_model=None):
    """The transformers float32 model peft runs on: the checkpoint itself, or for a GPTQ base a model built from its
    config whose weights are the engine's dequantized int4 weights (a GPTQ mixture of experts: transformers' own load
    of the checkpoint's weights dequantized, dequantized_moe_oracle)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if not gptq:
        from ..quant.config import hf_load_options  # (the hub's gpt-oss: its MXFP4 experts dequantized, as infer's)
        return AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, local_files_only=True,
                                                    **hf_load_options(base_path)).eval()
    from ..models.moe import is_moe
    from ..quant.config import GPTQConfig
    qc = GPTQConfig.from_model_dir(base_path)
    if is_moe(getattr(engine_model, "config", None)) and qc is not None and qc.quant_method == "gptq":
        return dequantized_moe_oracle(base_path, qc, getattr(engine_model, "quantized_head", False))
    cfg = copy.deepcopy(AutoConfig.from_pretrained(base_path, local_files_only=True))
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    if getattr(engine_model, "quantized_head", False):  # a GPTQ head is stored on its own, tied or not
        cfg.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    copy_dequantized(engine_model, model)
    return model


def dequantized_moe_oracle(base_path: Path, qc, quantized_head: bool):
    """transformers' float32 model of a GPTQ mixture of experts: every GPTQ layer of the checkpoint dequantized as
    infer's engine dequantizes it (kernels.packing.dequantize: the product in the scales' precision, so its fp16
    copy is exact), written with the other tensors as the float checkpoint it was quantized from (the experts one
    by one, experts.N.gate_proj.weight ...) into a temporary folder, and loaded from there, so transformers stacks
    the experts (and reads the routers and their score biases, whatever their names) as it loads any checkpoint of
    the family. The families whose experts transformers reads stacked alone get them stacked here as it stores them
    (`_stack_experts`): Granite's block_sparse_moe.input_linear (gate rows then up rows) and output_linear, Llama 4's
    feed_forward.experts.gate_up_proj [E, H, 2I] (gate columns then up) and down_proj [E, I, H], gpt-oss's
    mlp.experts.gate_up_proj (the halves GPTQModel split it into, concatenated back) and down_proj with their
    biases. The folder takes the model's size in the scales' dtype while it loads."""
    import json
    import re
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ..kernels.packing import dequantize
    from ..quant.convert import copy_tokenizer_files, load_weight_file, weight_files
    fields = (".qweight", ".qzeros", ".scales", ".g_idx")
    config = json.loads((Path(base_path) / "config.json").read_text())
    family = config.get("model_type")
    family = "granite" if family in ("granitemoe", "granitemoeshared", "granitemoehybrid") else family
    block = _STACKED_EXPERTS.get(family)
    expert = re.compile(block + r"\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)") if block else None
    with tempfile.TemporaryDirectory(prefix="infer-lora-oracle-") as tmp:
        written, experts = {}, {}
        for i, f in enumerate(weight_files(base_path)):
            tensors = load_weight_file(f)
            out = {}
            for k, t in tensors.items():
                m = expert.fullmatch(k) if expert else None
                if m:  # (an expert's bias: gpt-oss's)
                    experts.setdefault(m[1], {})[(int(m[2]), m[3], m[4])] = t
                elif not k.endswith(fields):
                    out[k] = t
            for k in [k for k in tensors if k.endswith(".qweight")]:
                prefix = k[: -len(".qweight")]
                qweight, scales = tensors[k], tensors[prefix + ".scales"]
                g_idx = tensors.get(prefix + ".g_idx")
                bits = qc.bits if g_idx is None else 32 * qweight.shape[0] // g_idx.numel()  # (dynamic rules' own)
                if g_idx is None:  # (a checkpoint without g_idx: the plain groups)
                    k_in = qweight.shape[0] * 32 // bits
                    g_idx = torch.arange(k_in) // (k_in // scales.shape[0])
                w = dequantize(qweight, tensors[prefix + ".qzeros"], scales, g_idx, bits, qc.zeros_v1, scales.dtype)
                m = expert.fullmatch(prefix + ".weight") if expert else None
                if m:
                    experts.setdefault(m[1], {})[(int(m[2]), m[3], "weight")] = w
                else:
                    out[prefix + ".weight"] = w
            name = f"model-{i:05d}.safetensors"
            save_file(out, str(Path(tmp) / name), metadata={"format": "pt"})
            written.update(dict.fromkeys(out, name))
        if experts:
            stacked = {}
            for at, ws in experts.items():
                stacked.update(_stack_experts(family, at, ws))
            save_file(stacked, str(Path(tmp) / "model-experts.safetensors"), metadata={"format": "pt"})
            written.update(dict.fromkeys(stacked, "model-experts.safetensors"))
        (Path(tmp) / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": written}))
        config.pop("quantization_config", None)
        if quantized_head:  # a GPTQ head is stored on its own, tied or not
            config["tie_word_embeddings"] = False
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        copy_tokenizer_files(base_path, Path(tmp))
        try:
            model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, local_files_only=True,
                                                               output_loading_info=True)
        except Exception as e:
            raise LoRAError(f"cannot build the float oracle: transformers cannot load the dequantized {base_path}: "
                            f"{e}", "check the adapters with --steps 0 (the static checks alone), or against the "
                            "float model the checkpoint was quantized from") from e
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise LoRAError(f"cannot build the float oracle: transformers has no weight for {missing[0]} in the "
                        f"dequantized {base_path} (it does not read this family's GPTQ experts)",
                        "check the adapters with --steps 0 (the static checks alone), or against the float model "
                        "the checkpoint was quantized from")
    return model.eval()


# the families whose experts transformers reads only stacked: where their GPTQ experts lie (experts.N.gate_proj ...)
_STACKED_EXPERTS = {"granite": r"(.+\.block_sparse_moe)\.experts", "llama4_text": r"(.+\.feed_forward\.experts)",
                    "gpt_oss": r"(.+\.mlp\.experts)"}


def _stack_experts(family: str, at: str, ws: dict) -> dict[str, torch.Tensor]:
    """The experts at `at` (ws: {(expert, projection, "weight" | "bias"): tensor}, weights [out, in]) stacked as
    transformers stores this family's: Granite's [E, 2I, H] input_linear (gate rows, then up rows) and [E, H, I]
    output_linear under block_sparse_moe; Llama 4's gate_up_proj [E, H, 2I] (x @ W: gate columns, then up) and
    down_proj [E, I, H]; gpt-oss's the same, with gate_up_proj_bias [E, 2I] and down_proj_bias [E, H] (GPTQModel's
    gate_proj and up_proj of gpt-oss are the first and second halves of transformers' interleaved columns, as
    infer's loader stacks them: concatenated back, the interleaving is transformers' own)."""
    count = 1 + max(e for e, _, _ in ws)
    gate = [ws[(e, "gate_proj", "weight")] for e in range(count)]
    up = [ws[(e, "up_proj", "weight")] for e in range(count)]
    down = torch.stack([ws[(e, "down_proj", "weight")] for e in range(count)])
    if family == "granite":
        return {f"{at}.input_linear.weight": torch.stack([torch.cat(gu) for gu in zip(gate, up)]),
                f"{at}.output_linear.weight": down}
    stacked = {f"{at}.gate_up_proj": torch.stack([torch.cat(gu).t() for gu in zip(gate, up)]).contiguous(),
               f"{at}.down_proj": down.transpose(1, 2).contiguous()}
    if family == "gpt_oss":
        stacked[f"{at}.gate_up_proj_bias"] = torch.stack(
            [torch.cat([ws[(e, "gate_proj", "bias")], ws[(e, "up_proj", "bias")]]) for e in range(count)])
        stacked[f"{at}.down_proj_bias"] = torch.stack([ws[(e, "down_proj", "bias")] for e in range(count)])
    return stacked


def dequantized_state(engine_model) -> dict[str, torch.Tensor]:
    """The engine model's weights under Hugging Face names, merged layers split (a fused module's shards kept
    together, as its checkpoint stores them) and int4 weights dequantized."""
    from ..models.layers import MergedLinear
    state: dict[str, torch.Tensor] = {}
    merged = {n for n, m in engine_model.named_modules() if isinstance(m, MergedLinear)}
    for mod in engine_model.modules():
        if isinstance(mod, MergedLinear):
            w = mod.dequantized_weight().float().cpu()
            b = mod.bias.float().cpu() if mod.bias is not None else None
            for name in dict.fromkeys(mod.names):  # a fused module (Phi-3's qkv_proj): every shard's rows, stacked
                shards = [i for i, n in enumerate(mod.names) if n == name]
                start, end = mod.shard_offset(shards[0]), mod.shard_offset(shards[-1]) + mod.out_sizes[shards[-1]]
                state[f"{name}.weight"] = w[start:end]
                if b is not None:
                    state[f"{name}.bias"] = b[start:end]
    for key, p in engine_model.named_parameters():
        if key.rpartition(".")[0] not in merged:
            state[key if key.startswith("lm_head.") else f"model.{key}"] = p.float().cpu()
    return state


def copy_dequantized(engine_model, hf_model) -> None:
    state = dequantized_state(engine_model)
    params = dict(hf_model.named_parameters())
    if "lm_head.weight" not in state and "lm_head.weight" in params:  # tied embeddings
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    keys = {k: _engine_name(hf_model.config, k) for k in params}
    missing = sorted(k for k, key in keys.items() if key not in state)
    if missing:
        raise LoRAError(f"cannot build the float oracle: no weight for {missing[0]}",
                        "this architecture's layout is not supported by lora-validate")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(state[keys[k]].view_as(p))


def _engine_name(config, name: str) -> str:
    """transformers' parameter `name` as infer's model (dequantized_state) names it: Nemotron-H's model.embeddings
    and model.norm_f are infer's model.embed_tokens and model.norm (models.nemotron_h.checkpoint_name)."""
    if getattr(config, "model_type", None) == "nemotron_h":
        from ..models.nemotron_h import checkpoint_name
        return checkpoint_name(name)
    return name


def peft_check(oracle, name: str, path: Path, runs, tol_scale: float, label: str) -> NumericCheck:
    """Teacher-force infer's tokens through peft (adapter on, then off) and compare the logits of every step.
    A LoRAError when peft cannot load the adapter at all (e.g. a target_modules regex that matches no module)."""
    from ..quant.convert import load_peft
    try:
        model = load_peft(oracle, path, adapter_name=name).eval()  # (with lora_dropout 0, as peft serves it)
    except Exception as e:  # peft's own verdict on the folder (NoMatchingPeftModuleError, a state-dict error, ...)
        _strip_peft(oracle)  # a failure after injecting its layers must not leak them into the next adapter's check
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise LoRAError(f"peft cannot load it: {lines[0] if lines else type(e).__name__}",
                        "peft and the tools built on it refuse the adapter as saved; fix its adapter_config.json "
                        "or save it again with peft") from e
    diff = effect = 0.0
    agree, scale, bad = True, 1.0, set()
    try:
        with torch.no_grad():
            for (prompt, tokens), ours in runs:
                ids = torch.tensor([prompt + tokens[:-1]])
                pos = slice(len(prompt) - 1, len(prompt) - 1 + len(tokens))
                ref = model(input_ids=ids).logits[0, pos].float()
                with model.disable_adapter():
                    base = model(input_ids=ids).logits[0, pos].float()
                # max() would skip a NaN difference (NaN > x is false) and report the adapter as agreeing
                bad |= {who for who, t in (("infer's", ours), ("peft's", ref)) if not bool(t.isfinite().all())}
                diff = max(diff, (ours - ref).abs().max().item())
                effect = max(effect, (ref - base).abs().max().item())
                scale = max(scale, ref.abs().max().item())
                agree = agree and ref.argmax(-1).tolist() == tokens
    finally:
        model.unload()  # the oracle gets its plain layers back for the next adapter
    whose = " and ".join(w for w in ("infer's", "peft's") if w in bad) or None
    return NumericCheck(diff, tol_scale * scale, agree, effect, label, whose)


def _strip_peft(model) -> None:
    """Put back the plain layers in place of any peft layer a failed PeftModel.from_pretrained left in `model`."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    tuned = [n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
    outer = [n for n in tuned if not any(n.startswith(f"{t}.") for t in tuned)]
    for name in outer:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, getattr(parent, child).get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config


def numeric_checks(base_path: Path, gptq: bool, adapters: dict[str, Path], max_rank: int, steps: int = 8,
                   device: str = "auto",
                   target_modules: list[str] | None = None) -> dict[str, NumericCheck | LoRAError]:
    """infer vs peft for every adapter (all must have passed the static checks); a LoRAError for an adapter peft
    cannot load, so one such adapter fails its own row and the others are still checked."""
    if not adapters:
        return {}
    from ..engine.pooling import classifier_folder
    if classifier_folder(base_path):  # (its engine pools: no generation to compare, no lm_head for peft's logits)
        raise ConfigError(f"{base_path} is a classifier (a *ForSequenceClassification or *ForTokenClassification "
                          "model): lora-validate's "
                          "numeric check compares the logits of generated tokens with peft's, and a classifier "
                          "generates none", "give --steps 0 for the static checks alone")
    llm = engine_for(base_path, adapters, max_rank, steps, device, target_modules)
    prompts = _prompt_ids(llm.tokenizer)
    _check_room(prompts, steps, llm.engine.config.max_model_len)
    runs = {name: [((p, toks), logits) for p, (toks, logits) in zip(prompts, infer_logits(llm, name, prompts, steps))]
            for name in adapters}
    oracle = oracle_model(base_path, gptq, llm.engine.runner.model)
    label = "peft on the dequantized int4 base" if gptq else "peft on the float base"
    tol = 1e-3 if llm.engine.device.type == "cpu" else 1e-2  # GPU kernels may use TF32 products
    out: dict[str, NumericCheck | LoRAError] = {}
    for name, path in adapters.items():
        try:
            out[name] = peft_check(oracle, name, path, runs[name], tol, label)
        except LoRAError as e:
            out[name] = e
    return out


def run_checks(base: str, adapter_args: list[str], quantized: bool = False, max_rank: int = 64, steps: int = 8,
               device: str = "auto", target_modules: list[str] | None = None):
    """Static checks for every adapter, then the numeric check for those without problems (steps=0 skips it);
    `target_modules`: --lora-target-modules (an adapter with weights outside them fails)."""
    from ..lora.adapter import Problem
    from ..lora.validate import static_reports
    info, reports, paths = static_reports(base, adapter_args, quantized, max_rank, target_modules)
    clean = {r.name: paths[r.name] for r in reports if r.static_ok}
    if steps > 0:
        checks = numeric_checks(info.path, info.gptq is not None, clean, max_rank, steps, device, target_modules)
        for r in reports:
            check = checks.get(r.name)
            if isinstance(check, LoRAError):  # no numbers to show: the row FAILs with peft's reason
                r.problems.append(Problem(check.message, check.hint or ""))
            else:
                r.numeric = check
    return info, reports
