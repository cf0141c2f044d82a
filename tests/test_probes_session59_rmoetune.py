"""Session 59 review of the fused MoE tuner (kernels.moe_tune) and its tables (gptq_configs' section "moe"): a
corrupt or hand-edited table file skipped with a warning (never a traceback at an engine start, never an invalid
launch config on every step) and tuned again; a cache that cannot be written keeps the configs for the process;
concurrent engine starts saving the same file keep each other's entries; the shipped tables packaged."""

from __future__ import annotations

import fnmatch
import json
import logging
import threading
import tomllib
from pathlib import Path

import pytest
import torch

from infer.kernels import gptq_configs, moe, moe_tune

from test_probes_session56_moeq import int4_experts, routing
from test_probes_session59_moetune import FASTEST, FakeModel, interpreted, moe_cache, use_table  # noqa: F401

KEY = moe.layer_key(8, 64, 32, 2, torch.float32)


def write_cache(name: str, data, section: str = moe.SECTION) -> Path:
    path = gptq_configs.cache_file(name, section)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_table_file_that_is_no_table_is_skipped_with_a_warning_naming_it(moe_cache, caplog):
    """Not JSON, a JSON list, a shape whose buckets are no object: the file (or that shape) ignored with a warning
    naming the file, the rest of the table still read (was: a JSONDecodeError swallowed silently, and an
    AttributeError traceback at the engine start for the others)."""
    caplog.set_level(logging.WARNING, logger="infer")
    path = write_cache("GPU_X", "{not json")
    assert gptq_configs.load("GPU_X", moe.SECTION) == {}
    assert str(path) in caplog.text and "delete it" in caplog.text
    for data in ([1, 2], {KEY: 5, "2,64,32,2,float32": {"1": {"BLOCK_M": 16}}}):
        caplog.clear()
        gptq_configs.load.cache_clear()
        write_cache("GPU_X", data)
        want = {} if isinstance(data, list) else {"2,64,32,2,float32": {1: {"BLOCK_M": 16}}}
        assert gptq_configs.load("GPU_X", moe.SECTION) == want
        assert str(path) in caplog.text


BAD = {"3": {"BLOCK_M": 24}, "4": {"BLOCK_M": 16, "BLOCK_K": 64}, "8": {"BLOCK_M": 16, "BLOCK_N": 48},
       "16": {"BLOCK_N": 32}, "32": {"BLOCK_M": 16, "num_warps": 3}, "64": {"BLOCK_M": 16, "num_stages": 0},
       "128": {"BLOCK_M": "16"}, "256": [16], "x": {"BLOCK_M": 16}}


@pytest.mark.parametrize("bucket", sorted(BAD))
def test_an_invalid_moe_entry_is_skipped_never_launched(moe_cache, monkeypatch, caplog, bucket):
    """A hand-edited (or another version's) entry that no launch can take (BLOCK_M 24, a BLOCK_K, a BLOCK_N or
    num_warps no power of two, no stages, no BLOCK_M, a string, no object, a bucket no count) is dropped from the
    loaded table with a warning naming the file, the shape and the bucket: a step of its bucket takes the
    heuristics (was: every step of it raised, or launched a kernel that cannot compile), the valid entries beside
    it kept."""
    caplog.set_level(logging.WARNING, logger="infer")
    good = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    path = write_cache("GPU_X", {KEY: {bucket: BAD[bucket], "2": good}})
    assert gptq_configs.load("GPU_X", moe.SECTION) == {KEY: {2: good}}
    assert str(path) in caplog.text and KEY in caplog.text and bucket in caplog.text
    use_table(monkeypatch, "GPU_X")
    tokens = int(bucket) if bucket.isdigit() else 1
    assert moe.step_config(KEY, tokens, 2, 8, torch.device("cpu")) == {"BLOCK_M": moe.choose_block_m(tokens, 2, 8)}
    assert moe.step_config(KEY, 2, 2, 8, torch.device("cpu")) == good
    assert moe.config_error(good) is None and moe.config_error(FASTEST) is None


