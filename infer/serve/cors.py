"""CORS as vLLM's server has it: --allowed-origins, --allowed-methods, --allowed-headers (JSON lists of strings,
default ["*"]) and --allow-credentials configure Starlette's CORSMiddleware, so that a browser page on another
origin can call the API (its preflight OPTIONS is answered before routing, hence before --api-key is checked: a
preflight never carries the key)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import ConfigError, json_problem


@dataclass(frozen=True)
class CorsOptions:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def middleware_kwargs(self) -> dict:
        return {"allow_origins": list(self.allowed_origins), "allow_methods": list(self.allowed_methods),
                "allow_headers": list(self.allowed_headers), "allow_credentials": self.allow_credentials}


def json_list(value: str, option: str) -> tuple[str, ...]:
    """`value` of `option` read as vLLM reads it: a JSON list of strings, e.g. '["http://localhost:3000"]'."""
    hint = f"give a JSON list of strings, e.g. {option} '[\"*\"]' or {option} '[\"http://localhost:3000\"]'"
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{option} {value[:60]!r} is not JSON ({json_problem(e)})", hint) from None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise ConfigError(f"{option} {value!r} is not a JSON list of strings", hint)
    return tuple(parsed)


def cors_options(origins: str, methods: str, headers: str, credentials: bool) -> CorsOptions:
    """The four command-line values, checked (each bad one is named)."""
    return CorsOptions(json_list(origins, "--allowed-origins"), json_list(methods, "--allowed-methods"),
                       json_list(headers, "--allowed-headers"), bool(credentials))
