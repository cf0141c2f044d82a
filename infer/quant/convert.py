"""Convert a Hugging Face model folder (.bin, sharded or safetensors) into (sharded-when-large) safetensors, optionally
changing the float dtype or folding a PEFT LoRA adapter into the weights.

GPTQ checkpoints keep their packed tensors as they are: only the file format changes. Their dtype cannot be changed
and no adapter can be merged into int4 weights (repacking for a kernel happens at load time, never on disk).
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import socket
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, LoRAError, ModelLoadError, OutputError, bom_error

DTYPES = ("float16", "bfloat16", "float32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "vocab.txt", "spiece.model")
# (a multimodal folder's processor configs: its layout is kept, _auto_class)
EXTRA_FILES = ("generation_config.json", "quantize_config.json", "preprocessor_config.json", "processor_config.json")


def is_awq(model_dir: Path) -> bool:
    """Whether config.json's quantization_config is AWQ's (quant_method "awq"), or, without one (and without GPTQ's
    quantize_config.json), the folder has older AutoAWQ's quant_config.json: as GPTQConfig.from_model_dir reads it."""
    qc = read_config_json(model_dir).get("quantization_config") or {}
    if not qc and not (Path(model_dir) / "quantize_config.json").is_file() and \
            (Path(model_dir) / "quant_config.json").is_file():
        from .config import GPTQConfig
        return getattr(GPTQConfig.from_model_dir(model_dir), "quant_method", None) == "awq"
    return isinstance(qc, dict) and str(qc.get("quant_method") or qc.get("method") or "").lower() == "awq"


def is_gptq(model_dir: Path) -> bool:
    cfg = read_config_json(model_dir)
    qc = cfg.get("quantization_config") or {}
    return (isinstance(qc, dict) and qc.get("quant_method") == "gptq") or \
        (Path(model_dir) / "quantize_config.json").is_file()


# what to do about a config.json whose values transformers (or infer) refuses
CONFIG_HINT = "fix config.json, or copy it again with the model"


def read_config_json(model_dir: Path) -> dict:
    """The model's config.json as a dict; a ModelLoadError (exit 2) naming the file when it cannot be read or is not
    a JSON object (a truncated copy), as `infer run` refuses the same folder."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}", "check the file's permissions") from None
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError
        raise bom_error(path, ModelLoadError) or ModelLoadError(f"cannot read {path}: it is not valid JSON ({e})",
                             "the file is corrupted or truncated; copy the model folder again") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"cannot read {path}: it is not a JSON object",
                             "the file is corrupted; copy the model folder again")
    return cfg


def recorded_source(model_dir: Path) -> str | None:
    """The model a GPTQ or AWQ checkpoint's weights were quantized from: config.json's `_name_or_path`, as `infer
    quantize` writes it (and GPTQModel, AutoGPTQ and AutoAWQ did under transformers 4; `infer convert` copies it,
    --to gptq too). None for a float model, whose `_name_or_path` may name the model it was fine-tuned from, or when
    none is recorded."""
    try:
        cfg = read_config_json(model_dir)
        named = cfg.get("_name_or_path")
        quantized = is_gptq(model_dir) or is_awq(model_dir)
        return named.strip() if isinstance(named, str) and named.strip() and quantized else None
    except ModelLoadError:
        return None


DTYPE_KEYS = ("dtype", "torch_dtype")


def keep_source_config(src: Path, out: Path, changed: dict) -> None:
    """Write the source's config.json into `out` with only the `changed` fields replaced (a dtype in the key or keys
    the source spells it with; another key set to None is removed). transformers saves a config in its own version's
    layout (transformers 5 moves rope_theta and rope_scaling into rope_parameters and writes dtype for torch_dtype),
    which tools reading the fields of older versions take for a model without them (vLLM on transformers 4 gets the
    default rope)."""
    cfg = read_config_json(src)
    for key, value in changed.items():
        if key == "dtype":
            if value is None:
                continue
            keys = [k for k in DTYPE_KEYS if k in cfg] or ["torch_dtype"]  # every transformers version reads it
            cfg.update({k: value for k in keys})
        elif value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (Path(out) / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def saved_dtype(out: Path) -> str | None:
    """The float dtype the config.json saved into `out` names (dtype or torch_dtype)."""
    cfg = read_config_json(out)
    return next((cfg[k] for k in DTYPE_KEYS if isinstance(cfg.get(k), str)), None)


def load_weight_file(f: Path) -> dict:
    """Every tensor of one .safetensors or .bin file; a corrupted or truncated file is a ModelLoadError naming it,
    worded as `infer run` words it (models/loader.py)."""
    import torch
    from safetensors.torch import load_file
    try:
        if f.suffix == ".safetensors":
            return load_file(f)
        return torch.load(f, map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as e:  # any loader error (SafetensorError, torch's zip reader, unpickling) means the same
        raise ModelLoadError(f"cannot read weight file {f}: {e}", "the file is corrupted or truncated") from e


def check_weight_files(model_dir: Path) -> None:
    """Read every weight file of `model_dir`: a ModelLoadError names the first that cannot be read."""
    for f in weight_files(model_dir):
        load_weight_file(f)


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files to read, those `infer run` and transformers read: a sharded checkpoint's through its index,
    refused as `infer run` refuses it when a shard is missing (copying the others would write an incomplete model);
    else model.safetensors or pytorch_model.bin alone (another file beside it, such as a LoRA adapter's
    adapter_model.safetensors, is not part of the model); otherwise every safetensors file, or pytorch_model*.bin."""
    from .files import indexed_files
    indexed = indexed_files(Path(model_dir))
    if indexed is not None:
        return indexed
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (Path(model_dir) / single).is_file():
            return [Path(model_dir) / single]
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
    if out.is_dir() and any(not _kept(p) for p in out.iterdir()):
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


