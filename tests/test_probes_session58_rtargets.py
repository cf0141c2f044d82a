"""Session 58 review of --lora-target-modules: the activation estimate counts the adapters' temporaries only on the
layers with slots (it counted every layer's: on Llama-3-8B with slots on the attention only, rank 64, a step of 8,192
tokens, 1.5 GiB where the step holds the 1.3 GiB of no adapters, 1.7 GiB with the expand beside the matmul), and
what a measured step holds stays within it."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.memory.sizes import activation_bytes
from infer.models.loader import load_config
from infer.models.tiny import ensure_builtin

from helpers import Stopped, random_prompts, stub_calls
from lora_helpers import hf_float, save_adapters
from quant_helpers import int4_kernel_path, make_gptqmodel_checkpoint, needs_gptqmodel
from test_probes_session50_memplan import _adapter, lora_prefill_peak


@pytest.mark.parametrize("targets", [["o_proj"], ["q_proj", "k_proj", "v_proj"]])
def test_the_step_formula_with_slots_on_the_attention_holds_the_measured_step_and_drops_the_mlps_adapter_terms(
        tmp_path, targets):
    """A bf16 engine on the CPU with slots (rank 64) on o_proj, or q/k/v, only and an adapter there: the worst
    case's prefill holds at most the formula's figure for those slots, which is below the figure for slots on every
    layer (the MLP's gate_up, whose output, a shard's float32 delta and its cast are alive together, has none)."""
    peak, formula = lora_prefill_peak(_adapter(tmp_path, 64, targets), 64, targets)
    assert 0 < peak <= formula
    cfg = load_config(ensure_builtin("tiny-llama"))
    assert formula < activation_bytes(cfg, torch.bfloat16, 1024, 4, 256, 64)


def test_the_estimate_with_every_module_named_is_the_estimate_without_the_option():
    """Naming every module (peft's names or the fused ones) is no restriction: the same figure as None, with the
    expand beside the matmul too; for a mixture of experts, slots without `experts` count no expert LoRA."""
    cfg = load_config(ensure_builtin("tiny-llama"))
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]
    for beside in (False, True):
        args = (cfg, torch.bfloat16, 1024, 4, 256, 64)
        assert activation_bytes(*args, lora_targets=every, lora_expand_beside=beside) == \
            activation_bytes(*args, lora_expand_beside=beside)
        assert activation_bytes(*args, lora_targets=["down_proj"], lora_expand_beside=beside) < \
            activation_bytes(*args, lora_expand_beside=beside)


@pytest.mark.parametrize("args", [
    ["tiny-llama", "--enable-lora", "--lora-target-modules", "o_proj", "qkv_proj", "--port", "0"],
    ["--lora-target-modules", "o_proj", "qkv_proj", "tiny-llama", "--enable-lora", "--port", "0"],
    ["tiny-llama", "--enable-lora", "--lora-target-modules", "o_proj", "--lora-target-modules", "qkv_proj",
     "--port", "0"],
])
def test_serve_takes_the_module_names_after_one_flag_as_vllms_nargs(monkeypatch, args):
    """vLLM's `--lora-target-modules o_proj qkv_proj` (a list option: several values after one flag) was refused
    with "unexpected extra argument(s) (qkv_proj)" (or "(tiny-llama)" with MODEL after them)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    seen = {}
    monkeypatch.setattr("infer.cli.serve._serve", lambda cfg, *a, **k: seen.update(model=cfg.model,
                                                                                   targets=cfg.lora_target_modules))
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 0, result.output
    assert seen == {"model": "tiny-llama", "targets": ["o_proj", "qkv_proj"]}


@pytest.mark.parametrize("where", ["after", "before"])
def test_run_takes_the_module_names_after_one_flag_too(tmp_path, monkeypatch, where):
    """`infer run MODEL INPUT --lora-target-modules o_proj qkv_proj` (and the flag before MODEL INPUT): the engine
    option as serve takes it, not "unexpected extra argument(s) (qkv_proj)"."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    seen = stub_calls(monkeypatch, "infer.engine.llm_engine.LLMEngine")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    flag = ["--lora-target-modules", "o_proj", "qkv_proj"]
    positional = ["tiny-llama", str(prompts)]
    args = [*positional, "--enable-lora", *flag] if where == "after" else [*flag, *positional, "--enable-lora"]
    result = CliRunner().invoke(app, ["run", *args])
    assert isinstance(result.exception, Stopped), result.output
    [config] = seen["args"]
    assert (config.model, config.lora_target_modules) == ("tiny-llama", ["o_proj", "qkv_proj"])


def test_the_option_without_adapters_is_said_to_do_nothing(caplog):
    """Without --enable-lora or --lora no slots exist: the engine starts (as vLLM's, which ignores it), and a
    warning says the option does nothing and what would make it count."""
    import logging

    with caplog.at_level(logging.WARNING, logger="infer"):
        with LLM("tiny-llama", device="cpu", max_model_len=64, lora_target_modules=["o_proj"]) as llm:
            assert llm.engine.lora_manager is None
    said = [r.getMessage() for r in caplog.records if "--lora-target-modules" in r.getMessage()]
    assert said and "--lora-target-modules o_proj does nothing without adapters" in said[0]
    assert "--enable-lora or --lora NAME=PATH" in said[0]


def test_every_source_file_compiles_without_warnings():
    """infer/lora/adapter.py's v4_converted docstring held r".*\\.gate_up_proj" in a plain string: an invalid escape
    sequence (a DeprecationWarning each time the module is compiled; a SyntaxWarning on Python 3.12)."""
    import warnings
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "infer"
    for path in sorted(root.rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(), str(path), "exec")


@needs_gptqmodel
@pytest.mark.parametrize("targets,names", [
    (["o_proj", "down_proj"], ["od", None, "od"]),
    (["qkv_proj"], ["q", None, "q"]),
])
def test_an_int4_base_with_slots_off_gate_up_runs_the_kernels_and_graphs_as_the_cpu_path(tmp_path, monkeypatch,
                                                                                          targets, names):
    """A 4-bit GPTQModel checkpoint, slots on o_proj and down_proj (or q/k/v) only: gate_up has no slots, so its
    int4 kernel applies silu_and_mul in its epilogue while adapters run (a combination only this option makes).
    Through the Triton kernels (interpreted) and emulated graphs: the CPU path's tokens, which are those of slots on
    every layer (the adapters are within the named modules)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real kernels (pytest -m gpu)")
    base = ensure_builtin("tiny-llama")
    qdir = make_gptqmodel_checkpoint(base, tmp_path / "q", bits=4, group_size=32, seq_len=32)
    paths = save_adapters(hf_float(base), tmp_path, {
        "od": dict(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"]),
        "q": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"])})
    opts = dict(loras={n: str(paths[n]) for n in set(names) if n}, max_loras=2, max_lora_rank=8, block_size=4,
                max_model_len=32, max_num_seqs=4)
    prompts = random_prompts(512, (5, 3, 7), seed=9)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(str(qdir), **opts) as llm:
        every = [o.token_ids for o in llm.generate(prompts, params, lora=names)]
        assert llm.generate(prompts[:1], params)[0].token_ids != every[0]  # (the adapter changes the tokens)
    with LLM(str(qdir), lora_target_modules=targets, **opts) as llm:
        cpu = [o.token_ids for o in llm.generate(prompts, params, lora=names)]
    int4_kernel_path(monkeypatch)
    with LLM(str(qdir), cuda_graph_max_tokens=4, lora_target_modules=targets, **opts) as llm:
        mlp = llm.engine.runner.model.layers[0].mlp
        assert mlp.gate_up_proj.lora is None and mlp.act_in_gate_up
        llm.engine.runner.capture_graphs(8, emulate=True)
        assert [o.token_ids for o in llm.generate(prompts, params, lora=names)] == cpu == every
        assert sum(llm.engine.runner.graphs.replays.values()) > 0


def test_a_mixture_of_experts_without_expert_slots_counts_no_expert_lora_and_the_step_holds_within_it(tmp_path):
    """Mixtral-8x7B's shapes, rank 64: slots on the attention only count none of the experts' LoRA (its shrink and
    gate_up delta for each of a token's experts), a third less a token; the attention and the experts (every layer
    Mixtral has) count what no option counts. Measured on a tiny Qwen3-MoE whose experts dominate a token (8 of 8
    experts a token, each twice the dense MLP's width): the worst case's prefill with slots on q/k/v only holds at
    most that smaller figure."""
    from transformers import AutoConfig

    from test_probes_session55_moe import build
    big = AutoConfig.for_model("mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                               num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=32000)
    args = (big, torch.bfloat16, 8192, 1, 16, 64)
    every = activation_bytes(*args)
    assert activation_bytes(*args, lora_targets=["qkv_proj", "o_proj", "experts"]) == every
    assert activation_bytes(*args, lora_targets=["qkv_proj", "o_proj"]) < every * 0.7
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1, intermediate_size=32, moe_intermediate_size=64,
          num_experts_per_tok=8)
    adapter = save_adapters(hf_float(tmp_path / "base"), tmp_path, {"q": dict(r=8, lora_alpha=8,
                                                                          target_modules=["q_proj", "v_proj"])})["q"]
    peak, formula = lora_prefill_peak(str(adapter), 8, ["qkv_proj"], path=tmp_path / "base")
    cfg = load_config(tmp_path / "base")
    assert 0 < peak <= formula < activation_bytes(cfg, torch.bfloat16, 1024, 4, 256, 8)
