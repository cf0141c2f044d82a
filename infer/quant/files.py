"""A checkpoint folder's weight files through its index (shared by the loader above and the quant drivers)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelLoadError


def indexed_files(path: Path) -> list[Path] | None:
    """The shards a sharded checkpoint's index names (safetensors' index first), each of them present; None when the
    folder has no index (model.safetensors beside a .bin index: the single safetensors file wins)."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = Path(path) / index_name
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ModelLoadError(f"{index} is not a valid weight index: {e}") from e
            missing = [n for n in names if not (path / n).is_file()]
            if missing:
                raise ModelLoadError(f"{path} is missing weight shards {missing}", "copy the whole model folder")
            return [path / n for n in names]
        if (Path(path) / single).is_file():
            return None
    return None