def check_inputs_kept(out: Path, overwrite: bool, inputs: dict[str, Path | None]) -> None:
    """--overwrite empties OUTPUT of what it holds (hidden entries apart) before the new model moves in: an input the
    run reads from inside it ({flag: path}, a --calibration file or a --merge-lora adapter) would be deleted with the
    old model. Refused before any work, as check_not_source refuses the model itself."""
    out = Path(out).expanduser().resolve()
    if not overwrite or not out.is_dir():
        return
    for flag, path in inputs.items():
        if path is None or not Path(path).expanduser().exists():  # a missing one is named by its own check
            continue
        path = Path(path).expanduser().resolve()
        if path == out or out in path.parents and not _kept(out / path.relative_to(out).parts[0]):
            where = "is the output folder" if path == out else f"is inside the output folder {out}"
            raise ConfigError(f"{flag} {path} {where}, which --overwrite would empty (deleting it)",
                              f"move it out of {out}, or write the model to another -o folder")


STAGING_PREFIX = ".infer-staging-"  # inside an existing OUTPUT folder (one left by a killed run does not count)


def _kept(p: Path) -> bool:
    """What an existing OUTPUT folder may hold besides a model, left as it is: hidden entries (a staging folder, and a
    git clone's .git and .gitattributes: a Hugging Face repo cloned to push the model, as transformers' save_pretrained
    writes into one, and huggingface_hub's .cache of a --local-dir download), and the lost+found of a volume's root (an
    ext4 volume mounted as OUTPUT has one, owned by root: never a model's file)."""
    return p.name.startswith(".") or p.name == "lost+found" and p.is_dir()


def _staging_prefix(out: Path, inside: bool) -> str:
    """The staging folder's name up to mkdtemp's random part: which run (host and process) writes into it, so that a
    later run can tell the folder of a run that was killed (SIGKILL, a lost machine: nothing removed it) from that of
    one still writing."""
    return f"{STAGING_PREFIX if inside else f'.{out.name}.tmp-'}{_host()}-{os.getpid()}-"


def _host() -> str:
    """This host, and the process-id namespace its pids are read in: containers on one machine may share its hostname
    (docker --network host) and a disk, each with pids of its own, so that another container's live run looked like
    a killed one here (its pid not found) and had its staging folder removed while it wrote."""
    name = socket.gethostname().replace("-", "_") or "host"
    space = _pid_namespace()
    return f"{name}_pidns{space}" if space else name


