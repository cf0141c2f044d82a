"""AWQ int4 checkpoints ("gemm" packing, AutoAWQ's default, which vLLM's awq method reads): `infer run` loads them
directly (each layer repacked into GPTQ's layout as it is read) and `infer convert --to gptq` rewrites them as the
GPTQ checkpoint of the same int4 weights, which transformers (with GPTQModel) loads. What infer cannot read (another
packing, 8 bits, no zero points) is refused naming the field.

Two oracles: a reference AWQ packer written here from the format's description (below), and a checkpoint GPTQModel
quantizes with its own AWQ method on the CPU, whose own load gives the tokens infer must give.

The AWQ "gemm" format, for a linear of `in` inputs and `out` outputs quantized in groups of g input rows:
  qweight int32 [in, out / 8]: word j of input row i holds the 4-bit values of output columns 8j .. 8j + 7, the
          value of column 8j + ORDER[k] in bits 4k .. 4k + 3, ORDER = [0, 2, 4, 6, 1, 3, 5, 7];
  qzeros  int32 [in / g, out / 8]: each group's zero points (the zero itself), packed the same way;
  scales  fp16  [in / g, out];
  W[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o], the product in fp16.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.errors import ModelLoadError, UnsupportedModelError
from infer.models.layers import MergedLinear
from infer.models.loader import load_model
from infer.models.tiny import ensure_builtin
from infer.quant.config import GPTQConfig

from helpers import random_prompts
from quant_helpers import has_gptqmodel, needs_gptqmodel, unpack_int32
from test_gptq_linear import triton_gemm  # noqa: F401 (the fixture: kernels.gptq_matmul through Triton)

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
GROUP = 32
N = 10
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _word(values: list[int]) -> int:
    """Eight 4-bit values (output columns 8j .. 8j + 7) -> one AWQ int32 word (signed), by the format's order."""
    word = 0
    for k in range(8):
        word |= values[ORDER[k]] << (4 * k)
    return word - (1 << 32) if word >= 1 << 31 else word


