"""Session 75: what made the test run (and `infer warmup` in a process holding many objects) slow.

- memory.meter.survivors_frozen: the meters' garbage collections (PeakMeter, resident_bytes: two a worst-case batch)
  scanned every object of the process; the warmup now freezes what survives one collection first, so that they scan
  only what the load and the runs allocate, and frees the same garbage.
- `infer warmup` built an embedding on the meta device first, to import torch._dynamo before it measured the weights
  (a meta embedding's init imports it: 2.6 s and ~100 MB); no model's load imports it any more, and no warmup does."""

import gc

import pytest

from infer.memory import meter


class Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture
def unfrozen():
    if gc.get_freeze_count():
        pytest.skip("this process froze objects of its own")
    yield
    gc.unfreeze()


def test_what_survived_is_frozen_and_a_cycle_made_inside_is_still_collected(unfrozen):
    import weakref
    before = Cycle()
    with meter.survivors_frozen():
        assert gc.get_freeze_count() > 0 and gc.is_tracked(before)
        inside = Cycle()
        gone = weakref.ref(inside)
        del inside
        meter.resident_bytes(__import__("torch").device("cpu"))  # (its collection, as the meter makes it)
        assert gone() is None
    assert gc.get_freeze_count() == 0


def test_an_error_inside_unfreezes(unfrozen):
    with pytest.raises(ZeroDivisionError):
        with meter.survivors_frozen():
            1 / 0
    assert gc.get_freeze_count() == 0


def test_inside_a_freeze_of_the_callers_nothing_is_unfrozen(unfrozen):
    """A server that froze its start-up objects (gc.freeze, as vLLM does) keeps them frozen."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    with meter.survivors_frozen():
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen


def test_the_warmups_meters_run_with_the_survivors_frozen(unfrozen, monkeypatch):
    from infer.cli.warmup_plan import measured_plan
    from infer.engine.config import EngineConfig
    counts = []
    enter = meter.PeakMeter.__enter__

    def counted(self):
        counts.append(gc.get_freeze_count())
        return enter(self)
    monkeypatch.setattr(meter.PeakMeter, "__enter__", counted)
    plan, _ = measured_plan(EngineConfig(model="tiny-llama", max_num_seqs=2, max_model_len=64), 64, 2)
    assert counts and all(c > 0 for c in counts) and plan.activation_peak_bytes > 0
    assert gc.get_freeze_count() == 0


def test_a_warmup_and_the_loads_of_three_families_import_no_dynamo():
    import os
    import subprocess
    import sys

    from infer.models.tiny import ensure_builtin
    for name in ("tiny-llama", "tiny-qwen3-moe", "tiny-granite4", "tiny-gemma3"):  # (built here: transformers builds
        ensure_builtin(name)  # a built-in from its config, which imports torch._dynamo; a load reads it)
    code = ("import sys, torch\nfrom infer.cli.warmup_plan import measured_plan\n"
            "from infer.engine.config import EngineConfig\nfrom infer.models.loader import load_model\n"
            "from infer.models.tiny import ensure_builtin\n"
            "measured_plan(EngineConfig(model='tiny-llama', max_num_seqs=1, max_model_len=64), 64, 1)\n"
            "for name in ('tiny-qwen3-moe', 'tiny-granite4', 'tiny-gemma3'):\n"
            "    load_model(ensure_builtin(name), torch.float32, torch.device('cpu'))\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]


def test_the_tests_tls_contexts_are_one_per_set_of_certificates():
    """tests/conftest.py: httpx's clients (one a one-off request) share a TLS context per CA set, each still a
    verifying client context."""
    import ssl

    import certifi
    import httpx
    a, b = ssl.create_default_context(), ssl.create_default_context()
    c = ssl.create_default_context(cafile=certifi.where())
    assert a is b and c is not a and c is ssl.create_default_context(cafile=certifi.where())
    assert c.verify_mode == ssl.CERT_REQUIRED and c.check_hostname and c.cert_store_stats()["x509_ca"] > 0
    assert ssl.create_default_context(ssl.Purpose.CLIENT_AUTH) is not a
    with httpx.Client() as one, httpx.Client() as two:
        pools = [client._transport._pool for client in (one, two)]
        shared = pools[0]._ssl_context  # (the CA set SSL_CERT_FILE names where it is set, else certifi's)
    assert shared is pools[1]._ssl_context and shared.verify_mode == ssl.CERT_REQUIRED
    assert any(shared is context for context in ssl.create_default_context.contexts.values())


def test_a_large_cache_makes_its_blocks_without_a_collection():
    """engine.block_manager.new_blocks: a cache's block objects set off no garbage collection while they are made
    (each of the 285 a collector running made of 200,000 blocks could scan the whole process; the rest of the
    manager's start may set off one), and the collector is left as it was."""
    from infer.engine.block_manager import BlockManager
    starts = []

    def count(phase, info):
        if phase == "start":
            starts.append(info["generation"])
    gc.callbacks.append(count)
    try:
        manager = BlockManager(200_000, 16)
    finally:
        gc.callbacks.remove(count)
    assert len(starts) <= 1 and gc.isenabled(), starts
    assert len(manager.blocks) == 200_000 and all(b.block_id == i for i, b in enumerate(manager.blocks))
    gc.disable()
    try:
        BlockManager(10, 16)
        assert not gc.isenabled()
    finally:
        gc.enable()
