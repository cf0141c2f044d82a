"""`infer demo`: the whole chain on a built-in model, each step the real `infer` command."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Callable

import typer

from ..errors import InferError

PROMPTS = [
    {"id": "base-1", "prompt": "The weather today is", "max_new_tokens": 24},
    {"id": "support-1", "messages": [{"role": "user", "content": "My computer is slow, what should I do?"}],
     "max_new_tokens": 24, "lora": "support"},
    {"id": "legal-1", "messages": [{"role": "user", "content": "Please send the report by Friday."}],
     "max_new_tokens": 24, "lora": "legal"},
    {"id": "base-2", "messages": [{"role": "user", "content": "How do I cook rice?"}], "max_new_tokens": 24},
    {"id": "support-2", "prompt": "Trains leave the central station", "max_new_tokens": 24, "lora": "support"},
    {"id": "legal-2", "prompt": "The team will review the numbers", "max_new_tokens": 24, "lora": "legal",
     "temperature": 0.7, "seed": 1},
]


def make_random_adapter(base: Path, out: Path, rank: int, targets: list[str], seed: int, rslora: bool = False):
    """A PEFT LoRA adapter for `base` with random (non-zero) weights, as a fine-tune would leave them."""
    import logging
    import torch
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # noise from peft's optional imports
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  use_rslora=rslora, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(out)


def _step(title: str, args: list[str], summary: Callable[[subprocess.CompletedProcess], str], ok=(0,)) -> None:
    cmd = ["infer", *args]
    typer.echo(f"\n$ {shlex.join(cmd)}", err=True)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "infer.cli", *args], capture_output=True, text=True)
    if proc.returncode not in ok:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise InferError(f"demo step '{title}' failed with exit code {proc.returncode}",
                         f"run the command above yourself to see its output")
    typer.echo(f"  {title}: {summary(proc)}  ({time.monotonic() - start:.1f} s)", err=True)


def demo(
    out: Annotated[Path, typer.Option("--out", help="Folder for every artifact.")] = Path("infer-demo"),
    model: Annotated[str, typer.Option(help="The built-in model to start from.")] = "tiny-llama",
) -> None:
    """Build a tiny model, quantize it to GPTQ int4, make two LoRA adapters, validate them, prove the memory,
    run a prompts file that mixes both adapters and the base, and benchmark it against transformers.

    Example: infer demo --out ./infer-demo
    """
    from ..models.resolve import resolve_model
    out.mkdir(parents=True, exist_ok=True)
    base = resolve_model(model)
    gptq, adapters = out / f"{model}-gptq", out / "adapters"
    typer.echo(f"infer demo: {model} ({base}) -> {out}", err=True)
    if not (gptq / "config.json").is_file():
        _step("quantize", ["quantize", model, "-o", str(gptq), "--bits", "4", "--group-size", "32",
                           "--num-samples", "32", "--seq-len", "128"],
              lambda p: f"GPTQ int4 checkpoint in {gptq}, per-layer errors in quantization_report.csv")
    for name, rank, targets, seed in (("support", 8, ["q_proj", "v_proj"], 1),
                                      ("legal", 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"], 2)):
        if not (adapters / name / "adapter_config.json").is_file():
            make_random_adapter(base, adapters / name, rank, targets, seed)
    typer.echo(f"\n  adapters: support (rank 8, q/v) and legal (rank 16, all projections) in {adapters}", err=True)
    loras = [f"support={adapters / 'support'}", f"legal={adapters / 'legal'}"]
    _step("lora-validate", ["lora-validate", str(gptq), *loras, "--quantized"],
          lambda p: "both adapters pass (shapes, finite weights, logits vs peft on the dequantized base)")
    _step("warmup", ["warmup", str(gptq), "--max-length", "2048", "--concurrency", "8", "--json"],
          lambda p: _warmup_line(p.stdout))
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    outputs = out / "outputs.jsonl"
    _step("run", ["run", str(gptq), str(prompts), "-o", str(outputs), "--quiet",
                  *[a for lo in loras for a in ("--lora", lo)]],
          lambda p: _run_line(outputs))
    _step("bench", ["bench", str(gptq), "--concurrency", "8", "--num-prompts", "16", "--input-len", "32",
                    "--output-len", "64", "--baseline", "hf", "--out", str(out / "bench"), "--quiet"],
          lambda p: _bench_line(out / "bench" / "results.json"))
    typer.echo(f"\nEverything is in {out}: checkpoint, adapters, prompts, outputs, bench report and plots.", err=True)


def _warmup_line(stdout: str) -> str:
    d = json.loads(stdout.strip().splitlines()[-1])
    verdict = "fits" if d["fits"] else "does NOT fit"
    return (f"{verdict}: 8 x 2048 tokens; room for {d['max_concurrency_at_max_length']} sequences of 2048 "
            f"({d['kv_blocks']} KV blocks)")


def _run_line(outputs: Path) -> str:
    recs = [json.loads(line) for line in outputs.read_text().splitlines()]
    bad = [r["id"] for r in recs if r["error"]]
    tokens = sum(r["usage"]["completion_tokens"] for r in recs)
    return f"{len(recs)} replies ({tokens} tokens), base + 2 adapters in the same batches" + \
        (f"; errors: {bad}" if bad else f" -> {outputs}")


def _bench_line(results: Path) -> str:
    runs = json.loads(results.read_text())
    r = runs[0]
    ratio = (r.get("ratio") or {}).get("output_throughput")
    return (f"{r['output_throughput']:.0f} output tok/s at concurrency {r['concurrency']}"
            + (f", {ratio:.2f}x transformers" if ratio else "") + f" -> {results.parent}")
