"""GPTQModel checkpoints quantized with `lm_head=True` (GPTQModel 7 writes the head at 8 bits through a `dynamic`
rule) and with another bit width per module (`dynamic` {"+:.*down_proj": {"bits": 8}}): vLLM loads both; infer
refused them ("a quantized lm_head is not supported", "infer runs one bit width per model"). Now the head is a GPTQ
layer of its own width, each decoder layer reads its own, and greedy tokens equal transformers on the same weights
dequantized by the test helpers' independent dequantizer (each layer at its width)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.errors import UnsupportedModelError
from infer.models.tiny import ensure_builtin
from infer.quant.config import GPTQConfig

from quant_helpers import dequantized_float_model, int4_kernel_path, make_gptqmodel_checkpoint, needs_gptqmodel

PROMPTS = [[5, 17, 99, 230], [7, 8, 9, 10, 11, 300, 12]]
N = 8


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """tiny-llama by GPTQModel: 4-bit layers, down_proj at 8 bits, the head quantized (8 bits, GPTQModel's rule)."""
    out = tmp_path_factory.mktemp("lmhead") / "gptq"
    return make_gptqmodel_checkpoint(ensure_builtin("tiny-llama"), out, lm_head=True,
                                     dynamic={"+:.*down_proj": {"bits": 8}})


def _hf_greedy(path) -> list[list[int]]:
    model = dequantized_float_model(ensure_builtin("tiny-llama"), path)
    model.generation_config.eos_token_id = None
    return [model.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in PROMPTS]


@needs_gptqmodel
def test_quantized_head_and_mixed_bits_generate_what_transformers_does_on_the_dequantized_weights(mixed):
    llm = LLM(str(mixed), block_size=4)
    model = llm.engine.runner.model
    assert model.quantized_head and model.lm_head.qweight is not None and model.lm_head.method.config.bits == 8
    assert model.layers[0].mlp.down_proj.method.config.bits == 8
    assert model.layers[0].self_attn.qkv_proj.method.config.bits == 4
    got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=N, ignore_eos=True))]
    assert got == _hf_greedy(mixed)


@needs_gptqmodel
def test_the_quantized_head_is_what_the_logits_come_from(mixed):
    """The engine's logprobs are those of the dequantized 8-bit head, not of the float head it was made from (the
    oracle's GPTQ weights rounded to float16 as the fp16 scales' product is in the engine)."""
    from transformers import AutoModelForCausalLM
    llm = LLM(str(mixed), block_size=4, dtype="float32")
    out = llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=1, logprobs=5))[0].outputs[0]
    got = {t["token_id"]: t["logprob"] for t in out.logprobs[0]["top_logprobs"]}
    ref = dequantized_float_model(ensure_builtin("tiny-llama"), mixed)
    float_head = AutoModelForCausalLM.from_pretrained(ensure_builtin("tiny-llama"), dtype=torch.float32).lm_head.weight
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("proj.weight") or name == "lm_head.weight":
                p.copy_(p.half().float())
        hidden = ref.model(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1]
        logp = torch.log_softmax(ref.lm_head(hidden).float(), -1)
        logp_float_head = torch.log_softmax(hidden @ float_head.t(), -1)
    ids = torch.tensor(list(got))
    assert (torch.tensor(list(got.values())) - logp[ids]).abs().max().item() < 1e-4
    assert (logp_float_head[ids] - logp[ids]).abs().max().item() > 1e-3, "the head's quantization shows"


@needs_gptqmodel
def test_adapters_leave_the_quantized_head_alone(mixed):
    llm = LLM(str(mixed), block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8)
    manager = llm.engine.lora_manager
    assert all("lm_head" not in linear.names for linear in manager.linears)
    assert len(manager.linears) == 2 * 4  # qkv, o, gate_up, down per layer


