"""Issue 4's measurement: the cost of mixing many LoRA adapters in one batch, against no LoRA and against the
"split whenever the adapter changes" policy, on the same engine and the same requests.

    python -m infer.bench.lora_compare --model llama-100m --num-adapters 16 --rank 16 \\
        --num-prompts 64 --input-len 44 --output-len 64 --concurrency 16 --out bench-results/lora

Makes `--num-adapters` random rank-`--rank` PEFT adapters (every attention and MLP projection, random
non-zero lora_B) on `--adapter-base` (default: MODEL; give the float model when MODEL is a GPTQ checkpoint),
builds one LLMEngine with all of them resident, and runs the workload three ways:

    none   no request uses an adapter
    mixed  request i uses adapter i mod K: every batch mixes K different adapters (the engine's policy)
    split  the same requests fed one adapter at a time (infer.bench.lora_split)

and prints output tok/s and the ratios mixed/none and mixed/split; the report goes to --out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: str, out: Path, num: int, rank: int, seed: int = 0) -> dict[str, str]:
    """`num` random PEFT LoRA adapters of rank `rank` for the model `base` (a folder or built-in name)."""
    from peft import LoraConfig, get_peft_model

    from ..lora.adapter import base_targets
    from ..models.resolve import resolve_model
    from .hf_baseline import hf_auto_class
    path = resolve_model(base)
    hf = hf_auto_class(path).from_pretrained(path, dtype=torch.float32)
    # (Phi-3's fused modules: peft found no q_proj there)
    targets = base_targets(hf.config.get_text_config().model_type, TARGETS)
    if hf.config.get_text_config() is not hf.config:  # a multimodal model: its language model's alone (infer refuses
        targets = rf".*language_model.*\.({'|'.join(targets)})"  # an adapter of its vision tower's q_proj, ...)
    model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    paths = {}
    for k in range(num):
        g = torch.Generator().manual_seed(seed + k)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=g) * (0.02 if "lora_B" in name else 0.05))
        paths[f"lora{k}"] = str(out / f"lora{k}")
        model.save_pretrained(paths[f"lora{k}"])
    return paths


def build_engine(model: str, adapters: dict[str, str], rank: int, concurrency: int, dtype: str):
    from ..engine.config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from .datasets import BenchRequest
    from .driver import run_in_process
    # no prefix caching: the runs share their prompts, and a later run must not skip prefills an earlier one did
    cfg = EngineConfig(model, dtype=dtype, max_num_seqs=concurrency, loras=adapters, max_loras=len(adapters),
                       max_lora_rank=rank, enable_prefix_caching=False)
    engine = LLMEngine(cfg)
    engine.warm_kernels()
    warm = [BenchRequest(None, [1, 2, 3], 2, lora=n, ignore_eos=True) for n in adapters]  # all slots filled
    run_in_process(engine, warm, concurrency=len(warm), progress=False)
    return engine


def warm_shapes(engine, requests, names: list[str], concurrency: int) -> None:
    """Not measured: one full batch of the workload, with and without adapters, so that no measured run pays
    for first-time kernel choices and allocations."""
    from dataclasses import replace

    from .datasets import assign_loras
    from .driver import run_in_process
    batch = [replace(r, output_len=min(r.output_len, 16)) for r in requests[:concurrency]]
    for reqs in (batch, assign_loras(batch, names)):
        run_in_process(engine, reqs, concurrency, progress=False)


def compare(engine, requests, names: list[str], concurrency: int, repeats: int = 1, progress: bool = True):
    """{"none" | "mixed" | "split": [RunResult per repeat]}, the three interleaved within each repeat."""
    from .datasets import assign_loras
    from .driver import run_in_process
    from .lora_split import run_split
    mixed_reqs = assign_loras(requests, names)
    runs: dict[str, list] = {"none": [], "mixed": [], "split": []}
    todo = {"none": lambda: run_in_process(engine, requests, concurrency, progress=progress),
            "mixed": lambda: run_in_process(engine, mixed_reqs, concurrency, progress=progress),
            "split": lambda: run_split(engine, mixed_reqs, concurrency, progress=progress)}
    for rep in range(repeats):
        for name, fn in todo.items():
            run = fn()
            runs[name].append(run)
            m = run.metrics()
            print(f"repeat {rep + 1} {name:5s}: {m['output_throughput']:8.1f} out tok/s, {m['completed']} done "
                  f"in {m['duration']:.1f} s", flush=True)
    for name, rs in runs.items():
        for r in rs:
            r.backend = {"none": "infer-nolora", "mixed": "infer-mixed"}.get(name, r.backend)
    return runs


def summary(runs: dict[str, list]) -> dict:
    """Best-of-repeats output tok/s per policy and the ratios issue 4 asks about."""
    tps = {k: max(r.metrics()["output_throughput"] for r in rs) for k, rs in runs.items()}
    every = {k: [round(r.metrics()["output_throughput"], 1) for r in rs] for k, rs in runs.items()}
    return {"output_tok_s": tps, "every_repeat": every,
            "mixed_over_none": tps["mixed"] / tps["none"], "mixed_cost": 1 - tps["mixed"] / tps["none"],
            "mixed_over_split": tps["mixed"] / tps["split"], "split_over_none": tps["split"] / tps["none"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m infer.bench.lora_compare", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--adapter-base", default=None, help="float model to make the adapters on (default: --model)")
    ap.add_argument("--adapters-dir", type=Path, default=None, help="where to write the adapters (default: temp)")
    ap.add_argument("--num-adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=44)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each policy, interleaved; best counts")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-results/lora-compare"))
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    from .datasets import random_requests
    from .report import write_report
    with tempfile.TemporaryDirectory(prefix="infer-loras-") as tmp:
        folder = a.adapters_dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        adapters = make_adapters(a.adapter_base or a.model, folder, a.num_adapters, a.rank, a.seed)
        engine = build_engine(a.model, adapters, a.rank, a.concurrency, a.dtype)
        requests = random_requests(engine.tokenizer, a.num_prompts, a.input_len, a.output_len, a.seed)
        warm_shapes(engine, requests, list(adapters), a.concurrency)
        runs = compare(engine, requests, list(adapters), a.concurrency, a.repeats, progress=not a.quiet)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    write_report(a.out, [r for rs in runs.values() for r in rs], config=config, show=not a.quiet)
    result = summary(runs)
    (a.out / "lora_summary.json").write_text(json.dumps({"config": config, **result}, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
