"""Session 68: `infer warmup --estimate` (loader.check_weights) takes a mixture of experts' GPTQ expert tensors in
bulk from the headers (models.moe.MoeForCausalLM.check_expert_headers: one expected shape per layer, projection and
tensor name; no GPTQ layer built per expert projection, no meta tensor per header entry), and still refuses what a
load refuses, naming the tensor: one of another shape, a missing one, a whole expert projection missing, an expert
the model has no place for, an act-order projection without g_idx. Checked against the per-tensor path (the bulk
pass switched off) on the same damaged checkpoints, on the CPU's model and on the GPU's (int4 experts)."""
import json
import struct

import pytest
import torch
from typer.testing import CliRunner

from infer.cli.main import app
from infer.errors import ModelLoadError

# Qwen3-MoE of 2 layers (GPTQ, groups of 32): gate/up of 64 inputs (2 groups), down of 32 (1 group)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             max_position_embeddings=256, tie_word_embeddings=False, norm_topk_prob=True, decoder_sparse_step=1,
             mlp_only_layers=[])
DEVICES = [None, torch.device("cuda")]  # the CPU's model (experts dequantized), a GPU's (int4 experts; no GPU needed)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{experts: (a header-only GPTQ Qwen3-MoE folder of that many experts a layer, [(name, dtype, shape)])}, each
    built once for the module."""
    from helpers import hub_shaped_folder
    out = {}
    for experts in (8, 128):
        folder = tmp_path_factory.mktemp(f"moe{experts}")
        hub_shaped_folder(folder, "qwen3_moe", "Qwen3MoeForCausalLM", {**SMALL, "num_experts": experts},
                          gptq_group=32)
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        entries = []
        for file in dict.fromkeys(index.values()):
            raw = (folder / file).read_bytes()
            header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
            entries += [(name, info["dtype"], info["shape"]) for name, info in header.items()]
            (folder / file).unlink()
        (folder / "model.safetensors.index.json").unlink()
        out[experts] = folder, entries
    return out


def _folder(tmp_path, built, experts: int):
    """A copy of the module's folder of `experts` experts (its weights not written yet: _write), its entries."""
    import shutil
    source, entries = built[experts]
    shutil.copytree(source, tmp_path / "model")
    return tmp_path / "model", entries


def _write(folder, entries, quant: dict | None = None) -> None:
    """The folder's weights as one header-only safetensors file of `entries` (data a hole of their size);
    `quant`: fields set in config.json's quantization_config."""
    header, end = {}, 0
    for name, dtype, shape in entries:
        size = (2 if dtype in ("BF16", "F16") else 4) * int(torch.tensor(shape).prod()) if shape else 4
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [end, end + size]}
        end += size
    raw = json.dumps(header).encode()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + end)
    if quant:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(quant)
        (folder / "config.json").write_text(json.dumps(config))


def _refusal(folder, device, bulk: bool = True, monkeypatch=None) -> str | None:
    """check_weights' refusal of the folder (None: none), with the bulk pass or without it (the per-tensor path)."""
    from infer.models import moe
    from infer.models.loader import check_weights
    if not bulk:
        monkeypatch.setattr(moe.MoeForCausalLM, "check_expert_headers", lambda self, entries, loaded: list(entries))
    try:
        check_weights(folder, device)
    except ModelLoadError as e:
        return str(e)
    finally:
        monkeypatch.undo() if not bulk else None
    return None


def _reshaped(entries, name: str, shape):
    return [(n, d, shape if n == name else s) for n, d, s in entries]


DAMAGE = {
    # one expert tensor of another shape (qzeros of 2 groups of 4 words, one word short)
    "shape": lambda e: _reshaped(e, "model.layers.1.mlp.experts.5.up_proj.qzeros", [2, 3]),
    "missing qzeros": lambda e: [x for x in e if x[0] != "model.layers.0.mlp.experts.3.down_proj.qzeros"],
    "missing projection": lambda e: [x for x in e if not x[0].startswith("model.layers.1.mlp.experts.2.up_proj.")],
    "expert beyond": lambda e: e + [("model.layers.0.mlp.experts.8.gate_proj.qweight", "I32", [8, 32])],
    "float expert": lambda e: e + [("model.layers.0.mlp.experts.1.gate_proj.weight", "BF16", [32, 64])],
    "g_idx shape": lambda e: _reshaped(e, "model.layers.0.mlp.experts.0.down_proj.g_idx", [64]),
}


