"""Which GPTQ matmul configuration to launch for a shape: a table tuned per GPU, else a heuristic.

Tables map "N,K" -> {M bucket: config}, M bucket being the next power of two (capped at 4096). They live in
two places, merged with the user's cache winning: tables shipped with infer for GPUs it was tuned on
(`kernels/configs/<GPU name>.json`), and `$INFER_CACHE/kernels/<GPU name>.json` (default ~/.cache/infer) written
by `gptq_tune` when an engine starts on a GPU or shape nobody tuned before, so a restart does not tune again;
and a folder the user names ($INFER_TUNED_CONFIG_FOLDER, laid out as the shipped one, read-only) over both.
A config is {"kernel": "gemv" | "mma" | "mmat" | "dequant", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "GROUP_M",
"num_warps", "num_stages", "FIELD", "SCALE_W", "PAIRS", "INPLACE", "BYTES", "BYTE_DOTS", "SYNC_MMA", "AHEAD",
"CHUNK_N"} (see
gptq_gemm; absent keys take its defaults).
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
    path = Path(value).expanduser()
    if not path.is_dir():
        from ..errors import ConfigError
        raise ConfigError(f"{FOLDER_VAR}={value!r} is no folder",
                          "point it at a folder of tuned tables (<GPU name>.json, moe/<GPU name>.json, as "
                          "infer/kernels/configs holds them), or unset it")
    return path


def _read(path: Path, section: str = "") -> dict:
    """{shape: {bucket (a string): config}} of the table file `path`, {} where there is none. What is no such table
    (a corrupt, truncated or hand-edited file: not JSON, not objects of objects, a bucket that is no integer) and
    an entry of a section whose check refuses it (`_check`: the fused MoE's launch configs) are skipped with a
    warning naming the file, never raised at an engine start or launched: the tuner measures those buckets again
    and its `save` writes over them."""
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
    out: dict = {}
    for shape, by_m in data.items():
        if not isinstance(by_m, dict):
            log.warning("ignoring %s's entry %s: not a JSON object of buckets (it is tuned again)", path, shape)
            continue
        for b, cfg in by_m.items():
            why = _check(b, cfg, section)
            if why:
                log.warning("ignoring %s's entry %s / %s: %s (it is tuned again)", path, shape, b, why)
            else:
                out.setdefault(shape, {})[b] = cfg
    return out


def _check(b: str, cfg, section: str) -> str | None:
    """Why a table entry (bucket `b`, `cfg`) cannot be used, or None."""
    if not isinstance(cfg, dict):
        return f"{json.dumps(cfg)} is no JSON object of launch parameters"
    try:
        int(b)
    except ValueError:
        return f"the bucket {b!r} is no count of tokens"
    if section == "moe":
        from .moe import config_error
        return config_error(cfg)
    return None


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
    for path in (SHIPPED / section / f"{name}.json", cache_file(name, section)) + \
            ((folder / section / f"{name}.json",) if folder is not None else ()):
        for shape, by_m in _read(path, section).items():
            merged.setdefault(shape, {}).update({int(b): c for b, c in by_m.items()})
    return merged


load.cache_clear = _load.cache_clear  # (forget the tables read: a test's new files, a new $INFER_CACHE)


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
