"""Which GPTQ matmul configuration to launch for a shape: a table tuned per GPU, else a heuristic.

Tables map "N,K" -> {M bucket: config}, M bucket being the next power of two (capped at 4096). They live in
two places, merged with the user's cache winning: tables shipped with infer for GPUs it was tuned on
(`kernels/configs/<GPU name>.json`), and `$INFER_CACHE/kernels/<GPU name>.json` (default ~/.cache/infer) written
by `gptq_tune` when an engine starts on a GPU or shape nobody tuned before, so a restart does not tune again.
A config is {"kernel": "gemv" | "mma" | "mmat" | "dequant", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "GROUP_M",
"num_warps", "num_stages", "FIELD", "SCALE_W", "PAIRS", "INPLACE", "BYTES", "BYTE_DOTS", "SYNC_MMA", "AHEAD",
"CHUNK_N"} (see
gptq_gemm; absent keys take its defaults).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

MAX_BUCKET = 4096
SHIPPED = Path(__file__).parent / "configs"


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


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@functools.lru_cache(maxsize=16)
def load(name: str, section: str = "") -> dict:
    """{"N,K": {bucket: config}} for the GPU called `name` (shipped, then the user's cache on top); a `section`'s
    table ({key: {bucket: config}}) from its own files."""
    merged: dict = {}
    for path in (SHIPPED / section / f"{name}.json", cache_file(name, section)):
        for shape, by_m in _read(path).items():
            merged.setdefault(shape, {}).update({int(b): c for b, c in by_m.items()})
    return merged


def table(device: torch.device, section: str = "") -> dict:
    return load(gpu_name(device), section) if device.type == "cuda" else {}


def save(name: str, tuned: dict, section: str = "") -> Path:
    """Merge {"N,K": {bucket: config}} into the user's cache file for GPU `name` (atomically) and into the table
    already loaded (a `section`'s: its own file and table)."""
    path = cache_file(name, section)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read(path)
    for shape, by_m in tuned.items():
        data.setdefault(shape, {}).update({str(b): c for b, c in by_m.items()})
        load(name, section).setdefault(shape, {}).update({int(b): c for b, c in by_m.items()})
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


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
