"""Model resolution: what a MODEL argument (a local Hugging Face folder or a built-in model's name) names on disk.

It sits beside the loader, which reads the folder it returns; nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelLoadError
from .tiny import BUILTIN_MODELS, ensure_builtin


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A local model folder as it is (it must hold config.json), or a built-in model name built into the cache."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"model folder {p} has no config.json",
                                 "pass a Hugging Face model folder (config.json and *.safetensors weights)")
        return p
    if p.exists():
        raise ModelLoadError(f"{p} is a file, not a model folder", "pass the folder that holds config.json")
    if str(name_or_path) in BUILTIN_MODELS:
        return ensure_builtin(str(name_or_path))
    raise ModelLoadError(f"{str(name_or_path)!r} is neither a local model folder nor a built-in model "
                         f"({', '.join(BUILTIN_MODELS)})",
                         "pass a folder with config.json and weights; nothing is downloaded")
