"""GPTQ tensors: pack/unpack round trips, v1 <-> v2 zero points, dequantization against a plain loop."""

import itertools

import pytest
import torch

from infer.quant import packing
from infer.quant.config import GPTQConfig
from infer.errors import UnsupportedModelError

CASES = list(itertools.product([4, 8], [32, 64, 128, -1], [True, False], [False, True]))


@pytest.mark.parametrize("bits, group, sym, desc_act", CASES)
def test_round_trip_and_dequantize(bits, group, sym, desc_act):
    g = torch.Generator().manual_seed(bits * 1000 + group + 7 * sym + 3 * desc_act)
    out_f, in_f = 24, 256
    w = torch.randn(out_f, in_f, generator=g)
    perm = torch.randperm(in_f, generator=g) if desc_act else None
    qweight, qzeros, scales, g_idx = packing.quantize_rtn(w, bits, group, sym, perm)
    pack = 32 // bits
    groups = 1 if group == -1 else in_f // group
    assert qweight.shape == (in_f // pack, out_f) and qweight.dtype == torch.int32
    assert qzeros.shape == (groups, out_f // pack) and scales.shape == (groups, out_f)
    assert scales.dtype == torch.float16 and g_idx.shape == (in_f,)
    q = packing.unpack_rows(qweight, bits)
    assert torch.equal(packing.pack_rows(q, bits), qweight)
    z = packing.unpack_cols(qzeros, bits)
    assert torch.equal(packing.pack_cols(z, bits), qzeros)
    assert torch.equal(packing.zeros_v2_to_v1(packing.zeros_v1_to_v2(qzeros, bits), bits), qzeros)
    if sym:
        assert bool((z == (1 << (bits - 1)) - 1).all())  # v1 stores zero - 1: 7 for 4-bit
    # dequantize against a plain loop over the packed words
    deq = packing.dequantize(qweight, qzeros, scales, g_idx, bits)
    mask = (1 << bits) - 1
    for o, i in [(0, 0), (out_f - 1, in_f - 1), (5, 77), (11, 130)]:
        word = int(qweight[i // pack, o]) & 0xFFFFFFFF
        qv = (word >> (bits * (i % pack))) & mask
        gi = int(g_idx[i])
        zword = int(qzeros[gi, o // pack]) & 0xFFFFFFFF
        zv = ((zword >> (bits * (o % pack))) & mask) + 1
        expect = float(torch.tensor(qv - zv, dtype=torch.float16) * scales[gi, o])
        assert deq[o, i].item() == pytest.approx(expect, abs=0, rel=0)
    v2 = packing.dequantize(qweight, packing.zeros_v1_to_v2(qzeros, bits), scales, g_idx, bits, zeros_v1=False)
    assert torch.equal(v2, deq)
    # and the quantization is a faithful approximation of w
    step = scales.float().max()
    assert (deq - w).abs().max() <= step


def test_config_reads_the_qwen_gptq_layout(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": False, "static_groups": False, "sym": True,
        "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model", "quant_method": "gptq",
        "use_exllama": True, "exllama_config": {"version": 1}, "batch_size": 1, "cache_block_outputs": True}}))
    cfg = GPTQConfig.from_model_dir(tmp_path)
    assert (cfg.bits, cfg.group_size, cfg.sym, cfg.zeros_v1) == (4, 128, True, True)


@pytest.mark.parametrize("d, message", [({"bits": 3}, "3-bit"),
                                        ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv'"),
                                        ({"group_size": 0}, "group_size"),
                                        ({"dynamic": {"+:.*down_proj": {"bits": 3}}}, "3 bits")])
def test_unsupported_settings(d, message):
    with pytest.raises(UnsupportedModelError, match=message):
        GPTQConfig.from_dict({"quant_method": "gptq", **d}, "config.json")


@pytest.mark.parametrize("bits, desc_act, v2", list(itertools.product([4, 8], [False, True], [False, True])))
def test_dequantize_every_entry_against_a_loop(bits, desc_act, v2):
    """Tiny shape, every (o, i): unpack the words by hand with Python ints (no tensor bit ops)."""
    g = torch.Generator().manual_seed(bits + 2 * desc_act + v2)
    out_f, in_f, group = 8, 64, 16
    perm = torch.randperm(in_f, generator=g) if desc_act else None
    qweight, qzeros, scales, g_idx = packing.quantize_rtn(torch.randn(out_f, in_f, generator=g), bits, group,
                                                          False, perm)
    if v2:
        qzeros = packing.zeros_v1_to_v2(qzeros, bits)
    pack, mask = 32 // bits, (1 << bits) - 1
    deq = packing.dequantize(qweight, qzeros, scales, g_idx, bits, zeros_v1=not v2)
    qw, qz, gi = qweight.tolist(), qzeros.tolist(), g_idx.tolist()
    for o in range(out_f):
        for i in range(in_f):
            qv = ((qw[i // pack][o] % (1 << 32)) >> (bits * (i % pack))) & mask
            zv = ((qz[gi[i]][o // pack] % (1 << 32)) >> (bits * (o % pack))) & mask
            zv = (zv + 1) & mask if not v2 else zv
            expect = torch.tensor(float(qv - zv), dtype=torch.float16) * scales[gi[i], o]
            assert deq[o, i].item() == expect.item(), (o, i)
    if desc_act:  # act-order groups follow the permutation: the first `group` rows of perm form group 0
        assert set(g_idx[perm[:group]].tolist()) == {0}


def test_pack_rows_handles_the_sign_bit():
    q = torch.full((8, 3), 15)
    packed = packing.pack_rows(q, 4)
    assert packed.tolist() == [[-1, -1, -1]]
    q[7] = 8  # top nibble 8: the word is 0x8fffffff
    assert packing.pack_rows(q, 4)[0, 0].item() == 0x8FFFFFFF - (1 << 32)
    assert torch.equal(packing.unpack_rows(packing.pack_rows(q, 4), 4), q.int())


def _write(path, name, d):
    import json
    (path / name).write_text(json.dumps(d))


def test_config_sources(tmp_path):
    assert GPTQConfig.from_model_dir(tmp_path) is None
    _write(tmp_path, "config.json", {"model_type": "llama"})
    assert GPTQConfig.from_model_dir(tmp_path) is None
    _write(tmp_path, "quantize_config.json", {"bits": 8, "group_size": 64, "desc_act": True, "sym": False,
                                              "checkpoint_format": "gptq_v2", "damp_percent": 0.1})
    cfg = GPTQConfig.from_model_dir(tmp_path)
    assert (cfg.bits, cfg.group_size, cfg.desc_act, cfg.sym, cfg.zeros_v1) == (8, 64, True, False, False)
    _write(tmp_path, "config.json", {"quantization_config": {"bits": 4, "group_size": -1, "quant_method": "gptq"}})
    cfg = GPTQConfig.from_model_dir(tmp_path)  # config.json wins
    assert (cfg.bits, cfg.group_size, cfg.num_groups(4096)) == (4, -1, 1)
    assert GPTQConfig.from_dict(cfg.to_dict(), "x") == cfg
    assert cfg.to_dict()["quant_method"] == "gptq"


@pytest.mark.parametrize("d, message", [({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
                                        ({"checkpoint_format": "marlin"}, "marlin"),
                                        ({"bits": 2}, "only 4-bit and 8-bit")])
def test_unsupported_settings_in_a_folder(tmp_path, d, message):
    _write(tmp_path, "config.json", {"quantization_config": {"quant_method": "gptq", **d}})
    with pytest.raises(UnsupportedModelError, match=message):
        GPTQConfig.from_model_dir(tmp_path)


@pytest.mark.parametrize("bits, interleave", [(4, 16), (4, 4), (8, 32), (8, 2), (4, 1)])
def test_interleaved_rows_are_a_permutation_with_fields_over_consecutive_rows(bits, interleave):
    pack, k = 32 // bits, 4 * interleave * (32 // bits)
    order = packing.field_rows(k, bits, interleave).view(k // pack, pack)  # [word, field] -> input row
    assert sorted(order.flatten().tolist()) == list(range(k))
    blocks = order.view(k // pack // interleave, interleave, pack)
    for b, block in enumerate(blocks):  # field j of the block's words: rows b*W*pack + j*W + 0 .. W-1
        for j in range(pack):
            start = b * interleave * pack + j * interleave
            assert block[:, j].tolist() == list(range(start, start + interleave))
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 1 << bits, (k, 24), generator=g)
    qw = packing.pack_rows(q, bits)
    stored = packing.interleave_rows(qw, bits, interleave)
    assert torch.equal(packing.unpack_rows(stored, bits), q[order.flatten()])
    assert torch.equal(packing.deinterleave_rows(stored, bits, interleave), qw)


@pytest.mark.parametrize("bits", [4, 8])
def test_v1_words_with_zero_points_of_zero_borrow_as_gptqmodel_writes_them(bits):
    """GPTQModel writes v1 zeros as one int32 subtraction of a 1 per field from the packed zeros (transformers reads
    them by adding it back): a zero of 0 borrows from the next field. The loader's reading gives every zero back."""
    g = torch.Generator().manual_seed(bits)
    z = torch.randint(1, 1 << bits, (6, 64), generator=g)
    z[:, ::3] = 0  # a zero point of 0 in every word
    ones = sum(1 << (bits * j) for j in range(32 // bits))
    words = packing.pack_cols(z, bits) - ones  # GPTQModel's convert_gptq_v2_to_v1_format, int32 wrapping
    assert torch.equal(packing.v1_words(packing.pack_cols(z, bits), bits), words)
    field_by_field = (packing.unpack_cols(words, bits) + 1) & packing.mask(bits)
    assert not torch.equal(field_by_field, z)  # the neighbours of the zeros of 0 come out one too low
    fields = packing.v1_words_to_fields(words, bits)
    assert torch.equal((packing.unpack_cols(fields, bits) + 1) & packing.mask(bits), z)
    no_borrow = packing.pack_cols(z.clamp(min=1), bits) - ones
    assert torch.equal(packing.v1_words_to_fields(no_borrow, bits), no_borrow)  # the usual words are left as they are
    qweight = packing.pack_rows(torch.randint(0, 1 << bits, (64, 64), generator=g), bits)
    scales = torch.rand(6, 64, generator=g).half()
    g_idx = torch.arange(64, dtype=torch.int32) * 6 // 64
    assert torch.equal(packing.dequantize(qweight, fields, scales, g_idx, bits),
                       packing.dequantize(qweight, packing.pack_cols(z, bits), scales, g_idx, bits, zeros_v1=False))