def awq_pack(ints: torch.Tensor) -> torch.Tensor:
    """[rows, cols] ints 0..15 -> int32 [rows, cols / 8], word by word as the format says."""
    rows, cols = ints.shape
    table = ints.tolist()
    return torch.tensor([[_word(table[r][8 * j:8 * j + 8]) for j in range(cols // 8)] for r in range(rows)],
                        dtype=torch.int32)


def awq_quantize(w: torch.Tensor, group: int = GROUP):
    """Round-to-nearest asymmetric 4-bit quantization of a float weight [out, in] as AWQ's zero-point quantizer
    does it (min/max per group of input rows, zero = round(-min / scale) clamped to 0..15). Returns (q [in, out],
    zeros [in / group, out], scales fp16 [in / group, out])."""
    wt = w.t().float()  # [in, out]
    k, n = wt.shape
    grouped = wt.reshape(k // group, group, n)
    lo, hi = grouped.amin(1), grouped.amax(1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = torch.clamp(torch.round(-lo / scales.float()), 0, 15).to(torch.int64)
    q = torch.clamp(torch.round(grouped / scales.float().unsqueeze(1)) + zeros.unsqueeze(1), 0, 15)
    return q.reshape(k, n).to(torch.int64), zeros, scales


def awq_dequantize(q, zeros, scales, group: int = GROUP) -> torch.Tensor:
    """The format's W [out, in] (fp16 product) from the integers, before any packing."""
    g = torch.arange(q.shape[0]) // group
    return (scales[g] * (q - zeros[g]).half()).t().contiguous()


def float_model(tmp: Path) -> Path:
    """tiny-llama with as many KV heads as query heads (GPTQModel's AWQ clip search needs 64-wide outputs) and random
    weights; the first 8 output columns of every first group are made positive (a zero point of 0: the v1 borrow)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    src = ensure_builtin("tiny-llama")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items()
                                            if k not in ("architectures", "transformers_version", "dtype")}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p[:8, :GROUP] = p[:8, :GROUP].abs() + 0.01
    out = tmp / "float"
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    return out


def write_awq(float_dir: Path, out: Path, skip: tuple[str, ...] = (), **qc) -> dict:
    """The reference AWQ checkpoint of the float model (modules whose name contains one of `skip` stay float);
    returns {module: W reference [out, in] fp16}."""
    state = load_file(float_dir / "model.safetensors")
    tensors, ref = {}, {}
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if not module.endswith(LINEARS) or any(s in module for s in skip):
            tensors[name] = t
            continue
        q, z, s = awq_quantize(t)
        tensors.update({f"{module}.qweight": awq_pack(q), f"{module}.qzeros": awq_pack(z), f"{module}.scales": s})
        ref[module] = awq_dequantize(q, z, s)
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((float_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                  "version": "gemm", "modules_to_not_convert": list(skip) or None, **qc}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(float_dir / f, out / f)
    return ref


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return float_model(tmp_path_factory.mktemp("awq"))


@pytest.fixture(scope="module")
def ref_awq(base):
    out = base.parent / "ref-awq"
    return out, write_awq(base, out)


def _convert(src: Path, out: Path, *extra: str):
    return CliRunner().invoke(app, ["convert", str(src), "-o", str(out), "--to", "gptq", *extra])


@pytest.fixture(scope="module")
def ref_gptq(ref_awq):
    out = ref_awq[0].parent / "ref-gptq"
    res = _convert(ref_awq[0], out)
    assert res.exit_code == 0, res.output
    return out


def _greedy(path, prompts) -> list[list[int]]:
    llm = LLM(str(path), block_size=4)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=N, ignore_eos=True))]


PROMPTS = random_prompts(512, (4, 9, 17, 26), seed=11)


def test_the_reference_packer_follows_the_order():
    """Column 8j + ORDER[k] in nibble k: columns 0..7 holding 0..7 give nibbles 0, 2, 4, 6, 1, 3, 5, 7."""
    assert awq_pack(torch.arange(8).view(1, 8)).item() == 0x75316420


def test_infer_loads_the_awq_weights_exactly(ref_awq):
    """Every AWQ layer infer loads dequantizes to the format's weight, bit for bit (merged q/k/v and gate/up too)."""
    path, ref = ref_awq
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    seen = 0
    for layer in model.modules():
        if isinstance(layer, MergedLinear):
            want = torch.cat([ref[f"model.{n}" if not n.startswith("model.") else n] for n in layer.names]).float()
            assert torch.equal(layer.weight, want), layer.names
            seen += len(layer.names)
    assert seen == len(ref) == 2 * len(LINEARS)


def test_convert_to_gptq_keeps_every_integer_and_scale(ref_awq, ref_gptq):
    """The GPTQ output (read with an unpacker independent of infer's) holds the same q, zeros and scales: its
    dequantized weights equal the AWQ input's bit for bit; float tensors and the tokenizer are copied."""
    path, ref = ref_awq
    src, out = load_file(path / "model.safetensors"), load_file(ref_gptq / "model.safetensors")
    for module, w in ref.items():
        q = unpack_int32(out[f"{module}.qweight"], 4, 0).long()  # [in, out]
        z = _v1_zeros(out[f"{module}.qzeros"])
        s, g = out[f"{module}.scales"], out[f"{module}.g_idx"].long()
        assert torch.equal(g, torch.arange(q.shape[0]) // GROUP)
        assert torch.equal(s, src[f"{module}.scales"])
        assert torch.equal((s[g] * (q - z[g]).half()).t(), w), module
    for name, t in src.items():
        if not name.rpartition(".")[2] in ("qweight", "qzeros", "scales"):
            assert torch.equal(out[name], t), name
    qc = json.loads((ref_gptq / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"], qc["checkpoint_format"]) == \
        ("gptq", 4, GROUP, False, False, "gptq")
    assert json.loads((ref_gptq / "quantize_config.json").read_text()) == qc
    assert (ref_gptq / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()


def _v1_zeros(qzeros: torch.Tensor) -> torch.Tensor:
    """GPTQ v1 zero words -> the zeros: the words are the packed zeros minus 0x11111111 as one int32 subtraction
    (GPTQModel's v1, which its v1-to-v2 conversion undoes by adding it back)."""
    words = (qzeros.long() + 0x11111111) & 0xFFFFFFFF
    return unpack_int32((words - ((words >> 31) << 32)).int(), 4, 1).long()


def test_some_zero_points_are_zero(ref_awq):
    """The fixture exercises the v1 borrow (a zero of 0 stored as -1)."""
    z = torch.cat([_unpack_awq_zeros(t).flatten() for n, t in load_file(ref_awq[0] / "model.safetensors").items()
                   if n.endswith("qzeros")])
    assert (z == 0).any() and (z > 0).any()


def _unpack_awq_zeros(packed: torch.Tensor) -> torch.Tensor:
    nib = unpack_int32(packed, 4, 1).view(packed.shape[0], -1, 8)
    out = torch.empty_like(nib)
    out[:, :, ORDER] = nib
    return out.reshape(packed.shape[0], -1)


@needs_gptqmodel
def test_awq_and_its_gptq_conversion_give_transformers_tokens(ref_awq, ref_gptq):
    from test_gptq_engine import hf_gptq_greedy
    want = hf_gptq_greedy(ref_gptq, PROMPTS, N)
    assert _greedy(ref_gptq, PROMPTS) == want
    assert _greedy(ref_awq[0], PROMPTS) == want


@pytest.fixture(scope="module")
def gptqmodel_awq(base):
    """A checkpoint GPTQModel quantizes with its own AWQ method (format gemm) on the CPU."""
    import tempfile

    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.looper import loop_processor
    from gptqmodel.quantization.config import FORMAT, METHOD
    from gptqmodel.utils.backend import BACKEND
    out = base.parent / "gptqmodel-awq"
    g = torch.Generator().manual_seed(0)
    calib = [{"input_ids": torch.randint(3, 512, (64,), generator=g).tolist(), "attention_mask": [1] * 64}
             for _ in range(8)]
    qcfg = QuantizeConfig(bits=4, group_size=GROUP, sym=False, quant_method=METHOD.AWQ, format=FORMAT.GEMM)
    with tempfile.TemporaryDirectory() as work:
        old, loop_processor._PROJECT_LOG_DIR = loop_processor._PROJECT_LOG_DIR, Path(work) / "logs"
        try:
            model = GPTQModel.load(str(base), qcfg, dtype=torch.float16)
            model.quantize(calib, batch_size=1, backend=BACKEND.AWQ_TORCH)
            model.save(str(out))
        finally:
            loop_processor._PROJECT_LOG_DIR = old
    return out


@needs_gptqmodel
def test_gptqmodel_awq_checkpoint_gives_gptqmodels_tokens(gptqmodel_awq):
    """infer on GPTQModel's AWQ checkpoint, and on its GPTQ conversion, gives the tokens GPTQModel's own AWQ load
    gives."""
    from gptqmodel import GPTQModel
    from gptqmodel.utils.backend import BACKEND
    qc = json.loads((gptqmodel_awq / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc.get("version") or qc.get("format")) == ("awq", "gemm")
    model = GPTQModel.load(str(gptqmodel_awq), device="cpu", backend=BACKEND.AWQ_TORCH, dtype=torch.float32)
    with torch.no_grad():
        want = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=N, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
    assert _greedy(gptqmodel_awq, PROMPTS) == want
    out = gptqmodel_awq.parent / "gptqmodel-gptq"
    res = _convert(gptqmodel_awq, out)
    assert res.exit_code == 0, res.output
    assert _greedy(out, PROMPTS) == want


def _with_qc(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    qc = {**cfg["quantization_config"], **changes}
    cfg["quantization_config"] = {k: v for k, v in qc.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, words", [
    ({"version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"version": "GEMV_FAST"}, "AWQ version 'gemv_fast' is not supported"),
    ({"version": "marlin"}, "AWQ version 'marlin' is not supported"),
    ({"version": "exllama"}, "AWQ version 'exllama' is not supported"),
    ({"version": None, "format": "gemv"}, "AWQ format 'gemv' is not supported"),
    ({"bits": 8}, "8-bit AWQ is not supported (bits 8)"),
    ({"bits": None, "w_bit": 3}, "3-bit AWQ is not supported"),
    ({"zero_point": False}, "AWQ zero_point false is not supported"),
    ({"backend": "llm-awq"}, "AWQ backend 'llm-awq' is not supported"),
    ({"pack_dtype": "int16"}, "AWQ pack_dtype 'int16' is not supported"),
    ({"group_size": 0}, "AWQ group_size 0 is not supported"),
])
def test_what_infer_cannot_read_is_refused_naming_the_field(ref_awq, tmp_path, changes, words):
    """infer run and infer convert --to gptq refuse it before reading a tensor, naming the field and a way out."""
    path = _with_qc(ref_awq[0], tmp_path / "m", **changes)
    with pytest.raises(UnsupportedModelError) as e:
        GPTQConfig.from_model_dir(path)
    assert words in e.value.message and "`infer quantize`" in e.value.hint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    res = CliRunner().invoke(app, ["run", str(path), str(prompts), "-o", str(tmp_path / "o.jsonl"), "-q"])
    assert res.exit_code == 2 and words in res.output, res.output
    res = _convert(path, tmp_path / "out")
    assert res.exit_code == 2 and words in res.output and not (tmp_path / "out").exists(), res.output


def test_older_autoawq_keys_are_read():
    """w_bit and q_group_size (AutoAWQ's quant_config.json, which vLLM reads too)."""
    cfg = GPTQConfig.from_dict({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
                                "version": "GEMM"}, "quant_config.json")
    assert (cfg.quant_method, cfg.bits, cfg.group_size, cfg.sym, cfg.desc_act) == ("awq", 4, 64, False, False)


def test_modules_to_not_convert_stay_float(base, tmp_path):
    """As vLLM reads it: a linear whose name contains one of modules_to_not_convert is float (here down_proj); its
    GPTQ conversion leaves it float through modules_in_block_to_quantize (which transformers reads: not `dynamic`),
    and infer on both and transformers on the conversion give the same tokens."""
    path = tmp_path / "awq-skip"
    ref = write_awq(base, path, skip=("mlp.down_proj",))
    assert not any("down_proj" in m for m in ref)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    down = model.layers[0].mlp.down_proj
    assert getattr(down, "qweight", None) is None
    assert torch.equal(down.weight, load_file(base / "model.safetensors")["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight,
                       torch.cat([ref["model.layers.0.mlp.gate_proj"], ref["model.layers.0.mlp.up_proj"]]).float())
    out = tmp_path / "gptq-skip"
    res = _convert(path, out)
    assert res.exit_code == 0, res.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    cfg = GPTQConfig.from_dict(qc, "config.json")
    assert cfg.for_module("model.layers.1.mlp.down_proj") is None
    assert cfg.for_module("model.layers.1.mlp.up_proj") is not None
    assert "model.layers.1.mlp.down_proj.weight" in load_file(out / "model.safetensors")
    assert "dynamic" not in qc and sorted(qc["modules_in_block_to_quantize"][0]) == sorted(
        m for m in LINEARS if m != "mlp.down_proj")
    want = _greedy(path, PROMPTS)
    assert _greedy(out, PROMPTS) == want
    if has_gptqmodel():
        from test_gptq_engine import hf_gptq_greedy
        assert hf_gptq_greedy(out, PROMPTS, N) == want


def test_a_layer_the_config_half_skips_is_refused(base, tmp_path):
    """modules_to_not_convert naming q_proj alone: infer runs q/k/v as one matmul, which cannot be half float."""
    path = tmp_path / "awq-q"
    write_awq(base, path, skip=("q_proj",))
    with pytest.raises(UnsupportedModelError, match="quantizes .*k_proj.* but not .*q_proj"):
        load_model(path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("tensor, change, words", [
    ("model.layers.0.self_attn.o_proj.qzeros", lambda t: t[:1], r"o_proj\.qzeros has shape \(1, 8\)"),
    ("model.layers.0.mlp.up_proj.g_idx", None, r"unexpected tensor .*up_proj\.g_idx in an AWQ layer"),
])
def test_a_damaged_awq_checkpoint_names_the_tensor(ref_awq, tmp_path, tensor, change, words):
    path = tmp_path / "m"
    shutil.copytree(ref_awq[0], path)
    state = load_file(path / "model.safetensors")
    state[tensor] = change(state[tensor]) if change else torch.arange(64, dtype=torch.int32) // GROUP
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=words):
        load_model(path, torch.float32, torch.device("cpu"))


def test_convert_refuses_what_it_cannot_make_gptq(base, ref_awq, tmp_path):
    res = _convert(base, tmp_path / "a")
    assert res.exit_code == 2 and "--to gptq" in res.output and "is a float model" in res.output, res.output
    res = CliRunner().invoke(app, ["convert", str(ref_awq[0]), "-o", str(tmp_path / "b"), "--to", "awq"])
    assert res.exit_code == 2 and "--to 'awq' is not supported" in res.output, res.output
    res = _convert(ref_awq[0], tmp_path / "c", "--dtype", "bfloat16")
    assert res.exit_code == 2 and "cannot change the dtype of the AWQ checkpoint" in res.output, res.output


def test_convert_to_safetensors_keeps_awq_tensors(ref_awq, tmp_path):
    """--to safetensors (the default) copies an AWQ checkpoint unchanged, as it copies a GPTQ one (transformers
    could not load it as a float model)."""
    out = tmp_path / "copy"
    res = CliRunner().invoke(app, ["convert", str(ref_awq[0]), "-o", str(out)])
    assert res.exit_code == 0, res.output
    src, got = load_file(ref_awq[0] / "model.safetensors"), load_file(out / "model.safetensors")
    assert src.keys() == got.keys() and all(torch.equal(src[k], got[k]) for k in src)
    assert json.loads((out / "config.json").read_text()) == json.loads((ref_awq[0] / "config.json").read_text())


def test_lora_validate_names_an_awq_base(ref_awq):
    from infer.lora.validate import read_base
    assert read_base(str(ref_awq[0]), quantized=True).gptq == f"AWQ 4-bit, group {GROUP}"


def test_warmup_estimate_reads_an_awq_checkpoint(ref_awq):
    res = CliRunner().invoke(app, ["warmup", str(ref_awq[0]), "--estimate", "--max-length", "64", "--concurrency",
                                   "1", "--device", "cpu"])
    assert res.exit_code == 0, res.output


def _awq_merged_layer(use_kernel: bool):
    """A merged q/k/v AWQ layer (AWQLinearMethod) of random weights, and the format's weight [out, in] float32."""
    from infer.quant.awq import AWQLinearMethod
    g = torch.Generator().manual_seed(3)
    names, sizes, k = ["m.q_proj", "m.k_proj", "m.v_proj"], [64, 32, 32], 128
    cfg = GPTQConfig.from_dict({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                "version": "gemm"}, "config.json")
    layer = MergedLinear(k, sizes, names, False, AWQLinearMethod(cfg, use_kernel), torch.float32)
    ref = []
    for i, n in enumerate(sizes):
        q, z, s = awq_quantize(torch.randn(n, k, generator=g))
        for name, t in (("qweight", awq_pack(q)), ("qzeros", awq_pack(z)), ("scales", s)):
            layer.load_shard(name, i, t)
        ref.append(awq_dequantize(q, z, s))
    layer.finish_loading()
    return layer, torch.cat(ref).float()


@pytest.mark.parametrize("use_kernel", [False, True])
def test_an_awq_layer_computes_with_the_formats_weight(use_kernel):
    """The CPU path (dequantized float weight) and the int4 kernel path (its torch reference here) of an AWQ layer
    give F.linear with the format's weight."""
    layer, w = _awq_merged_layer(use_kernel)
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(4))
    assert torch.equal(layer.dequantized_weight(), w)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-4)
    if use_kernel:
        assert layer.weight is None and layer.gptq_group_size == GROUP


def test_an_awq_layer_through_the_triton_kernel(triton_gemm):  # noqa: F811
    layer, w = _awq_merged_layer(True)
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-4)
