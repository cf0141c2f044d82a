"""Models of real shapes with random weights, built directly on the device (nothing is downloaded), for the GPU
end-to-end benchmark (`infer.bench.gpu_e2e`): the Hugging Face config of a named shape, an infer model with random
but valid GPTQ int4 (or float) weights, a word-level tokenizer over its vocabulary, and random PEFT adapters."""

from __future__ import annotations

import json
from pathlib import Path

import torch


SHAPES = {
    "llama-2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    "qwen1.5-14b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13696, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40, vocab_size=152064,
                        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        tie_word_embeddings=False),
    # grouped-query attention (8 KV heads for 32 query heads), the shape of most current 7-8B models
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
def hf_config(name: str, **overrides):
    """The Hugging Face config of the named shape (fp16 checkpoint), with `overrides` (e.g. tiny sizes in tests)."""
    from transformers import AutoConfig
    kw = {**SHAPES[name], **overrides}
    model_config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    model_config.dtype = "float16"
    return model_config


def dtype_label(dtype: torch.dtype) -> str:
    """fp16, bf16, float32: how the tables name float weights."""
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype).split(".")[-1])


def gptq_method_factory(group_size: int = 128):
    """names -> GPTQLinearMethod (int4), or None when the GPTQ linear method is not in this tree."""
    try:
        from ..quant.config import GPTQConfig
        from ..quant.gptq_linear import GPTQLinearMethod
    except ImportError:
        return None
    config = GPTQConfig(bits=4, group_size=group_size)
    return lambda names: None if names == ["lm_head"] else GPTQLinearMethod(config)  # the head stays float


def _random_shards(layer, gen_scale: float = 0.02) -> list[tuple[str, int, torch.Tensor]]:
    """Random tensors for every shard of a MergedLinear, in the checkpoint's shapes (GPTQ or float)."""
    k, out = layer.in_features, []
    gptq = getattr(layer, "qweight", None) is not None
    dev = layer.qweight.device if gptq else layer.weight.device
    for shard, n in enumerate(layer.out_sizes):
        if gptq:
            groups = layer.scales.shape[0]
            out.append(("qweight", shard, torch.randint(-2**31, 2**31, (k // 8, n), dtype=torch.int32, device=dev)))
            out.append(("qzeros", shard, torch.randint(-2**31, 2**31, (groups, n // 8), dtype=torch.int32,
                                                       device=dev)))
            # |q - z| is about 5 on average: scales of gen_scale / 5 give weights of about gen_scale
            scales = (torch.rand(groups, n, device=dev) + 0.5) * (gen_scale / 5)
            out.append(("scales", shard, scales.half()))
        else:
            out.append(("weight", shard, torch.randn(n, k, device=dev, dtype=layer.dtype) * gen_scale))
        if layer.bias is not None:
            out.append(("bias", shard, torch.randn(n, device=dev, dtype=layer.dtype) * gen_scale))
    return out


def build_model(model_config, dtype: torch.dtype, device, quantized: bool = True, seed: int = 0):
    """(infer model with random weights built on `device`, weights label). Layers are filled through
    MergedLinear.load_shard, the loader's own path, so their checks and finish_loading run as for a checkpoint."""
    from ..models.layers import MergedLinear
    from ..models.registry import model_class
    method_for = gptq_method_factory() if quantized else None
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(model_config)(model_config, dtype, method_for)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MergedLinear):
                for name, shard, tensor in _random_shards(module):
                    module.load_shard(name, shard, tensor)
                module.finish_loading()
        model.embed_tokens.weight.normal_(0, 0.02)
        if not model.tie_word_embeddings:
            model.lm_head.weight.normal_(0, 0.02)
    model.finish_loading()
    plain = dtype_label(dtype)
    label = "gptq-int4-g128" if method_for else (f"{plain} (GPTQ linear method missing)" if quantized else plain)
    return model.eval(), label


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer whose token i is the word t<i>: enough for the engine's detokenizer and for HF."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def write_random_adapters(model_config, out: Path, num: int, rank: int, seed: int = 0) -> dict[str, str]:
    """`num` PEFT LoRA folders (adapter_config.json + adapter_model.safetensors) for `model_config`, random A and B:
    TARGETS under the family's module names (lora.adapter.base_targets: an MLP without gate's up_proj and down_proj,
    StarCoder2's c_fc and c_proj, Phi-3's fused layers)."""
    from safetensors.torch import save_file

    from ..lora.adapter import base_targets, expected_shapes
    from ..lora.targets import ATTENTION
    io = expected_shapes(model_config)  # (in, out) of each of the family's projections
    targets = [t for t in base_targets(getattr(model_config, "model_type", None), TARGETS) if t in io]
    paths = {}
    for a in range(num):
        g = torch.Generator().manual_seed(seed + a)
        tensors = {}
        for layer in range(model_config.num_hidden_layers):
            for proj in targets:
                parent = "self_attn" if proj in ATTENTION else "mlp"
                base = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
                fan_in, fan_out = io[proj]
                tensors[f"{base}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) * 0.02).half()
                tensors[f"{base}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.02).half()
        path = out / f"lora{a}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}))
        paths[f"lora{a}"] = str(path)
    return paths
