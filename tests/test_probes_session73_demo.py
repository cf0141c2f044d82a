"""`infer demo` on the Mamba-2 hybrids (Bamba, Falcon-H1, LFM2, Nemotron-H, Granite 4.0 without experts), the MLPs
without gate (Arcee, Nemotron, Apertus, StarCoder2) and the mixtures of experts, refused until now. On the MLPs
without gate the chain passed as it was; on a mixture of experts its bench's transformers baseline runs the float
model (transformers reads no GPTQ experts: `--baseline-model`) and lora-validate's oracle is transformers' load of
the dequantized checkpoint (test_probes_session73_moelv); on the hybrids it broke in three places, each a bug of the
command it ran:
- `infer bench --baseline hf` on their GPTQ checkpoints crashed at transformers' first forward: GPTQModel's default
  CPU kernel (TorchAtenLinear) takes any width on paper, but torch's int4 packing needs a multiple of 16 outputs,
  and a Mamba-2 mixer's in_proj has 328 here (bench.hf_baseline.gptq_cpu_options: its torch kernel there);
- `infer lora-validate --quantized` on a GPTQ Nemotron-H: "cannot build the float oracle: no weight for
  model.embeddings.weight" (transformers' embeddings and norm_f, infer's embed_tokens and norm);
- the demo's adapter of every projection named gate_proj, up_proj and down_proj on Granite 4.0, whose MLP is
  shared_mlp.input_linear and output_linear (lora.adapter.base_targets).
And the same baseline on a GPTQ mixture of experts (which the demo refuses) ran transformers' model with its experts
uninitialized, without a word: refused now, naming the weights it lacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from infer import LLM
from infer.cli import demo as demo_module
from infer.cli.main import app
from infer.models.tiny import ensure_builtin

from helpers import greedy_each, greedy_tokens, random_prompts
from quant_helpers import needs_gptqmodel
from test_probes_session56_review_moeq import rtn_gptq

TAKEN = ["tiny-bamba", "tiny-falcon-h1", "tiny-lfm2", "tiny-nemotron-h", "tiny-granite4-dense", "tiny-arcee",
         "tiny-nemotron", "tiny-apertus", "tiny-starcoder2", "tiny-qwen3-moe", "tiny-mixtral", "tiny-granite4",
         "tiny-nemotron-h-moe",
         # (refused until the seventy-fourth session: test_probes_session74_moe)
         "tiny-gpt-oss", "tiny-llama4", "tiny-deepseek-v3", "tiny-deepseek-v2"]


class _Started(Exception):
    """Raised by the first step: the demo accepted its arguments."""


@pytest.mark.parametrize("model", TAKEN)
def test_the_demo_takes_the_hybrids_the_mlps_without_gate_and_the_mixtures_of_experts(tmp_path, monkeypatch, model):
    def first_step(steps, out, name, sizes):
        assert name == model and out == tmp_path / "d"
        raise _Started
    monkeypatch.setattr(demo_module, "_model_steps", first_step)
    res = CliRunner().invoke(app, ["demo", "--model", model, "--out", str(tmp_path / "d")])
    assert isinstance(res.exception, _Started), res.output


def test_the_demos_bench_runs_a_mixture_of_experts_baseline_on_its_float_model(tmp_path):
    """transformers reads no GPTQ mixture of experts: the demo's bench step gives its baseline the built-in float
    model (--baseline-model) on Granite 4.0 with experts, not on the dense one, and its line says so."""
    class Steps:
        def __init__(self):
            self.ran = []

        def run(self, title, args, summary, module="infer.cli"):
            self.ran.append((title, args))
    for model, source in (("tiny-granite4", ["--baseline-model", "tiny-granite4"]), ("tiny-granite4-dense", [])):
        steps = Steps()
        (tmp_path / model).mkdir()
        demo_module._serve_steps(steps, tmp_path / model, tmp_path / "q", [], demo_module.SIZES[True], model)
        bench = dict(steps.ran)["bench"]
        assert (bench[bench.index("--baseline") + 2:bench.index("--out")] if source else
                [a for a in bench if a == "--baseline-model"]) == source, bench
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"output_throughput": 900.0, "concurrency": 8, "ratio": {"output_throughput": 0.9},
                                    "baseline": {"output_throughput": 1000.0, "label": "hf (tiny-granite4)"}}]))
    assert "0.90x transformers (1000 tok/s, its float model, same requests: transformers reads no GPTQ experts)" in \
        demo_module._bench_line(results)


@needs_gptqmodel
def test_the_demo_on_granite4_with_experts_end_to_end(tmp_path):
    """The whole chain on Granite 4.0 with experts, a Mamba-2 hybrid and a mixture of experts (the quick sizes): every
    step passes (the adapters, its shared MLP's among them, validate against peft on the dequantized int4 base, the
    experts stacked as transformers reads Granite's; the benchmark's transformers baseline runs the float model, since
    transformers reads no GPTQ experts), six replies."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "infer.cli", "demo", "--model", "tiny-granite4", "--out", str(out),
                           "--quick"], capture_output=True, text=True, env=dict(os.environ), timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lora-validate: both adapters pass" in proc.stderr
    verdict = demo_module.VERDICT.search(proc.stderr)
    assert verdict and "its float model, same requests: transformers reads no GPTQ experts" in proc.stderr, proc.stderr
    runs = json.loads((out / "bench" / "results.json").read_text())
    assert runs[0]["completed"] == 8 and runs[0]["baseline"]["completed"] == 8
    assert runs[0]["baseline"]["label"] == "hf (tiny-granite4)"
    recs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and all(r["error"] is None and r["token_ids"] for r in recs)
    legal = json.loads((out / "tiny-granite4-adapters" / "legal" / "adapter_config.json").read_text())
    assert {"q_proj", "o_proj", "shared_mlp.input_linear", "shared_mlp.output_linear"} <= set(legal["target_modules"])


