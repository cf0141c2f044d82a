"""Probes of the eighteenth session: each test fails without the fix it names."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import infer
from infer import errors


def test_every_error_class_imports_from_infer():
    """`from infer import RequestError` works, as `from vllm import ...` users expect, and gives the class infer raises
    (not a copy); `import infer` still loads no torch."""
    classes = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.InferError)}
    assert {"InferError", "RequestError", "ConfigError", "LoRAError", "ClosedError"} <= classes
    for name in classes:
        assert getattr(infer, name) is getattr(errors, name), name
        assert name in infer.__all__, name
    with pytest.raises(AttributeError, match="NotAnError"):
        infer.NotAnError  # noqa: B018
    code = "import sys, infer; infer.RequestError; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
