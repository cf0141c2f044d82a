"""`infer bench MODEL`: throughput and latency of the engine (in-process) or of any OpenAI-compatible server
(--url), at one or more concurrency levels, optionally against HF transformers generate (--baseline hf) or against the
same engine without speculative decoding (--baseline no-spec). With --runner pooling: embeddings (POST /v1/embeddings
with --url), against transformers' AutoModel last_hidden_state pooled alike (--baseline hf)."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from dataclasses import replace
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..checks import missing_file_hint
from ..engine.config import ENGINE, LORA, RANGES, EngineConfig, batched_tokens_below_seqs, cli_fields, parse_loras
from ..errors import ConfigError, read_utf8
from . import options as o

WL = "Workload options"
TARGET = "Target options"
BASELINES = ("hf", "no-spec")
POLICIES = ("mixed", "split")
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 44, 128  # the random dataset's lengths (output: also jsonl's default)


# ------------------------------------------------------------------------------------------------ parsing
def parse_concurrency(text: str) -> list[int]:
    """'16' -> [16]; '1,4,16' -> [1, 4, 16] (each at least 1, no repeats)."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--concurrency {text!r} is not a number or a comma-separated list of numbers",
                          "e.g. --concurrency 16 or --concurrency 1,4,16,64") from None
    if any(c < 1 for c in levels):
        raise ConfigError(f"--concurrency {text!r}: every level must be at least 1")
    if len(set(levels)) != len(levels):
        raise ConfigError(f"--concurrency {text!r} repeats a level", "give each level once")
    return levels


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise ConfigError(f"--request-rate {text!r} is not a number", "requests per second, or inf") from None
    if math.isnan(rate) or rate <= 0:
        raise ConfigError(f"--request-rate must be > 0, got {text}", "use inf to send every request at once")
    return rate


def parse_goodput(items: list[str] | None) -> dict | None:
    """--goodput, as vLLM's: KEY:MS service level objectives, KEY one of ttft, tpot, e2el (each flag one or more
    pairs, separated by spaces or commas) -> {"ttft": 100.0, ...}; None when not given."""
    from ..bench.metrics import SLO_METRICS
    if not items:
        return None
    slos: dict[str, float] = {}
    for pair in (p for item in items for p in item.replace(",", " ").split()):
        name, sep, value = pair.partition(":")
        try:
            ms = float(value) if sep else math.nan
        except ValueError:
            ms = math.nan
        if name not in SLO_METRICS or math.isnan(ms):
            raise ConfigError(f"--goodput {pair!r} is not a KEY:MS service level objective",
                              f"KEY is one of {', '.join(SLO_METRICS)}, MS a number of milliseconds, e.g. "
                              "--goodput ttft:100 --goodput tpot:50")
        if ms < 0:
            raise ConfigError(f"--goodput {pair!r}: an objective must be >= 0 ms")
        if name in slos:
            raise ConfigError(f"--goodput sets {name} twice", "give each objective once")
        slos[name] = ms
    if not slos:
        raise ConfigError("--goodput names no objective", "e.g. --goodput ttft:100 --goodput tpot:50")
    return slos


# where the ShareGPT file of vLLM's benchmarks comes from (infer downloads nothing itself)
SHAREGPT_REPO, SHAREGPT_FILE = "anon8231489123/ShareGPT_Vicuna_unfiltered", "ShareGPT_V3_unfiltered_cleaned_split.json"


def _sharegpt_fetch(path: str) -> str:
    """The hf download of the ShareGPT file vLLM's benchmarks read into the folder of --dataset sharegpt:PATH, and
    the PATH to pass then where PATH names another file (README's ./sharegpt.json): it keeps its own name."""
    import shlex
    folder = Path(path).expanduser().parent
    then = "" if Path(path).name == SHAREGPT_FILE else \
        f", then pass --dataset sharegpt:{shlex.quote(str(folder / SHAREGPT_FILE))}"
    return (f"; the ShareGPT file vLLM's benchmarks use is fetched with `hf download {SHAREGPT_REPO} {SHAREGPT_FILE} "
            f"--repo-type dataset --local-dir {shlex.quote(str(folder))}`{then}")


