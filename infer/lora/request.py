"""vLLM's LoRARequest, so that vLLM code that names its adapters by request runs unchanged: `LLM.generate(...,
lora_request=LoRARequest("sql", 1, "/adapters/sql"))` registers the folder under its name on first use (the engine
needs adapter slots: enable_lora=True, as vLLM needs), then runs it as `lora="sql"`. vLLM's own LoRARequest objects
are read the same way (any object with `lora_name` and `lora_path`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import LoRANameError, RequestError


@dataclass(eq=False)
class LoRARequest:
    """vLLM's fields: `lora_name` (what outputs and /v1/models call it), `lora_int_id` (vLLM's unique id, 1 or more;
    infer keys adapters by name), `lora_path` (the PEFT folder; vLLM's older `lora_local_path` is read too). Equal
    and hashed by lora_name, as vLLM's (a set or a dict key of requests holds one per adapter)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: str | None = None
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise RequestError(f"lora_name must be a non-empty string, got {self.lora_name!r}"[:200])
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise RequestError(f"lora_int_id must be an integer of at least 1 (vLLM's rule), got "
                               f"{self.lora_int_id!r}"[:200])
        if not (self.lora_path or self.lora_local_path):
            raise RequestError(f"LoRARequest {self.lora_name!r} has no lora_path", "give the adapter's PEFT folder")

    def __eq__(self, other) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def adapter_id(self) -> int:  # vLLM's names for the fields
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path or self.lora_local_path


def request_path(request) -> tuple[str, str]:
    """(name, folder) of a LoRARequest, infer's or vLLM's (read by attribute)."""
    name = getattr(request, "lora_name", None)
    path = getattr(request, "lora_path", None) or getattr(request, "lora_local_path", None)
    if not isinstance(name, str) or not name or not path:
        raise RequestError(f"lora_request must be a LoRARequest (lora_name and lora_path), got "
                           f"{type(request).__name__}", 'e.g. LoRARequest("sql", 1, "/adapters/sql"), or pass '
                                                       "lora=NAME for an adapter registered with loras= / add_lora")
    return name, str(path)


def to_register(request, slots) -> tuple[str, str | None]:
    """(the adapter name of vLLM's LoRARequest, its folder if it still has to be registered under that name, else
    None); a name registered from another folder is a LoRANameError naming both. `slots()`: the engine's adapter
    manager (a LoRAError naming enable_lora when it has none), asked once the request is known to be one."""
    name, path = request_path(request)
    manager = slots()
    if not manager.has(name):
        return name, path
    if not same_folder(manager.path_of(name), path):
        raise clash(name, manager.path_of(name), path)
    return name, None


def same_folder(a, b) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return str(a) == str(b)


def clash(name: str, registered: str, path: str) -> LoRANameError:
    return LoRANameError(f"LoRA adapter {name!r} is registered from {registered}; this LoRARequest names {path}",
                         "give the request another lora_name, or replace the adapter first: "
                         "llm.add_lora(name, path, replace=True)")
