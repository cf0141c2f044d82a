"""A benchmark plan (what `infer bench` was asked) and `run_plan`, which measures it and writes the report.

    plan = BenchPlan(model="tiny-llama", levels=[1, 4], out=Path("bench-out"), engine=EngineConfig("tiny-llama"))
    results, interrupted = run_plan(plan)

The target is an in-process LLMEngine (`plan.engine` set; warmed up first, adapters made resident) or the
server at `plan.url`. Every level runs the same requests; with `baseline="hf"` each level is followed by HF
transformers generate at batch size = concurrency. Ctrl-C ends the plan: what was measured is still written,
marked partial, and `interrupted` is True.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .datasets import BenchRequest, assign_loras, length_range, load_workload
from .metrics import RunResult


@dataclass
class BenchPlan:
    model: str
    levels: list[int]
    out: Path
    rate: float = math.inf
    num_prompts: int | None = None
    dataset: str = "random"
    input_len: int = 44
    output_len: int = 128
    range_ratio: float = 0.0  # random: lengths drawn from [len x (1 - r), len x (1 + r)]
    loras: list[str] = field(default_factory=list)  # adapter names spread round-robin over the requests
    lora_policy: str = "mixed"  # mixed | split (in-process only)
    url: str | None = None
    model_id: str | None = None  # the base model's id on the server (--url)
    api_key: str | None = None
    baseline: str | None = None  # None | "hf"
    seed: int = 0
    quiet: bool = False
    engine: object | None = None  # EngineConfig for an in-process run
    dtype: str = "auto"  # the HF baseline's, with --url (in-process: the engine's)
    device: str = "auto"


class _Target:
    """Runs one level against the in-process engine or the server; knows the tokenizer and the baseline dtype."""

    def __init__(self, plan: BenchPlan):
        self.plan = plan
        self.engine = None
        if plan.url is None:
            from ..engine.llm_engine import LLMEngine
            self.engine = LLMEngine(plan.engine)
            self.engine.warm_kernels()
            self.tokenizer = self.engine.tokenizer
            self.hf_dtype, self.hf_device = str(self.engine.dtype).split(".")[-1], self.engine.device.type
        else:
            from ..engine.setup import load_tokenizer
            from ..models.resolve import resolve_model
            self.tokenizer = load_tokenizer(resolve_model(plan.model))
            self.hf_dtype, self.hf_device = plan.dtype, plan.device

    def warm_adapters(self, names: list[str]) -> None:
        """One short request per adapter, so the measured runs start with the adapters loaded (as a server that
        has been up a while)."""
        if self.engine is None or not names:
            return
        from .driver import run_in_process
        reqs = [BenchRequest(None, [1, 2, 3], 2, lora=n, ignore_eos=True) for n in names]
        run_in_process(self.engine, reqs, concurrency=len(reqs), progress=False)

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        p = self.plan
        progress = not p.quiet
        if self.engine is not None:  # each level starts cold: no prefix blocks left by the level before
            self.engine.block_manager.reset_prefix_cache()
        if p.url is not None:
            from .http_driver import run_http
            return run_http(p.url, p.model_id, requests, concurrency, p.rate, api_key=p.api_key, seed=p.seed,
                            progress=progress, tokenizer=self.tokenizer)
        if p.lora_policy == "split":
            from .lora_split import run_split
            return run_split(self.engine, requests, concurrency, p.rate, seed=p.seed, progress=progress)
        from .driver import run_in_process
        return run_in_process(self.engine, requests, concurrency, p.rate, seed=p.seed, progress=progress)


def report_config(plan: BenchPlan, description: str) -> dict:
    cfg = {k: v for k, v in asdict(plan).items() if k not in ("engine", "api_key", "out", "quiet")}
    cfg["request_rate"] = None if math.isinf(plan.rate) else plan.rate
    del cfg["rate"]
    cfg["workload"] = description
    if plan.engine is not None:
        cfg["engine"] = {k: v for k, v in asdict(plan.engine).items() if k != "loras"}
    return cfg


def _measure(plan: BenchPlan, target: _Target, requests, hf, runs: list, bases: list) -> bool:
    """Fill `runs` (and `bases`) level by level; True when Ctrl-C cut the plan short."""
    from .hf_baseline import run_hf_generate
    for c in plan.levels:
        run = target.run(requests, c)
        runs.append(run)
        if run.partial:
            return True
        if hf is not None:
            base = run_hf_generate(hf, requests, batch_size=c, progress=not plan.quiet)
            bases.append(base)
            if base.partial:
                return True
    return False


def _check_fits(plan: BenchPlan, target: _Target) -> None:
    """Random prompts that cannot fit the engine are refused before they are made (a prompt of 10^8 tokens took
    minutes to build, and every request then failed)."""
    if target.engine is None or plan.dataset != "random":
        return
    cap = target.engine.max_model_len
    longest = length_range(plan.input_len, plan.range_ratio)[1] + length_range(plan.output_len, plan.range_ratio)[1]
    if longest > cap:
        drawn = f" (the longest drawn with --random-range-ratio {plan.range_ratio:g}: {longest})" \
            if plan.range_ratio else ""
        raise ConfigError(f"--input-len {plan.input_len} + --output-len {plan.output_len} tokens{drawn} do not fit "
                          f"the engine's max length of {cap}", "lower them, or raise --max-model-len (up to the "
                                                               "model's limit)")


def _console():
    """The terminal's width on a terminal; wide enough for every column when the output is a file or a pipe."""
    import sys

    from rich.console import Console
    return Console() if sys.stdout.isatty() else Console(width=200)


def run_plan(plan: BenchPlan, console=None) -> tuple[list[dict], bool]:
    """Measure `plan` and write its report into `plan.out`; returns (results, interrupted). Raises
    KeyboardInterrupt only when Ctrl-C came before anything was measured."""
    from .report import write_report
    target = _Target(plan)
    _check_fits(plan, target)
    workload = load_workload(plan.dataset, target.tokenizer, num_prompts=plan.num_prompts,
                             input_len=plan.input_len, output_len=plan.output_len, seed=plan.seed,
                             range_ratio=plan.range_ratio)
    requests = assign_loras(workload.requests, plan.loras) if plan.loras else workload.requests
    hf = None
    if plan.baseline == "hf":
        from .hf_baseline import load_hf
        hf = load_hf(plan.model, target.hf_dtype, target.hf_device)
    target.warm_adapters(plan.loras)
    runs: list[RunResult] = []
    bases: list[RunResult] = []
    try:
        interrupted = _measure(plan, target, requests, hf, runs, bases)
    except KeyboardInterrupt:  # between runs (a run itself returns partial)
        interrupted = True
    if not runs:
        raise KeyboardInterrupt
    if interrupted:
        runs[-1].partial = True
    results = write_report(plan.out, runs, bases, config=report_config(plan, workload.description),
                           console=console or _console(), show=not plan.quiet)
    return results, interrupted