def check_dataset(spec: str) -> None:
    """Fail before loading anything on an unknown dataset kind or a missing dataset file."""
    from ..bench.datasets import WORKLOADS
    kind, sep, path = spec.partition(":")
    if not ((spec in ("random", "liteqwen")) or (sep and kind in ("jsonl", "sharegpt"))):
        raise ConfigError(f"--dataset {spec!r} is not a known dataset", f"use one of {', '.join(WORKLOADS)}")
    if sep and not path:
        raise ConfigError(f"--dataset {spec} names no file", f"pass {kind}:PATH")
    if sep and not Path(path).expanduser().is_file():
        near = None if Path(path).expanduser().exists() else missing_file_hint(path)  # a typo: the closest file
        fetch = _sharegpt_fetch(path) if kind == "sharegpt" and not Path(path).expanduser().exists() else ""
        raise ConfigError(f"--dataset {spec}: {path} is not a file",
                          (f"{near} (pass an existing file: {kind}:PATH)" if near
                           else f"pass an existing file: {kind}:PATH") + fetch)
    if sep:  # a file that is not UTF-8 is refused now, not after the model has loaded
        read_utf8(Path(path).expanduser(), f"--dataset {kind}: file")


def lora_names(items: list[str] | None, url: str | None) -> list[str]:
    """Adapter names from --lora: NAME=PATH in-process (checked by the engine config); NAME or NAME=PATH with
    --url (the server has the adapters; only the names are used, as the request's model)."""
    if url is None:
        return list(parse_loras(items))
    names = [item.partition("=")[0] for item in items or []]
    if any(not n for n in names):
        raise ConfigError("--lora needs a NAME", "with --url: --lora NAME (an adapter the server serves)")
    return names


def mix(names: list[str], k: int | None) -> list[str]:
    """The first K registered adapters (all of them if K is None, none if no adapter is registered)."""
    if k is None:
        return names
    if k < 1:
        raise ConfigError(f"--lora-mix must be at least 1, got {k}")
    if k > len(names):
        raise ConfigError(f"--lora-mix {k} needs {k} adapters but {len(names)} are registered",
                          "pass more --lora NAME=PATH, or lower --lora-mix")
    return names[:k]


def check_url(url: str, model_id: str, adapters: list[str], api_key: str | None, pooling: bool = False) -> str:
    """The server's base URL, after checking it answers /v1/models and serves `model_id` and `adapters`, and that it
    runs its model as the bench will drive it (`pooling`: embeddings, else generation)."""
    import httpx

    from ..bench.http_driver import base_url
    base = base_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base}/v1/models", headers=headers, timeout=10.0, trust_env=False)
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach {base}: {e or type(e).__name__}",
                          "start the server first (infer serve MODEL) or fix --url") from None
    if resp.status_code in (401, 403):
        if not api_key:
            raise ConfigError(f"{base} requires an API key (HTTP {resp.status_code})", "pass --api-key KEY")
        raise ConfigError(f"{base} refused the --api-key given (HTTP {resp.status_code})",
                          "pass a key the server was started with (its --api-key, INFER_API_KEY or VLLM_API_KEY)")
    try:
        cards = resp.json()["data"] if resp.status_code == 200 else None
        served = {m["id"] for m in cards} if cards is not None else None
        bases = sorted(m["id"] for m in cards if isinstance(m, dict) and not m.get("parent")) if cards else []
    except (ValueError, KeyError, TypeError):
        served, bases = None, []
    missing = [m for m in [model_id, *adapters] if served is not None and m not in served]
    if missing:
        # what to type: the id the server lists for its base (a card without a parent, as vLLM's), the adapters'
        fix = [f"pass --served-model-name {bases[0]} (the server's id for its base)" if bases else
               "pass --served-model-name with the server's id for its base"] if model_id in missing else []
        if len(missing) > (model_id in missing):
            fix.append("give --lora only for adapters the server serves (start it with infer serve --lora NAME=PATH)")
        raise ConfigError(f"{base} does not serve {', '.join(map(repr, missing))}; it serves "
                          f"{', '.join(sorted(served)) or 'nothing'}", "; ".join(fix))
    (check_embeds if pooling else check_generates)(base, model_id, headers)
    return base


