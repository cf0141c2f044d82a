"""A benchmark plan (what `infer bench` was asked) and `run_plan`, which measures it and writes the report.

    plan = BenchPlan(model="tiny-llama", levels=[1, 4], out=Path("bench-out"), engine=EngineConfig("tiny-llama"))
    results, interrupted = run_plan(plan)

The target is an in-process LLMEngine (`plan.engine` set; warmed up first, adapters made resident) or the
server at `plan.url`. The workload is read and checked first, with the model's tokenizer only: a bad dataset is
refused before any model loads. Every level runs the same requests; with `baseline="hf"` every level of ours runs
first, then ours' engine is freed and HF transformers generate runs each level at batch size = concurrency (one
model in memory at a time, so each side's peak memory is its own; warmed first with one short batch, as the engine
is warmed before it is measured; each output length cut where the engine's max model length or the request's
max_length cuts ours, so both generate the same tokens), with transformers' (and GPTQModel's) own output kept off
the terminal unless --debug. That baseline runs the base model: with adapters in the workload it is labelled
"hf (base, no adapters)" in the table and the report, and a note says so. With `baseline="no-spec"` (ours runs
with a speculative_config) every level of ours runs first, then ours' engine is closed and the baseline's, the same
engine config without speculative_config, is built and runs every level: labelled "infer (no speculation)", one
engine in memory at a time, so each side's peak memory is its own. Ctrl-C ends the plan: what was
measured is still written, marked partial, and `interrupted` is True.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..errors import ConfigError, InferError
from .datasets import BenchRequest, Workload, assign_loras, length_range, load_workload
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
    loras: list[str] = field(default_factory=list)  # adapter names spread round-robin over the requests (unless
    # the workload names its own: jsonl lines with "lora")
    lora_policy: str = "mixed"  # mixed | split (in-process only)
    url: str | None = None
    model_id: str | None = None  # the base model's id on the server (--url)
    api_key: str | None = None
    baseline: str | None = None  # None | "hf" | "no-spec" (the same engine without its speculative_config)
    baseline_model: str | None = None  # with baseline "hf": the model transformers runs instead of `model` (the
    # float checkpoint a GPTQ `model` was quantized from); its tokenizer is `model`'s (checked by the CLI)
    seed: int = 0
    quiet: bool = False
    engine: object | None = None  # EngineConfig for an in-process run
    dtype: str = "auto"  # the HF baseline's, with --url (in-process: the engine's)
    device: str = "auto"
    chat_template: str | None = None  # with --url: what the workload's messages are rendered with (in-process:
    # the engine's)
    goodput: dict | None = None  # service level objectives {"ttft" | "tpot" | "e2el": ms} (vLLM's --goodput)
    save_detailed: bool = False  # results.json also holds each request's figures (vLLM's --save-detailed)
    pooling: bool = False  # embeddings (--runner pooling): each request a prompt in, its vector out, no token made;
    # the baseline is transformers' AutoModel last_hidden_state pooled as the engine (or the server) pools
    pooler_config: dict | None = None  # with --url: how the server pools (its --pooler-config), for the baseline


BASE_NO_ADAPTERS = "hf (base, no adapters)"  # the HF baseline's label when the workload uses adapters
NO_SPEC = "no-spec"  # the baseline that runs ours' engine config without its speculative_config
NO_SPEC_LABEL = "infer (no speculation)"  # its label in the table, report.md, results.csv and results.json


def load_plan_tokenizer(plan: BenchPlan):
    """The tokenizer of the model benchmarked (the engine's, or MODEL's with --url), without loading the model."""
    from ..engine.setup import load_tokenizer
    from ..models.resolve import resolve_model
    if plan.engine is not None:
        return load_tokenizer(resolve_model(plan.engine.model), plan.engine.chat_template)
    return load_tokenizer(resolve_model(plan.model), plan.chat_template)


class _Target:
    """Runs one level against the in-process engine or the server; knows the tokenizer and the baseline dtype."""

    def __init__(self, plan: BenchPlan, tokenizer):
        self.plan = plan
        self.engine = None
        self.tokenizer = tokenizer
        self.levels_run = 0  # with --url: the levels sent to the server so far
        if plan.url is None:
            from ..engine.llm_engine import LLMEngine
            self.engine = LLMEngine(plan.engine)
            self.engine.warm_kernels()
            self.hf_dtype, self.hf_device = str(self.engine.dtype).split(".")[-1], self.engine.device.type
        else:
            self.hf_dtype, self.hf_device = plan.dtype, plan.device

    def close(self) -> None:
        """Free the in-process engine (weights, KV cache) and give the heap back to the OS, so that an engine built
        next is measured alone."""
        if self.engine is None:
            return
        import gc

        from ..memory.meter import trim_heap
        self.engine.close()
        self.engine = None
        gc.collect()
        trim_heap()

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
            from .http_driver import reset_prefix_cache, run_http
            if not reset_prefix_cache(p.url, p.api_key) and self.levels_run == 1:  # said once, at the second level
                print(f"note: {p.url} did not reset its prefix cache (infer serve does on POST /reset_prefix_cache, "
                      "vLLM with VLLM_SERVER_DEV_MODE=1): each level after the first sends the same prompts again, "
                      "which a server with prefix caching finds cached, so their TTFT is lower than a cold level's; "
                      "bench one level per run, or start the server without prefix caching", file=sys.stderr,
                      flush=True)
            self.levels_run += 1
            return run_http(p.url, p.model_id, requests, concurrency, p.rate, api_key=p.api_key, seed=p.seed,
                            progress=progress, tokenizer=self.tokenizer, pooling=p.pooling)
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
    if plan.pooling:  # (an embedding generates no token: the plan's output length is unused)
        cfg["output_len"] = None
    if plan.engine is not None:
        cfg["engine"] = {k: v for k, v in asdict(plan.engine).items() if k != "loras"}
    if plan.baseline == NO_SPEC:
        cfg["baseline_engine"] = ("the same engine options without speculative_config, built after ours was "
                                  "freed (one engine in memory at a time): each side's peak memory is its own")
    elif plan.baseline == "hf" and plan.pooling:
        cfg["baseline_engine"] = ("transformers AutoModel last_hidden_state, pooled as ours, in static batches of "
                                  "the level's size, loaded after every level of ours, with ours' engine freed first "
                                  "(one model in memory at a time): each side's peak memory is its own")
    elif plan.baseline == "hf":
        cfg["baseline_engine"] = ("transformers generate, loaded after every level of ours, with ours' engine freed "
                                  "first (one model in memory at a time): each side's peak memory is its own")
    if plan.baseline == "hf" and plan.baseline_model:
        cfg["baseline_engine"] += f"; on {plan.baseline_model} (--baseline-model), not on the model ours runs"
    return cfg


def _shown():
    """No hiding: what run_plan uses for the HF baseline when the caller gives no `hide_libraries`."""
    return contextlib.nullcontext(None)


def baseline_requests(requests: list[BenchRequest], max_model_len: int | None) -> list[BenchRequest]:
    """The requests the HF baseline runs: each output length cut to what ours can generate, prompt and output
    within the request's max_length and the engine's (or server's) max model length, as the engine caps them:
    generate knows neither cap and ran the whole output length, more tokens than ours made."""
    out = []
    for r in requests:
        caps = [c for c in (r.max_length, max_model_len) if c is not None]
        room = min(caps) - r.prompt_len if caps and r.prompt_token_ids else None
        out.append(r if room is None or room >= r.output_len or room < 1 else replace(r, output_len=room))
    return out


def _measure(plan: BenchPlan, target: _Target, requests, runs: list, bases: list, hide=_shown) -> bool:
    """Fill `runs` level by level, then `bases` (the baseline's levels, after all of ours); True when Ctrl-C cut
    the plan short."""
    for c in plan.levels:
        _say(plan, f"{len(requests)} requests at concurrency {c}")
        with _keeping_partial(runs, plan.goodput):
            run = target.run(requests, c)
        run.goodput = plan.goodput
        runs.append(run)
        if run.partial:
            return True
    if plan.baseline == "hf":
        return _measure_hf(plan, target, requests, bases, hide)
    if plan.baseline == NO_SPEC:
        return _measure_no_spec(plan, target, requests, bases)
    return False


def _say(plan: BenchPlan, what: str) -> None:
    """Where the progress bars draw nothing (their console, rich's on stdout, is no terminal: a CI log, `> out`,
    `| tee log`), a line per level on stderr says what runs, so a bench of many minutes does not look hung."""
    if plan.quiet:
        return
    from rich import get_console
    bars = get_console()  # where bench.driver.Progress draws
    if bars.is_terminal and not bars.is_dumb_terminal:
        return
    print(f"infer bench: {what} ...", file=sys.stderr, flush=True)


def _measure_hf(plan: BenchPlan, target: _Target, requests, bases: list, hide=_shown) -> bool:
    """The HF baseline, after every level of ours: ours' engine is freed first, then transformers loads MODEL and
    runs every level (one model in memory at a time, so each side's peak memory is its own: with both loaded, ours'
    peak held the baseline's weights and the baseline's ours' weights and KV cache); True when Ctrl-C cut it
    short."""
    from .hf_baseline import load_hf, run_hf_embed, run_hf_generate
    label = baseline_label(plan, requests)
    try:
        # (a pooling run's requests are its prompts, each the same as ours': nothing to cut)
        base_requests = requests if plan.pooling else baseline_requests(requests, _context_len(plan))
        pooler = plan_pooler(plan) if plan.pooling else None
        target.close()
        with hide():
            hf = load_hf(plan.baseline_model or plan.model, target.hf_dtype, target.hf_device)
        for c in plan.levels:
            what = "AutoModel embeddings" if plan.pooling else "generate"
            _say(plan, f"baseline: transformers {what}, {len(base_requests)} requests in batches of {c}")
            with hide() as term, _keeping_partial(bases, plan.goodput, label):
                if plan.pooling:
                    base = run_hf_embed(hf, base_requests, c, pooler, progress=not plan.quiet, console=term,
                                        warmup=True)
                else:
                    base = run_hf_generate(hf, base_requests, batch_size=c, progress=not plan.quiet, console=term,
                                           warmup=True)  # warmed, as the engine is, before it is measured
            if _add_baseline(plan, base, label, bases):
                return True
    except KeyboardInterrupt:  # while transformers loaded or between its levels: ours are complete
        return True
    return False


def plan_pooler(plan: BenchPlan):
    """How the benchmarked engine (or server) pools (engine.pooling.resolve_pooler: --pooler-config, else the
    model's sentence-transformers files, else LAST and normalized), which the HF baseline pools the same way."""
    from ..engine.pooling import resolve_pooler
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    path = resolve_model(plan.model)
    config = plan.engine.pooler_config if plan.engine is not None else plan.pooler_config
    return resolve_pooler(path, load_config(path).hidden_size, config)


@contextlib.contextmanager
def _keeping_partial(into: list, goodput: dict | None, label: str | None = None):
    """A run that an error stopped half way raises it with what finished before it (`bench_partial`, marked
    partial): that part is added to `into` (labelled, with the plan's objectives), so the report keeps it."""
    try:
        yield
    except Exception as e:
        part = getattr(e, "bench_partial", None)
        if isinstance(part, RunResult):
            part.goodput, part.label = goodput, label or part.label
            into.append(part)
        raise


def baseline_label(plan: BenchPlan, requests: list[BenchRequest]) -> str | None:
    """The HF baseline's label where it says more than "hf": the model it ran when --baseline-model names another
    one, and that it ran the base model without adapters when the workload uses some."""
    bare = not any(r.lora for r in requests)
    if not plan.baseline_model:
        return None if bare else BASE_NO_ADAPTERS
    name = Path(plan.baseline_model).name or plan.baseline_model
    return f"hf ({name})" if bare else f"hf ({name}, base, no adapters)"


def _add_baseline(plan: BenchPlan, base: RunResult, label: str | None, bases: list) -> bool:
    """Record a baseline run of one level (labelled, with the plan's objectives); True when it was cut short."""
    base.label, base.goodput = label, plan.goodput
    bases.append(base)
    return base.partial


def no_spec_plan(plan: BenchPlan) -> BenchPlan:
    """The no-spec baseline's plan: ours with the engine's speculative_config dropped, nothing else changed."""
    return replace(plan, engine=replace(plan.engine, speculative_config=None), baseline=None)


def _measure_no_spec(plan: BenchPlan, target: _Target, requests, bases: list) -> bool:
    """The no-spec baseline, after every level of ours: ours' engine is freed first, then the same engine without
    speculation is built, warmed as ours was, and runs every level with the same requests (and rate); True when
    Ctrl-C cut it short."""
    base = None
    try:
        target.close()
        base = _Target(no_spec_plan(plan), target.tokenizer)
        base.warm_adapters(plan.loras)
        for c in plan.levels:
            _say(plan, f"baseline: {NO_SPEC_LABEL}, {len(requests)} requests at concurrency {c}")
            with _keeping_partial(bases, plan.goodput, NO_SPEC_LABEL):
                run = base.run(requests, c)
            if _add_baseline(plan, run, NO_SPEC_LABEL, bases):
                return True
    except KeyboardInterrupt:  # while the baseline's engine was built or between its levels: ours are complete
        return True
    finally:
        if base is not None:
            base.close()
    return False


def _max_model_len(plan: BenchPlan) -> int | None:
    """The in-process engine's max length, from the model's config and the engine options (as the engine will
    compute it), without loading the model; None with --url."""
    if plan.url is not None or plan.engine is None:
        return None
    from ..engine.setup import model_max_len
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    return model_max_len(load_config(resolve_model(plan.engine.model)), plan.engine)


def _context_len(plan: BenchPlan) -> int | None:
    """The in-process engine's max model length, or the one the server reports for the model in /v1/models (vLLM's
    and infer serve's model cards carry it); None when it says none."""
    if plan.url is None:
        return _max_model_len(plan)
    import httpx
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
    try:
        models = httpx.get(f"{plan.url}/v1/models", headers=headers, timeout=10.0, trust_env=False).json()
        card = next(m for m in models["data"] if isinstance(m, dict) and m.get("id") == plan.model_id)
        return int(card["max_model_len"]) if card.get("max_model_len") else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, StopIteration):
        return None


def _check_fits(plan: BenchPlan) -> None:
    """Random prompts that cannot fit the engine are refused before they are made (a prompt of 10^8 tokens took
    minutes to build, and every request then failed), and before the model loads."""
    if plan.dataset != "random":
        return
    cap = _max_model_len(plan)
    if cap is None:
        return
    out = 0 if plan.pooling else length_range(plan.output_len, plan.range_ratio)[1]  # (a pooling run makes none)
    longest = length_range(plan.input_len, plan.range_ratio)[1] + out
    if longest > cap:
        drawn = f" (the longest drawn with --random-range-ratio {plan.range_ratio:g}: {longest})" \
            if plan.range_ratio else ""
        raise ConfigError(f"--input-len {plan.input_len} + --output-len {plan.output_len} tokens{drawn} do not fit "
                          f"the engine's max length of {cap}", _longer_hint(plan, cap))


def _longer_hint(plan: BenchPlan, cap: int) -> str:
    """Raising --max-model-len helps only below the model's limit: at it (the default), the limit and what sets it
    (a sliding window, longrope) are said instead."""
    from ..engine.setup import context_limit
    from ..models.loader import load_config
    from ..models.resolve import resolve_model
    limit, why = context_limit(load_config(resolve_model(plan.engine.model)))
    if cap < limit:
        return f"lower them, or raise --max-model-len (up to {limit}, the model's limit)"
    return f"lower them: {limit} tokens is the model's limit" + (f" ({why})" if why else "")


def _check_own_loras(plan: BenchPlan, requests: list[BenchRequest]) -> None:
    """An in-process engine has only the adapters --lora gives: a jsonl line naming another one was measured as a
    failed request, each failure saying how to register an adapter with the Python API (LLM(..., loras=...)),
    after the model had loaded and the level had run."""
    if plan.url is not None or plan.engine is None:  # (a server's adapters are its own)
        return
    loras = plan.engine.loras or []  # NAME=PATH items (--lora), or {name: path}
    given = set(plan.loras) | {item.partition("=")[0] if isinstance(item, str) else item for item in loras}
    unknown = [r.lora for r in requests if r.lora and r.lora not in given]
    if unknown:
        missing = sorted(set(unknown))
        raise ConfigError(f"{plan.dataset} names the adapter(s) {', '.join(map(repr, missing))} ({len(unknown)} "
                          f"request(s)), which no --lora gives (given: {', '.join(sorted(given)) or 'none'})",
                          f"add --lora NAME=PATH for each (e.g. --lora {missing[0]}=./adapters/{missing[0]}), or "
                          "remove the lines' \"lora\"")


def _console():
    """The terminal's width on a terminal; wide enough for every column when the output is a file or a pipe."""
    import sys

    from rich.console import Console
    return Console() if sys.stdout.isatty() else Console(width=200)


def _note_base_baseline(plan: BenchPlan, requests: list[BenchRequest]) -> None:
    """With adapters in the workload, say once that the HF baseline runs the base model without them."""
    names = sorted({r.lora for r in requests if r.lora})
    if names:
        print(f"note: --baseline hf runs {plan.baseline_model or plan.model} without adapters, labelled "
              f"{baseline_label(plan, requests)!r}; the requests "
              f"measured use {', '.join(names)}, so the x columns compare serving adapters with the plain base model",
              file=sys.stderr, flush=True)


def _note_short_dataset(plan: BenchPlan, workload: Workload) -> None:
    """Say when the dataset gave fewer requests than --num-prompts asked for (vLLM repeats requests to reach the
    number; infer measures the dataset as it is, and says so: a report of 2 requests read as one of 100 misleads)."""
    got = len(workload.requests)
    if plan.num_prompts and got < plan.num_prompts:
        those = "that one" if got == 1 else f"those {got}"
        print(f"note: --num-prompts {plan.num_prompts}, but {plan.dataset} gives {got} usable request"
              f"{'s' if got != 1 else ''}: measuring {those} (requests are not repeated to reach the number)",
              file=sys.stderr, flush=True)


def run_plan(plan: BenchPlan, console=None, hide_libraries=None) -> tuple[list[dict], bool]:
    """Measure `plan` and write its report into `plan.out`; returns (results, interrupted). Raises
    KeyboardInterrupt only when Ctrl-C came before anything was measured; the error of a later level (the server
    went away, the GPU ran out of memory) once the report of the levels measured before it is written.
    `hide_libraries`: a context manager factory that keeps other libraries' output off the terminal while the HF
    baseline loads and runs, yielding a rich Console for the baseline's progress bar or None (the CLI passes
    `cli.quiet.library_output_to_bar`)."""
    hide = hide_libraries or _shown
    if plan.baseline == NO_SPEC and getattr(plan.engine, "speculative_config", None) is None:
        raise ConfigError("the no-spec baseline runs the in-process engine without its speculative_config, and this "
                          "plan has none", "set the engine's speculative_config (--speculative-config), or use "
                          "baseline hf")
    from .report import write_report
    tokenizer = load_plan_tokenizer(plan)  # the workload is read and checked before any model loads
    _check_fits(plan)
    workload = load_workload(plan.dataset, tokenizer, num_prompts=plan.num_prompts,
                             input_len=plan.input_len, output_len=plan.output_len, seed=plan.seed,
                             range_ratio=plan.range_ratio, pooling=plan.pooling)
    _note_short_dataset(plan, workload)
    own = any(r.lora for r in workload.requests)  # a jsonl line's "lora" is its own: --lora only registers it
    if own:
        _check_own_loras(plan, workload.requests)
    requests = assign_loras(workload.requests, plan.loras) if plan.loras and not own else workload.requests
    if plan.baseline == "hf":
        _note_base_baseline(plan, requests)
    target = _Target(plan, tokenizer)
    target.warm_adapters(plan.loras)
    runs: list[RunResult] = []
    bases: list[RunResult] = []

    def report() -> list[dict]:
        return write_report(plan.out, runs, bases, config=report_config(plan, workload.description),
                            console=console or _console(), show=not plan.quiet, detailed=plan.save_detailed)
    try:
        interrupted = _measure(plan, target, requests, runs, bases, hide)  # the run cut short is marked partial
    except KeyboardInterrupt:  # between runs, or inside one that does not return partial: the last one is suspect
        interrupted = True
        if runs:
            runs[-1].partial = True
    except Exception as e:  # a later level could not run (the server went away, the GPU ran out of memory): the
        if not runs:  # levels measured before it are written, then the error is raised
            raise
        report()
        held = "the levels measured before" if getattr(e, "bench_partial", None) is None else \
            "what was measured before it (the run it stopped marked partial)"
        if isinstance(e, InferError):
            raise type(e)(f"{e.message} (the report in {plan.out} holds {held})", e.hint) from None
        print(f"error: the benchmark stopped at an error; the report in {plan.out} holds {held}",
              file=sys.stderr, flush=True)
        raise
    if not runs:
        raise KeyboardInterrupt
    return report(), interrupted
