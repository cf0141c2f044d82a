"""Convert a Hugging Face model folder (.bin, sharded or safetensors) into (sharded-when-large) safetensors, optionally
changing the float dtype or folding a PEFT LoRA adapter into the weights.

GPTQ checkpoints keep their packed tensors as they are: only the file format changes. Their dtype cannot be changed
and no adapter can be merged into int4 weights (repacking for a kernel happens at load time, never on disk).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError, LoRAError, ModelLoadError

DTYPES = ("float16", "bfloat16", "float32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "vocab.txt", "spiece.model")
EXTRA_FILES = ("generation_config.json", "quantize_config.json")


def is_gptq(model_dir: Path) -> bool:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    return qc.get("quant_method") == "gptq" or (Path(model_dir) / "quantize_config.json").is_file()


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors")) or sorted(Path(model_dir).glob("pytorch_model*.bin"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no weights (*.safetensors or pytorch_model*.bin)",
                             "pass a complete Hugging Face model folder")
    return files


def copy_tokenizer_files(src: Path, out: Path, names: tuple[str, ...] = TOKENIZER_FILES) -> list[str]:
    """Copy the tokenizer files of `src` that `out` does not have yet; returns the names copied."""
    copied = []
    for name in names:
        if (Path(src) / name).is_file() and not (Path(out) / name).exists():
            shutil.copy2(Path(src) / name, Path(out) / name)
            copied.append(name)
    return copied


def check_output(out: Path, overwrite: bool) -> None:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} exists and is not a folder", "pass a folder path with -o")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"output folder {out} is not empty", "pass --overwrite to replace it, or another -o")
        if not (out / "config.json").is_file():
            raise ConfigError(f"output folder {out} is not empty and holds no model (no config.json)",
                              "--overwrite only replaces a model folder; pass an empty or new folder with -o")


def check_not_source(src: Path, out: Path, what: str) -> None:
    """Replacing OUTPUT must never delete the model being read: OUTPUT may be neither its folder nor above it."""
    src, out = Path(src).resolve(), Path(out).resolve()
    if out == src or out in src.parents:
        where = "the input folder" if out == src else f"a folder that holds the input {src}"
        raise ConfigError(f"output {out} is {where}", f"write the {what} model to another folder")


@contextmanager
def staged_output(out: Path, overwrite: bool):
    """Yield a temporary sibling folder of `out`; on success it replaces `out`, on failure it is removed, so an
    interrupted run never leaves a half-written model behind."""
    out = Path(out).resolve()
    check_output(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise ConfigError(f"cannot write into {out.parent}: {e.strerror or e}",
                          "pass an -o folder you can write to") from None
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_model(src: Path, out: Path, dtype: str | None = None, merge_lora: Path | None = None,
                  max_shard_size: str = "4GB", overwrite: bool = False) -> Path:
    """Write `src` as safetensors into `out`; returns `out`."""
    src = Path(src)
    if not (src / "config.json").is_file():
        raise ModelLoadError(f"{src} has no config.json", "pass a Hugging Face model folder")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported", f"use one of {', '.join(DTYPES)}")
    if merge_lora is not None:
        _check_adapter(Path(merge_lora))
    check_not_source(src, Path(out), "converted")
    gptq = is_gptq(src)
    if gptq and (dtype or merge_lora):
        what = "change the dtype of" if dtype else "merge a LoRA adapter into"
        raise ConfigError(f"cannot {what} the GPTQ checkpoint {src}: its weights are packed int4",
                          "convert or merge the float model first, then quantize it with `infer quantize`; "
                          "adapters can be served on top of GPTQ with --lora")
    with staged_output(out, overwrite) as tmp:
        if gptq:
            _copy_tensors(src, tmp, max_shard_size)
        else:
            _save_float(src, tmp, dtype, merge_lora, max_shard_size)
        copy_tokenizer_files(src, tmp)
    return Path(out)


def _check_adapter(adapter: Path) -> None:
    if not (adapter / "adapter_config.json").is_file():
        raise LoRAError(f"--merge-lora {adapter} is not a PEFT adapter folder (no adapter_config.json)",
                        "pass the folder written by peft's save_pretrained")


def _save_float(src: Path, out: Path, dtype: str | None, merge_lora: Path | None, max_shard_size: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    torch_dtype = getattr(torch, dtype) if dtype else "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, device_map="cpu")
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"transformers cannot load {src}: {e}", "check that the folder is complete") from e
    if merge_lora is not None:
        model = _merge(model, Path(merge_lora))
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    copy_tokenizer_files(src, out, EXTRA_FILES)


def _merge(model, adapter: Path):
    from peft import PeftModel
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter))
    except (RuntimeError, ValueError, KeyError) as e:
        raise LoRAError(f"the adapter {adapter} does not fit the model: {_first_line(e)}",
                        "pass an adapter trained on this base model (`infer lora-validate` lists every mismatch)") \
            from e
    return peft_model.merge_and_unload()


def _first_line(e: Exception) -> str:
    """torch's load_state_dict error lists every mismatched tensor on its own line: the first and a count."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    mismatches = [line.replace("base_model.model.", "") for line in lines if line.startswith("size mismatch")]
    if not mismatches:
        return lines[0] if lines else type(e).__name__
    more = f" (and {len(mismatches) - 1} more tensors)" if len(mismatches) > 1 else ""
    return mismatches[0].rstrip(".") + more


def _copy_tensors(src: Path, out: Path, max_shard_size: str) -> None:
    """Copy the tensors of a GPTQ checkpoint unchanged into safetensors shards, with its config files."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import load_file, save_file
    state: dict = {}
    for f in weight_files(src):
        part = load_file(f) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu", weights_only=True)
        state.update({k: v.contiguous() for k, v in part.items()})
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, out / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.copy2(src / "config.json", out / "config.json")
    copy_tokenizer_files(src, out, EXTRA_FILES)