def _probe_error(base: str, route: str, body: dict, headers: dict) -> dict:
    """The error object a server answers a probe with ({} when it answers, or cannot be read or reached)."""
    import httpx
    try:
        resp = httpx.post(f"{base}{route}", json=body, headers=headers, timeout=10.0, trust_env=False)
        error = resp.json().get("error") or {}
    except (httpx.HTTPError, ValueError, AttributeError):
        return {}  # (the run says what fails)
    return error if isinstance(error, dict) else {}


CLASSIFIER_BENCH = ("{model} is a classifier (a *ForSequenceClassification or *ForTokenClassification model, run on "
                    "the pooling runner): "
                    "infer bench's pooling runner benches embeddings (POST /v1/embeddings), which a classifier does "
                    "not make")
CLASSIFIER_HINT = ("bench an embedding model; a classifier's classes and scores (LLM.classify, POST /classify, "
                   "/score, /rerank) are not benched by infer bench")


def check_embeds(base: str, model_id: str, headers: dict) -> None:
    """--runner pooling with --url: refuse a server that runs its model for text generation or as a classifier
    (every embeddings request would fail after the whole run), asked with one short input to embed."""
    from ..engine.classify import NOT_EMBEDDER, TOKEN_CLASSIFIER_ONLY
    error = _probe_error(base, "/v1/embeddings", {"model": model_id, "input": "Hi"}, headers)
    if any(why in str(error.get("message")) for why in (NOT_EMBEDDER, TOKEN_CLASSIFIER_ONLY)):
        raise ConfigError(CLASSIFIER_BENCH.format(model=f"{model_id!r} at {base}"), CLASSIFIER_HINT)
    if error.get("code") == "model_not_supported" or "does not support Embeddings API" in str(error.get("message")):
        raise ConfigError(f"{base} serves {model_id!r} for text generation, and --runner pooling benches embeddings "
                          "(POST /v1/embeddings): every request would fail",
                          "drop --runner pooling to bench its generation, or bench a server started with --runner "
                          "pooling")


def check_generates(base: str, model_id: str, headers: dict) -> None:
    """Refuse a server that runs its model as a pooling model (embeddings): every request would fail after the
    whole run. Asked with a valid body of one token to generate (vLLM checks the body before it finds that its
    model generates nothing: a body without a prompt got a 400 for the prompt from a pooling vLLM too); a
    generation server answers it (or refuses it some other way: never taken as a pooling one), a pooling one
    (infer's --runner pooling, vLLM's) that the model does not do completions."""
    probe = {"model": model_id, "prompt": "Hi", "max_tokens": 1, "stream": False}
    error = _probe_error(base, "/v1/completions", probe, headers)
    if error.get("code") == "model_not_supported" or "does not support Completions API" in str(error.get("message")):
        raise ConfigError(f"{base} serves {model_id!r} as a pooling model (embeddings): infer bench measures text "
                          "generation (TTFT, TPOT, ITL) and every request would fail",
                          "bench its embeddings with --runner pooling (POST /v1/embeddings), or bench a server "
                          "started without --runner pooling")


def check_options(num_prompts: int | None, dataset: str, baseline: str | None, lora_policy: str, url: str | None,
                  rate: float) -> None:
    if num_prompts is not None and num_prompts < 1:
        raise ConfigError(f"--num-prompts must be at least 1, got {num_prompts}", "e.g. --num-prompts 64")
    check_dataset(dataset)
    if baseline is not None and baseline not in BASELINES:
        raise ConfigError(f"--baseline {baseline!r} is not supported", f"use one of: {', '.join(BASELINES)}")
    if lora_policy not in POLICIES:
        raise ConfigError(f"--lora-policy {lora_policy!r} is not one of {', '.join(POLICIES)}",
                          "mixed (the engine) or split (the baseline)")
    if url is not None and lora_policy != "mixed":
        raise ConfigError("--lora-policy split runs the in-process engine", "drop --url, or use --lora-policy mixed")
    if lora_policy == "split" and not math.isinf(rate):
        raise ConfigError("--lora-policy split sends every group at once; it takes no --request-rate")
    if baseline == "no-spec" and url is not None:
        raise ConfigError("--baseline no-spec runs the in-process engine a second time, without speculation; --url "
                          "benches a server", "drop --url (bench MODEL in-process with --speculative-config), or "
                          "bench two servers, one started without --speculative-config")
    if baseline == "hf" and not math.isinf(rate):  # ours would be paced by the arrivals, the baseline not
        raise ConfigError(f"--baseline {baseline} sends each static batch at once; it takes no --request-rate",
                          "drop --request-rate to compare throughput with the baseline, or drop --baseline")


