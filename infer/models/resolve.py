"""Model resolution: what a MODEL argument (a local Hugging Face folder or a built-in model's name) names on disk.

It sits beside the loader, which reads the folder it returns; nothing is downloaded.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from ..checks import closest_sibling
from ..errors import ModelLoadError
from .tiny import BUILTIN_MODELS, ensure_builtin

# a Hugging Face hub id as vLLM and transformers take it: ORG/NAME, each part of letters, digits, "-", "_", "."
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# a model's page on the hub, as a browser shows it: https://huggingface.co/ORG/NAME (/tree/main, ...); not a page of
# the hub's other kinds (https://huggingface.co/datasets/ORG/NAME is no model ORG "datasets")
_HUB_SITE = r"(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/"
_HUB_URL = re.compile(_HUB_SITE + r"(?!(?:datasets|spaces|docs|collections|papers|blog|organizations|settings)/)"
                      r"([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:/.*)?$")


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A local model folder as it is (it must hold config.json), or a built-in model name built into the cache."""
    if not str(name_or_path).strip():  # (Path('') is the current folder: "model folder . has no config.json")
        raise ModelLoadError(f"the model is empty ({str(name_or_path)!r}): no folder, built-in name or hub id",
                             "give a model folder, a built-in model (e.g. tiny-llama) or a Hugging Face id "
                             "(is the variable that holds it unset?)")
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise _not_a_model_folder(p)
        return p
    if p.exists():
        if p.suffix.lower() == ".gguf":
            raise ModelLoadError(f"{p} is a GGUF file: infer does not read GGUF (llama.cpp's format)",
                                 "pass the original Hugging Face folder (config.json, safetensors weights, tokenizer "
                                 "files), or its GPTQ version; `infer quantize FOLDER -o OUT` makes one")
        raise ModelLoadError(f"{p} is a file, not a model folder", "pass the folder that holds config.json")
    name = str(name_or_path)
    if name in BUILTIN_MODELS:
        return ensure_builtin(name)
    if is_hub_id(name):  # downloaded before (hf download, transformers, vLLM): the local hub cache's snapshot
        cached = _hub_cache_snapshot(name)
        if cached is not None:
            return cached
    raise ModelLoadError(f"{name!r} is neither a local model folder nor a built-in model "
                         f"({', '.join(BUILTIN_MODELS)})", _unknown_name_hint(name))


def typed_name(name_or_path: str | os.PathLike) -> str | None:
    """A built-in model's name or a hub id as the user typed it (what titles and banners name, as `infer serve` lists
    it), not the cache folder or snapshot it resolves to; None for a local path (the caller names the folder)."""
    given = str(name_or_path)
    if Path(given).expanduser().exists():
        return None
    return given if given in BUILTIN_MODELS or is_hub_id(given) else None


def source_name(name_or_path: str | os.PathLike) -> str:
    """The name a copy of the model records as its source (config.json's `_name_or_path`, which an adapter trained on
    the model may name as its base): a local folder's absolute path, else the built-in or hub name as given."""
    p = Path(name_or_path).expanduser()
    return str(p.resolve()) if p.is_dir() else str(name_or_path)


def _not_a_model_folder(p: Path) -> ModelLoadError:
    """A folder without config.json: say what it holds when a newcomer's usual mix-up explains it."""
    if (p / "adapter_config.json").is_file():
        return ModelLoadError(f"{p} is a PEFT LoRA adapter (adapter_config.json, no config.json), not a model"
                              f"{_trained_on(p)}",
                              f"pass its base model as MODEL and the adapter with --lora NAME={p} (infer convert: "
                              f"--merge-lora {p}; infer lora-validate: BASE {p})")
    ggufs = sorted(f.name for f in p.glob("*.gguf"))
    if ggufs:
        return ModelLoadError(f"model folder {p} has no config.json, only GGUF weights ({ggufs[0]}): infer does not "
                              "read GGUF (llama.cpp's format)",
                              "pass the original Hugging Face folder (config.json, safetensors weights, tokenizer "
                              "files), or its GPTQ version; `infer quantize FOLDER -o OUT` makes one")
    snapshots = _snapshots(p / "snapshots")
    if snapshots:  # a hub cache's models--ORG--NAME folder: the model files are in a snapshot below it
        return ModelLoadError(f"{p} is a Hugging Face cache folder: the model files are in its snapshots",
                              f"pass the snapshot folder, e.g. {snapshots[-1]}")
    return ModelLoadError(f"model folder {p} has no config.json",
                          "pass a Hugging Face model folder (config.json and *.safetensors weights)")


