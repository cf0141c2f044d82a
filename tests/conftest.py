import os
from pathlib import Path

# Without a GPU, Triton kernels can only run in the interpreter; it must be chosen before anything imports triton.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session", autouse=True)
def _infer_cache(tmp_path_factory):
    """Built-in models are generated once per test session into a temporary cache (unless INFER_CACHE is set)."""
    if not os.environ.get("INFER_CACHE"):
        os.environ["INFER_CACHE"] = str(tmp_path_factory.mktemp("infer-cache"))
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
