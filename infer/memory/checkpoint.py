"""Weights of a checkpoint as the engine will hold them, from the safetensors headers alone (no tensor is read):
what `infer warmup --estimate` plans with."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..kernels import cpu_gemm
from ..models.classifier import is_classifier, token_head
from ..models.moe import float32_filter, mtp_filter
from ..models.multimodal import is_multimodal, text_name
from ..quant.config import mxfp4_model
from ..quant.fp8 import ACTIVATION_SCALES, SCALE, fp8_model

_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}
_LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|gate_up_proj"
                     r"|c_fc|c_proj|in_proj_qkvz?|in_proj_z|in_proj_ba?|in_proj_a|in_proj|out_proj"
                     r"|shared_mlp\.input_linear|shared_mlp\.output_linear"
                     r"|q_a_proj|q_b_proj|kv_a_proj_with_mqa|fc1_latent_proj|fc2_latent_proj)"
                     r"\.weight$")  # (c_fc, c_proj: StarCoder2's
# MLP; in_proj_*, out_proj: Qwen3.5's and Qwen3-Next's linear-attention layers, models.qwen3_5; in_proj, out_proj,
# shared_mlp's: Granite 4.0's Mamba-2 layers and shared MLP, models.granite4, and GraniteMoeShared's, models.moe;
# q_a_proj, q_b_proj, kv_a_proj_with_mqa: DeepSeek's multi-head latent attention, models.deepseek, whose absorbed
# kv_b_proj is never prepacked; fc1_latent_proj, fc2_latent_proj: Nemotron 3 Super's latent experts', models.moe)


def safetensors_header(path: Path) -> dict:
    """name -> {"dtype", "shape", "data_offsets"}; a header that is not one, or a file shorter than its header
    says (a copy cut short), is a ModelLoadError."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        header.pop("__metadata__", None)
        end = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
        if any(not isinstance(info["dtype"], str) or not isinstance(info["shape"], list) for info in header.values()):
            raise ValueError("a tensor entry has no dtype or shape")
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError) as e:
        raise ModelLoadError(f"cannot read the safetensors header of {path}: {e}", "the file is corrupted") from e
    size = path.stat().st_size
    if 8 + n + end > size:
        raise ModelLoadError(f"{path} is truncated: its header describes {8 + n + end:,} bytes, the file has "
                             f"{size:,}", "the file is incomplete; copy or download it again")
    return header


_TORCH_ST = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


