"""Which Triton kernels compile while a block of code runs: an engine start is meant to leave nothing to compile on
a user's request, and `bench.gpu_e2e` reports what a measured run compiled (through Triton's public compile hook,
`triton.knobs.runtime.jit_cache_hook`, called before every compile that is not already in memory)."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def watch_compiles():
    """Yields a list that receives the name of every kernel Triton compiles inside the block (empty, and nothing
    watched, without Triton). A hook set before is still called, and decides as before."""
    names: list[str] = []
    try:
        from triton import knobs
    except ImportError:
        yield names
        return
    before = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        names.append(getattr(fn, "name", None) or str(kwargs.get("repr", "?")))
        return before(*args, **kwargs) if before is not None else False  # False: compile as usual
    knobs.runtime.jit_cache_hook = hook
    try:
        yield names
    finally:
        knobs.runtime.jit_cache_hook = before