def check_baseline_model(baseline: str | None, baseline_model: str | None, model: str) -> None:
    """--baseline-model is transformers' model for --baseline hf, run on MODEL's requests (token ids): it must be a
    model transformers loads whose tokenizer is MODEL's, refused now rather than after ours has run."""
    if baseline_model is None:
        return
    if baseline != "hf":
        raise ConfigError("--baseline-model names the model the transformers baseline runs, and --baseline hf is not "
                          "given", "add --baseline hf, or drop --baseline-model")
    from transformers import AutoTokenizer

    from ..models.resolve import resolve_model
    vocabs = []
    for flag, name in (("MODEL", model), ("--baseline-model", baseline_model)):
        try:
            vocabs.append(AutoTokenizer.from_pretrained(resolve_model(name), local_files_only=True).get_vocab())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{flag} {name}: cannot read its tokenizer ({e})",
                              "pass a model folder with its tokenizer files (or a built-in name)") from e
    if vocabs[0] != vocabs[1]:
        raise ConfigError(f"--baseline-model {baseline_model} has another tokenizer than {model} "
                          f"({len(vocabs[1]):,} tokens against {len(vocabs[0]):,}, or other ids): the baseline runs "
                          "the same token ids", "pass the model MODEL was made from (its float checkpoint)")


def check_no_spec(baseline: str | None, engine: EngineConfig) -> None:
    """--baseline no-spec measures what --speculative-config buys: without it both sides would be the same engine."""
    if baseline == "no-spec" and engine.speculative_config is None:
        raise ConfigError("--baseline no-spec compares against the same engine without --speculative-config, which "
                          "is not given", "add --speculative-config '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 3}', or use --baseline hf")


def check_runner(engine: EngineConfig, output_len: int | None, slos: dict | None, lora_policy: str,
                 dataset: str = "random") -> None:
    """--runner pooling benches embeddings (each request a prompt in, its vector out): what only a generation has
    (an output length, a TTFT or TPOT objective, the split policy's generation driver) is refused, not ignored."""
    if not engine.pooling():
        return
    from ..engine.pooling import classifier_folder
    if classifier_folder(engine.model):  # (its outputs are classes: no embeddings to time, no baseline to pool)
        raise ConfigError(CLASSIFIER_BENCH.format(model=engine.model), CLASSIFIER_HINT)
    if output_len is not None:
        raise ConfigError("--output-len: --runner pooling benches embeddings, which generate no token",
                          "drop --output-len (--input-len sets the prompts' length)")
    timed = sorted(set(slos or ()) - {"e2el"})
    if timed:
        raise ConfigError(f"--goodput {timed[0]}: an embedding has no token times, only its end-to-end latency",
                          "give --goodput e2el:MS with --runner pooling")
    if lora_policy != "mixed":
        raise ConfigError("--lora-policy split benches generation; --runner pooling runs the adapters mixed",
                          "drop --lora-policy")
    if dataset == "liteqwen":  # (its figure of merit is reply characters per second)
        raise ConfigError("--dataset liteqwen measures replies (characters per second); --runner pooling generates "
                          "none", "use --dataset random (--input-len sets the prompts' length), jsonl:PATH or "
                          "sharegpt:PATH")


def check_range_ratio(ratio: float, dataset: str) -> None:
    """--random-range-ratio: in [0, 1), and only for the random dataset (the others carry their own lengths)."""
    if math.isnan(ratio) or not 0 <= ratio < 1:
        raise ConfigError(f"--random-range-ratio must be in [0, 1), got {ratio}",
                          "e.g. --random-range-ratio 0.5 draws lengths from half to one and a half times "
                          "--input-len and --output-len")
    if ratio and dataset != "random":
        raise ConfigError(f"--random-range-ratio applies to --dataset random, not {dataset}",
                          "drop --random-range-ratio; the dataset's requests carry their own lengths")