@needs_gptqmodel
def test_quantized_head_through_the_kernels_interpreted_equals_cpu(mixed, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    cpu = [o.token_ids for o in LLM(str(mixed), block_size=4).generate(PROMPTS, params)]
    int4_kernel_path(monkeypatch)
    llm = LLM(str(mixed), block_size=4, max_num_seqs=2, max_model_len=64)
    assert llm.engine.runner.model.lm_head.weight is None  # the packed layout
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == cpu


def test_head_settings_from_the_config():
    base = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    assert GPTQConfig.from_dict(base, "config.json").for_head() is None
    cfg = GPTQConfig.from_dict({**base, "lm_head": True}, "config.json")
    assert cfg.for_head() == cfg
    cfg = GPTQConfig.from_dict({**base, "lm_head": True, "dynamic": {"lm_head": {"bits": 8, "mse": 2.4}}}, "c")
    assert cfg.for_head().bits == 8 and cfg.for_module("model.layers.0.mlp.down_proj").bits == 4
    assert GPTQConfig.from_dict({**base, "lm_head": True, "dynamic": {"-:lm_head": {}}}, "c").for_head() is None
    # modules_in_block_to_quantize names decoder-layer modules: it does not leave the head in float
    cfg = GPTQConfig.from_dict({**base, "lm_head": True, "modules_in_block_to_quantize": [["self_attn.q_proj"]]}, "c")
    assert cfg.for_head() is not None
    with pytest.raises(UnsupportedModelError, match="3 bits"):
        GPTQConfig.from_dict({**base, "dynamic": {"+:.*down_proj": {"bits": 3}}}, "config.json")


@needs_gptqmodel
def test_the_head_runs_in_slices_that_never_take_the_dequantize_path(mixed, monkeypatch):
    """More rows than HEAD_ROWS (prompt_logprobs, long steps) go through the head in slices, each small enough for
    the fused int4 kernels: the same logprobs as in one matmul; and the memory plan's dequantize scratch leaves
    the head out (the checkpoint estimate too, each layer at its own width)."""
    from infer.memory import checkpoint, sizes
    from infer.models import llama
    from infer.models.loader import weight_files
    assert llama.HEAD_ROWS <= sizes.DEQUANT_MIN_TOKENS
    params = SamplingParams(max_new_tokens=2, prompt_logprobs=2, ignore_eos=True)
    whole = LLM(str(mixed), block_size=4, dtype="float32").generate([PROMPTS[1]], params)[0].prompt_logprobs
    llm = LLM(str(mixed), block_size=4, dtype="float32")
    monkeypatch.setattr(llama, "HEAD_ROWS", 2)
    head, rows = llm.engine.runner.model.lm_head, []
    real = head.forward
    monkeypatch.setattr(head, "forward", lambda x, ctx=None: (rows.append(len(x)), real(x, ctx))[1])
    sliced = llm.generate([PROMPTS[1]], params)[0].prompt_logprobs
    assert rows and max(rows) <= 2 and sum(rows) >= len(PROMPTS[1]) - 1
    assert sliced == whole
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if getattr(m, "qweight", None) is not None and m is not model.lm_head]
    largest = max(m.qweight.numel() * (32 // m.method.config.bits) for m in layers)
    assert checkpoint.checkpoint_int4_layer_elements(weight_files(mixed), 4) == largest


def test_the_dequantize_scratch_is_sized_without_the_head():
    from types import SimpleNamespace

    from infer.memory import sizes

    class _Layer(torch.nn.Module):
        def __init__(self, k: int, n: int, bits: int, head: bool = False):
            super().__init__()
            self.qweight = SimpleNamespace(numel=lambda: k * bits // 32 * n, is_cuda=True)
            self.weight, self.method = None, SimpleNamespace(config=SimpleNamespace(bits=bits))
            if head:
                self.output_head = True

    model = torch.nn.Sequential(_Layer(64, 128, 4), _Layer(64, 512, 8, head=True))
    assert sizes.int4_layer_bytes(model, torch.float16) == 64 * 128 * 2


def test_the_checkpoint_estimate_reads_each_layers_width_from_its_g_idx(tmp_path):
    """A layer at 8 bits in a 4-bit checkpoint holds half the weights a 4-bit reading of its words gives."""
    from safetensors.torch import save_file

    from infer.memory import checkpoint
    save_file({"model.layers.0.mlp.down_proj.qweight": torch.zeros(32, 64, dtype=torch.int32),  # K 128 at 8 bits
               "model.layers.0.mlp.down_proj.g_idx": torch.zeros(128, dtype=torch.int32),
               "lm_head.qweight": torch.zeros(32, 512, dtype=torch.int32)}, tmp_path / "model.safetensors")
    assert checkpoint.checkpoint_int4_layer_elements([tmp_path / "model.safetensors"], 4) == 128 * 64


@needs_gptqmodel
def test_quantize_lm_head_writes_a_quantized_head_infer_runs(tmp_path):
    """`infer quantize --lm-head` (GPTQModel's lm_head=True): the head is GPTQ (8 bits, GPTQModel's rule) and the
    checkpoint generates what transformers does on its dequantized weights; a tied head is refused up front
    (GPTQModel raised NotImplementedError after loading the model)."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "-o", str(out), "--lm-head", "--group-size", "32",
                                   "--num-samples", "4", "--seq-len", "64"])
    assert res.exit_code == 0, res.output
    assert "transformers does not read a quantized lm_head" in res.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] is True
    llm = LLM(str(out), block_size=4)
    assert llm.engine.runner.model.quantized_head
    got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=N, ignore_eos=True))]
    assert got == _hf_greedy(out)
    res = CliRunner().invoke(app, ["quantize", "tiny-llama3", "-o", str(tmp_path / "t"), "--lm-head",
                                   "--group-size", "32"])
    assert res.exit_code == 2 and "ties lm_head to the embeddings" in res.output, res.output
