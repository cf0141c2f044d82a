"""`infer demo`: the whole chain on a built-in model, each step the real `infer` command in a process of its own.

Every step (the adapters too) runs in a fresh process with the environment the demo started with, so no step
inherits what an earlier one left behind (threads, environment variables that libraries set on import) and the
benchmark runs as `infer bench` would run alone. Each step's full output goes to OUT/demo.log; the terminal gets
one line per step.

Steps run with one CPU thread (OMP_NUM_THREADS=1 unless the caller set it). The tiny model's matrices are too small
to split between threads, and a step split over every core waits at each of its many small parallel regions for
whichever thread another process has preempted: on a 2-core machine with anything else running, TPOT went from
1.3-2.1 ms (one thread) to 11-45 ms (two), for infer and transformers alike, so the verdict depended on the load.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Callable

import typer

from ..errors import ConfigError, InferError
from . import options as o

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
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"support": (8, ["q_proj", "v_proj"], 1), "legal": (16, ALL_PROJECTIONS, 2)}  # rank, targets, seed
# (calibration samples, calibration length, lora-validate steps, bench prompts, bench output tokens)
SIZES = {False: (32, 128, 8, 16, 64), True: (8, 64, 2, 8, 16)}
VERDICT = re.compile(r"bench: (?P<tps>\d+) output tok/s at concurrency (?P<c>\d+), (?P<ratio>[\d.]+)x transformers")


def make_random_adapter(base: Path, out: Path, rank: int, targets: list[str], seed: int, rslora: bool = False):
    """A PEFT LoRA adapter for `base` with random (non-zero) weights, as a fine-tune would leave them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    from ..lora.adapter import base_targets
    # (Phi-3's: q|k|v and gate|up fused; DeepSeek's latent attention's own)
    targets = base_targets(model.config.model_type, targets, getattr(model.config, "q_lora_rank", None) is not None)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  use_rslora=rslora, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(out)


