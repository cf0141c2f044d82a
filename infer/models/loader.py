"""Load a Hugging Face model folder (safetensors or .bin, sharded or not, float, GPTQ or AWQ) into infer's model."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoConfig

from ..errors import ModelLoadError, UnsupportedModelError
from ..quant.convert import CONFIG_HINT, read_config_json
from ..quant.files import indexed_files
from .classifier import add_score_head, is_classifier, set_token_head, token_head
from .layers import MergedLinear, UnquantizedLinearMethod
from .moe import mtp_filter
from .multimodal import quant_config, text_config, text_tensors, wrapper_of
from .registry import check_llama4_temperature_tuning, check_near_family, check_supported, model_class
from .rope import check_rope
from .shapes import check_config_values, check_shapes

log = logging.getLogger("infer")

# buffers transformers saved in older checkpoints (and ColossalAI its cos/sin caches): no weights, as vLLM skips them
_IGNORED = re.compile(r"rotary_emb\.(inv_freq|cos_cached|sin_cached)$")

# float8 weights without scales: their values upcast exactly (infer has no float8 weights, so they take the model's
# dtype); a warning says so. An fp8-quantized checkpoint's scales and quantization_config are refused elsewhere.
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _dtype_name(d) -> str:
    return str(d).removeprefix("torch.")


def load_config(path: Path):
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json", "pass a Hugging Face model folder")
    raw = read_config_json(path)
    check_config_values(raw)  # (bad JSON, a size of 0: said before transformers reads it)
    check_near_family(raw.get("model_type"), raw.get("architectures") or [])  # (remote code transformers lacks)
    check_llama4_temperature_tuning(raw)  # (an integer transformers 4.51 wrote, which transformers 5 refuses)
    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # an unknown model_type, a field of the wrong type, ...
        raise UnsupportedModelError(f"cannot read {path / 'config.json'}: {e}", CONFIG_HINT) from e
    if wrapper_of(cfg) is not None:  # a multimodal checkpoint: its text model (models.multimodal)
        check_config_values(raw.get("text_config") or {})
        cfg = text_config(cfg, raw)
    check_supported(cfg)
    check_shapes(cfg)
    check_rope(cfg)  # refused here, not only when the model is built: warmup --estimate never builds it
    head = token_head(cfg)  # (a classifier of lm_head's rows of tokens: one label for vLLM's from_2_way_softmax)
    if head is not None:
        cfg.num_labels = 1 if head[0] == "from_2_way_softmax" else len(head[1])
    return cfg


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: safetensors preferred, then .bin; sharded through their index."""
    indexed = indexed_files(path)
    if indexed is not None:
        return indexed
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (path / single).is_file():
            return [path / single]
    found = sorted(p.name for p in path.glob("*.safetensors")) or sorted(p.name for p in path.glob("*.bin"))
    if found:
        return [path / n for n in found]
    raise ModelLoadError(f"{path} has no weights (model.safetensors or pytorch_model.bin)",
                         "pass a complete Hugging Face model folder")