@needs_gptqmodel
def test_the_hf_baseline_runs_a_gptq_checkpoint_whose_outputs_are_no_multiple_of_16(tmp_path):
    """Bamba's Mamba-2 in_proj [64 -> 328] in GPTQ: transformers' model for the baseline (load_hf) runs it on
    GPTQModel's torch kernel and gives infer's greedy tokens on the same int4 weights; a checkpoint of widths that are multiples
    of 16 keeps GPTQModel's default kernel."""
    from infer.bench.hf_baseline import gptq_cpu_options, load_hf
    rtn_gptq(ensure_builtin("tiny-bamba"), tmp_path / "bamba")
    rtn_gptq(ensure_builtin("tiny-llama"), tmp_path / "llama")
    assert gptq_cpu_options(tmp_path / "llama") == {} and gptq_cpu_options(ensure_builtin("tiny-bamba")) == {}
    assert gptq_cpu_options(tmp_path / "bamba")["quantization_config"].backend == "torch"
    prompts = random_prompts(512, (5, 12), seed=3)
    hf = load_hf(str(tmp_path / "bamba"), dtype="float32", device="cpu")
    with LLM(str(tmp_path / "bamba"), block_size=4, max_model_len=64) as llm:
        got = greedy_tokens(llm, prompts, 6)
    assert greedy_each(hf.model, prompts, 6) == got


