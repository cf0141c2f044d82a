"""Session 60: the kernel tuning tables (gptq_configs' files, issue 13) robust to entries that can only fail on a
user's GPU: a GPTQ matmul entry checked when read as the fused MoE's are (`gptq_configs.dense_error`: its keys, tile
sizes within the kernels' limits, split-K), a fused MoE entry over sm_90's shared memory (`moe_tune.entry_error`,
the bound the tuner's candidates keep) skipped, each with a warning naming the file and the entry, and tuned again;
a file of another revision of the kernels (`gptq_configs.FORMAT`) tuned again whole; $INFER_TUNED_CONFIG_FOLDER
pointed at a file, at its moe/ folder, or at tables of another GPU named. All on CPU, the timing stubbed."""

from __future__ import annotations

import itertools
import json
import logging

import pytest
import torch

from infer.kernels import gptq_configs, gptq_tune, moe, moe_tune

from test_probes_session56_moeq import int4_experts
from test_probes_session59_moetune import FASTEST, FakeModel, meta_int4, moe_cache, use_table  # noqa: F401
from test_probes_session59_rmoetune import write_cache

CPU = torch.device("cpu")
SHAPE = "64,256"
GOOD = dict(kernel="mma", BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=4, GROUP_M=1, num_warps=4, num_stages=3,
            FIELD=True, SCALE_W=False)


def write_dense(name: str, data) -> str:
    """The user's cache file of GPTQ matmul tables for GPU `name` holding `data`; its path."""
    return str(write_cache(name, data, ""))


# ------------------------------------------------------------------------------------- GPTQ matmul entries
def stub_dense_tuning(monkeypatch, winner: dict) -> list:
    """gptq_tune.tune_model on CPU for GPU_X's tables and one layer shape (64, 256): tune_shape stubbed, every
    bucket it is asked won by `winner`. Returns the list of (N, K, buckets) it is asked."""
    asked = []

    def tune_shape(n, k, buckets, bits, gs, device, log=None, quick=True):
        asked.append((n, k, list(buckets)))
        return {b: (winner, 1.0) for b in buckets}
    use_table(monkeypatch, "GPU_X")
    monkeypatch.setattr(gptq_configs, "gpu_name", lambda device: "GPU_X")
    monkeypatch.setattr(gptq_tune, "layer_shapes", lambda model: {(64, 256, 4, 128)})
    monkeypatch.setattr(gptq_tune, "tune_shape", tune_shape)
    return asked


def test_every_shipped_entry_passes_the_checks(caplog):
    """The shipped tables (both sections) read whole, without a warning: the checks refuse nothing infer ships."""
    caplog.set_level(logging.WARNING, logger="infer")
    files = [(p, "") for p in gptq_configs.SHIPPED.glob("*.json")]
    files += [(p, moe.SECTION) for p in (gptq_configs.SHIPPED / moe.SECTION).glob("*.json")]
    assert files
    for path, section in files:
        raw = json.loads(path.read_text())
        raw.pop(gptq_configs.FORMAT_KEY, None)
        assert gptq_configs._read(path, section) == raw, path
    assert caplog.text == ""


@pytest.mark.parametrize("k", [256, 4096, 14336])
def test_every_config_the_dense_tuner_can_write_passes_the_check(k):
    """Every candidate of both sets (each bucket, each K step a group layout allows) and every whole-wave split of
    it (`wave_splits`, any integer) passes dense_error: a restart never refuses what the tuner saved."""
    n = 4096
    for m, step, quick in itertools.product(gptq_tune.BUCKETS, (128, 64, 32), (True, False)):
        for cfg in gptq_tune.candidates(m, step, quick, k):
            for c in [cfg] + gptq_tune.wave_splits(cfg, m, n, k, 132):
                assert gptq_configs.dense_error(f"{n},{k}", c) is None, (m, c)
    assert gptq_configs.dense_error(f"{n},{k}", gptq_configs.heuristic(1, n, k, 132)) is None
    assert gptq_configs.dense_error(f"{n},{k}", gptq_configs.heuristic(64, n, k, 132)) is None