@pytest.mark.parametrize("device", DEVICES, ids=["cpu", "int4"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_the_bulk_check_refuses_as_the_per_tensor_path(tmp_path, built, monkeypatch, damage, device):
    """Each damage to a GPTQ MoE checkpoint's expert tensors is refused by check_weights with the bulk pass exactly
    as without it (the per-tensor path: a GPTQ layer per expert projection, fed meta tensors), naming the tensor."""
    folder, entries = _folder(tmp_path, built, 8)
    _write(folder, DAMAGE[damage](entries))
    bulk = _refusal(folder, device)
    assert bulk == _refusal(folder, device, bulk=False, monkeypatch=monkeypatch), bulk
    if damage == "float expert" and device is None:  # (the CPU's float experts take it: the GPTQ ones overwrite it)
        assert bulk is None
        return
    assert bulk is not None and "model.layers." in bulk, bulk


@pytest.mark.parametrize("device", DEVICES, ids=["cpu", "int4"])
def test_act_order_experts_without_g_idx_are_refused_as_the_per_tensor_path(tmp_path, built, monkeypatch, device):
    """desc_act set and an expert's gate_proj (2 groups) without g_idx: refused naming it, bulk or not; its
    down_proj (1 group) without g_idx is no fault, nor are all experts without any g_idx where desc_act is off."""
    folder, entries = _folder(tmp_path, built, 8)
    without = [x for x in entries if x[0] != "model.layers.1.mlp.experts.6.gate_proj.g_idx"]
    _write(folder, without, {"desc_act": True})
    bulk = _refusal(folder, device)
    assert bulk == _refusal(folder, device, bulk=False, monkeypatch=monkeypatch), bulk
    assert bulk.startswith("the checkpoint has no tensor model.layers.1.mlp.experts.6.gate_proj.g_idx but "
                           "config.json sets desc_act (act-order groups)"), bulk
    _write(folder, [x for x in entries if x[0] != "model.layers.1.mlp.experts.6.down_proj.g_idx"], {"desc_act": True})
    assert _refusal(folder, device) is None
    _write(folder, [x for x in entries if not x[0].endswith("g_idx")], {"desc_act": False})
    assert _refusal(folder, device) is None


@pytest.mark.parametrize("device", DEVICES, ids=["cpu", "int4"])
def test_a_sound_checkpoint_passes_and_the_bulk_pass_takes_every_expert_tensor(tmp_path, built, monkeypatch, device):
    """The undamaged checkpoint passes check_weights; the bulk pass takes each of its 2 x 8 x 3 x 4 expert tensors
    (none left to a GPTQ layer built per expert projection) and hands on every other tensor."""
    from infer.models import moe
    from infer.models.loader import check_weights
    folder, entries = _folder(tmp_path, built, 8)
    _write(folder, entries)
    left: list[str] = []
    real = moe.MoeForCausalLM.check_expert_headers

    def spy(self, tensors, loaded):
        rest = real(self, tensors, loaded)
        left.extend(name for name, _ in rest)
        return rest
    monkeypatch.setattr(moe.MoeForCausalLM, "check_expert_headers", spy)
    monkeypatch.setattr(moe.SparseMoeBlock, "gptq_layer", lambda *a: pytest.fail("a GPTQ layer built per expert"))
    check_weights(folder, device)
    experts = [n for n, _, _ in entries if ".experts." in n]
    assert len(experts) == 2 * 8 * 3 * 4 and not set(experts) & set(left)
    assert sorted(left) == sorted(n for n, _, _ in entries if ".experts." not in n)


def test_one_bad_expert_tensor_of_thousands_is_refused_naming_it(tmp_path, built):
    """`warmup --estimate` of a GPTQ MoE checkpoint of 2 x 128 experts (3,072 expert tensors): one scales tensor of
    another shape refused naming it and both shapes; one qweight missing named as missing; sound, it plans. (A GPU's
    model, int4 experts: the tests above, check_weights alone.)"""
    folder, entries = _folder(tmp_path, built, 128)
    args = ["warmup", str(folder), "--estimate"]
    _write(folder, _reshaped(entries, "model.layers.1.mlp.experts.97.down_proj.scales", [1, 48]))
    res = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    words = " ".join(res.output.split())
    assert res.exit_code != 0 and "model.layers.1.mlp.experts.97.down_proj.scales has shape (1, 48) but " \
        "config.json implies (1, 64)" in words, words
    _write(folder, [x for x in entries if x[0] != "model.layers.0.mlp.experts.120.gate_proj.qweight"])
    res = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    words = " ".join(res.output.split())
    assert res.exit_code != 0 and "the checkpoint has no tensor model.layers.0.mlp.experts.120.gate_proj.qweight" \
        in words, words
    _write(folder, entries)
    res = CliRunner().invoke(app, args + ["--json"], env={"COLUMNS": "250"})
    assert json.loads(res.stdout.strip().splitlines()[-1])["fits"], res.output