def _pid_namespace() -> str:
    """The inode of this process's pid namespace (Linux), "" where it cannot be read."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def remove_dead_staging(out: Path) -> list[Path]:
    """Remove the staging folders (a whole model's size each) that runs killed on this host left for `out`, inside it
    or beside it: those whose process is gone. A folder of a live process, of another host (a shared disk), or of an
    older infer (no host and process in its name) is left alone. Returns what was removed."""
    removed = []
    for where, prefix in ((out, STAGING_PREFIX), (out.parent, f".{out.name}.tmp-")):
        try:
            entries = list(where.glob(f"{glob.escape(prefix)}{glob.escape(_host())}-*")) if where.is_dir() else []
        except OSError:
            continue
        for folder in entries:
            pid = folder.name[len(prefix) + len(_host()) + 1:].split("-", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)) or not folder.is_dir():
                continue
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process
        return True
    return True


@contextmanager
def staged_output(out: Path, overwrite: bool):
    """Yield a temporary folder; on success its files become `out`, on failure it is removed, so an interrupted run
    never leaves a half-written model behind. A new `out` is staged beside it and renamed into place; an existing
    folder (empty, or a model --overwrite replaces) is kept, staged inside and filled at the end: it may be a mount
    point (a container's volume) or hold permissions of its own, and its parent may not be writable."""
    out = Path(out).resolve()
    for folder in remove_dead_staging(out):
        print(f"note: removed {folder}, the staging folder of a run to {out} that was killed", file=sys.stderr)
    check_output(out, overwrite)
    tmp, inside = None, out.is_dir()
    try:  # one try from the folder's creation on: an interrupt right after mkdtemp removes it too
        where = out if inside else out.parent
        try:
            where.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=_staging_prefix(out, inside), dir=where))
        except OSError as e:
            raise ConfigError(f"cannot write into {where}: {e.strerror or e}",
                              "pass an -o folder you can write to") from None
        try:
            yield tmp
        except Exception as e:  # safetensors' SafetensorError, GPTQModel's save wrapped in an InferError, ...
            if _out_of_space(e):
                raise OutputError(f"no space left on the device while writing {out}: nothing was written",
                                  f"free space on the disk that holds {out.parent}, or pass an -o on another "
                                  "disk") from e
            raise
        apply_umask(tmp)  # before the old model goes: a failure here leaves it in place
        if inside:
            _fill(out, tmp)
        else:
            try:
                tmp.rename(out)
            except OSError as e:  # ENOTEMPTY/EEXIST: another run (or the user) made OUT meanwhile; it is left as is
                if not out.exists():
                    raise
                raise OutputError(f"output folder {out} was created and filled by something else (another run to "
                                  f"the same -o?) while this one wrote its model: nothing was written "
                                  f"({e.strerror or e})", "pass another -o, or remove that folder and rerun") \
                    from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _fill(out: Path, tmp: Path) -> None:
    """Replace what `out` holds (an old model, or nothing) with the files staged in `tmp`, a folder inside it."""
    # config.json first, for the same reason as it is moved in last (below): the old model's files half deleted
    for p in sorted(out.iterdir(), key=lambda p: p.name != "config.json"):
        if p != tmp and not _kept(p):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    moved = []
    try:  # config.json last: a folder without it is no model, so a run killed (SIGKILL) between two renames leaves
        # no folder that loads as a model with files missing (the weights' second shard, tokenizer_config.json)
        for p in sorted(tmp.iterdir(), key=lambda p: (p.name == "config.json", p.name)):
            p.rename(out / p.name)
            moved.append(out / p.name)
    except BaseException:  # an interrupt between two renames: no half-moved model is left as if complete
        for p in moved:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        raise


def _out_of_space(e: BaseException | None) -> bool:
    """Whether `e` or an exception it was raised from is a full disk or quota (an OSError, or the safetensors
    writer's error, which carries only the OS's words)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (os.umask can only swap it, which races
    with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Give `folder` and everything in it the modes a plain mkdir/open would (0755/0644 under umask 022): mkdtemp
    makes the staging folder 0700 and safetensors writes 0600 files, so the finished model could otherwise be served
    only by the account that wrote it. Bottom-up, so a restrictive umask never locks the walk out of a folder."""
    mask = current_umask()
    for root, dirs, files in os.walk(folder, topdown=False):
        for name, mode in [(d, 0o777) for d in dirs] + [(f, 0o666) for f in files]:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, mode & ~mask)
    os.chmod(folder, 0o777 & ~mask)