def test_lora_validate_quantized_on_a_gptq_nemotron_h(tmp_path):
    """`infer lora-validate --quantized` builds its float oracle from infer's dequantized Nemotron-H: transformers'
    model.embeddings and model.norm_f are filled from infer's embed_tokens and norm (it stopped at the first)."""
    rtn_gptq(ensure_builtin("tiny-nemotron-h"), tmp_path / "q")
    demo_module.make_random_adapter(ensure_builtin("tiny-nemotron-h"), tmp_path / "a", 8, demo_module.ALL_PROJECTIONS,
                                    seed=2)
    res = CliRunner().invoke(app, ["lora-validate", str(tmp_path / "q"), f"all={tmp_path / 'a'}", "--quantized",
                                   "--steps", "2", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output[res.output.index('{"name"'):].splitlines()[0])
    assert report["ok"] and report["numeric"]["tokens_agree"] and report["base_quantization"] == "GPTQ 4-bit, group 32"
    assert report["numeric"]["adapter_effect"] > 100 * report["numeric"]["max_abs_diff"], report


def test_the_demos_adapter_of_every_projection_adapts_granite4s_shared_mlp(tmp_path):
    """The demo's adapter of every projection on Granite 4.0 without experts targets its shared MLP (input_linear for
    gate and up, output_linear for down; never block_sparse_moe.input_linear, experts peft does not adapt) beside the
    attention; infer's tokens with it equal peft's, in a batch mixed with the base."""
    from lora_helpers import check_mixed_adapters_equal_peft
    from safetensors.torch import load_file, save_file

    from helpers import hf_model
    base = ensure_builtin("tiny-granite4-dense")
    demo_module.make_random_adapter(base, tmp_path / "all", 8, demo_module.ALL_PROJECTIONS, seed=2)
    targets = json.loads((tmp_path / "all" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == ["k_proj", "o_proj", "q_proj", "shared_mlp.input_linear", "shared_mlp.output_linear",
                               "v_proj"]
    assert demo_module.adapters_described("tiny-granite4-dense").startswith("support (rank 8, q/v) and legal (rank 16, "
                                                                             "all projections)")
    weights = tmp_path / "all" / "adapter_model.safetensors"  # (B x 20: Granite's multipliers damp the delta)
    save_file({k: t * 20 if "lora_B" in k else t for k, t in load_file(weights).items()}, str(weights))
    check_mixed_adapters_equal_peft(base, hf_model(str(base)), {"all": tmp_path / "all"},
                                    random_prompts(512, (7, 13), seed=2), ["all", None])


@needs_gptqmodel
def test_the_hf_baseline_refuses_a_gptq_mixture_of_experts_instead_of_running_random_experts(tmp_path):
    """transformers 5 stacks a mixture of experts' experts into float parameters and has no place for a GPTQ
    checkpoint's int4 experts.N.*.qweight: it loaded Mixtral's with those parameters uninitialized, and the bench's
    baseline ran that model (garbage tokens, float experts: not the checkpoint). Refused, naming both sides."""
    from infer.bench.hf_baseline import load_hf
    from infer.errors import ModelLoadError
    rtn_gptq(ensure_builtin("tiny-mixtral"), tmp_path / "q")
    with pytest.raises(ModelLoadError) as e:
        load_hf(str(tmp_path / "q"), dtype="float32", device="cpu")
    said = str(e.value)
    assert "its model has no tensor for model.layers.0.mlp.experts.down_proj (4 weights missing)" in said
    assert "no place for the checkpoint's model.layers.0.mlp.experts.0.w1.g_idx" in said
    assert "give --baseline-model the float checkpoint it was quantized from" in e.value.hint


@pytest.mark.parametrize("name, experts", [("tiny-mixtral", True), ("tiny-minimax-m2", True),
                                          ("tiny-granitemoe", False), ("tiny-phimoe", False),
                                          ("tiny-qwen3-moe", True)])
def test_the_demos_adapter_of_every_projection_passes_infers_checks_on_a_mixture_of_experts(tmp_path, name, experts):
    """The demo's adapter of every projection names the family's own MLP modules: Mixtral's and MiniMax-M2's w1, w3,
    w2 (gate_proj ... were refused as modules the base does not have), which peft turns into the experts' stacked
    parameters; none on Granite MoE and Phi-3.5-MoE, whose MLP is their experts (the attention alone, and the demo
    says so)."""
    from transformers import AutoConfig

    from infer.lora.adapter import adapter_problems
    base = ensure_builtin(name)
    demo_module.make_random_adapter(base, tmp_path / "all", 8, demo_module.ALL_PROJECTIONS, seed=2)
    assert adapter_problems("all", tmp_path / "all", AutoConfig.from_pretrained(base)) == []
    held = set(safe_open(str(tmp_path / "all" / "adapter_model.safetensors"), "pt").keys())
    assert any(".experts." in k for k in held) == experts, sorted(held)[:8]
    said = demo_module.adapters_described(name)
    assert said.endswith("legal (rank 16, all projections)" if experts else "legal (rank 16, q_proj, k_proj, v_proj, "
                                                                             "o_proj)"), said