def check_lengths(dataset: str, input_len: int | None, output_len: int | None) -> None:
    """--input-len is the random dataset's, --output-len the random one's and jsonl's default: given with a dataset
    whose requests carry their own lengths, they were silently ignored (and the report's config still showed them)."""
    kind = dataset.partition(":")[0]
    if input_len is not None and kind != "random":
        raise ConfigError(f"--input-len applies to --dataset random, not {kind}",
                          "drop --input-len; the dataset's prompts carry their own lengths")
    if output_len is not None and kind in ("liteqwen", "sharegpt"):
        mine = "each conversation's gpt reply" if kind == "sharegpt" else "liteqwen's ~230-character reply"
        raise ConfigError(f"--output-len applies to --dataset random and jsonl, not {kind}",
                          f"drop --output-len; each request's output length is that of {mine}")


# what an engine option still sets with --url (bench's own --seed seeds the workload: prompts, arrivals)
# (--runner pooling: bench the server's embeddings; --pooler-config: how it pools, which the HF baseline pools alike)
URL_ENGINE_OPTIONS = ("dtype", "device", "chat_template", "seed", "runner", "pooler_config")


def check_url_engine_options(url: str | None) -> None:
    """With --url no engine runs here: an engine option given (--max-model-len, --block-size, --max-num-seqs ...)
    was silently ignored, the server's own settings measured instead. Refused, but --dtype and --device (the HF
    baseline's), --chat-template (renders the dataset's messages) and --seed (the workload's prompts and arrivals)."""
    ctx = o.get_current_context(silent=True)
    if url is None or ctx is None:
        return
    fields = {f.name for f in cli_fields()} | {"max_num_seqs", "max_loras"}
    given = [p.opts[0] for p in ctx.command.params
             if (p.name in fields or p.name.removesuffix("_as_vllm") in fields) and p.opts
             and p.name.removesuffix("_as_vllm") not in URL_ENGINE_OPTIONS
             and ctx.get_parameter_source(p.name) not in (None, o.click_core.ParameterSource.DEFAULT,
                                                          o.click_core.ParameterSource.DEFAULT_MAP)]
    if given:
        raise ConfigError(f"{', '.join(given)} set the in-process engine, which --url does not run: the server's own "
                          "settings are measured", "drop them here and start the server with them (infer serve MODEL "
                          f"{given[0]} ...), or drop --url")


def check_sizes(levels: list[int], **sizes: int | None) -> None:
    """Token counts and engine sizes a benchmark cannot run with; --max-num-seqs may not be below a level."""
    for name, value in sizes.items():
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be at least 1, got {value}", f"e.g. {flag} 16")
    if sizes.get("max_num_seqs") is not None and sizes["max_num_seqs"] < max(levels):
        raise ConfigError(f"--max-num-seqs {sizes['max_num_seqs']} is below the largest concurrency {max(levels)}",
                          f"raise it to {max(levels)} or more, or leave it out (it defaults to the largest level)")


def require_report_libraries() -> None:
    """The report needs pandas and matplotlib (the bench extra): missing, they failed the run after every level was
    measured, with a traceback and no report."""
    import importlib.util
    for package in ("pandas", "matplotlib"):
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"infer bench writes its report with {package}, which is not installed",
                              "pip install 'infer[bench]' (the bench extra)")


def check_out(out: Path | None) -> None:
    """The report folder must be creatable and writable: found now, not after the whole benchmark has run."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder", "give a folder for the report, e.g. --out ./bench")
    existing = out
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a link to nothing: no folder can be made under it
            raise ConfigError(f"--out {out}: {existing} is a link to {os.readlink(existing)}, which does not exist",
                              "create the link's target, remove the link, or give another --out folder")
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file, not a folder", "give a path inside a folder")
    try:  # try for real (the file is removed): os.access says yes to root even on /sys, and its no said "Permission
        tempfile.TemporaryFile(dir=existing).close()  # denied" for a read-only mount, where chmod cannot help
    except OSError as e:
        raise ConfigError(f"--out {out} is not writable ({existing}: {e.strerror or e})",
                          "choose another folder or fix its permissions") from None
    from ..bench.report import REPORT_FILES
    for name in REPORT_FILES:  # a report file of an earlier run is overwritten; one that cannot be is said now
        path = out / name
        if path.exists() and (not path.is_file() or not os.access(path, os.W_OK)):
            why = "a folder" if path.is_dir() else "not a regular file" if not path.is_file() else "not writable"
            raise ConfigError(f"--out {out}: the report file {path} cannot be written ({why})",
                              "remove it, or choose another --out folder")


def default_out(root: Path = Path("bench-results")) -> Path:
    """The default --out, ROOT/<timestamp>, chosen before anything runs (so check_out sees it) and made at once, so
    that it is this run's: one that exists (a run started in the same second, by a script that starts several at
    once, whose folder is otherwise only made when its report is written) gets a suffix, <timestamp>-2 and so on,
    rather than one report over the other. One that cannot be made is returned for check_out to say why."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    k = 1
    while True:
        out = root / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            out.mkdir(parents=True)
        except FileExistsError:
            if not os.path.lexists(out):  # a folder above is in the way (a dangling link): check_out says why
                return out
            k += 1
            continue
        except OSError:
            pass
        return out