def parse_shard_size(size: str | int) -> int:
    """--max-shard-size in bytes, as Hugging Face reads it: 4GB = 4e9 bytes, 2GiB = 2 * 2**30, a plain number is bytes
    (huggingface_hub itself takes no binary units and GPTQModel reads GB as 2**30: both get the number of bytes)."""
    from ..checks import parse_size
    return parse_size(size, "--max-shard-size", decimal=True)


TARGETS = ("safetensors", "gptq")


def convert_model(src: Path, out: Path, dtype: str | None = None, merge_lora: Path | None = None,
                  max_shard_size: str | int = "4GB", overwrite: bool = False,
                  check_weights: Callable[[Path], None] | None = None, source_name: str | None = None,
                  to: str = "safetensors", shown: str | None = None) -> Path:
    """Write `src` as safetensors into `out`; returns `out`. `check_weights`: the engine loader's checks of a
    checkpoint against its config.json (models.loader.check_weights, which the CLI passes: quant sits below models),
    run before transformers loads a float one and before a quantized one is copied. `source_name`: the name a float
    copy's config.json records as the model its weights are (`_name_or_path`; default: `src`'s path); a merged model
    records none, and a GPTQ checkpoint's config.json is copied unchanged (the model it was quantized from, which it
    records, is the copy's).
    `to`: "safetensors" keeps a quantized checkpoint's tensors as they are (an AWQ one stays AWQ); "gptq" rewrites an
    AWQ 'gemm' checkpoint as the GPTQ checkpoint of the same weights (quant/awq.py), copies a GPTQ one, and refuses a
    float model (`infer quantize` makes a GPTQ checkpoint of it). `shown`: the model as the user typed it (a built-in
    name or hub id), which a refusal names and tells to pass (default: `src`'s path)."""
    src, out = Path(src).expanduser(), Path(out).expanduser()  # as `infer run` reads MODEL and --lora reads PATH
    merge_lora = Path(merge_lora).expanduser() if merge_lora is not None else None
    max_shard_size = parse_shard_size(max_shard_size)  # a bad size fails now, not after loading the model
    if not (src / "config.json").is_file():
        raise ModelLoadError(f"{src} has no config.json", "pass a Hugging Face model folder")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported", f"use one of {', '.join(DTYPES)}")
    if merge_lora is not None:
        _check_adapter(Path(merge_lora))
    check_not_source(src, Path(out), "converted")
    check_inputs_kept(out, overwrite, {"--merge-lora": merge_lora})
    if to not in TARGETS:
        raise ConfigError(f"--to {to!r} is not supported", f"use one of {', '.join(TARGETS)}")
    awq = is_awq(src)
    gptq = is_gptq(src)
    if (gptq or awq) and (dtype or merge_lora):
        what = "change the dtype of" if dtype else "merge a LoRA adapter into"
        kind, bits = ("AWQ", "int4") if awq else ("GPTQ", _gptq_bits(src))
        raise ConfigError(f"cannot {what} the {kind} checkpoint {src}: its weights are packed {bits}",
                          "convert or merge the float model first, then quantize it with `infer quantize`; "
                          "adapters can be served on top of GPTQ with --lora")
    if to == "gptq" and not (gptq or awq):
        raise ConfigError(f"--to gptq: {shown or src} is a float model (config.json has no AWQ or GPTQ "
                          "quantization_config)", f"quantize it into a GPTQ checkpoint with `infer quantize "
                          f"{shown or src} -o OUT`")
    if (gptq or awq) and check_weights is not None:  # the copy is what `infer run` loads: its quantization config
        check_weights(src)  # (bits infer runs) and its tensors (qweight... where config.json claims them), refused now
    awq_config = None
    if awq and to == "gptq":
        from .config import GPTQConfig
        awq_config = GPTQConfig.from_model_dir(src)  # refuses a version, bits or zero_point infer cannot read
        if awq_config is None or awq_config.quant_method != "awq":
            raise ConfigError(f"--to gptq: {src}'s config.json names AWQ but infer reads another quantization config",
                              "remove quantize_config.json or fix config.json's quantization_config")
    from .fp8 import fp8_config
    fp8 = fp8_config(read_config_json(src))
    if fp8 is not None and merge_lora is not None:
        raise ConfigError(f"cannot merge a LoRA adapter into the FP8 checkpoint {src}: its weights are float8 with "
                          "block scales", f"write its float model first (`infer convert {shown or src} -o FLOAT`: the "
                          "FP8 weights dequantized), then merge the adapter into FLOAT")
    if fp8 is not None and check_weights is not None:  # (every FP8 weight with its scale, the shapes config.json's)
        check_weights(src)
    with staged_output(out, overwrite) as tmp:
        if fp8 is not None:
            _fp8_to_float(src, tmp, fp8, dtype, max_shard_size, source_name or str(src.resolve()))
        elif awq_config is not None:
            _awq_to_gptq(src, tmp, max_shard_size, awq_config)
        elif gptq or awq:  # config.json unchanged: the source it records (recorded_source) is the copy's
            _copy_tensors(src, tmp, max_shard_size)
        else:
            # the same weights as the source's; merged, the weights of no model an adapter was trained on
            named = None if merge_lora is not None else source_name or str(src.resolve())
            _save_float(src, tmp, dtype, merge_lora, max_shard_size, check_weights, named)
        copy_tokenizer_files(src, tmp)
    return Path(out)


