"""Kernel switches chosen by an environment variable (read once by the module that owns the switch; tests and
benchmarks set the module's value directly)."""

from __future__ import annotations

import os


def env_choice(var: str, choices: tuple[str, ...], what: str) -> str:
    """The environment's `var` (surrounding blanks ignored) if it is one of `choices`, the first of them when it is
    unset; a ConfigError that names the variable and the choices otherwise. `what`: what the value says (for the
    message: "INFER_X='y' is not <what>")."""
    value = os.environ.get(var, choices[0]).strip()
    if value not in choices:
        from ..errors import ConfigError
        raise ConfigError(f"{var}={value!r} is not {what}",
                          f"use {choices[0]} (the default) or {' or '.join(choices[1:])}, or unset it")
    return value