BAD = {
    "no kernel": {k: v for k, v in GOOD.items() if k != "kernel"},
    "unknown kernel": dict(GOOD, kernel="wgmma"),
    "BLOCK_M 24": dict(GOOD, BLOCK_M=24),
    "BLOCK_M 8 on a tensor-core tile": dict(GOOD, BLOCK_M=8),
    "gemv of 32 rows": dict(GOOD, kernel="gemv", BLOCK_M=32),
    "BLOCK_N 48": dict(GOOD, BLOCK_N=48),
    "BLOCK_K 256": dict(GOOD, BLOCK_K=256),
    "BLOCK_K 8": dict(GOOD, BLOCK_K=8),
    "num_warps 3": dict(GOOD, num_warps=3),
    "num_stages 0": dict(GOOD, num_stages=0),
    "num_stages 9": dict(GOOD, num_stages=9),
    "SPLIT_K 0": dict(GOOD, SPLIT_K=0),
    "SPLIT_K a string": dict(GOOD, SPLIT_K="4"),
    "SPLIT_K a float": dict(GOOD, SPLIT_K=4.0),
    "SPLIT_K beyond the K steps": dict(GOOD, SPLIT_K=17),
    "GROUP_M 0": dict(GOOD, GROUP_M=0),
    "FIELD not a flag": dict(GOOD, FIELD="yes"),
    "a truncated entry": {k: v for k, v in GOOD.items() if k != "num_stages"},
    "an unknown key": dict(GOOD, BLOCK_X=16),
    "a dequant with tiles": dict(kernel="dequant", BLOCK_N=128),
    "CHUNK_N 16": dict(kernel="dequant", CHUNK_N=16),
    "CHUNK_N on a fused tile": dict(GOOD, CHUNK_N=4096),
    "8 stages of 128 x 256": dict(GOOD, BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=8),
    "5 stages of the transposed 256 x 128": dict(GOOD, kernel="mmat", BLOCK_M=256, num_warps=8, num_stages=5),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_an_invalid_dense_entry_is_skipped_with_a_warning_never_launched(moe_cache, monkeypatch, caplog, case):
    """A hand-edited, truncated or another version's GPTQ matmul entry is dropped from the loaded table with a
    warning naming the file, the shape and the bucket: its bucket takes the heuristic (was: launched as read, an
    invalid tile or a KeyError on every step of that bucket), the valid entry beside it kept."""
    caplog.set_level(logging.WARNING, logger="infer")
    path = write_dense("GPU_X", {SHAPE: {"1": BAD[case], "2": GOOD}})
    assert gptq_configs.load("GPU_X") == {SHAPE: {2: GOOD}}
    assert path in caplog.text and f"{SHAPE} / 1" in caplog.text and "tuned again" in caplog.text
    assert len(caplog.records) == 1
    use_table(monkeypatch, "GPU_X")
    assert gptq_configs.choose(1, 64, 256, CPU) == gptq_configs.heuristic(1, 64, 256, gptq_configs.num_sms(CPU))
    assert gptq_configs.choose(2, 64, 256, CPU) == GOOD


def test_a_bad_shape_or_bucket_is_skipped_with_a_warning(moe_cache, caplog):
    """A dense shape that is no "N,K" and a bucket no power of two (never looked up: `bucket`) or over MAX_BUCKET
    are skipped naming them; the good ones kept."""
    caplog.set_level(logging.WARNING, logger="infer")
    write_dense("GPU_X", {"4096": {"1": GOOD}, "0,256": {"1": GOOD}, SHAPE: {"3": GOOD, "8192": GOOD, "4": GOOD}})
    assert gptq_configs.load("GPU_X") == {SHAPE: {4: GOOD}}
    for named in ("entry 4096:", "entry 0,256:", f"{SHAPE} / 3", f"{SHAPE} / 8192"):
        assert named in caplog.text


def test_a_refused_dense_entry_is_tuned_again_and_saved_over(moe_cache, monkeypatch):
    """The engine start's tuning (gptq_tune.tune_model, tune_shape stubbed) measures the bucket whose entry was
    refused, and only it; its save writes the winner over the bad entry, the file stamped with its format."""
    path = write_dense("GPU_X", {SHAPE: {"1": dict(GOOD, BLOCK_K=256), "2": GOOD}})
    asked = stub_dense_tuning(monkeypatch, GOOD)
    assert gptq_tune.tune_model(None, 2, CPU, quick=True)[0] == 1
    assert asked == [(64, 256, [1])]
    assert json.loads(open(path).read()) == {SHAPE: {"1": GOOD, "2": GOOD}, gptq_configs.FORMAT_KEY: 1}
    gptq_configs.load.cache_clear()  # a restart: nothing left to tune
    asked.clear()
    assert gptq_tune.tune_model(None, 2, CPU, quick=True)[0] == 0 and asked == []


def test_the_dense_shared_memory_floor_is_below_what_triton_takes_for_sm90():
    """Compiled for sm_90 (the compile side of a driver, no GPU): for tiles of each kind and flag that changes what
    the pipeline buffers (two fields per dot, mma.sync, the reshaped mma, the transposed tiles' many stages, the
    gemv), gptq_configs.smem_floor is at most the shared memory Triton's kernel takes: the read check never refuses
    an entry that fits."""
    import textwrap

    from helpers import COMPILE_ONLY_LAUNCHES, run_compile_only
    tile = dict(kernel="mmat", BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3,
                FIELD=True, SCALE_W=True)
    cfgs = [dict(tile, SYNC_MMA=True), dict(tile, BLOCK_M=16, SCALE_W=False, PAIRS=True),
            dict(tile, BLOCK_M=128, num_stages=5), dict(tile, kernel="mma", GROUP_M=1, num_stages=4),
            dict(GOOD, BLOCK_N=256, num_warps=8, num_stages=2, PAIRS=True),
            dict(tile, kernel="mma", BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, FIELD=False),
            dict(kernel="gemv", BLOCK_N=128, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3)]
    script = COMPILE_ONLY_LAUNCHES + textwrap.dedent(f'''
        from infer.kernels import gptq_configs, gptq_gemm
        shared = []
        real_compile = jit.JITFunction._do_compile
        def grab(self, key, *a, **k):
            kernel = real_compile(self, key, *a, **k)
            shared.append(kernel.metadata.shared)
            return kernel
        jit.JITFunction._do_compile = grab
        k = n = 4096
        qw, qz = torch.zeros(k // 8, n, dtype=torch.int32), torch.zeros(k // 128, n // 8, dtype=torch.int32)
        s, g = torch.zeros(k // 128, n, dtype=torch.float16), torch.zeros(k, dtype=torch.int32)
        wp = gptq_configs.interleave_for(128, k, 8)
        out = []
        for cfg in {cfgs!r}:
            x = torch.empty(cfg.get("BLOCK_M", 1), k, dtype=torch.float16)
            gptq_gemm.gptq_matmul(x, qw, qz, s, g, 4, True, 128, wp, config=cfg, compile_only=True)
            out.append([cfg, shared[-1]])
        print(json.dumps(out))
    ''')
    got = run_compile_only(script, 600)
    assert len(got) == len(cfgs)
    for cfg, shared in got:
        assert gptq_configs.smem_floor(cfg) <= shared, (cfg, shared)
    assert max(gptq_configs.smem_floor(c) for c in cfgs) > 100_000  # (a floor that says something)


# ------------------------------------------------------------------------------------- fused MoE entries
def layers():
    """(key, moe_tune.layer_shape) of float and int4 layers (group sizes 128, 32, act-order) on the meta device."""
    e, h, i, k = 8, 2048, 768, 8
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        w13, w2 = torch.empty(e, 2 * i, h, device="meta"), torch.empty(e, h, i, device="meta")
        out.append((moe.experts_key(w13, w2, k, dtype), moe_tune.layer_shape(w13, w2, k, dtype)))
    for gs, perm in ((128, False), (32, False), (0, True)):
        w13, w2 = meta_int4(e, h, 2 * i, gs, perm), meta_int4(e, i, h, gs, perm)
        out.append((moe.experts_key(w13, w2, k, torch.bfloat16), moe_tune.layer_shape(w13, w2, k, torch.bfloat16)))
    return out


def test_the_moe_read_check_refuses_exactly_what_the_tuner_skips():
    """For float and int4 layers, every launch config config_error passes: entry_error (from the table key alone)
    refuses it exactly where moe_tune.fits (from the layer's tensors) does, so the tuner's candidates all read back
    and an entry over sm_90's shared memory (BLOCK_M 128, BLOCK_N 256, 16 warps, 8 stages) never does."""
    for key, layer in layers():
        for bm, bn, w, st in itertools.product((16, 32, 64, 128), (16, 32, 64, 128, 256), (4, 16), range(1, 9)):
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
            assert moe.config_error(cfg) is None
            assert (moe_tune.entry_error(key, cfg) is None) == moe_tune.fits(cfg, layer), (key, cfg)
    key = layers()[0][0]  # (bf16, BLOCK_K 128)
    huge = {"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 16, "num_stages": 8}
    assert "more than sm_90's" in moe_tune.entry_error(key, huge) and moe.config_error(huge) is None


def test_a_moe_entry_over_sm90_shared_memory_is_skipped_and_tuned_again(moe_cache, monkeypatch, caplog):
    """An entry moe.config_error passes but sm_90's shared memory cannot hold is dropped when read with a warning
    naming the file, the layer and the bucket, and the engine start's tuning (moe_tune.tune_model, tune_layer
    stubbed) measures that bucket again, the fitting one beside it kept."""
    caplog.set_level(logging.WARNING, logger="infer")
    e, k, h, i = 8, 2, 256, 32  # (the gate_up's K step 128 wide: its group size)
    w13, w2 = int4_experts(e, h, 2 * i, 128, False, False, True, 0), int4_experts(e, i, h, 32, False, False, True, 1)
    key = moe.experts_key(w13, w2, k, torch.float32)
    huge = {"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 16, "num_stages": 8}
    path = write_cache("GPU_X", {key: {"1": huge, "2": FASTEST}})
    assert gptq_configs.load("GPU_X", moe.SECTION) == {key: {2: FASTEST}}
    assert str(path) in caplog.text and f"{key} / 1" in caplog.text and "shared memory" in caplog.text
    asked = []

    def tune_layer(w13, w2, top_k, buckets, *args, **kwargs):
        asked.append(list(buckets))
        return {b: (FASTEST, 1.0, 2.0) for b in buckets}
    monkeypatch.setattr(moe_tune, "tune_layer", tune_layer)
    assert moe_tune.tune_model(FakeModel(w13, w2, k), 2, CPU, name="GPU_X", quick=True)[0] == 1
    assert asked == [[1]]
    assert json.loads(path.read_text())[key] == {"1": FASTEST, "2": FASTEST}


# ------------------------------------------------------------------------------------- format / revision
@pytest.mark.parametrize("stamp", [2, "1", True, None])
def test_a_table_of_another_format_is_skipped_whole_with_a_warning(moe_cache, caplog, stamp):
    """A file whose FORMAT_KEY is not this infer's (another revision of the kernels, or no integer) is ignored
    whole, with one warning naming the file and the field: its entries are never launched."""
    caplog.set_level(logging.WARNING, logger="infer")
    path = write_dense("GPU_X", {SHAPE: {"2": GOOD}, gptq_configs.FORMAT_KEY: stamp})
    assert gptq_configs.load("GPU_X") == {}
    assert path in caplog.text and gptq_configs.FORMAT_KEY in caplog.text and "tuned again" in caplog.text


def test_a_kernel_revision_bump_tunes_the_older_tables_again(moe_cache, monkeypatch, caplog):
    """A file without the field is of format 1 (the shipped ones, the caches written before it) and read while
    FORMAT is 1; once FORMAT is bumped the same file is stale: every bucket tuned again, the save writing a file of
    the new format without the stale entries."""
    caplog.set_level(logging.WARNING, logger="infer")
    path = write_dense("GPU_X", {SHAPE: {"1": GOOD, "2": GOOD}, "4096,4096": {"1": GOOD}})
    assert gptq_configs.load("GPU_X")[SHAPE] == {1: GOOD, 2: GOOD}
    gptq_configs.load.cache_clear()
    monkeypatch.setattr(gptq_configs, "FORMAT", {"": 2, moe.SECTION: 1})
    new = dict(GOOD, SPLIT_K=2)
    asked = stub_dense_tuning(monkeypatch, new)
    assert gptq_tune.tune_model(None, 2, CPU, quick=True)[0] == 1
    assert asked == [(64, 256, [1, 2])] and path in caplog.text
    assert json.loads(open(path).read()) == {SHAPE: {"1": new, "2": new}, gptq_configs.FORMAT_KEY: 2}
    assert gptq_configs.load("GPU_X", moe.SECTION) == {}  # (the other section's format unchanged: nothing read)


# ------------------------------------------------------------------------------------- the tuned folder
def test_a_tuned_folder_that_is_a_file_is_refused_naming_the_folder_to_use(moe_cache, monkeypatch):
    from infer.errors import ConfigError
    folder = moe_cache / "tuned"
    folder.mkdir()
    (folder / "GPU_X.json").write_text(json.dumps({SHAPE: {"1": GOOD}}))
    monkeypatch.setenv("INFER_TUNED_CONFIG_FOLDER", str(folder / "GPU_X.json"))
    with pytest.raises(ConfigError, match="is a file, not a folder") as err:
        gptq_configs.load("GPU_X")
    assert repr(str(folder)) in err.value.hint


def test_a_tuned_folder_naming_its_moe_folder_warns_with_the_fix(moe_cache, monkeypatch, caplog):
    """$INFER_TUNED_CONFIG_FOLDER at the moe/ folder itself: its <GPU>.json (fused MoE tables) is not read as the
    GPTQ matmul's table; one warning names the file and says to name the folder above moe/. The reverse (GPTQ
    matmul tables under moe/) likewise."""
    caplog.set_level(logging.WARNING, logger="infer")
    key = moe.layer_key(8, 64, 32, 2, torch.float32)
    folder = moe_cache / "tuned"
    (folder / "moe").mkdir(parents=True)
    (folder / "moe" / "GPU_X.json").write_text(json.dumps({key: {"1": FASTEST}}))
    monkeypatch.setenv("INFER_TUNED_CONFIG_FOLDER", str(folder / "moe"))
    assert gptq_configs.load("GPU_X") == {}
    assert str(folder / "moe" / "GPU_X.json") in caplog.text and "fused MoE tables" in caplog.text
    assert "folder above moe/" in caplog.text and len(caplog.records) == 1
    caplog.clear()
    gptq_configs.load.cache_clear()
    (folder / "moe" / "GPU_X.json").write_text(json.dumps({SHAPE: {"1": GOOD}}))
    monkeypatch.setenv("INFER_TUNED_CONFIG_FOLDER", str(folder))
    assert gptq_configs.load("GPU_X", moe.SECTION) == {}
    assert "GPTQ matmul tables" in caplog.text and "not moe/" in caplog.text


def test_a_tuned_folder_without_this_gpus_tables_warns_once_naming_what_it_holds(moe_cache, monkeypatch, caplog):
    """Tables are read by the GPU's name: a folder holding another GPU's (or misnamed files) gets one warning
    naming the GPU's file names and the files it holds (was: ignored silently); a folder with this GPU's tables
    none."""
    caplog.set_level(logging.WARNING, logger="infer")
    folder = moe_cache / "tuned"
    (folder / "moe").mkdir(parents=True)
    (folder / "NVIDIA_H100_PCIe.json").write_text(json.dumps({SHAPE: {"1": GOOD}}))
    monkeypatch.setenv("INFER_TUNED_CONFIG_FOLDER", str(folder))
    assert gptq_configs.load("GPU_X") == {} and gptq_configs.load("GPU_X", moe.SECTION) == {}
    assert len(caplog.records) == 1
    assert "no table for this GPU (GPU_X.json, moe/GPU_X.json" in caplog.text
    assert "NVIDIA_H100_PCIe.json" in caplog.text
    caplog.clear()
    gptq_configs.load.cache_clear()
    (folder / "moe" / "GPU_X.json").write_text(json.dumps({}))
    assert gptq_configs.load("GPU_X") == {} and caplog.text == ""