def _gptq_bits(src: Path) -> str:
    """What the GPTQ checkpoint's weights are packed as ("int4", "int8"), from its quantization config as infer reads
    it (config.json's quantization_config, else quantize_config.json); "integers" when the bits cannot be read."""
    for name, key in (("config.json", "quantization_config"), ("quantize_config.json", None)):
        try:
            data = json.loads((Path(src) / name).read_text())
        except (OSError, ValueError):
            continue
        qc = data.get(key) if key and isinstance(data, dict) else data
        if isinstance(qc, dict) and qc:
            return f"int{qc['bits']}" if isinstance(qc.get("bits"), int) else "integers"
    return "integers"


def _check_adapter(adapter: Path) -> None:
    if not (adapter / "adapter_config.json").is_file():
        raise LoRAError(f"--merge-lora {adapter} is not a PEFT adapter folder (no adapter_config.json)",
                        "pass the folder written by peft's save_pretrained")


def _save_float(src: Path, out: Path, dtype: str | None, merge_lora: Path | None, max_shard_size: int,
                check_weights: Callable[[Path], None] | None = None, named: str | None = None) -> None:
    import torch
    from .config import hf_load_options
    unsupported = _check_tensors(src, check_weights)
    torch_dtype = getattr(torch, dtype) if dtype else "auto"
    # the hub's gpt-oss (MXFP4 experts): dequantized as `infer run` loads it, saved as the float model it is,
    # without the quantization_config
    extra = hf_load_options(src)
    mxfp4 = bool(extra)
    try:  # mismatched sizes come back in the report (refused below) instead of as transformers' RuntimeError
        model, info = _auto_class(src).from_pretrained(src, dtype=torch_dtype, device_map="cpu",
                                                       output_loading_info=True, ignore_mismatched_sizes=True, **extra)
    except Exception as e:
        check_weight_files(src)  # a corrupted or truncated weight file (SafetensorError, ...): named, exit 2
        if unsupported is not None:  # (a hidden_act 'frob': transformers' KeyError 'frob'; infer names the field)
            raise unsupported from e
        if isinstance(e, (OSError, ValueError, KeyError)):
            raise ModelLoadError(f"transformers cannot load {src}: {e}", "check that the folder is complete") from e
        raise
    _check_loading_info(src, type(model).__name__, info)
    bad = nonfinite_tensors(model.state_dict().items())
    if bad:
        cast = f" once cast to {dtype}" if dtype else ""
        raise ModelLoadError(f"{src} has non-finite weights (inf or NaN){cast}: {_some(bad)}",
                             f"values beyond {dtype}'s range (or inf/NaN in the checkpoint): keep the checkpoint's "
                             "dtype or use float32" if dtype
                             else "the checkpoint is corrupted; copy it again or convert the model it came from")
    untied = False
    if merge_lora is not None:
        model, untied = _merge(model, Path(merge_lora))
        bad = nonfinite_tensors(model.state_dict().items())
        if bad:
            raise LoRAError(f"merging the adapter {merge_lora} gives non-finite weights (inf or NaN): {_some(bad)}",
                            "the adapter's weights are too large for the model (`infer lora-validate` shows its "
                            "scaling); check the adapter, or merge into a float32 copy of the model")
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    keep_source_config(src, out, {"_name_or_path": named, **({"dtype": saved_dtype(out)} if dtype else {}),
                                  **({"tie_word_embeddings": False} if untied else {}),
                                  **({"quantization_config": None} if mxfp4 else {})})
    copy_tokenizer_files(src, out, EXTRA_FILES)