def _unknown_name_hint(name: str) -> str:
    local = missing_folder_hint(name)
    if local and ("/" in name or name.startswith("~")):  # a path (no built-in name has a "/"): its folder first
        return local
    close = _close_builtins(name)
    if close:
        names = repr(close[0]) if len(close) == 1 else f"{', '.join(map(repr, close[:-1]))} or {close[-1]!r}"
        return f"did you mean the built-in model {names}? Else pass a folder with config.json and weights"
    if local:
        return local
    if is_hub_id(name):
        return _download_hint(name, f"{name!r} looks like a Hugging Face hub id, and the local hub cache "
                                    f"({_hub_cache_root()}) does not hold it")
    url = _HUB_URL.match(name)
    if url:  # a model page's address, copied from the browser
        repo = url.group(1)
        if _hub_cache_snapshot(repo) is not None:
            return f"infer takes no URL: pass the hub id {repo}, which the local hub cache holds"
        return _download_hint(repo, "infer takes no URL, and the local hub cache does not hold this model")
    if re.match(_HUB_SITE, name):  # a dataset's or a space's page
        return ("infer takes no URL, and this is no model's page on the hub: pass a model's hub id ORG/NAME (its page "
                "is https://huggingface.co/ORG/NAME) or a local model folder")
    if "://" in name:
        return "infer reads local folders only, never a URL: download the model into a folder and pass that folder"
    if "/" in name or name.startswith(("~", ".")):
        return _missing_ancestor_hint(name)
    cached = _cached_hub_ids(name)
    if cached:
        return f"did you mean the hub id {' or '.join(cached)}, which the local hub cache holds? Pass it as ORG/NAME"
    return (f"pass a folder with config.json and weights, or a Hugging Face hub id, ORG/{name}, that the local hub "
            f"cache holds (`hf download ORG/{name}` fetches it); nothing is downloaded")


def _download_hint(repo: str, why: str) -> str:
    local = repo.split("/")[1]
    return (f"{why}; nothing is downloaded: fetch it first, `hf download {repo}` (then pass {repo}), or with "
            f"`--local-dir ./{local}` and pass ./{local}")


def _missing_ancestor_hint(name: str) -> str:
    """For a path none of whose last parts exist: the first folder on it that is missing."""
    p = Path(name).expanduser()
    missing = p
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    if missing != p and missing.parent.is_dir():
        return f"there is no folder {str(missing)!r} (check the path): pass a folder with config.json and weights"
    return "pass a folder with config.json and weights; nothing is downloaded"


def _cached_hub_ids(name: str) -> list[str]:
    """The hub ids ORG/NAME whose NAME is `name` (any letter case) that the local hub cache holds, at most three."""
    try:
        folders = sorted(f.name for f in _hub_cache_root().iterdir() if f.name.startswith("models--"))
    except OSError:
        return []
    ids = [f.removeprefix("models--").replace("--", "/", 1) for f in folders]
    return [i for i in ids if i.split("/")[-1].lower() == name.lower()
            and _snapshots(_hub_cache_root() / f"models--{i.replace('/', '--')}" / "snapshots")][:3]


def _close_builtins(name: str) -> list[str]:
    """The built-in names close to `name`, at most three, closest first: every one a typo may have meant
    (`tiny-gemma4`: tiny-gemma, tiny-gemma2, tiny-gemma3), and a name typed without the `tiny-` prefix (`mixtral`,
    `gemma3`, `phi4`)."""
    key = name.lower()
    close = difflib.get_close_matches(key, BUILTIN_MODELS, n=3, cutoff=0.75)
    if not key.startswith("tiny-") and "/" not in key:  # (not a hub id's ORG/NAME: Qwen/Qwen2 is no tiny-qwen2)
        close += [c for c in difflib.get_close_matches("tiny-" + key, BUILTIN_MODELS, n=3, cutoff=0.75)
                  if c not in close]
    return close[:3]


def missing_folder_hint(text: str) -> str | None:
    """For a path that is not there but whose parent is a local folder (a typo in the last part): the parent's
    folder of the closest name, else None. A missing `infer-demo/tiny-llama-gtpq` is then no hub id to download."""
    p = Path(text).expanduser()
    parent = p.parent
    if p.name in ("", ".", "..") or not parent.is_dir():
        return None
    close = closest_sibling(p, folders=True)
    if close is None:
        return None
    if close:
        return f"the folder {str(parent)!r} has no {p.name!r}: did you mean {str(parent / close[0])!r}?"
    if parent == Path("."):
        return None  # a bare name (or ./NAME) nothing is close to: the caller's own hint applies
    return f"the folder {str(parent)!r} has no {p.name!r} (check the path)"


def is_hub_id(name: str) -> bool:
    """Whether `name` (not a local path) reads as a Hugging Face hub id, ORG/NAME."""
    return bool(_HUB_ID.fullmatch(name)) and not name.startswith(".")


def _hub_cache_root() -> Path:
    """The local Hugging Face hub cache, as huggingface_hub finds it (read from the environment on each call)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    hf_home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(hf_home).expanduser() / "hub"


def _hub_cache_snapshot(repo_id: str) -> Path | None:
    """The snapshot of `repo_id` the local hub cache's `main` points to (what transformers and vLLM load offline),
    else its newest snapshot that holds config.json (one downloaded at a pinned revision), or None."""
    from huggingface_hub import try_to_load_from_cache
    root = _hub_cache_root()
    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=root)
    except Exception:  # noqa: BLE001 - a name huggingface_hub refuses is simply not in the cache
        found = None
    if isinstance(found, str):
        return Path(found).parent
    snapshots = _snapshots(root / ("models--" + repo_id.replace("/", "--")) / "snapshots")
    return snapshots[-1] if snapshots else None


def _snapshots(folder: Path) -> list[Path]:
    """The snapshot folders under a hub cache's `snapshots` that hold config.json, oldest first."""
    try:
        found = [s for s in folder.iterdir() if (s / "config.json").is_file()]
    except OSError:
        return []
    return sorted(found, key=lambda s: s.stat().st_mtime)


def _trained_on(adapter: Path) -> str:
    """': it was trained on NAME' from the adapter's base_model_name_or_path, or '' when it names none."""
    import json
    try:
        named = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return ""
    return f": it was trained on {named!r}" if isinstance(named, str) and named.strip() else ""