def iter_tensors(files: list[Path], meta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the files; `meta`: each as a meta tensor of its shape, read from the
    headers (float32 or int32: only the kind matters to the checks), no weight data read."""
    if meta:
        yield from _metas(iter_headers(files))
        return
    yield from _read(files)


def iter_headers(files: list[Path], names: bool = False) -> Iterator[tuple[str, tuple[str, list[int]] | torch.Tensor]]:
    """(name, (safetensors dtype, shape)) of every tensor in the files, from the headers, no tensor made (a .bin
    file's: (name, meta tensor)): check_weights takes a mixture of experts' thousands of expert tensors in bulk.
    `names`: (name, None) of a safetensors file's tensors, their headers' fields not read."""
    return _read(files, "names" if names else "headers")


def _read(files: list[Path], what: str = "tensors"):
    for f in files:
        try:
            if f.suffix == ".safetensors":
                from safetensors import safe_open
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():
                        if what == "names":
                            yield name, None
                        elif what == "headers":
                            part = sf.get_slice(name)
                            yield name, (part.get_dtype(), part.get_shape())
                        else:
                            yield name, sf.get_tensor(name)
            else:
                state = torch.load(f, map_location="cpu" if what == "tensors" else "meta", weights_only=True)
                yield from state.items()
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read weight file {f}: {e}", "the file is corrupted or truncated") from e


# safetensors' dtype names of the integer kinds (as meta tensors: the checks name a tensor's dtype)
_INT_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
               "BOOL": torch.bool}


def _metas(entries) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_headers' entries as (name, meta tensor)."""
    return ((name, h if isinstance(h, torch.Tensor) else _meta_of(*h)) for name, h in entries)


def _meta_of(code: str, shape: list[int]) -> torch.Tensor:
    kind = torch.float32 if "F" in code else _INT_DTYPES.get(code, torch.int32)  # F16, BF16, F8_E4M3, ...
    return torch.empty(shape, dtype=kind, device="meta")


def _check_kind(name: str, t: torch.Tensor, dest) -> None:
    """An integer tensor (int8, uint8, ...) bound for a float parameter or buffer is refused: cast to float it is
    garbage (quantized values without their scales). GPTQ's qweight/qzeros/g_idx land in integer buffers."""
    if isinstance(dest, torch.Tensor) and dest.is_floating_point() and not t.is_floating_point():
        raise ModelLoadError(f"{name} is {str(t.dtype).removeprefix('torch.')} in a checkpoint whose config.json has "
                             "no quantization_config for it: infer would read its integers as float weights",
                             "a quantized checkpoint needs the quantization_config it was saved with (infer runs "
                             "GPTQ and AWQ); otherwise use the float checkpoint")


def module_key(name: str) -> str:
    """A checkpoint module's (or tensor's) name as the model holds it: without the `model.` prefix, which a checkpoint
    saved from the base model (LlamaModel) lacks (place_weights maps both alike). The quantization config's rules
    are matched against `model.` + this (the module names of a ...ForCausalLM, as GPTQModel matches them), the output
    head's (`lm_head`) aside."""
    return name[len("model."):] if name.startswith("model.") else name


def linear_method_factory(path: Path, cfg):
    """A function names -> LinearMethod for the checkpoint's quantization (None = float weights)."""
    qc = getattr(cfg, "quantization_config", None)
    if not qc and not any((path / f).is_file() for f in ("quantize_config.json", "quant_config.json")):
        return lambda names: None
    from ..quant.config import GPTQConfig, mxfp4_gpt_oss
    if mxfp4_gpt_oss({"model_type": getattr(cfg, "model_type", None), "quantization_config": qc}):
        # the hub's gpt-oss checkpoints: MXFP4 experts, kept packed (models.moe.Experts' mxfp4 stacks), every
        # other layer float
        return lambda names: None
    from ..quant.fp8 import fp8_model
    if fp8_model(cfg) is not None:  # block-scaled FP8 weights: dequantized as they are read (fp8_dequantized)
        return lambda names: None
    from ..quant.gptq_linear import GPTQLinearMethod
    gcfg = quant_config(GPTQConfig.from_model_dir(path), cfg)  # (a multimodal one's rules: models.multimodal)
    if gcfg is None:
        raise UnsupportedModelError(f"{path} has a quantization config infer cannot read")
    if gcfg.quant_method == "awq":  # AWQ 'gemm': each layer repacked into GPTQ's layout as it is read
        from ..quant.awq import AWQLinearMethod as GPTQLinearMethod  # noqa: F811
    packed = getattr(model_class(cfg), "packed_modules_mapping", {})
    stored: set[str] = set()  # the modules the checkpoint has tensors of (read from the headers when first needed)

    def stored_names(names: list[str]) -> list[str]:
        """The checkpoint modules whose settings decide a merged layer's shards, as its readers match the config
        against them: a fused module that stores every shard (Phi-3's mlp.gate_up_proj) where the checkpoint
        stores it, else the projections it packs where it stores those (GPTQModel writes a Phi-3's mlp.gate_proj
        and mlp.up_proj apart, and matches its `dynamic` rules against each)."""
        parent, _, fused = names[0].rpartition(".")
        projs = packed.get(fused)
        if len(set(names)) != 1 or not projs or len(projs) != len(names):
            return names
        split = [f"{parent}.{p}" for p in projs]
        settings = {None if c is None else c.settings() for c in map(gcfg.for_module, [names[0], *split])}
        if len(settings) == 1:  # the same whichever the layout: no need to read the headers
            return names
        if not stored:  # (as place_weights reads them: with or without the `model.` prefix)
            stored.update(module_key(name.rpartition(".")[0])
                          for name, _ in text_tensors(cfg, iter_headers(weight_files(path), names=True)))
        return split if any(module_key(n) in stored for n in split) else names

    quantized: dict[str, bool] = {}  # layers.N -> whether it stores its experts quantized ("": any qweight at all)

    def float_experts(names: list[str]) -> bool:
        """Whether `names` are a mixture of experts' expert projections (models.moe) that a GPTQ checkpoint stores in
        float, its other layers quantized but none of this layer's experts (a qweight): GPTQModel 7.6 on transformers
        5 leaves Granite MoE's stacked experts float with no `dynamic` rule saying so. (The headers read once, when
        first asked; a checkpoint without any qweight is left to the config's word, as before.)"""
        block, sep, _ = module_key(names[0]).partition(".experts.")
        if not sep:
            return False
        if not quantized:
            quantized[""] = False
            for name, _ in text_tensors(cfg, iter_headers(weight_files(path), names=True)):
                if name.endswith(".qweight"):
                    quantized[""] = True
                    if ".experts." in name:  # (layers.N: Mixtral's experts stored under block_sparse_moe or mlp)
                        quantized[module_key(name).partition(".experts.")[0].rpartition(".")[0]] = True
        return quantized[""] and block.rpartition(".")[0] not in quantized

    def method_for(names):
        if names == ["lm_head"]:  # the output head: quantized only where the checkpoint says lm_head (None: float)
            head = gcfg.for_head()
            return None if head is None else GPTQLinearMethod(head)
        if float_experts(names):
            return UnquantizedLinearMethod("the checkpoint stores these experts in float (no qweight)")
        names = stored_names(names)
        configs = [gcfg.for_module(n) for n in names]
        quantized = [n for n, c in zip(names, configs) if c is not None]
        alike = "infer computes these projections as one matmul: quantize them alike, or leave them all in float"
        if len(quantized) == len(names):
            other = [(n, c) for n, c in zip(names, configs) if c.settings() != configs[0].settings()]
            if other:  # dynamic overrides for some of them
                (name, config), first = other[0], configs[0]
                keys = [k for k, a, b in zip(("bits", "group_size", "desc_act", "sym"), first.settings(),
                                             config.settings()) if a != b]
                raise UnsupportedModelError(
                    f"{path}: {gcfg.source}'s dynamic quantizes {names[0]} and {name} with different settings: "
                    f"{', '.join(f'{k} {json.dumps(getattr(first, k))}' for k in keys)} ({gcfg.why(names[0])}) and "
                    f"{', '.join(f'{k} {json.dumps(getattr(config, k))}' for k in keys)} ({gcfg.why(name)})", alike)
            return GPTQLinearMethod(configs[0])
        which = "dynamic" if gcfg.dynamic else "modules_in_block_to_quantize"
        if not quantized:  # left in float by modules_in_block_to_quantize or dynamic
            return UnquantizedLinearMethod(f"{gcfg.source}'s {which} leaves it in float")
        floats = [n for n in names if n not in quantized]
        raise UnsupportedModelError(f"{path}: {which} quantizes {', '.join(quantized)} but not {', '.join(floats)} "
                                    f"({gcfg.why(floats[0])})", alike)
    return method_for


def load_model(path: Path, dtype: torch.dtype, device: torch.device, max_positions: int | None = None):
    """(the model, its HF config); `max_positions`: the positions it will see (the rope table's rows)."""
    cfg = load_config(path)
    files = weight_files(path)
    with torch.device(device):
        model = _build(cfg, dtype, linear_method_factory(path, cfg), max_positions)
    stored = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if _dtype_name(stored).startswith("float8"):
        log.warning(f"config.json's dtype is {_dtype_name(stored)}: infer has no float8 weights and computes in "
                    f"{_dtype_name(dtype)}")
    load_weights(model, fp8_dequantized(cfg, path, text_tensors(cfg, iter_tensors(files))), dtype)
    if token_head(cfg) is not None:
        set_token_head(model, cfg, path)
    model.finish_loading()
    model.eval()
    return model, cfg


def fp8_dequantized(cfg, path: Path, tensors):
    """The tensors of a block-scaled FP8 checkpoint (quant.fp8: quant_method "fp8") with each FP8 weight
    dequantized (its scale dropped), as the float model's; another checkpoint's as they are."""
    from ..quant import fp8
    qc = fp8.fp8_model(cfg)
    if qc is None:
        return tensors
    return fp8.dequantized(tensors, fp8.block_size(qc, str(path / "config.json")), str(path))


def _build(cfg, dtype: torch.dtype, method_for, max_positions: int | None):
    """The model of `cfg`, on the current device; a ForSequenceClassification's with its score head (one built from
    lm_head's rows of tokens keeps lm_head to load: set_token_head replaces it)."""
    model = model_class(cfg)(cfg, dtype, method_for, max_positions)
    if is_classifier(cfg) and token_head(cfg) is None:
        add_score_head(model, cfg, dtype)
    return model


def check_weights(path: Path, device: torch.device | None = None):
    """What load_model checks of a checkpoint (float, GPTQ or AWQ), without reading a tensor: an architecture infer
    runs, its quantization config against the layers infer merges (`dynamic` rules that set them apart), every
    tensor's name and shape against config.json, none missing and none left over. The model is built on the meta
    device and fed the shapes in the weight files' headers (`infer convert` and `infer quantize` call it before
    transformers, which fills missing weights at random and drops the others, sees the folder; `infer warmup
    --estimate` before it reads the sizes, so that it refuses what a load refuses). `device`: the one the load
    will be on (a GPU: the model built as a GPU builds it, a mixture of experts' GPTQ experts int4, models.moe);
    None: the CPU's. Returns the model on the meta device (its layers' methods: what a load would quantize)."""
    from .moe import meta_as_gpu
    cfg = load_config(path)
    files = weight_files(path)
    with torch.device("meta"), meta_as_gpu(device is not None and torch.device(device).type == "cuda"):
        model = _build(cfg, torch.float32, linear_method_factory(path, cfg), 1)
    tensors, loaded = fp8_dequantized(cfg, path, text_tensors(cfg, iter_headers(files))), set()
    if hasattr(model, "check_expert_headers"):  # (a mixture of experts' GPTQ experts: checked in bulk, models.moe)
        tensors = model.check_expert_headers(tensors, loaded)
    place_weights(model, _metas(tensors), torch.float32, loaded)
    for layer in model.modules():  # a quantized layer's own tensors (qweight, qzeros, scales, g_idx) all in
        if isinstance(layer, MergedLinear) and hasattr(layer.method, "check_complete"):
            layer.method.check_complete(layer)
    if token_head(cfg) is not None:  # (the tokens are looked up in the tokenizer, as a load does)
        set_token_head(model, cfg, path)
    return model


def load_weights(model, tensors, dtype: torch.dtype) -> None:
    stored_head = place_weights(model, tensors, dtype)
    for layer in model.modules():
        if isinstance(layer, MergedLinear):
            layer.finish_loading()
    if stored_head is not None:
        emb = model.embed_tokens.weight
        if not torch.equal(stored_head.to(emb.device), emb):
            log.warning("config.json ties lm_head to embed_tokens but the checkpoint stores a different "
                        "lm_head.weight: using the stored head, as transformers does")
            model.untie_head(stored_head)


def place_weights(model, tensors, dtype: torch.dtype, loaded: set[str] | None = None):
    """Copy each (name, tensor) into the model, checking names and shapes against it: a ModelLoadError for a tensor
    of the wrong shape, one the model has no place for (a layer config.json does not count, another architecture's
    names) or a missing one. `loaded`: the parameters already checked (check_weights' bulk pass). Returns a stored
    lm_head.weight that config.json ties to the embeddings (else None)."""
    params = dict(model.named_parameters())
    loaded = set() if loaded is None else loaded
    unexpected: list[str] = []
    stored_head = None
    merged: dict[str, MergedLinear] = {n: m for n, m in model.named_modules() if isinstance(m, MergedLinear)}
    shards = packed_shards(type(model))
    packed = getattr(type(model), "packed_modules_mapping", {})
    # inf/NaN: each tensor as it is read on a CPU model; on a GPU the parameters once loaded, on the GPU (a pass over
    # the CPU copies would cost seconds on a 7B, the GPU's one milliseconds)
    on_cpu = all(p.device.type == "cpu" for p in params.values())
    float8: list[str] = []
    experts = getattr(model, "load_expert_tensor", None)
    mtp_tensor = mtp_filter(getattr(model, "config", None))
    for name, t in tensors:
        if _IGNORED.search(name) or mtp_tensor(name):  # (multi-token prediction)
            continue
        if t.dtype in _FLOAT8:
            float8.append(f"{name} ({_dtype_name(t.dtype)})")
        elif t.is_floating_point() and t.element_size() < 2:  # float4 (two to a byte), float8_e8m0fnu (scales)
            raise ModelLoadError(f"{name} is {_dtype_name(t.dtype)}, which infer cannot read as weights",
                                 "use a float16, bfloat16 or float32 checkpoint (or GPTQ)")
        raw = t
        if t.is_floating_point() and not name.endswith("scales"):
            t = t.to(dtype)
        if on_cpu:
            _check_finite(name, raw, t)
        key = module_key(name)
        into = experts(key, t, name, raw) if experts is not None else None  # a mixture of experts' (models.moe)
        if into is not None:
            loaded.add(into)
            continue
        routed = _merged_shard(key, shards, merged)
        if routed is not None:
            layer, pname, shard = routed
            if shard is not None and layer.fused and layer.stored_names is None:  # its shards stored apart
                parent = name.rpartition(".")[0].rpartition(".")[0]
                layer.stored_names = [f"{parent}.{p}" for p in packed[layer.names[0].rpartition(".")[2]]]
            _check_kind(name, t, getattr(layer, pname, None))
            if shard is None:
                layer.load_fused(pname, t)
            else:
                layer.load_shard(pname, shard, t)
            continue
        if key == "lm_head.weight" and "lm_head.weight" not in params:
            _check_kind(name, t, params.get("embed_tokens.weight"))
            stored_head = t  # tied embeddings: kept only if it differs from them (checked once both are in)
            continue
        if key == "lm_head.bias" and "head_bias" in params:  # (ERNIE 4.5 MoE's use_bias: LlamaForCausalLM.head_bias)
            key = "head_bias"
        if key not in params:
            unexpected.append(name)
            continue
        if tuple(params[key].shape) != tuple(t.shape):
            raise ModelLoadError(f"{name} has shape {tuple(t.shape)}, config.json implies {tuple(params[key].shape)}",
                                 "the weights do not match config.json")
        _check_kind(name, t, params[key])
        params[key].data.copy_(t)
        loaded.add(key)
    if stored_head is not None and "embed_tokens.weight" not in loaded and model.tie_word_embeddings:
        # the tied matrix stored under lm_head.weight alone (safetensors' save_model keeps the first of shared
        # names in sorted order): transformers ties the embeddings to it, and so does infer
        emb = params["embed_tokens.weight"]
        if tuple(stored_head.shape) != tuple(emb.shape):
            raise ModelLoadError(f"lm_head.weight has shape {tuple(stored_head.shape)}, config.json implies "
                                 f"{tuple(emb.shape)}", "the weights do not match config.json")
        emb.data.copy_(stored_head)
        loaded.add("embed_tokens.weight")
        stored_head = None
    if experts is not None:
        model.check_experts()
    _zero_missing_ernie_bias(model, params, loaded)
    _check_complete(params, loaded, merged)
    if not on_cpu:
        _check_finite_on_device(model, dtype)
    if unexpected:  # vLLM refuses them too; transformers drops them with a warning (a layer config.json leaves out)
        raise ModelLoadError(f"the checkpoint has tensors config.json has no place for: {unexpected[0]}"
                             + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""),
                             "config.json does not describe these weights (num_hidden_layers, the architecture): "
                             "use the config.json that came with them")
    if float8:
        log.warning(f"the checkpoint stores float8 weights without scales: {float8[0]}"
                    + (f" and {len(float8) - 1} more" if len(float8) > 1 else "")
                    + f"; infer has no float8 weights and upcasts them to {_dtype_name(dtype)} (exactly)")
    if stored_head is not None and "embed_tokens.weight" in loaded:
        emb = params["embed_tokens.weight"]
        if tuple(stored_head.shape) != tuple(emb.shape):
            raise ModelLoadError(f"lm_head.weight has shape {tuple(stored_head.shape)}, config.json implies "
                                 f"{tuple(emb.shape)}", "the weights do not match config.json")
        return stored_head
    return None


def _check_finite(name: str, raw: torch.Tensor, t: torch.Tensor) -> None:
    """A float tensor with an inf or a NaN (in the file, or from the cast to the model's dtype) is refused: on a CPU
    attention over NaN keys still gives finite output, so a broken checkpoint would write normal-looking text."""
    if not t.is_floating_point() or t.is_meta or _finite(t):
        return
    if raw is not t and _finite(raw):
        raise ModelLoadError(f"{name} has values beyond {_dtype_name(t.dtype)}'s range (inf after the cast from "
                             f"{_dtype_name(raw.dtype)})", "use a wider --dtype (the checkpoint's own, or float32)")
    raise ModelLoadError(f"{name} has non-finite values (inf or NaN)",
                         "the checkpoint is broken: download or convert it again")


def _check_finite_on_device(model, dtype: torch.dtype) -> None:
    """_check_finite for a model on a GPU, after its weights are in: each float parameter on its device (the
    checkpoint's name is not known there, nor whether the cast made the inf), and each GPTQ/AWQ layer's scales (a
    buffer in float16 whatever the dtype: one of another float type beyond its range is refused as it is read,
    quant.gptq_linear._check_scales, so an inf or NaN there is the checkpoint's own)."""
    for pname, p in model.named_parameters():
        if p.is_floating_point() and not p.is_meta and not _finite(p.detach()):
            raise ModelLoadError(f"{pname} has non-finite values (inf or NaN) as {_dtype_name(dtype)}",
                                 "the checkpoint holds inf or NaN (download or convert it again), or values beyond "
                                 f"{_dtype_name(dtype)}'s range (load it with a wider --dtype, e.g. float32)")
    for bname, b in model.named_buffers():
        if bname.endswith(".scales") and b.is_floating_point() and not b.is_meta and not _finite(b):
            raise ModelLoadError(f"{bname} has non-finite values (inf or NaN)",
                                 "the checkpoint is broken: download or convert it again")


def _finite(t: torch.Tensor) -> bool:
    """No inf or NaN in t: its min and max (aminmax propagates NaN) are finite; one pass and no mask of t's size
    (isfinite(t).all() is 20x slower on a CPU). float8 is read as float32 (no aminmax for it)."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t.float() if t.element_size() == 1 else t)
    return math.isfinite(low.item()) and math.isfinite(high.item())


def packed_shards(model_cls) -> dict[str, tuple[str, int]]:
    """HF projection -> (merged module, shard index), from the model class's `packed_modules_mapping`."""
    mapping = getattr(model_cls, "packed_modules_mapping", {})
    return {proj: (packed, i) for packed, projs in mapping.items() for i, proj in enumerate(projs)}


def _merged_shard(key: str, shards: dict[str, tuple[str, int]], merged: dict[str, MergedLinear]):
    """(MergedLinear, parameter name, shard) for a checkpoint tensor that one of the model's merged layers holds
    (a packed projection such as q_proj, or a plain one such as o_proj as shard 0), else None. Shard None: the
    tensor of a fused module that stores every shard (Phi-3's qkv_proj: MergedLinear.load_fused)."""
    module, _, pname = key.rpartition(".")
    parent, _, proj = module.rpartition(".")
    packed, shard = shards.get(proj, (proj, 0))
    layer = merged.get(f"{parent}.{packed}" if parent else packed)
    if layer is not None and proj == packed and layer.fused:
        shard = None
    return None if layer is None else (layer, pname, shard)


_LAYER = re.compile(r"^layers\.(\d+)\.")


def _check_layer_count(params, loaded, merged) -> None:
    """Weights for the first k layers and none after, where config.json implies more: named as a layer count (a
    config.json of another model size, or none of num_hidden_layers, whose transformers default is 32), not as the
    first projection of layer k missing from "an incomplete folder"."""
    def index(name: str) -> int | None:
        m = _LAYER.match(name)
        return int(m.group(1)) if m else None
    wanted = {i for i in map(index, [*params, *merged]) if i is not None}
    have = {index(k) for k in loaded} | {index(m) for m, layer in merged.items() if layer.loaded_names()}
    have.discard(None)
    k = len(have)
    if wanted and 0 < k < len(wanted) and have == set(range(k)):
        raise ModelLoadError(f"the checkpoint has weights for {k} layer{'s' if k > 1 else ''}, config.json implies "
                             f"{len(wanted)} (its num_hidden_layers, or transformers' default of it where it has none)",
                             f"use the config.json that came with these weights (num_hidden_layers: {k}); if the "
                             "model has more layers, a weight file is missing from the folder")


def _zero_missing_ernie_bias(model, params, loaded) -> None:
    """ERNIE 4.5 MoE's router bias (mlp.moe_statics.e_score_correction_bias) where the checkpoint has none: zeros, as
    transformers' _init_weights leaves it (a plain top k of the softmax), with a log line."""
    if getattr(getattr(model, "config", None), "model_type", None) != "ernie4_5_moe":
        return
    missing = [k for k in params if k.endswith(".mlp.gate.e_score_correction_bias") and k not in loaded]
    for k in missing:
        params[k].data.zero_()
        loaded.add(k)
    if missing:
        log.info("the checkpoint has no moe_statics.e_score_correction_bias for %d layers: zeros, as transformers",
                 len(missing))


def _check_complete(params, loaded, merged) -> None:
    _check_layer_count(params, loaded, merged)
    for mname, layer in merged.items():
        have = layer.loaded_names()
        for shard in range(len(layer.names)):
            hf_name = layer.prefix_of(shard)
            if not any(s == shard for s, _ in have):
                raise ModelLoadError(f"the checkpoint has no tensors for {hf_name}", "the model folder is incomplete")
            if layer.bias is not None and (shard, "bias") not in have:
                raise ModelLoadError(f"the checkpoint has no tensor {hf_name}.bias",
                                     "the model folder is incomplete, or config.json wrongly declares biases")
    merged_params = {f"{m}.{p}" for m, layer in merged.items() for p, _ in layer.named_parameters(recurse=False)}
    missing = [k for k in params if k not in loaded and k not in merged_params]
    if "lm_head.weight" in missing:  # (transformers fills it at random and answers through it)
        raise ModelLoadError("the checkpoint has no tensor lm_head.weight, and config.json does not tie the output "
                             "head to the embeddings (tie_word_embeddings is false or missing)",
                             'if the model shares its embedding matrix as its output head, set "tie_word_embeddings": '
                             "true in config.json; otherwise the model folder is incomplete")
    if missing:
        raise ModelLoadError(f"the checkpoint has no tensor model.{missing[0]}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                             "the model folder is incomplete or of another architecture")