@interpreted
def test_the_tuner_measures_an_invalid_entry_again_and_writes_over_it(moe_cache, monkeypatch):
    """An invalid entry of the cache file counts as missing: the engine start's tuning measures its bucket again
    and the save writes the winner over it (the file's invalid entries dropped)."""
    e, k, h, i = 8, 2, 64, 32
    w13, w2 = int4_experts(e, h, 2 * i, 32, False, False, True, 0), int4_experts(e, i, h, 32, False, False, True, 1)
    key = moe.experts_key(w13, w2, k, torch.float32)
    path = write_cache("GPU_X", {key: {"1": {"BLOCK_M": 24}, "2": FASTEST, "8": {"BLOCK_M": 16, "BLOCK_N": 48}}})

    def timer(fns, cfg):
        return 1.0 if cfg == FASTEST else 5.0
    assert moe_tune.tune_model(FakeModel(w13, w2, k), 2, torch.device("cpu"), timer=timer, name="GPU_X",
                               quick=True)[0] == 1
    assert json.loads(path.read_text()) == {key: {"1": FASTEST, "2": FASTEST},
                                            gptq_configs.FORMAT_KEY: gptq_configs.FORMAT[moe.SECTION]}


def test_a_cache_that_cannot_be_written_keeps_the_configs_for_the_process(moe_cache, monkeypatch, caplog):
    """$INFER_CACHE not writable (here a file where its folder should be; a read-only mount alike): save warns,
    naming the file and INFER_CACHE, returns None, and this process's table has the configs (was: an OSError
    traceback out of the engine start, after all the tuning)."""
    caplog.set_level(logging.WARNING, logger="infer")
    blocker = moe_cache / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("INFER_CACHE", str(blocker))
    assert gptq_configs.save("GPU_X", {KEY: {4: FASTEST}}, moe.SECTION) is None
    assert "INFER_CACHE" in caplog.text and str(gptq_configs.cache_file("GPU_X", moe.SECTION)) in caplog.text
    assert gptq_configs.load("GPU_X", moe.SECTION) == {KEY: {4: FASTEST}}
    assert gptq_configs.save("GPU_X", {"64,64": {1: {"kernel": "dequant"}}}) is None  # (the int4 table's too)
    assert gptq_configs.load("GPU_X", "") == {"64,64": {1: {"kernel": "dequant"}}}  # (as table() reads it)


def test_engines_saving_the_same_cache_file_at_once_keep_each_others_entries(moe_cache, monkeypatch):
    """Two savers of one cache file (engines starting at once on one machine): the second waits for the first's
    read-merge-replace (an flock), so the file ends with both entries (was: each read the file, merged its own
    and replaced it: the last writer dropped the other's entries, both writing the same `<pid>.tmp` in threads)."""
    first_read, second_done = threading.Event(), threading.Event()
    real = gptq_configs._read
    calls = []

    def slow_read(path, section=""):
        out = real(path, section)
        calls.append(path)
        if len(calls) == 1:  # the first saver has read the file: the second runs now, if nothing stops it
            first_read.set()
            second_done.wait(2)
        return out
    path = write_cache("GPU_X", {})
    gptq_configs.load("GPU_X", moe.SECTION)  # (loaded: the savers' reads are their merges')
    monkeypatch.setattr(gptq_configs, "_read", slow_read)
    one = threading.Thread(target=gptq_configs.save, args=("GPU_X", {KEY: {1: FASTEST}}, moe.SECTION))
    one.start()
    assert first_read.wait(10)
    two = threading.Thread(target=lambda: (gptq_configs.save("GPU_X", {KEY: {2: FASTEST}}, moe.SECTION),
                                           second_done.set()))
    two.start()
    one.join(10)
    two.join(10)
    assert calls == [path, path]
    assert json.loads(path.read_text()) == {KEY: {"1": FASTEST, "2": FASTEST},
                                            gptq_configs.FORMAT_KEY: gptq_configs.FORMAT[moe.SECTION]}
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".tmp"] == []  # (no temporary file left)


