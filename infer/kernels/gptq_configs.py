"""Which GPTQ matmul configuration to launch for a shape: a table tuned per GPU, else a heuristic.

Tables map "N,K" -> {M bucket: config}, M bucket being the next power of two (capped at 4096). They live in
two places, merged with the user's cache winning: tables shipped with infer for GPUs it was tuned on
(`kernels/configs/<GPU name>.json`), and `$INFER_CACHE/kernels/<GPU name>.json` (default ~/.cache/infer) written
by `gptq_tune` when an engine starts on a GPU or shape nobody tuned before, so a restart does not tune again;
and a folder the user names ($INFER_TUNED_CONFIG_FOLDER, laid out as the shipped one, read-only) over both.
A config is {"kernel": "gemv" | "mma" | "mmat" | "dequant", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "GROUP_M",
"num_warps", "num_stages", "FIELD", "SCALE_W", "PAIRS", "INPLACE", "BYTES", "BYTE_DOTS", "SYNC_MMA", "AHEAD",
"CHUNK_N"} (see
gptq_gemm; absent keys take its defaults). Every entry is checked when read (`dense_error`; the MoE section's:
moe.config_error and moe_tune.entry_error) and a file carries its format (FORMAT_KEY): what a launch cannot take,
or another revision of the kernels wrote, is skipped with a warning and tuned again at the engine start.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import tempfile
from pathlib import Path

import torch

MAX_BUCKET = 4096
# The table files' format, by section: the revision of the kernels their entries were tuned for. `save` writes it
# (FORMAT_KEY, beside the shapes); a file that holds another (another infer's, or one from before a kernel change
# that alters what an entry launches: bump it then) is skipped with a warning, its shapes tuned again. A file
# without the field (those before it, the shipped ones) is of format 1. vLLM's tuned fused_moe files are keyed by
# the device name and the shapes alone (a folder per Triton version at most): a stale entry there is launched.
FORMAT = {"": 1, "moe": 1}
FORMAT_KEY = "_format"
KERNELS = ("gemv", "mma", "mmat", "dequant")
FLAGS = ("FIELD", "SCALE_W", "PAIRS", "INPLACE", "BYTES", "BYTE_DOTS", "SYNC_MMA", "AHEAD")  # true / false
SHIPPED = Path(__file__).parent / "configs"
log = logging.getLogger("infer")


def bucket(m: int) -> int:
    return min(1 << max(m - 1, 0).bit_length(), MAX_BUCKET)


def block_k_limit(group_size: int | None, k: int, pack: int) -> int:
    """The largest power-of-two BLOCK_K (<= 128) that keeps a K step inside one group; 0 when g_idx must be read
    row by row (no promise, or groups too small for a K step): then only `dequant` applies."""
    if group_size is None:
        return 0
    if group_size == -1 or group_size >= k:
        return 128
    step = group_size & -group_size  # the largest power of two dividing group_size
    return min(step, 128) if step >= max(16, pack) else 0


def interleave_for(group_size: int | None, k: int, pack: int) -> int:
    """Words per interleaved block (`packing.field_rows`) for a layer the fused kernels run: blocks of the largest
    K step (so a field of a step's words covers consecutive rows); 1 (GPTQ order) when there is none or K is not
    a whole number of blocks."""
    step = block_k_limit(group_size, k, pack)
    return step // pack if step >= 2 * pack and k % step == 0 else 1


@functools.lru_cache(maxsize=8)
def gpu_name(device: torch.device) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", torch.cuda.get_device_name(device)).strip("_")


def cache_file(name: str, section: str = "") -> Path:
    """The user's cache file of GPU `name`; section: a table of other kernels in a folder of its own ("moe": the
    fused MoE's, kernels.moe_tune), shipped the same way under SHIPPED / section."""
    root = Path(os.environ.get("INFER_CACHE") or Path.home() / ".cache" / "infer")
    return root / "kernels" / section / f"{name}.json"


FOLDER_VAR = "INFER_TUNED_CONFIG_FOLDER"


def tuned_folder() -> Path | None:
    """$INFER_TUNED_CONFIG_FOLDER (vLLM's VLLM_TUNED_CONFIG_FOLDER): a folder of tables laid out as SHIPPED is
    (`<GPU name>.json`, `moe/<GPU name>.json`: tuned on another machine of the same GPU, `python -m
    infer.bench.moe --tune` and `python -m infer.bench.kernels --tune` write them), read over the shipped tables
    and the user's cache (`load`), never written; None when unset. A ConfigError where it names no folder."""
    value = os.environ.get(FOLDER_VAR, "").strip()
    if not value:
        return None
    from ..errors import ConfigError
    try:
        path = Path(value).expanduser()
    except RuntimeError:  # (~name of no user: Path.expanduser's RuntimeError ended the engine start)
        raise ConfigError(f"{FOLDER_VAR}={value!r} starts with a ~user that this machine has no home folder for",
                          "give the folder's full path, or unset it") from None
    if path.is_file():
        raise ConfigError(f"{FOLDER_VAR}={value!r} is a file, not a folder of tables",
                          f"point it at the folder that holds it ({str(path.parent)!r}, where its name is the GPU's: "
                          "<GPU name>.json, moe/<GPU name>.json), or unset it")
    if not path.is_dir():
        raise ConfigError(f"{FOLDER_VAR}={value!r} is no folder",
                          "point it at a folder of tuned tables (<GPU name>.json, moe/<GPU name>.json, as "
                          "infer/kernels/configs holds them), or unset it")
    return path


def _read(path: Path, section: str = "") -> dict:
    """{shape: {bucket (a string): config}} of the table file `path`, {} where there is none. What is no such table
    (a corrupt, truncated or hand-edited file: not JSON, not objects of objects, a bucket that is no power of two),
    a file of another format (FORMAT_KEY: another revision of the kernels) or of the other section (the MoE tables
    where the GPTQ matmul's belong, or the reverse: a $INFER_TUNED_CONFIG_FOLDER that names the moe/ folder) and an
    entry that `_check` refuses are skipped with a warning naming the file (and the entry), never raised at an
    engine start or launched: the tuner measures those buckets again and its `save` writes over them."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring the kernel config table %s: %s (delete it: the tuner writes it again)", path, err)
        return {}
    if not isinstance(data, dict):
        log.warning("ignoring the kernel config table %s: not a JSON object of shapes (delete it: the tuner "
                    "writes it again)", path)
        return {}
    fmt, want = data.pop(FORMAT_KEY, 1), FORMAT.get(section, 1)
    if type(fmt) is not int or fmt != want:
        log.warning("ignoring the kernel config table %s: written for another revision of the kernels (%s %s, "
                    "this infer reads %s): its shapes are tuned again", path, FORMAT_KEY, json.dumps(fmt), want)
        return {}
    other = _other_section(data, section)
    if other:
        log.warning("ignoring the kernel config table %s: it holds %s (such as %r), not %s: %s", path, *other)
        return {}
    out: dict = {}
    for shape, by_m in data.items():
        if not isinstance(by_m, dict):
            log.warning("ignoring %s's entry %s: not a JSON object of buckets (it is tuned again)", path, shape)
            continue
        if section == "" and not DENSE_SHAPE.fullmatch(shape):
            log.warning("ignoring %s's entry %s: no shape \"N,K\" of a GPTQ layer (it is tuned again)", path, shape)
            continue
        for b, cfg in by_m.items():
            why = _check(shape, b, cfg, section)
            if why:
                log.warning("ignoring %s's entry %s / %s: %s (it is tuned again)", path, shape, b, why)
            else:
                out.setdefault(shape, {})[b] = cfg
    return out


DENSE_SHAPE = re.compile(r"[1-9][0-9]*,[1-9][0-9]*")  # a GPTQ matmul table's key: "N,K"
MOE_SHAPE = re.compile(r"[0-9]+,[0-9]+,[0-9]+,[0-9]+,.+")  # a fused MoE table's (moe.layer_key): "E,H,I,top_k,kind"


def _other_section(data: dict, section: str) -> tuple | None:
    """(what the table holds, a key of it, what it should hold, the fix) where every shape of `data` is a key of the
    other section's tables (the fused MoE's in a GPTQ matmul table, or the reverse), else None."""
    if not data:
        return None
    if section == "" and all(MOE_SHAPE.fullmatch(k) for k in data):
        return ("fused MoE tables", next(iter(data)), "GPTQ matmul tables",
                "those belong in moe/<GPU name>.json (a $" + FOLDER_VAR + " names the folder above moe/)")
    if section == "moe" and all(DENSE_SHAPE.fullmatch(k) for k in data):
        return ("GPTQ matmul tables", next(iter(data)), "fused MoE tables",
                "those belong in the folder above moe/ (a $" + FOLDER_VAR + " names that folder, not moe/)")
    return None


def _check(shape: str, b: str, cfg, section: str) -> str | None:
    """Why a table entry (layer `shape`, bucket `b`, `cfg`) cannot be used, or None."""
    if not isinstance(cfg, dict):
        return f"{json.dumps(cfg)} is no JSON object of launch parameters"
    try:
        m = int(b)
    except ValueError:
        return f"the bucket {b!r} is no count of tokens"
    if not 1 <= m <= MAX_BUCKET or m & (m - 1):
        return f"the bucket {b!r} is no power of two from 1 to {MAX_BUCKET} (no step looks it up)"
    if section == "moe":
        from .moe import config_error
        from .moe_tune import entry_error
        return config_error(cfg) or entry_error(shape, cfg)
    if section == "":
        return dense_error(shape, cfg)
    return None


def dense_error(shape: str, cfg: dict) -> str | None:
    """Why `cfg` cannot be a tuned entry of the GPTQ matmul of the layer shape "N,K" (gptq_gemm), or None: a kernel
    of KERNELS (a `dequant` takes CHUNK_N alone, at least 32 columns); the fused kernels' tile sizes powers of two
    within their limits (BLOCK_M 16 to 256 on the tensor-core tiles, 1 to 16 rows on gemv; BLOCK_N 16 to 256;
    BLOCK_K 16 to 128, the largest K step block_k_limit allows: the launch caps it to the layer's group layout and
    interleave), num_warps 1 to 16, 1 to 8 stages, SPLIT_K a count from 1 to the most K steps of 16 (16 at least:
    the candidates'; the launch rounds it to whole K steps), GROUP_M 1 to 64, the FLAGS true or false."""
    kind = cfg.get("kernel")
    if kind not in KERNELS:
        return f"the kernel {json.dumps(kind)} is none of {', '.join(KERNELS)}" if "kernel" in cfg \
            else f"it names no kernel ({', '.join(KERNELS)})"
    k = int(shape.split(",")[1])
    bounds = {"BLOCK_M": (1, 16) if kind == "gemv" else (16, 256), "BLOCK_N": (16, 256), "BLOCK_K": (16, 128),
              "num_warps": (1, 16), "num_stages": (1, 8), "SPLIT_K": (1, max(16, -(-k // 16))), "GROUP_M": (1, 64)}
    known = {"kernel", "CHUNK_N"} if kind == "dequant" else {"kernel", *bounds, *FLAGS}
    extra = sorted(set(cfg) - known)
    if extra:
        return f"{', '.join(extra)} {'is' if len(extra) == 1 else 'are'} no key of a {kind} entry"
    if kind == "dequant":
        v = cfg.get("CHUNK_N", 32)
        return None if type(v) is int and v >= 32 else f"CHUNK_N {json.dumps(v)} is no count of columns from 32"
    required = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages") + (() if kind == "gemv" else ("BLOCK_M",))
    missing = [key for key in required if key not in cfg]
    if missing:
        return f"it has no {', '.join(missing)}"
    for name, v in cfg.items():
        if name in FLAGS and type(v) is not bool:
            return f"{name} {json.dumps(v)} is not true or false"
        if name in bounds:
            (lo, hi), pow2 = bounds[name], name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")
            if type(v) is not int or not lo <= v <= hi or (pow2 and v & (v - 1)):
                return f"{name} {json.dumps(v)} is no {'power of two' if pow2 else 'integer'} from {lo} to {hi}"
    from .moe import SM90_SMEM
    floor = smem_floor(cfg)
    if floor > SM90_SMEM:
        return (f"it takes at least {floor} bytes of shared memory, more than sm_90's {SM90_SMEM} (smem_floor: "
                "fewer stages or smaller tiles)")
    return None


def smem_floor(cfg: dict) -> int:
    """Shared memory a GPTQ matmul entry takes at least on sm_90 (a floor, so an entry over it cannot launch and one
    under it may still not: Triton's allocations add more, with no simple law): the tensor-core tiles (mma, mmat)
    keep num_stages - 1 buffers of a K step's 4-bit words [BLOCK_K / 8, BLOCK_N] (int32) and, but on the mma's
    two-fields-per-dot tiles (PAIRS: x's tile stays in registers), of x's tile [BLOCK_M, BLOCK_K] in 16 bits
    (Triton 3.6 compile-only builds for sm_90 reported 0.3 to 52 KiB more; the mma PAIRS tiles less than with x
    counted); the gemv pipelines nothing through shared memory (2 KiB at any stages): 0."""
    if cfg.get("kernel") not in ("mma", "mmat"):
        return 0
    words = cfg["BLOCK_K"] // 8 * cfg["BLOCK_N"] * 4
    x = 0 if cfg["kernel"] == "mma" and cfg.get("PAIRS") and cfg.get("FIELD") else cfg["BLOCK_M"] * cfg["BLOCK_K"] * 2
    return (cfg["num_stages"] - 1) * (words + x)


def load(name: str, section: str = "") -> dict:
    """{"N,K": {bucket: config}} for the GPU called `name` (shipped, the user's cache on top, and on top of both
    $INFER_TUNED_CONFIG_FOLDER's: `tuned_folder`); a `section`'s table ({key: {bucket: config}}) from its own
    files. Read once (`_load`, cached by both arguments: load(name) and load(name, "") are one table, which `save`
    updates)."""
    return _load(name, section)


@functools.lru_cache(maxsize=16)
def _load(name: str, section: str) -> dict:
    merged: dict = {}
    folder = tuned_folder()
    if folder is not None:
        _folder_note(folder, name)
    for path in (SHIPPED / section / f"{name}.json", cache_file(name, section)) + \
            ((folder / section / f"{name}.json",) if folder is not None else ()):
        for shape, by_m in _read(path, section).items():
            merged.setdefault(shape, {}).update({int(b): c for b, c in by_m.items()})
    return merged


@functools.lru_cache(maxsize=16)
def _folder_note(folder: Path, name: str) -> None:
    """One warning where $INFER_TUNED_CONFIG_FOLDER holds no table of GPU `name` (neither `<name>.json` nor
    `moe/<name>.json`): tables are read by the GPU's name, so another GPU's (or a misnamed file) would be ignored
    silently."""
    if (folder / f"{name}.json").exists() or (folder / "moe" / f"{name}.json").exists():
        return
    held = sorted(str(p.relative_to(folder)) for p in (*folder.glob("*.json"), *folder.glob("moe/*.json")))
    log.warning("%s=%s holds no table for this GPU (%s.json, moe/%s.json: tables are read by the GPU's name; it "
                "holds %s): the shipped tables and the cache are used, the rest tuned at the engine start", FOLDER_VAR,
                folder, name, name, ", ".join(held) if held else "no table")


def _cache_clear() -> None:
    """Forget the tables read (a test's new files, a new $INFER_CACHE) and the folder notes given."""
    _load.cache_clear()
    _folder_note.cache_clear()


load.cache_clear = _cache_clear


def table(device: torch.device, section: str = "") -> dict:
    return load(gpu_name(device), section) if device.type == "cuda" else {}


def save(name: str, tuned: dict, section: str = "") -> Path | None:
    """Merge {"N,K": {bucket: config}} into the table already loaded (a `section`'s: its own table) and into the
    user's cache file for GPU `name` (its own file), under an flock of the file's `.lock` beside it (engines starting
    at once, each tuning: none loses the other's entries) and replaced atomically (from a temporary file of its
    own). Returns the file, or None where it cannot be written (a read-only $INFER_CACHE, a full disk): a warning
    then, the configs used by this process alone (set INFER_CACHE to a writable folder to keep them)."""
    for shape, by_m in tuned.items():
        load(name, section).setdefault(shape, {}).update({int(b): c for b, c in by_m.items()})
    path = cache_file(name, section)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_name(path.name + ".lock")):
            data = _read(path, section)
            for shape, by_m in tuned.items():
                data.setdefault(shape, {}).update({str(b): c for b, c in by_m.items()})
            data[FORMAT_KEY] = FORMAT.get(section, 1)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(data, indent=1, sort_keys=True))
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as err:
        log.warning("could not save the tuned kernel configs to %s (%s): this process uses them, a restart tunes "
                    "again; set INFER_CACHE to a writable folder to keep them", path, err)
        return None
    return path


@contextlib.contextmanager
def _locked(lock: Path):
    """An exclusive flock of `lock` (created) while the block runs: one writer of a table file at a time (a file
    system without flock, some network ones: unlocked, as before; the replace stays atomic)."""
    import fcntl
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def tuned(m: int, n: int, k: int, device: torch.device) -> dict | None:
    return table(device).get(f"{n},{k}", {}).get(bucket(m))


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def heuristic(m: int, n: int, k: int, sms: int) -> dict:
    """A reasonable configuration without tuning: split K until about two waves of programs fill the GPU; for
    2-256 rows the field-by-field tensor-core kernel (scale folded into the weights from 17 rows on)."""
    if m == 1:
        block_n = 128
        split = max(1, min(-(-2 * sms // -(-n // block_n)), k // 512, 16))
        return dict(kernel="gemv", BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=split, num_warps=4, num_stages=2)
    if m <= 256:
        block_m = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else 128))
        tiles = -(-m // block_m) * -(-n // 128)
        split = max(1, min(-(-2 * sms // tiles), k // 512, 16))
        return dict(kernel="mma", BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, SPLIT_K=split, GROUP_M=1,
                    num_warps=8 if block_m == 128 else 4, num_stages=3, FIELD=True, SCALE_W=m > 16)
    return dict(kernel="dequant")


def choose(m: int, n: int, k: int, device: torch.device) -> dict:
    return tuned(m, n, k, device) or heuristic(m, n, k, num_sms(device))