def _auto_class(src: Path):
    """transformers' auto class of the model: a *ForSequenceClassification (its score head kept), a multimodal
    ...ForConditionalGeneration with a text_config (Gemma 3's, Mistral 3's: saved whole, its vision tower kept, in
    its own layout; infer serves its text model, models.multimodal) or a causal LM."""
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                              AutoModelForSequenceClassification)
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLS
    cfg = AutoConfig.from_pretrained(src, local_files_only=True)
    archs = getattr(cfg, "architectures", None) or []
    if getattr(cfg, "text_config", None) is not None and any(a.endswith("ForConditionalGeneration") for a in archs):
        return AutoModelForImageTextToText
    return AutoModelForSequenceClassification if set(archs) & set(CLS.values()) else AutoModelForCausalLM


def _check_tensors(src: Path, check_weights: Callable[[Path], None] | None) -> Exception | None:
    """The checks `infer run`'s loader makes of config.json (a size no model has, by name) and of the weights (every
    tensor's name and shape against config.json, none missing, none left over), in its words, before transformers
    fills missing weights at random and drops the others. An architecture infer does not run is left to
    transformers' loading report (_check_loading_info): infer's refusal is returned, said if transformers fails too."""
    from transformers import AutoConfig

    from ..errors import UnsupportedModelError
    unsupported = None
    if check_weights is not None:
        try:
            check_weights(src)
        except UnsupportedModelError as e:  # (a config.json transformers cannot read either: refused just below)
            unsupported = e
    try:
        AutoConfig.from_pretrained(src, local_files_only=True)
    except Exception as e:  # transformers' validation of the config's values (layer_types against the layers, ...)
        raise ModelLoadError(f"cannot read {src / 'config.json'}: {' '.join(str(e).split())}", CONFIG_HINT) from e
    return unsupported


def _check_loading_info(src: Path, arch: str, info: dict) -> None:
    """Refuse what transformers only reports: weights of the wrong shape, missing ones (initialized at random) and
    left-over ones (dropped)."""
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        name, stored, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ModelLoadError(f"{name} has shape {tuple(stored)}, config.json implies {tuple(wanted)}{more}",
                             "the weights do not match config.json")
    missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])
    parts = ([f"no tensor {_some(missing)}"] if missing else []) + \
        ([f"tensors it has no place for: {_some(unexpected)}"] if unexpected else [])
    if parts:
        raise ModelLoadError(f"the weights of {src} do not match config.json ({arch}): {'; '.join(parts)}",
                             "transformers would fill the missing weights at random and drop the others: use the "
                             "config.json that came with these weights, or copy the whole model folder")


