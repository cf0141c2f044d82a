import os
from pathlib import Path

# Without a GPU, Triton kernels can only run in the interpreter; it must be chosen before anything imports triton.
# And torch.compile runs eagerly: infer compiles nothing, but GPTQModel's torch kernel (the oracle of the GPTQ tests,
# quant_helpers.gptqmodel_greedy) compiles its dequantization at every load, a C++ build per shape (minutes on a cold
# inductor cache) for the values an eager run gives.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _threads() -> int:
    """Torch's CPU threads in this test process: the cores shared among the pytest-xdist workers (scripts/test runs one
    a core), at most 2. Two workers of two threads each on two cores oversubscribe them: each worker's OpenMP threads
    spin while the other's run, which made CPU-bound test files about twice as slow (60 s against 30 s for
    test_engine_hf.py with session 59's families, on the 2-core CI machine)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, min(2, (os.cpu_count() or 1) // workers))


torch.set_num_threads(_threads())
if os.environ.get("PYTEST_XDIST_WORKER"):  # (and the infer processes a test starts: the same share of the cores)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads()))


def _interpret_device_calls_without_repatching() -> None:
    """Under TRITON_INTERPRET=1, triton's interpreter patches triton.language (inspect.getmembers over its modules)
    at every launch, and again at every call of a @triton.jit helper inside a kernel, per program: a third to two
    fifths of an interpreted kernel or engine test's time. A helper's call patches what its module sees (triton.language, triton.language.core)
    and leaves it so until the launch returns; here a helper whose modules this launch already patched skips it.
    Launches patch and restore as before. Test speed only: a triton whose interpreter lacks `_patch_lang` runs as it
    is, and INFER_TEST_SLOW_INTERPRETER=1 turns it off."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or hasattr(patch, "patched"):
        return
    patched: set = set()  # ids of the language modules the running launch has patched
    seen: dict = {}  # function -> the ids of the language modules it sees

    def langs(fn) -> set:
        if fn not in seen:
            import triton.language as tl
            seen[fn] = {id(v) for v in fn.__globals__.values() if isinstance(v, type(tl)) and v in (tl, tl.core)}
        return seen[fn]

    class Launch:  # the scope of a launch's patches: restored when the launch returns
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            patched.clear()
            self.scope.restore()

    def patch_lang(fn):
        mine = langs(fn)
        if patched and mine <= patched:  # a helper inside a launch whose patches cover its modules
            return None
        scope = patch(fn)
        if patched:  # a helper that sees a module the launch did not (the interpreter never restores these)
            patched.update(mine)
            return scope
        patched.update(mine)
        return Launch(scope)
    patch_lang.patched = patched
    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1" and not os.environ.get("INFER_TEST_SLOW_INTERPRETER"):
    _interpret_device_calls_without_repatching()


@pytest.fixture(scope="session", autouse=True)
def _infer_cache(tmp_path_factory):
    """Built-in models are generated once per test session into a temporary cache (unless INFER_CACHE is set)."""
    if not os.environ.get("INFER_CACHE"):
        os.environ["INFER_CACHE"] = str(tmp_path_factory.mktemp("infer-cache"))
    yield



@pytest.fixture
def poisoned_outputs():
    """torch.empty returns NaN-filled tensors while deterministic mode is on (kernel tests use it: a row a kernel
    forgets to write fails the comparison)."""
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)


@pytest.fixture
def gen():
    """A generator with a fresh random seed every run (its initial_seed() names it on failure)."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


_MISSING = object()


def defuser_originals() -> dict:
    """What GPTQModel's defuser replaces process-wide when it quantizes or loads a mixture of experts (transformers'
    sparse MoE blocks of Qwen3-MoE, Mixtral and Qwen2-MoE become per-expert ModuleLists, and its checkpoint
    conversion mapping renames their weights): {(module, attribute): the original}, taken before any test runs."""
    try:
        import importlib

        from defuser.model_registry import MODEL_CONFIG, PATCH
    except Exception:  # (GPTQModel's defuser absent: nothing patches transformers)
        return {}
    import transformers.conversion_mapping as conversion
    import transformers.modeling_utils as modeling
    found = {(m, "get_checkpoint_conversion_mapping"): getattr(m, "get_checkpoint_conversion_mapping", _MISSING)
             for m in (conversion, modeling)}
    for model_type in ("qwen3_moe", "mixtral", "qwen2_moe"):
        for orig, _ in MODEL_CONFIG.get(model_type, {}).get(PATCH.REPLACE_MODULE, []):
            module, name = orig.rsplit(".", 1)
            m = importlib.import_module(module)
            found[(m, name)] = getattr(m, name)
    return found


def restore_originals(originals: dict) -> None:
    for (module, name), value in originals.items():
        if getattr(module, name, _MISSING) is not value:
            if value is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, value)


@pytest.fixture(scope="session")
def _defuser_originals():
    return defuser_originals()


@pytest.fixture(autouse=True)
def _undo_defuser(_defuser_originals):
    """A test that quantizes or loads an MoE with GPTQModel in this process leaves transformers' MoE classes as they
    were for the next test (which may build transformers' Qwen3-MoE or Mixtral as the reference)."""
    yield
    restore_originals(_defuser_originals)

def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