def _bin_header(path: Path) -> dict | None:
    """A .bin's {name: {dtype, shape}} without reading its tensors (torch.load memory-maps the zip format); None for
    the legacy format, whose size alone is then the estimate."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # the legacy (non-zip) format cannot be memory-mapped; a damaged file fails at load anyway
        return None
    return {k: {"dtype": _TORCH_ST.get(v.dtype, "F32"), "shape": list(v.shape)} for k, v in state.items()
            if isinstance(v, torch.Tensor)}


def checkpoint_weights_bytes(files: list[Path], model_config, dtype: torch.dtype, device: torch.device,
                             bits: int | None = None, act_order: bool = False, bits_of=None, awq: bool = False) -> int:
    """Bytes of the weights once loaded: float tensors in `dtype`, integer (GPTQ) tensors as stored, plus the
    CPU matmul copies the engine prepacks (float linear layers and the output head); on a CPU a GPTQ layer also
    holds its dequantized float weight (and its prepacked copy), and MLA's GPTQ kv_b_proj its float weight on every
    device (models.deepseek.MLAttention.absorb: never prepacked). A merged GPTQ layer (q/k/v, gate/up) holds one
    int32 g_idx, whether the checkpoint has one per shard or none (quant.gptq_linear), and on CUDA with act-order
    (`act_order`: the GPTQ config's desc_act) the int64 permutation of its inputs. `bits`: the GPTQ config's (as the
    loader reads it, quantize_config.json too); else config.json's, else 4. A layer's input width comes from its
    g_idx, else from its words at `bits_of(module)` (its own bits: `dynamic`, a quantized head), else at `bits`.
    `awq`: the checkpoint's int4 layers are AWQ's (qweight [in, out / 8], no g_idx), which the loader repacks into
    GPTQ's layout: the same bytes once loaded, and one g_idx of `in` entries per merged layer."""
    elem = torch.finfo(dtype).bits // 8
    prepacks = device.type == "cpu" and cpu_gemm.available(torch.empty(0, dtype=dtype))
    if bits is None:
        qc = getattr(model_config, "quantization_config", None)
        bits = int((qc if isinstance(qc, dict) else vars(qc) if qc is not None else {}).get("bits", 4) or 4)
    mxfp4 = mxfp4_model(model_config)
    fp8 = fp8_model(model_config) is not None  # (its FP8 weights dequantized at load, their scales dropped)
    total = 0
    gptq_inputs: dict[str, int] = {}  # merged GPTQ layer -> its input width
    expert_inputs: dict[str, int] = {}  # the same for a mixture of experts' GPTQ experts (gate/up merged)
    expert_sorted: set[str] = set()  # those of several groups, sorted by group at load with act-order (their perm)
    headers = []
    for f in files:
        header = safetensors_header(f) if f.suffix == ".safetensors" else _bin_header(f)
        if header is None:
            total += f.stat().st_size  # a legacy .bin: the stored size is the estimate
            continue
        headers.append(header)
    if is_multimodal(model_config):  # its text model's tensors alone, named as a text model's (models.multimodal)
        headers = [{plain: info for name, info in h.items() if (plain := text_name(name)) is not None}
                   for h in headers]
    g_idx = {name: info for header in headers for name, info in header.items() if name.endswith(".g_idx")}
    scales = {name: info for header in headers for name, info in header.items() if name.endswith(".scales")}
    # a tied lm_head.weight is the embeddings' copy, except in a checkpoint that stores the tied matrix under that
    # name alone (safetensors' save_model): the loader makes it the embeddings (models.loader.place_weights)
    stored = {name for header in headers for name in header}
    head_only = not {"model.embed_tokens.weight", "embed_tokens.weight"} & stored
    # the embeddings' prepacked copy as the output head (tied), which a classifier has not (models.classifier)
    ties = getattr(model_config, "tie_word_embeddings", False) and not is_classifier(model_config)
    # a score head made of lm_head's rows of tokens (an LLM reranker): lm_head read, then dropped for the float32
    # score head (models.classifier.set_token_head)
    drops_head = token_head(model_config) is not None
    if drops_head:
        total += model_config.num_labels * model_config.hidden_size * 4
    float32_tensor, mtp_tensor = float32_filter(model_config), mtp_filter(model_config)
    for header in headers:
        for name, info in header.items():
            if drops_head and name.startswith("lm_head."):
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            if fp8 and name.endswith((SCALE, *ACTIVATION_SCALES)):
                continue
            # (float8 weights: upcast at load, dequantized where the checkpoint is FP8's, models.loader)
            is_float = info["dtype"] in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2") \
                and not name.endswith("scales")
            size = numel * (elem if is_float else _ST_BYTES.get(info["dtype"], 4))
            if float32_tensor(name):  # (GLM-4.5's router: float32 in any dtype)
                size = numel * 4
            if mtp_tensor(name):  # (GLM-4.5's, ERNIE 4.5 MoE's MTP layers: skipped at load)
                continue
            if info["dtype"] == "U8" and name.endswith(("_proj_blocks", "_proj_scales")) and not mxfp4:
                # MXFP4 tensors without config.json's word (models.moe dequantizes them at load): two values a byte
                # of blocks, loaded as float; the scales dropped. (gpt-oss's MXFP4 experts, config.json's
                # quantization_config: held packed as stored, models.moe.Mxfp4Stack: a byte each.)
                size = 2 * numel * elem if name.endswith("_blocks") else 0
            if name == "lm_head.weight" and getattr(model_config, "tie_word_embeddings", False) and not head_only:
                continue
            if name.endswith(".g_idx"):  # one per merged layer, counted below
                continue
            # a mixture of experts' GPTQ experts (models.moe): on a GPU held int4 as stored (stacked, their g_idx
            # too, with act-order an int32 permutation of each expert's inputs: Int4Stack.perm); on the CPU
            # dequantized at load into the float experts (never prepacked), their int tensors dropped
            expert = ".experts." in name and name.endswith((".qweight", ".qzeros", ".scales"))
            if name.endswith(".qweight") and len(info["shape"]) == 2:
                # K from the layer's g_idx: a layer may have its own bits (dynamic, a quantized lm_head at 8)
                own = g_idx.get(name.removesuffix("qweight") + "g_idx")
                width = (bits_of(name.removesuffix(".qweight")) if bits_of else None) or bits
                k, n = info["shape"]
                if awq:  # input rows as they are, 32 // 4 outputs per word
                    n *= 32 // 4
                else:
                    k = own["shape"][0] if own and own["shape"] else k * (32 // width)
                (expert_inputs if expert else gptq_inputs)[_merged_key(name)] = k
                groups = scales.get(name.removesuffix("qweight") + "scales", {"shape": [1]})["shape"][0]
                if expert and act_order and groups > 1:  # (one group: plain, never sorted)
                    expert_sorted.add(_merged_key(name))
                # the CPU path dequantizes each GPTQ layer once at load (and prepacks it); MLA's absorbed kv_b_proj
                # (models.deepseek) holds its float weight on every device, never prepacked (on a GPU beside its int4
                # tensors: MLAttention.absorb)
                absorbed = name.endswith(".kv_b_proj.qweight")
                if device.type == "cpu" or absorbed:
                    total += k * n * elem * (2 if prepacks and not expert and not absorbed else 1)
            if expert and device.type == "cpu":
                continue
            total += size
            # (a mixture of experts' experts are stacked and never prepacked: models.moe)
            if prepacks and is_float and (_LINEAR.search(name) and ".experts." not in name or name == "lm_head.weight"):
                total += size
            if prepacks and name == "model.embed_tokens.weight" and ties:
                total += size
    per_input = 4 + (8 if act_order and device.type == "cuda" else 0)  # g_idx (int32), act_perm (int64)
    # the experts' g_idx, and Int4Stack.perm (int32) of those sorted by group
    experts = sum(k * (8 if key in expert_sorted else 4) for key, k in expert_inputs.items())
    return total + sum(gptq_inputs.values()) * per_input + (experts if device.type != "cpu" else 0) \
        + model_buffer_bytes(model_config, dtype)


def model_buffer_bytes(model_config, dtype: torch.dtype) -> int:
    """The buffers a model computes from its config beside its tensors (Falcon-H1's mup vectors and gate scales:
    models.falcon_h1.buffer_elements), in `dtype`; 0 for others."""
    if getattr(model_config, "model_type", None) != "falcon_h1":
        return 0
    from ..models.falcon_h1 import buffer_elements
    return buffer_elements(model_config) * (torch.finfo(dtype).bits // 8)


def checkpoint_load_bytes(path: Path, model_config, dtype: torch.dtype, device: torch.device) -> int:
    """checkpoint_weights_bytes of the model folder `path`, its GPTQ or AWQ config (bits, desc_act, each layer's own
    bits) read as the loader reads it (another quant_method, or 3-bit GPTQ, refused); the rotary table not counted."""
    from ..models.loader import weight_files
    from ..quant.config import GPTQConfig
    gptq = GPTQConfig.from_model_dir(path)
    if gptq is None:
        return checkpoint_weights_bytes(weight_files(path), model_config, dtype, device)
    return checkpoint_weights_bytes(weight_files(path), model_config, dtype, device, gptq.bits, gptq.desc_act,
                                    lambda module: own_bits(gptq, module), awq=gptq.quant_method == "awq")


def own_bits(gptq, module: str) -> int | None:
    """A checkpoint module's own bits as the loader reads them (None: in float): the head's from the config's
    lm_head settings, another's from its rules matched against its `model.`-prefixed name, whether the checkpoint
    stores it with the prefix or without (models.loader.module_key)."""
    from ..models.loader import module_key
    key = module_key(module)
    own = gptq.for_head() if key == "lm_head" else gptq.for_module(f"model.{key}")
    return own.bits if own is not None else None


# the engine's merged layers (models.layers.MergedLinear): q, k, v and gate, up are one GPTQ layer each
_MERGED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up",
           "in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz",  # (Qwen3.5's linear attention: models.qwen3_5)
           "w1": "gate_up", "w3": "gate_up"}  # (LFM2's feed_forward: models.lfm2)
# Mixtral's experts' gate and up (block_sparse_moe.experts.N.w1, w3): one int4 stack, one g_idx (models.moe)
_MERGED_EXPERT = {"w1": "gate_up", "w3": "gate_up"}


def _merged_key(qweight_name: str) -> str:
    """The engine's layer a GPTQ tensor `PREFIX.MODULE.qweight` loads into (q/k/v and gate/up merged; an expert's
    gate and up, Mixtral's w1 and w3 too)."""
    prefix, _, module = qweight_name[: -len(".qweight")].rpartition(".")
    if ".experts." in f"{prefix}.":
        module = _MERGED_EXPERT.get(module, module)
    return f"{prefix}.{_MERGED.get(module, module)}"


def checkpoint_int4_layer_elements(files: list[Path], bits: int) -> int:
    """Weights of the biggest GPTQ layer the engine builds from these files (q/k/v and gate/up merged), from the
    headers alone: what an int4 prefill on CUDA dequantizes into its scratch (memory.sizes.int4_layer_bytes)."""
    layers: dict[str, int] = {}
    headers: dict[str, dict] = {}
    for f in files:
        headers.update((safetensors_header(f) if f.suffix == ".safetensors" else _bin_header(f)) or {})
    for name, info in headers.items():
        if not name.endswith(".qweight") or name.removeprefix("model.") == "lm_head.qweight":
            continue  # a GPTQ head takes its rows in fused slices, never the scratch (LlamaForCausalLM.compute_logits)
        if ".experts." in name or name.endswith(".kv_b_proj.qweight"):
            continue  # nor do a mixture of experts' int4 experts (kernels.fused_moe_int4 dequantizes in registers),
            # nor MLA's absorbed kv_b_proj (never multiplied: its float copy read, models.deepseek)
        rows, cols = info["shape"]
        g_idx = headers.get(name.removesuffix("qweight") + "g_idx")  # K itself: a layer may have its own bits
        key = _merged_key(name)
        layers[key] = layers.get(key, 0) + cols * (g_idx["shape"][0] if g_idx else rows * (32 // bits))
    return max(layers.values(), default=0)