def nonfinite_tensors(tensors) -> list[str]:
    """The names of the floating-point tensors among (name, tensor) pairs that hold an inf or a NaN."""
    import torch
    return [name for name, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _some(names: list[str]) -> str:
    return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def load_peft(model, adapter: Path, **kw):
    """PeftModel.from_pretrained(model, adapter) for inference: the adapter's config read as peft reads it, with
    lora_dropout 0 (dropout does nothing at inference, but peft's ParamWrapper (0.21, 0.22), the LoRA of a mixture of
    experts' stacked parameters (target_parameters, or transformers 4's per-expert modules peft converts into
    them), refuses any other value); nothing is written to the adapter's folder."""
    from peft import PEFT_TYPE_TO_CONFIG_MAPPING, PeftConfig, PeftModel
    config = PEFT_TYPE_TO_CONFIG_MAPPING[PeftConfig._get_peft_type(str(adapter))].from_pretrained(str(adapter))
    if getattr(config, "lora_dropout", 0):
        config.lora_dropout = 0.0
    return PeftModel.from_pretrained(model, str(adapter), config=config, **kw)


def _merge(model, adapter: Path):
    """(the model with the adapter merged in, whether its lm_head is no longer its embeddings' tensor)."""
    keep = _keeps_tying(adapter)  # peft ties the adapter's embedding and head modules as the base ties theirs
    tied = not keep and _untie(model)
    try:
        peft_model = load_peft(model, adapter)
    except (RuntimeError, ValueError, KeyError) as e:
        raise LoRAError(f"the adapter {adapter} does not fit the model: {_first_line(e)}",
                        "pass an adapter trained on this base model (`infer lora-validate` lists every mismatch)") \
            from e
    emb, head = _embeddings(peft_model.get_base_model())
    if keep and emb is not None and head is not None and emb.weight is head.weight \
            and any(hasattr(m, "lora_A") for m in (emb, head)):
        raise LoRAError(f"the adapter {adapter} has a LoRA on the tied embeddings with ensure_weight_tying: peft's "
                        "merge into the one tensor they share does not give what peft computes with it",
                        "serve the adapter with peft, or train it with ensure_weight_tying false")
    _check_read(peft_model, adapter)
    merged = peft_model.merge_and_unload()
    return merged, tied and not _retie(merged)


def _check_read(peft_model, adapter: Path) -> None:
    """LoRAError when the adapter's file holds tensors peft did not load (named without peft's base_model.model.
    prefix, or with the adapter's name in them): peft leaves them out with a warning and would merge nothing of them,
    where `--lora` serves them. The file's tensors are compared as peft converted them on loading (transformers 4's
    per-expert modules: the stacked experts' parameters)."""
    from peft.utils import get_peft_model_state_dict
    from peft.utils.save_and_load import load_peft_weights
    from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers
    read = convert_peft_adapter_state_dict_for_transformers(peft_model, peft_model.peft_config["default"],
                                                            load_peft_weights(str(adapter), device="cpu"))
    unread = sorted(set(read) - set(get_peft_model_state_dict(peft_model)))
    if unread:
        raise LoRAError(f"peft does not read {_some(unread)} from the adapter {adapter}: the merged model would "
                        "not hold those weights",
                        "peft reads tensors named as its save_pretrained names them (base_model.model.MODULE."
                        "lora_A.weight): rename them so, or serve the adapter with --lora instead of merging it")


def _adapter_config(adapter: Path) -> dict:
    """adapter_config.json as it is in the folder ({} when it does not read as an object)."""
    try:
        config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _keeps_tying(adapter: Path) -> bool:
    """Whether adapter_config.json sets peft's ensure_weight_tying (the adapter is saved for a tied model)."""
    return _adapter_config(adapter).get("ensure_weight_tying") is True


def _embeddings(model):
    return model.get_input_embeddings(), model.get_output_embeddings()


def _untie(model) -> bool:
    """A tied base (tie_word_embeddings: lm_head's weight is embed_tokens' tensor) gets an lm_head of its own before
    a merge: merged into the one shared tensor, a LoRA on lm_head (or embed_tokens) changed both, where peft's forward
    changes only the module it adapts. True when it untied them."""
    import torch
    emb, head = _embeddings(model)
    if emb is None or head is None or head.weight is not emb.weight:
        return False
    head.weight = torch.nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    return True


def _retie(model) -> bool:
    """Tie lm_head back to the embeddings when the merge left them equal (the adapter adapts neither); True then."""
    import torch
    emb, head = _embeddings(model)
    if not torch.equal(emb.weight, head.weight):
        return False
    head.weight = emb.weight
    model.config.tie_word_embeddings = True
    return True


def _first_line(e: Exception) -> str:
    """torch's load_state_dict error lists every mismatched tensor on its own line: the first and a count."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    mismatches = [line.replace("base_model.model.", "") for line in lines if line.startswith("size mismatch")]
    if not mismatches:
        return lines[0] if lines else type(e).__name__
    more = f" (and {len(mismatches) - 1} more tensors)" if len(mismatches) > 1 else ""
    return mismatches[0].rstrip(".") + more


def _unshared(state: dict, tied: bool) -> dict:
    """safetensors stores no two tensors on one storage; a .bin of a tied model (torch.save of its state dict) has
    lm_head.weight on the embeddings' storage: the tied head is left out, as transformers saves it, and any other
    shared tensor gets its own copy."""
    out, seen = {}, set()
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            if tied and name.endswith("lm_head.weight"):
                continue
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _awq_to_gptq(src: Path, out: Path, max_shard_size: int, config) -> None:
    """Write the AWQ checkpoint `src` as the GPTQ checkpoint of the same weights: each AWQ layer repacked (exactly),
    every other tensor as it is; config.json's quantization_config (and quantize_config.json, as GPTQModel writes
    both) GPTQ's asymmetric v1 settings, its modules_to_not_convert as the modules_in_block_to_quantize that
    transformers reads (awq.converted_config)."""
    from .awq import converted_config, state_to_gptq
    names: list[str] = []

    def transform(state: dict) -> dict:
        state = state_to_gptq(state, config)
        names.extend(state)
        return state
    _copy_tensors(src, out, max_shard_size, transform, configs=False)
    gptq = converted_config(config, names).to_dict()
    keep_source_config(src, out, {"quantization_config": gptq})
    (out / "quantize_config.json").write_text(json.dumps(gptq, indent=2) + "\n")
    copy_tokenizer_files(src, out, ("generation_config.json",))


def _fp8_to_float(src: Path, out: Path, qc: dict, dtype: str | None, max_shard_size: int, named: str) -> None:
    """A block-scaled FP8 checkpoint (quant.fp8) written as its float model, a weight file at a time: each FP8
    weight dequantized (in float32, rounded to `dtype`, else config.json's dtype, else bfloat16) and its scale
    dropped, every other tensor as stored (cast to `dtype` where given), in shards of `max_shard_size`; config.json
    without the quantization_config. transformers' loading would hold the whole model (671 B parameters for
    DeepSeek-V3) and dequantizes a partial edge block (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows in blocks of 128)
    with the wrong block size; this reads each weight's blocks as vLLM does."""
    import torch
    from safetensors.torch import save_file

    from . import fp8
    source = read_config_json(src)
    stored = next((source[k] for k in DTYPE_KEYS if isinstance(source.get(k), str)), None)
    wanted = dtype or stored
    target = getattr(torch, wanted if wanted in DTYPES else "bfloat16")
    block = fp8.block_size(qc, str(src / "config.json"))

    def tensors():
        for f in weight_files(src):
            yield from load_weight_file(f).items()

    shards: list[dict] = [{}]
    sizes = [0]
    weight_map: dict[str, int] = {}
    total = 0
    done: set[str] = set()  # the weights dequantized
    for name, t in fp8.dequantized(tensors(), block, str(src), done):
        if t.is_floating_point() and (dtype is not None or name in done):
            t = t.to(target)
        bad = nonfinite_tensors([(name, t)])
        if bad:
            raise ModelLoadError(f"{src}: {name} is not finite once dequantized (inf or NaN)",
                                 "the checkpoint is corrupted; copy or download it again")
        size = t.numel() * t.element_size()
        if sizes[-1] and sizes[-1] + size > max_shard_size:
            save_file(shards[-1], out / f"part-{len(shards):05d}.safetensors", metadata={"format": "pt"})
            shards.append({})
            sizes.append(0)
        shards[-1][name] = t.contiguous()
        sizes[-1] += size
        weight_map[name] = len(shards)
        total += size
    save_file(shards[-1], out / f"part-{len(shards):05d}.safetensors", metadata={"format": "pt"})
    del shards
    n = len(sizes)
    files = {i: "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
    for i, name in files.items():
        (out / f"part-{i:05d}.safetensors").rename(out / name)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: files[i] for k, i in weight_map.items()}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    keep_source_config(src, out, {"_name_or_path": named, "quantization_config": None,
                                  "dtype": str(target).removeprefix("torch.")})
    copy_tokenizer_files(src, out, EXTRA_FILES)


def _copy_tensors(src: Path, out: Path, max_shard_size: int, transform: Callable[[dict], dict] | None = None,
                  configs: bool = True) -> None:
    """Copy the tensors of a quantized checkpoint into safetensors shards (unchanged, or through `transform`), with
    its config files unless `configs` is false."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    state: dict = {}
    for f in weight_files(src):
        part = load_weight_file(f)
        state.update({k: v.contiguous() for k, v in part.items()})
    state = _unshared(state, bool(read_config_json(src).get("tie_word_embeddings", False)))
    if transform is not None:
        state = transform(state)
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, out / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if configs:
        shutil.copy2(src / "config.json", out / "config.json")
        copy_tokenizer_files(src, out, EXTRA_FILES + ("quant_config.json",))
