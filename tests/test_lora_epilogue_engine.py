"""The engine's GPU code path on an int4 base with mixed adapters, where every LoRA expand (and the qkv bias) is
added in the int4 matmul's epilogue: every op through its Triton kernel (interpreted on CPU), decode steps through
emulated CUDA graphs, on an act-order, asymmetric GPTQ checkpoint of a model with qkv biases (Qwen2). Greedy tokens
equal the CPU path's (which equal peft's over the dequantized base, test_lora_engine), with the epilogue and with
the expand launched on its own, and with the automatic choice (EngineConfig.lora_epilogue True / False / None)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams, kernels
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from quant_helpers import int4_kernel_path, make_gptqmodel_checkpoint, needs_gptqmodel
from test_lora_engine import SPECS, hf_float, save_adapter

OPTS = dict(block_size=4, num_kv_blocks=96, max_model_len=64, max_num_seqs=8, max_loras=3, max_lora_rank=16,
            cuda_graph_max_tokens=48)  # the 34-token prefill through the piecewise graphs (bucket 48)


@pytest.fixture(scope="module")
def qwen_int4(tmp_path_factory):
    base = ensure_builtin("tiny-qwen2")
    root = tmp_path_factory.mktemp("epilogue")
    qdir = make_gptqmodel_checkpoint(base, root / "q", bits=4, group_size=32, desc_act=True, sym=False)
    hf = hf_float(base)
    adapters = {n: str(save_adapter(hf, root / n, seed=i + 3, **SPECS[n]))
                for i, n in enumerate(("all8", "qv4", "mlp16rs"))}
    return qdir, adapters


def _counting(monkeypatch, name: str) -> list:
    calls = []
    real = getattr(kernels, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(kernels, name, counted)
    return calls


@needs_gptqmodel
@pytest.mark.parametrize("epilogue", [True, False, None])
def test_int4_kernel_path_with_adapters_equals_cpu_path(qwen_int4, monkeypatch, epilogue):
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    qdir, adapters = qwen_int4
    names = ["all8", None, "qv4", "mlp16rs", "all8", "qv4"]
    cpu_llm = LLM(str(qdir), loras=adapters, **OPTS)
    prompts = random_prompts(cpu_llm.engine.model_config.vocab_size, (5, 9, 3, 7, 6, 4), seed=5)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    cpu = [o.token_ids for o in cpu_llm.generate(prompts, params, lora=names)]
    cpu_llm.close()

    int4_kernel_path(monkeypatch)
    deltas, applies = _counting(monkeypatch, "lora_delta"), _counting(monkeypatch, "lora_apply")
    llm = LLM(str(qdir), loras=adapters, lora_epilogue=epilogue, **OPTS)
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.bias is not None and qkv.act_perm is not None  # int4 kernels, bias, act-order
    llm.engine.runner.capture_graphs(OPTS["max_model_len"], emulate=True)
    got = [o.token_ids for o in llm.generate(prompts, params, lora=names)]
    assert got == cpu
    assert sum(llm.engine.runner.graphs.replays.values()) >= 3
    assert llm.engine.stats()["piecewise_graph_steps"] == 1
    # the expand really went where it was asked to: through a delta for the int4 kernel, or lora_apply's launches
    assert (len(deltas) > 0, len(applies) > 0) == (epilogue is not False, epilogue is False)
    llm.close()


@needs_gptqmodel
def test_silu_in_gate_up_in_steps_without_adapters_only(qwen_int4, monkeypatch):
    """An engine with adapter slots: a step whose batch has no adapter lets the int4 gate_up kernel apply
    silu_and_mul in its epilogue (EngineConfig.silu_in_gate_up); a step with adapters adds gate_up's delta first,
    so it takes the plain kernel and silu_and_mul after. Greedy tokens equal the CPU path's both ways; with the
    option off no MLP is set to it."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    qdir, adapters = qwen_int4
    cpu_llm = LLM(str(qdir), loras=adapters, **OPTS)
    prompts = random_prompts(cpu_llm.engine.model_config.vocab_size, (5, 9, 3), seed=6)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    runs = {"none": [None] * 3, "mixed": ["all8", None, "mlp16rs"]}
    want = {k: [o.token_ids for o in cpu_llm.generate(prompts, params, lora=v)] for k, v in runs.items()}
    cpu_llm.close()

    int4_kernel_path(monkeypatch)
    llm = LLM(str(qdir), loras=adapters, **OPTS)
    assert all(layer.mlp.act_in_gate_up for layer in llm.engine.runner.model.layers)
    gemm = kernels._triton("gptq_gemm")
    launch, gated = gemm._launch, []
    monkeypatch.setattr(gemm, "_launch", lambda *a, **kw: (gated.append(len(a) > 16 and a[16]), launch(*a, **kw))[1])
    for kind, names in runs.items():
        gated.clear()
        assert [o.token_ids for o in llm.generate(prompts, params, lora=names)] == want[kind], kind
        assert any(gated) == (kind == "none"), (kind, gated)
    llm.close()
    off = LLM(str(qdir), loras=adapters, silu_in_gate_up=False, **OPTS)
    assert not any(layer.mlp.act_in_gate_up for layer in off.engine.runner.model.layers)
    off.close()