def test_the_shipped_moe_tables_are_packaged():
    """pyproject's package-data takes the files gptq_configs reads as shipped tables of section "moe"
    (kernels/configs/moe/<GPU>.json) as it takes the dense ones: a wheel without them tunes at every first start."""
    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["infer"]
    for section in ("", moe.SECTION):
        shipped = (gptq_configs.SHIPPED / section / "NVIDIA_H100_80GB_HBM3.json").relative_to(root / "infer")
        assert any(fnmatch.fnmatch(str(shipped), g) and g.count("/") == str(shipped).count("/") for g in globs), \
            shipped


@interpreted
def test_a_step_with_expert_adapters_takes_the_tuned_entry_and_computes_the_reference(moe_cache, monkeypatch):
    """A tuned entry (BLOCK_M, BLOCK_N, warps, stages) is the experts' launch config of a step with the experts'
    adapters too (their pairs keep the heuristics), and the output is the reference's."""
    from infer.kernels import reference
    e, k, h, i, slots, r = 8, 2, 64, 32, 2, 8
    w13, w2 = int4_experts(e, h, 2 * i, 32, False, False, True, 0), int4_experts(e, i, h, 32, False, False, True, 1)
    t = 5
    cfg = {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    gptq_configs.save("GPU_X", {moe.experts_key(w13, w2, k, torch.float32): {gptq_configs.bucket(t): cfg}},
                      moe.SECTION)
    use_table(monkeypatch, "GPU_X")
    gen = torch.Generator().manual_seed(0)
    lora = reference.MoELoRA(*(torch.randn(slots, e, *s, generator=gen) * 0.1
                               for s in ((r, h), (2 * i, r), (r, i), (h, r))),
                             torch.tensor([0, -1, 1, 0, 1]))
    x = torch.randn(t, h, generator=gen)
    w, ids = routing(t, e, k, seed=1)
    got = moe.fused_moe_int4(x, w13, w2, w, ids, lora)
    want = reference.fused_moe(x, w13.dequantize(torch.float32), w2.dequantize(torch.float32), w, ids, lora)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_tuned_config_folder_is_read_over_the_shipped_tables_and_the_cache(moe_cache, monkeypatch):
    """$INFER_TUNED_CONFIG_FOLDER (vLLM's VLLM_TUNED_CONFIG_FOLDER): tables laid out as the shipped folder (the
    dense `<GPU>.json`, the fused MoE's `moe/<GPU>.json`), its entries winning over the cache's and the shipped
    ones per bucket, never written; a value that is no folder refused naming the variable."""
    from infer.errors import ConfigError
    folder = moe_cache / "tuned"
    (folder / "moe").mkdir(parents=True)
    (folder / "moe" / "GPU_X.json").write_text(json.dumps({KEY: {"1": FASTEST}}))
    (folder / "GPU_X.json").write_text(json.dumps({"64,64": {"1": {"kernel": "dequant"}}}))
    write_cache("GPU_X", {KEY: {"1": {"BLOCK_M": 16}, "2": {"BLOCK_M": 32}}})
    monkeypatch.setenv("INFER_TUNED_CONFIG_FOLDER", str(folder))
    assert gptq_configs.load("GPU_X", moe.SECTION) == {KEY: {1: FASTEST, 2: {"BLOCK_M": 32}}}
    assert gptq_configs.load("GPU_X", "") == {"64,64": {1: {"kernel": "dequant"}}}
    gptq_configs.save("GPU_X", {KEY: {4: FASTEST}}, moe.SECTION)
    assert json.loads((folder / "moe" / "GPU_X.json").read_text()) == {KEY: {"1": FASTEST}}
    gptq_configs.load.cache_clear()
    monkeypatch.setenv("INFER_TUNED_CONFIG_FOLDER", str(folder / "missing"))
    with pytest.raises(ConfigError, match="INFER_TUNED_CONFIG_FOLDER=.*missing.* is no folder"):
        gptq_configs.load("GPU_X", moe.SECTION)


@pytest.mark.parametrize("argv, flag, named", [(["--quick"], "--quick", "add --tune"),
                                               (["--tune", "--block-m", "32"], "--block-m", "drop one")])
def test_the_moe_bench_refuses_options_its_mode_ignores(capsys, argv, flag, named):
    """`python -m infer.bench.moe`: --quick without --tune, and --block-m with --tune (options the run would
    ignore), refused naming them before anything runs, on a CPU as on a GPU (was: ignored silently)."""
    from infer.bench.moe import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and flag in err


@interpreted
def test_reload_weights_tunes_a_new_experts_layout_and_warms_its_tuned_configs(tmp_path, moe_cache, monkeypatch):
    """An engine that tuned and warmed its fused MoE at start (a GPU's; the GPU code path, interpreted, on a fake
    tuner), reloaded with experts of another layout (act-order -> plain groups: another table key): the reload tunes
    the new key's buckets (saved to the cache) and warms the configs they chose, so that no step of the new
    weights launches a config nobody tuned or compiled (was: the new key ran the heuristics untuned); a second
    reload of that layout tunes nothing."""
    import shutil

    from quant_helpers import int4_kernel_path
    from test_probes_session55_moe import build
    from test_probes_session56_review_moeq import rtn_gptq
    from test_probes_session59_experts import record_int4_launches

    from infer import LLM
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1, norm_topk_prob=True)
    rtn_gptq(tmp_path / "base", tmp_path / "plain")
    rtn_gptq(tmp_path / "base", tmp_path / "m", act_order=True)
    int4_kernel_path(monkeypatch)
    monkeypatch.setattr(gptq_configs, "gpu_name", lambda device: "GPU_X")
    use_table(monkeypatch, "GPU_X")
    tuned_keys = []

    def tune_layer(w13, w2, top_k, buckets, dtype, *args, **kwargs):
        tuned_keys.append(moe.experts_key(w13, w2, top_k, dtype))
        return {b: (FASTEST, 1.0, 2.0) for b in buckets}
    monkeypatch.setattr(moe_tune, "tune_layer", tune_layer)
    launched = record_int4_launches(monkeypatch)
    with LLM(str(tmp_path / "m"), block_size=8, max_num_batched_tokens=32, max_num_seqs=2, max_model_len=64) as llm:
        engine = llm.engine
        engine.start_times["moe_tuning_s"] = moe_tune.tune_model(engine.runner.model, 32, engine.device)[1]
        engine._warm_moe_blocks()  # (the start of an engine on a GPU)
        assert tuned_keys == list(moe_tune.moe_layers(engine.runner.model))
        for f in ("model.safetensors", "config.json"):
            shutil.copy(tmp_path / "plain" / f, tmp_path / "m" / f)
        launched.clear()
        engine.reload_weights()
        new = list(moe_tune.moe_layers(engine.runner.model))
        assert len(tuned_keys) == 2 and tuned_keys[1:] == new and new[0] != tuned_keys[0]
        table = json.loads(gptq_configs.cache_file("GPU_X", moe.SECTION).read_text())
        assert table.pop(gptq_configs.FORMAT_KEY) == gptq_configs.FORMAT[moe.SECTION]
        assert sorted(table) == sorted(tuned_keys)
        assert {cfg for *_, cfg in launched} == {tuple(sorted((k, v) for k, v in FASTEST.items() if k != "BLOCK_M"))}
        engine.reload_weights()
        assert len(tuned_keys) == 2


def test_a_cache_on_a_file_system_without_flock_is_still_written(moe_cache, monkeypatch):
    """flock refused (some network file systems: ENOLCK): the save goes on unlocked, as before the lock, rather
    than warn that the cache cannot be written."""
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks available")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    path = gptq_configs.save("GPU_X", {KEY: {1: FASTEST}}, moe.SECTION)
    stamp = {gptq_configs.FORMAT_KEY: gptq_configs.FORMAT[moe.SECTION]}
    assert path is not None and json.loads(path.read_text()) == {KEY: {"1": FASTEST}, **stamp}