@contextlib.contextmanager
def removed_if_empty(folders: list[Path]):
    """The folders made for the default report before the run (innermost first), removed again (those still empty)
    when the run ends early."""
    try:
        yield
    except BaseException:
        for folder in folders:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only an empty one: a report written (an interrupted run's) stays
        raise


def report_failures(results: list[dict] | None) -> bool:
    """One line per level where requests failed, with why; True if any did."""
    failed = False
    for r in results or []:
        if r.get("failed"):
            failed = True
            why = "; ".join(r.get("errors") or []) or "no reason recorded"
            typer.echo(f"error: {r['failed']} of {r['num_requests']} requests failed at concurrency "
                       f"{r['concurrency']}: {why}", err=True)
    return failed


# ------------------------------------------------------------------------------------------------ the command
@o.engine_options(exclude=("max_num_seqs", "seed", "loras", "max_loras"))
def bench(
    model: o.Model,
    concurrency: Annotated[str, typer.Option("--concurrency", "-c", help="Requests in flight: one level, or a "
                                             "comma-separated list (one run per level).", rich_help_panel=WL)] = "16",
    num_prompts: Annotated[Optional[int], typer.Option(help="Requests per run (default: the dataset's; random: "
                                                       "100, liteqwen: 80).", rich_help_panel=WL)] = None,
    dataset: Annotated[str, typer.Option(help="random | liteqwen | jsonl:PATH | sharegpt:PATH.",
                                         rich_help_panel=WL)] = "random",
    input_len: Annotated[Optional[int], typer.Option(help="Prompt tokens (random) [default: 44].",
                                                     rich_help_panel=WL, show_default=False)] = None,
    output_len: Annotated[Optional[int], typer.Option(help="Output tokens (random; default for jsonl lines) "
                                                      "[default: 128].", rich_help_panel=WL,
                                                      show_default=False)] = None,
    random_range_ratio: Annotated[float, typer.Option(help="Random: draw each request's prompt and output "
                                                      "lengths uniformly from [len x (1 - R), len x (1 + R)], "
                                                      "0 <= R < 1 (vLLM's option).", rich_help_panel=WL)] = 0.0,
    request_rate: Annotated[str, typer.Option(help="Poisson arrivals per second, or inf (all at once).",
                                              rich_help_panel=WL)] = "inf",
    goodput: Annotated[Optional[list[str]], typer.Option("--goodput", help="vLLM's service level objectives, "
                                                         "KEY:MS with KEY ttft, tpot or e2el (repeat it, or give "
                                                         "several in one quoted value): adds request_goodput, the "
                                                         "completed requests per second that meet them all.",
                                                         rich_help_panel=WL, show_default=False,
                                                         metavar="KEY:MS")] = None,
    lora_mix: Annotated[Optional[int], typer.Option(help="Spread the first K --lora adapters over the requests "
                                                    "round-robin (default: all of them); jsonl lines that "
                                                    "name a \"lora\" keep it.", rich_help_panel=WL)] = None,
    lora_policy: Annotated[str, typer.Option(help="mixed: adapters share batches (the engine); split: one adapter "
                                             "at a time, as servers that split batches do (a baseline).",
                                             rich_help_panel=WL)] = "mixed",
    url: Annotated[Optional[str], typer.Option(help="Drive this OpenAI-compatible server (streaming "
                                               "/v1/completions) instead of an in-process engine.",
                                               rich_help_panel=TARGET)] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="With --url: the base model's id on the server "
                                                             "(default: MODEL's name).", rich_help_panel=TARGET)]
    = None,
    api_key: Annotated[Optional[str], typer.Option(help="With --url: sent as 'Authorization: Bearer KEY'.",
                                                   envvar="INFER_API_KEY", rich_help_panel=TARGET,
                                                   show_default=False)] = None,
    baseline: Annotated[Optional[str], typer.Option(help="hf: also run HF transformers generate on MODEL, static "
                                                    "batches of size = concurrency, and report ours/baseline (works "
                                                    "with --url too: MODEL must then be a local folder). no-spec: "
                                                    "with --speculative-config, also run the same engine and options "
                                                    "without it, after ours (ours freed first), and report "
                                                    "ours/baseline with the acceptance rate.",
                                                    rich_help_panel=TARGET)] = None,
    baseline_model: Annotated[Optional[str], typer.Option(help="With --baseline hf: the model transformers runs "
                                                          "instead of MODEL, e.g. the float checkpoint a GPTQ MODEL "
                                                          "was quantized from (transformers does not read a GPTQ "
                                                          "mixture of experts); its tokenizer must be MODEL's.",
                                                          rich_help_panel=TARGET, show_default=False,
                                                          metavar="<path>")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Report folder (default: "
                                                "./bench-results/<timestamp>).", parser=o.folder_path,
                                                metavar="<path>")] = None,
    save_detailed: Annotated[bool, typer.Option("--save-detailed", help="results.json also holds each request's "
                                                "input_lens, output_lens, ttfts, itls (s), generated_texts and "
                                                "request_errors, as vLLM's option.", rich_help_panel=WL)] = False,
    seed: Annotated[int, typer.Option(help="Seed of the workload (prompts, arrivals) and of the engine.")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or tables.")] = False,
    max_num_seqs: Annotated[Optional[int], typer.Option(help="Most sequences in one step (default and minimum: "
                                                        "the largest concurrency).", rich_help_panel=ENGINE)] = None,
    lora: Annotated[Optional[list[str]], typer.Option("--lora", help="An adapter as NAME=PATH (PEFT folder); "
                                                      "with --url just NAME. Repeat for more.", rich_help_panel=LORA,
                                                      show_default=False, metavar="NAME=PATH")] = None,
    max_loras: Annotated[Optional[int], typer.Option(help="Adapters resident at once (default: max(4, adapters "
                                                     "in the mix)).", rich_help_panel=LORA)] = None,
    engine: EngineConfig = None,
) -> None:
    """Benchmark MODEL: vLLM's metrics (throughput, TTFT, TPOT, ITL, E2EL) per concurrency level, written to
    results.json / results.csv / report.md / plots in --out and shown as a table. Ctrl-C stops and still writes
    what was measured, marked partial.

    Example: infer bench llama-100m -c 1,4,16 --num-prompts 64 --input-len 44 --output-len 128
    --baseline hf

    Uneven lengths: infer bench llama-100m -c 16 --input-len 256 --output-len 128 --random-range-ratio 0.75

    Against a server: infer bench tiny-llama --url http://127.0.0.1:8000 -c 16

    Does speculation pay: infer bench tiny-llama --speculative-config '{"method": "ngram",
    "num_speculative_tokens": 3}' --baseline no-spec -c 4

    int4 against the float model it came from: infer bench ./qwen3-moe-gptq -c 8 --baseline hf --baseline-model
    ./qwen3-moe

    Embeddings (embeddings/s, input tokens/s, E2EL, memory; the baseline transformers' AutoModel pooled alike):
    infer bench tiny-llama --runner pooling -c 1,8 --input-len 128 --baseline hf
    """
    levels, rate, slos = parse_concurrency(concurrency), parse_rate(request_rate), parse_goodput(goodput)
    check_options(num_prompts, dataset, baseline, lora_policy, url, rate)
    if lora_policy == "split" and not lora:  # one group, the base model's: the same run as mixed, labelled split
        raise ConfigError("--lora-policy split runs each adapter's requests apart, and no --lora is given",
                          "pass --lora NAME=PATH for each adapter (and --lora-mix K to spread them), or drop "
                          "--lora-policy")
    if served_model_name is not None and url is None:  # the in-process engine has no ids to choose from
        raise ConfigError("--served-model-name is the base model's id on a server, used with --url only",
                          "add --url http://HOST:PORT, or drop --served-model-name")
    check_range_ratio(random_range_ratio, dataset)
    check_lengths(dataset, input_len, output_len)
    check_url_engine_options(url)
    check_no_spec(baseline, engine)
    check_baseline_model(baseline, baseline_model, model)
    check_runner(engine, output_len, slos, lora_policy, dataset)
    input_len, output_len = DEFAULT_INPUT_LEN if input_len is None else input_len, \
        (1 if engine.pooling() else DEFAULT_OUTPUT_LEN) if output_len is None else output_len  # (pooling: unused)
    made = []  # the default folder (and bench-results) made now: removed if the run ends before writing to it
    if out is None:
        fresh = not os.path.lexists("bench-results")
        out = default_out()
        made = [out, Path("bench-results")] if fresh else [out]
    out = out.expanduser()  # one folder for every file (pandas expands ~)
    with removed_if_empty(made):
        check_out(out)
        require_report_libraries()
        check_sizes(levels, input_len=input_len, output_len=output_len, max_num_seqs=max_num_seqs, max_loras=max_loras)
        names = mix(lora_names(lora, url), lora_mix)
        model_id = served_model_name or o.base_model_id(model)
        from ..bench.plan import BenchPlan
        plan = BenchPlan(model=model, levels=levels, rate=rate, num_prompts=num_prompts, dataset=dataset,
                         input_len=input_len, output_len=output_len, range_ratio=random_range_ratio, loras=names,
                         lora_policy=lora_policy,
                         url=None if url is None else check_url(url, model_id, names, api_key, engine.pooling()),
                         model_id=model_id, api_key=api_key, baseline=baseline, baseline_model=baseline_model,
                         seed=seed, quiet=quiet, goodput=slos,
                         save_detailed=save_detailed, pooling=engine.pooling(), out=out)
        set_target(plan, engine, lora, max_num_seqs, max_loras)
        run_and_report(plan)


