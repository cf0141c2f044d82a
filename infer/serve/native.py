"""Bound the native caches that grow with every new batch shape, so a long-running server's memory levels off.

On CPU each matmul of a new shape (the flat batch of a step has a new token count most steps) adds an entry to
oneDNN's primitive cache and to PyTorch's ideep LRU cache; both default to 1024 entries of JIT code and scratch
buffers, which grew the server's RSS by ~250 MB over 3,000 requests (issue 16). Both caches read their capacity
from the environment when first used, so this must run before the engine loads a model. A value already set in
the environment wins.
"""

from __future__ import annotations

import os

NATIVE_CACHE_ENTRIES = 64  # enough for the recurring decode shapes; measured flat RSS in tests/test_serve_soak.py
_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_native_caches(entries: int = NATIVE_CACHE_ENTRIES) -> dict[str, str]:
    """Set the cache capacities (unless the environment sets them); returns what is in effect."""
    for name in _VARS:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in _VARS}