class _Steps:
    """Runs each step as `python -m infer.cli ...` with the demo's starting environment, output to the log."""

    def __init__(self, log: Path):
        self.log = log
        self.env = dict(os.environ)  # as the demo found it: no step sees what another step's libraries set
        self.env.setdefault("OMP_NUM_THREADS", "1")  # see the module docstring

    def run(self, title: str, args: list[str], summary: Callable[[str], str], module: str = "infer.cli") -> None:
        """Run one step; `summary(its stdout)` is the step's line."""
        shown = ["infer", *args] if module == "infer.cli" else ["python", "-m", module, *args]
        typer.echo(f"\n$ {shlex.join(shown)}", err=True)
        start = time.monotonic()
        with open(self.log, "a", encoding="utf-8") as log:
            log.write(f"\n$ {shlex.join(shown)}\n")
            log.flush()
            at = log.tell()
            proc = subprocess.run([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=log,
                                  stdin=subprocess.DEVNULL, env=self.env, text=True, errors="replace")
            log.write(proc.stdout)
        code = proc.returncode
        if code != 0:
            tail = self.log.read_text(encoding="utf-8", errors="replace")[at:].splitlines()[-25:]
            sys.stderr.write("".join(f"  | {line}\n" for line in tail))
            raise InferError(f"demo step '{title}' failed with exit code {code}",
                             f"its full output is in {self.log}; run the command above yourself to see it live")
        typer.echo(f"  {title}: {summary(proc.stdout)}  ({time.monotonic() - start:.1f} s)", err=True)


def _check_args(out: Path, model: str) -> Path:
    """Refuse a bad --model or --out before any work; the log file's path."""
    from ..models.tiny import BUILTIN_MODELS
    if model not in BUILTIN_MODELS:
        raise ConfigError(f"--model {model!r} is not a built-in model",
                          f"choose one of: {', '.join(BUILTIN_MODELS)}")
    from ..models.multimodal import WRAPPERS
    # (its adapters target every projection of the model: a multimodal checkpoint's vision tower's too)
    other = {kind: f"a multimodal {arch}" for arch, kind in WRAPPERS.items()}
    dense = [name for name, spec in BUILTIN_MODELS.items() if spec.arch not in other]
    if BUILTIN_MODELS[model].arch in other:
        raise ConfigError(f"--model {model} is {other[BUILTIN_MODELS[model].arch]}, which the demo's chain does not "
                          "take",
                          f"run the demo on another built-in ({', '.join(dense)}); try {model} itself with `infer "
                          f"run {model} examples/prompts.jsonl -o out.jsonl`")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder",
                          "pass a folder for the demo's files (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        log = out / "demo.log"
        log.write_text("")
    except OSError as e:
        raise ConfigError(f"cannot write into --out {out}: {e.strerror or e}", "pass a folder you can write to") \
            from e
    return log


def _moe(spec) -> bool:
    """Whether built-in `spec` (models.tiny.TinySpec) is a mixture of experts (Granite 4.0's and Nemotron-H's
    built-ins are one or not by their config: tiny-granite4 and tiny-nemotron-h-moe have experts, tiny-granite4-dense
    and tiny-nemotron-h none), from its config alone."""
    from ..models.moe import BASE, is_moe
    if spec.arch not in ("granitemoehybrid", "nemotron_h"):
        return spec.arch in BASE
    from transformers import AutoConfig
    return is_moe(AutoConfig.for_model(spec.arch, **spec.config))


def demo(
    out: Annotated[Path, typer.Option("-o", "--out", help="Folder for every artifact (created if missing; a re-run "
                                                    "reuses its checkpoint and adapters).",
                                         parser=o.folder_path, metavar="<path>")] = Path("infer-demo"),
    model: Annotated[str, typer.Option(help="The built-in model to start from.")] = "tiny-llama",
    quick: Annotated[bool, typer.Option("--quick", help="Smaller calibration, check and benchmark: a smoke test "
                                                        "(its numbers are noisier).")] = False,
) -> None:
    """Build a tiny model, quantize it to GPTQ int4, make two LoRA adapters, validate them, prove the memory,
    run a prompts file that mixes both adapters and the base, and benchmark it against transformers.

    Built-in models have random weights: the replies are gibberish, which is expected. The bench step's line (the
    last before "Done") compares infer with transformers `generate` on the same int4 checkpoint, the same
    requests and concurrency.

    Example: infer demo --out ./infer-demo
    """
    log = _check_args(out, model)
    started = time.monotonic()
    steps = _Steps(log)
    typer.echo(f"infer demo: {model} (built-in, random weights: its text is gibberish, as expected) -> {out}\n"
               f"Other libraries' messages and each step's full output: {log}\n"
               f"CPU threads per step: {steps.env['OMP_NUM_THREADS']} (OMP_NUM_THREADS)", err=True)
    gptq, loras = _model_steps(steps, out, model, SIZES[quick])
    _serve_steps(steps, out, gptq, loras, SIZES[quick], model)
    typer.echo(f"\nDone in {time.monotonic() - started:.0f} s. Everything is in {out}: checkpoint, adapters, "
               f"prompts, outputs, bench report and plots.", err=True)


def _model_steps(steps: _Steps, out: Path, model: str, sizes: tuple) -> tuple[Path, list[str]]:
    """Quantize and make the adapters (each reused from an earlier run into the same folder)."""
    samples, seq_len, check_steps = sizes[:3]
    # adapters fit one base: another --model into the same --out makes its own (reusing them failed the demo)
    gptq, adapters = out / f"{model}-gptq", out / ("adapters" if model == "tiny-llama" else f"{model}-adapters")
    if (gptq / "config.json").is_file() and any(gptq.glob("*.safetensors")):
        typer.echo(f"\n  quantize: reusing {gptq} from an earlier run (delete it to quantize again)", err=True)
    else:
        steps.run("quantize", ["quantize", model, "-o", str(gptq), "--bits", "4", "--group-size", "32",
                               "--num-samples", str(samples), "--seq-len", str(seq_len)],
                  lambda _: f"GPTQ int4 checkpoint in {gptq}, per-layer errors in quantization_report.csv")
    missing = [n for n in ADAPTERS if not (adapters / n / "adapter_config.json").is_file()]
    described = f"{adapters_described(model)} in {adapters}"
    if missing:
        steps.run("adapters", [model, str(adapters), *missing], lambda _: described, module="infer.cli.demo")
    else:
        typer.echo(f"\n  adapters: reusing {described} from an earlier run", err=True)
    loras = [f"{n}={adapters / n}" for n in ADAPTERS]
    steps.run("lora-validate", ["lora-validate", str(gptq), *loras, "--quantized", "--steps", str(check_steps)],
              lambda _: "both adapters pass (shapes, finite weights, logits vs peft on the dequantized base)")
    return gptq, loras


def _serve_steps(steps: _Steps, out: Path, gptq: Path, loras: list[str], sizes: tuple, model: str) -> None:
    from ..models.tiny import BUILTIN_MODELS
    num_prompts, output_len = sizes[3:]
    steps.run("warmup", ["warmup", str(gptq), "--max-length", "2048", "--concurrency", "8", "--json"],
              _warmup_line)
    prompts, outputs = out / "prompts.jsonl", out / "outputs.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    outputs.unlink(missing_ok=True)  # the demo's outputs start over, even after an interrupted demo
    steps.run("run", ["run", str(gptq), str(prompts), "-o", str(outputs), "--quiet",
                      *[a for lo in loras for a in ("--lora", lo)]], lambda _: _run_line(outputs))
    # (transformers reads no GPTQ mixture of experts: its baseline runs the float model the checkpoint came from)
    source = ["--baseline-model", model] if _moe(BUILTIN_MODELS[model]) else []
    steps.run("bench", ["bench", str(gptq), "--concurrency", "8", "--num-prompts", str(num_prompts),
                        "--input-len", "32", "--output-len", str(output_len), "--baseline", "hf", *source,
                        "--out", str(out / "bench"), "--quiet"],
              lambda _: _bench_line(out / "bench" / "results.json"))


def _warmup_line(stdout: str) -> str:
    d = json.loads(stdout.strip().splitlines()[-1])
    verdict = "fits" if d["fits"] else "does NOT fit"
    return (f"{verdict}: 8 x 2048 tokens; room for {d['max_concurrency_at_max_length']} sequences of 2048 "
            f"({d['kv_blocks']:,} KV blocks)")


def _run_line(outputs: Path) -> str:
    recs = [json.loads(line) for line in outputs.read_text().splitlines()]
    bad = [r["id"] for r in recs if r["error"]]
    tokens = sum(r["usage"]["completion_tokens"] for r in recs)
    return f"{len(recs)} replies ({tokens} tokens, gibberish: random weights), base + 2 adapters in the same " \
           f"batches" + (f"; errors: {bad}" if bad else f" -> {outputs}")


def _bench_line(results: Path) -> str:
    """The demo's verdict (VERDICT parses it)."""
    r = json.loads(results.read_text())[0]
    ratio = (r.get("ratio") or {}).get("output_throughput")
    base = (r.get("baseline") or {}).get("output_throughput")
    line = f"{r['output_throughput']:.0f} output tok/s at concurrency {r['concurrency']}"
    if ratio:
        label = (r.get("baseline") or {}).get("label") or ""
        float_model = label.startswith("hf (") and label != "hf (base, no adapters)"  # (--baseline-model)
        what = "its float model, same requests: transformers reads no GPTQ experts" if float_model else \
            "same int4 checkpoint and requests"
        line += f", {ratio:.2f}x transformers ({base:.0f} tok/s, {what})"
    return f"{line} -> {results.parent}"


def adapters_described(model: str) -> str:
    """The demo's adapters on built-in `model` as its summary line names them: each one's rank and the modules it
    targets there (Llama's q/v; a Phi-3's fused qkv_proj, which adapts q, k and v)."""
    from ..lora.adapter import EXPERTS_ONLY, base_targets
    from ..models.tiny import BUILTIN_MODELS
    arch = BUILTIN_MODELS[model].arch
    q_lora = BUILTIN_MODELS[model].config.get("q_lora_rank") is not None  # (DeepSeek's q_a/q_b, or q_proj)

    def what(targets: list[str]) -> str:
        # (Granite MoE's and Phi-3.5-MoE's MLP is their experts: not adapted; DeepSeek's kv_b_proj absorbed)
        if targets == ALL_PROJECTIONS and arch not in (*EXPERTS_ONLY, "deepseek_v3", "deepseek_v2"):
            return "all projections"
        modules = base_targets(arch, targets, q_lora)
        return "/".join(t.removesuffix("_proj") for t in modules) if modules == targets else ", ".join(modules)
    return " and ".join(f"{name} (rank {rank}, {what(targets)})" for name, (rank, targets, _) in ADAPTERS.items())


def _make_adapters(model: str, folder: str, *names: str) -> None:
    """The demo's adapter step, in a process of its own: python -m infer.cli.demo MODEL FOLDER NAME..."""
    from ..models.resolve import resolve_model
    base = resolve_model(model)
    for name in names:
        rank, targets, seed = ADAPTERS[name]
        make_random_adapter(base, Path(folder) / name, rank, targets, seed)


def _adapters_main(argv: list[str]) -> int:
    """`python -m infer.cli.demo MODEL FOLDER NAME...` as the demo prints it: a usage line, not a traceback, for
    missing arguments or a name the demo has no adapter recipe for."""
    usage = f"usage: python -m infer.cli.demo MODEL FOLDER NAME... (NAME: {', '.join(ADAPTERS)})"
    unknown = [n for n in argv[2:] if n not in ADAPTERS]
    if len(argv) < 3 or unknown:
        why = f"unknown adapter name {unknown[0]!r}" if unknown else "MODEL, FOLDER and at least one NAME are needed"
        print(f"error: {why}\n  {usage}", file=sys.stderr)
        return 2
    _make_adapters(*argv)
    return 0


if __name__ == "__main__":
    sys.exit(_adapters_main(sys.argv[1:]))