def set_target(plan, engine: EngineConfig, lora: list[str] | None, max_num_seqs: int | None,
               max_loras: int | None) -> None:
    """In-process: the engine config, from the command's engine options and its own defaults for the benchmark
    (max_num_seqs at least the largest level, room for every adapter in the mix). With --url: only the dtype and
    device a baseline loads MODEL with, and the --chat-template the workload's messages are rendered with."""
    if plan.url is None:
        most = RANGES["max_num_seqs"][1]  # the engine's --max-num-seqs, which the largest level sets
        if max(plan.levels) > most:
            raise ConfigError(f"--concurrency {max(plan.levels)} is more than the engine runs at once ({most})",
                              f"give levels up to {most}, or bench a server with --url")
        seqs = max(max_num_seqs or 1, max(plan.levels))
        if engine.max_num_batched_tokens < seqs:  # named as given: the largest level sets the sequences by default
            raise ConfigError(*batched_tokens_below_seqs(engine.max_num_batched_tokens, seqs, "--max-num-seqs" if
                                                         max_num_seqs else "the largest --concurrency"))
        slots = max(4, len(plan.loras))  # by default no more slots than --max-cpu-loras, which must hold them all
        slots = min(slots, engine.max_cpu_loras) if engine.max_cpu_loras else slots
        plan.engine = replace(engine, seed=plan.seed, loras=lora or [], max_num_seqs=seqs, max_loras=max_loras or slots)
    else:
        plan.dtype, plan.device, plan.chat_template = engine.dtype, engine.device, engine.chat_template
        plan.pooler_config = engine.pooler_config


def run_and_report(plan) -> None:
    """Run the plan and say where the report is; exit 130 when Ctrl-C cut it short, 143 when SIGTERM did (a
    timeout, a job scheduler): either way what was measured is written first."""
    from ..bench.plan import run_plan
    from .entry import Terminated, terminate_as_interrupt, terminated
    from .quiet import library_output_to_bar
    try:
        with terminate_as_interrupt():
            results, interrupted = run_plan(plan, hide_libraries=library_output_to_bar)
    except KeyboardInterrupt:  # before anything was measured
        if terminated():
            raise Terminated from None
        raise
    typer.echo(f"infer bench: report written to {plan.out}", err=True)
    if interrupted:
        word = "terminated" if terminated() else "interrupted"
        typer.echo(f"{word}: the report in {plan.out} holds what was measured (marked partial)", err=True)
        raise typer.Exit(143 if terminated() else 130)
    if report_failures(results):
        raise typer.Exit(1)
