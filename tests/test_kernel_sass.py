"""scripts/kernel-sass: the GPTQ kernels compile for an H100 (sm_90) on a machine without a GPU, and the tool reads
their main loop out of the machine code. Also guards the claim docs/perf.md makes from it: interleaved rows remove
the per-field barriers and scalar activation loads of the 16-row field kernel."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
triton = pytest.importorskip("triton")
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_interleaved_rows_drop_the_per_field_barriers_at_sm90():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--loop", "mma 16 128 4 3 1 0",
                          "mma 16 128 4 3 16 0"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("mma ")]
    assert len(rows) == 2, out.stdout
    count = [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", row)} for row in rows]
    loops = [int(re.search(r"loop\s+(\d+)", row).group(1)) for row in rows]
    assert count[0]["HMMA"] == count[1]["HMMA"] > 0 and loops[1] < loops[0]
    assert count[1]["BAR"] < count[0]["BAR"] / 2 and count[1]["LDG"] < count[0]["LDG"] / 4, out.stdout


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_pairs_and_in_place_unpacking_spend_fewer_instructions_at_sm90():
    """docs/perf.md's claim for PAIRS (two 4-bit fields per lop3) and INPLACE (fields in the mantissa where they
    lie): the same tile's main loop, same tensor-core work, fewer instructions and far fewer shifts."""
    specs = ["mma 16 128 4 3 16 0", "mmap 16 128 4 3 16 0", "gemv 1 128 4 1 16 0", "gemvi 1 128 4 1 16 0"]
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--loop", *specs],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.split(" ")[0] in ("mma", "mmap", "gemv", "gemvi")]
    assert len(rows) == 4, out.stdout
    count = [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", row)} for row in rows]
    loops = [int(re.search(r"loop\s+(\d+)", row).group(1)) for row in rows]
    assert count[1]["HMMA"] == count[0]["HMMA"] > 0 and loops[1] < 0.9 * loops[0], out.stdout
    assert count[1]["SHF"] < count[0]["SHF"] / 3 and count[3]["SHF"] < count[2]["SHF"] / 2, out.stdout
    assert loops[3] < 0.9 * loops[2] and "STACK:0" in rows[1] and "STACK:0" in rows[3], out.stdout


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_fields_by_byte_permute_spend_fewer_instructions_at_sm90():
    """docs/perf.md's claim for the field tiles' byte permute (gptq_kernels._byte_fields, the default for 4-bit
    fields): the same tile's main loop, the same tensor-core work and barriers, at least a fifth fewer
    instructions, about one permute per four weights and almost no shifts; on the transposed 4-warp tiles, where a
    config asks, one dot per byte (BYTE_DOTS), so half the wgmma waits."""
    specs = ["mmat 16 128 4 3 16 0", "mmatb 16 128 4 3 16 0", "mma 16 128 4 3 16 0", "mmab 16 128 4 3 16 0",
             "mmat 128 128 4 2 16 1", "mmatb 128 128 4 2 16 1", "mmatj 16 128 4 3 16 0", "mmatj 128 128 4 2 16 1"]
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--loop", *specs],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.split(" ")[0].startswith("mma")]
    assert len(rows) == 8, out.stdout
    count = [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", row)} for row in rows]
    loops = [int(re.search(r"loop\s+(\d+)", row).group(1)) for row in rows]
    for shift, byte in ((0, 1), (2, 3), (4, 5)):
        mma = "HGMMA" if count[shift]["HGMMA"] else "HMMA"
        assert count[byte][mma] == count[shift][mma] > 0 and count[byte]["BAR"] <= count[shift]["BAR"], out.stdout
        assert loops[byte] < 0.8 * loops[shift] and count[byte]["SHF"] < 10 < count[shift]["SHF"], out.stdout
        # each thread unpacks 128 weights per K step: a 128 x 128 weight tile over 4 warps; beside the weights' 32, up
        # to four more: the masked scale load's zero fill, the scale carried to the next step (PRE_S), two pairs of
        # columns' zeros packed into one register each
        assert count[byte]["PRMT"] <= 128 // 4 + 4 and count[byte]["LDL"] == count[byte]["STL"] == 0, out.stdout
    for fields, joined in ((1, 6), (5, 7)):  # wgmma: each dot's wait and arrive once per byte instead of per field
        assert count[joined]["HGMMA"] == count[fields]["HGMMA"] > 0, out.stdout
        assert 0 < count[joined]["WARPGROUP"] <= count[fields]["WARPGROUP"] // 2, out.stdout


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_sync_mma_tiles_issue_mma_sync_and_unpack_each_weight_once_at_sm90():
    """docs/perf.md's claim for SYNC_MMA (gptq_tune._sync): the transposed field tile's dots batched over one slice
    of columns per warp compile to mma.sync (HMMA) with no wgmma nor its waits, the same tensor-core work as the
    wgmma tile (a 64 x 128 x 128 K step: 16 wgmma of 64 x 64 x 16 per warpgroup, 128 m16n8k16 per warp), each
    weight unpacked once (no warp unpacks another's columns), nothing spilled."""
    specs = ["mmatb 64 128 4 3 16 1", "mmatb 64 128 4 3 16 1 sync", "mmatb 32 128 4 3 16 1 sync",
             "mmatb 64 256 8 2 16 1 sync"]
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--loop", *specs],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("mmatb ")]
    assert len(rows) == 4, out.stdout
    count = [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", row)} for row in rows]
    assert count[0]["HGMMA"] == 16 and count[0]["HMMA"] == 0, out.stdout
    for c, hmma in zip(count[1:], (128, 64, 128)):  # per warp: (rows / 8) x (columns per warp / 16) x 8 fields
        assert c["HMMA"] == hmma and c["HGMMA"] == 0 and c["WARPGROUP"] == 0, out.stdout
        assert c["PRMT"] <= 128 // 4 + 4 and c["LDL"] == c["STL"] == 0, out.stdout
    assert all("STACK:0" in row for row in rows), out.stdout


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_every_quick_tuning_candidate_compiles_fits_and_does_not_spill_at_sm90():
    """What an engine start tunes over on an H100 (gptq_tune's quick set, M = 1-4096) and what it launches
    untuned (every fused entry of the shipped tables, at its own layer shape), compiled through the launcher in
    parallel, launched with programmatic dependent launch as on an H100: every call's kernel is compiled by
    compile_parallel, none exceeds sm_90's shared memory, none spills registers in its main loop."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--audit"], capture_output=True,
                         text=True, timeout=1200, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    summary = re.search(r"(\d+) shipped table entries: (\d+) calls, (\d+) kernels, 0 over the shared-memory limit "
                        r"or spilling in the main loop, 0 not compiled", out.stdout)
    assert summary and int(summary.group(1)) >= 40 and int(summary.group(3)) >= 50, out.stdout[-2000:]
    assert "(launched with programmatic dependent launch)" in out.stdout  # as an H100 engine's start compiles them


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_every_kernel_an_engine_launches_at_7b_shapes_compiles_for_sm90():
    """The engine's GPU code path run here at Llama-2-7B shapes (one layer, two adapters), each Triton launch
    compiled for sm_90 instead: the start (compile_kernels, warm_kernels), prompts of many lengths, a 300-token
    prefill through dequantize + cuBLAS, decodes past one attention partition, mixed adapters. Every kernel function
    the GPU path has is reached, each kernel fits and does not spill, nothing compiles on a request after the
    start, and nothing in the requests' steps waits for the GPU; by default and with EngineConfig.lora_expand_fused
    (the decode attention's and silu_and_mul's LoRA variants). One after the other in one test: the second finds
    most of its kernels in triton's cache (a cold compile of them all takes minutes on two cores)."""
    for expand_fused in (False, True):
        _engine_at_7b_shapes(expand_fused)


def _engine_at_7b_shapes(expand_fused: bool) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--engine", "llama-2-7b"]
                         + (["--expand-fused"] if expand_fused else []),
                         capture_output=True, text=True, timeout=1200, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    names = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("ok ")}
    # (rotary_store_kv writes k and v into the cache in the rotary kernel: the engine launches no _store_kv_kernel)
    # (the decode steps' LoRA expands of up to lora_ops.GATHER_AUTO_TOKENS tokens are gathers, the longer by segments)
    assert names == {"_decode_kernel", "_unified_kernel", "_rms_norm_kernel", "_rotary_kernel",
                     "_rms_norm_lora_kernel", "_embed_rms_norm_kernel", "_silu_and_mul_kernel", "_shrink_kernel",
                     "_expand_kernel", "_expand_gather_kernel", "gemv_kernel", "mma_kernel", "_dequant_kernel",
                     "_bitmask_kernel"}, out.stdout[-3000:]
    assert "0 over the shared-memory limit or spilling in the main loop or compiled late or waiting for the GPU in " \
        "a request's step (0 waits;" in out.stdout, out.stdout
    # as an engine on sm_90 launches them: with programmatic dependent launch, every launch with the constexpr and
    # the attribute both set, every such kernel waiting before it touches the step's data (kernels.pdl)
    pdl = re.search(r"PDL on: (\d+) launches, 0 not set so", out.stdout)
    assert pdl and int(pdl.group(1)) > 500, out.stdout[-1000:]
    # the decode attention (with the rotary, the KV write and, with expand_fused, the qkv LoRA delta) keeps four
    # programs per SM: at most 128 registers a thread (the LoRA variant capped there: attention.LORA_MAX_REGS)
    regs = [int(r) for r in re.findall(r"_decode_kernel\s+warps 4 shared\s+\d+ REG:(\d+)", out.stdout)]
    assert len(regs) >= (4 if expand_fused else 2) and max(regs) <= 128, out.stdout[-3000:]
    fields = re.search(r"field tiles by byte permute: (\d+) of (\d+) launches", out.stdout)
    assert fields and fields.group(1) == fields.group(2) and int(fields.group(1)) > 50, out.stdout[-1000:]


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_lora_expand_issues_its_loads_before_shared_memory_at_sm90():
    """docs/perf.md's claim for the decode LoRA expand (`lora_ops._expand_kernel`) in its early order: y's tile, the
    partial sums and B's tile are all requested before the partials' sum and B's layout change go through shared
    memory (a load written after either waits for its data: two more round trips to memory per program). The late
    order (the default since an H200 timed it faster): 19 of 36 loads with Triton 3.6, 27 with 3.9."""
    counts = {}
    for order in ("early", "late"):  # INFER_LORA_EXPAND_LOADS: the late order is the default since 2026-11-27
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--lora-expand"],
                             capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, PYTHONPATH=str(ROOT), INFER_LORA_EXPAND_LOADS=order))
        assert out.returncode == 0, out.stderr[-2000:]
        m = re.search(r"(\d+) global loads \((\d+) of 128 bits\), (\d+) issued before", out.stdout)
        assert m, out.stdout
        counts[order] = tuple(map(int, m.groups()))
    total, wide, early = counts["early"]
    assert wide == 16 and total >= wide and early >= total - 2, counts
    late_total, late_wide, late_early = counts["late"]  # the same loads, more of them after shared memory
    assert late_wide == wide and late_early < early - 4, counts


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_k_step_bookkeeping_costs_no_division_nor_masks_at_sm90():
    """docs/perf.md's claims for the K steps' bookkeeping (thirty-third session): a group of a power-of-two size is
    found by a shift (GS_LOG2), not the integer division that cost the 16-row tile and the one-row gemv 20-36
    instructions a step; the decode LoRA shrink drops its masks along K where K is a whole number of steps."""
    specs = ["mmab 16 128 4 3 16 0", "mmab 16 128 4 3 16 0 div", "gemvi 1 128 4 1 16 0", "gemvi 1 128 4 1 16 0 div"]
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--loop", *specs],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.split(" ")[0] in ("mmab", "gemvi")]
    assert len(rows) == 4, out.stdout
    count = [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", row)} for row in rows]
    loops = [int(re.search(r"loop\s+(\d+)", row).group(1)) for row in rows]
    for shift, div in ((0, 1), (2, 3)):
        assert count[shift]["HMMA"] == count[div]["HMMA"] and count[shift]["FFMA"] == count[div]["FFMA"], out.stdout
        assert loops[shift] <= loops[div] - 15, out.stdout
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--lora-shrink"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.findall(r"EVEN_K=(True|False): loop (\d+) .*HMMA=(\d+)", out.stdout)
    shrink = {even: (int(n), int(hmma)) for even, n, hmma in found}
    assert set(shrink) == {"True", "False"}, out.stdout
    assert shrink["True"][1] == shrink["False"][1] > 0 and shrink["True"][0] <= 0.9 * shrink["False"][0], out.stdout


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_lora_gather_expand_compiles_without_spills_at_sm90():
    """The decode LoRA expand as a gather (INFER_LORA_EXPAND=gather) compiles for an H100 on 1, 2 and 4 warps a
    program (the LoRA bench's sweep) without local memory; docs/perf.md gives the counts this prints."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-sass"), "--lora-gather"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"(\d) warps: (\d+) instructions a warp, \d+ a program, REG:(\d+) STACK:(\d+)", out.stdout)
    assert [int(w) for w, *_ in rows] == [1, 2, 4], out.stdout
    assert all(int(n) > 0 and int(stack) == 0 for _, n, _, stack in rows), out.stdout


SPILL_CHECK = """
import sys
from importlib.machinery import SourceFileLoader
ks = SourceFileLoader("kernel_sass", sys.argv[1]).load_module()
reads, disassemble = [], ks.disassemble
def counted(kernel, sass=True):
    reads.append(sass)
    return disassemble(kernel, sass)
ks.disassemble = counted
for spec in ("mma 16 128 4 3 16 0", "mma 16 256 1 3 16 0"):
    res, local = ks.main_loop_spills(ks.tile_kernel(spec, 90))
    print(spec, "|", ks._resources(res), "| local", local, "| SASS read", reads.count(True))
"""


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton ships no cuobjdump")
def test_a_tile_that_spills_is_caught_without_reading_the_sass_of_one_that_does_not():
    """The audits' spill check (`main_loop_spills`) reads a kernel's SASS only when its resource usage shows a
    stack frame or local memory: a 16 x 256 tensor-core tile on one warp spills hundreds of registers in its main
    loop and is found; the engine's decode tile does not, and its SASS is never disassembled."""
    out = subprocess.run([sys.executable, "-c", SPILL_CHECK, str(ROOT / "scripts" / "kernel-sass")],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("mma ")]
    assert len(rows) == 2, out.stdout
    (_, res0, local0, read0), (_, res1, local1, read1) = rows
    assert "STACK:0" in res0 and local0 == "local 0" and read0 == "SASS read 0", out.stdout
    assert "STACK:0" not in res1 and int(local1.split()[1]) > 100 and read1 == "SASS read 1", out.stdout
