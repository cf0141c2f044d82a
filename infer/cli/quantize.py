"""`infer quantize`: GPTQ-quantize a float model with GPTQModel, with per-layer progress and an error report."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..quant.calibration import CalibrationSet
from ..quant.quantize import (REPORT_NAME, QuantizeObserver, QuantizeOptions, QuantizeResult, captured_output,
                              module_name)
from . import options as o
from .entry import terminate_as_interrupt

GPTQ = "GPTQ settings"
CALIB = "Calibration"


class RichObserver(QuantizeObserver):
    """Draws one progress bar over the decoder layers, naming the modules being solved."""

    def __init__(self, console: Console, lm_head: bool = False):
        self.console = console
        self.lm_head = lm_head  # GPTQModel solves the head as one more layer, numbered after the decoder's
        self.num_layers = 0
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[detail]}"), console=console)
        self.task = None

    def start(self, num_layers: int, calibration: CalibrationSet) -> None:
        source = ("the built-in calibration text (pass --calibration FILE for text like your workload)"
                  if calibration.source == "built-in" else calibration.source)
        n = len(calibration.samples)
        self.console.print(f"Calibrating on {n} sample{'s' if n != 1 else ''}, {calibration.num_tokens} tokens, "
                           f"from {source}")
        self.progress.start()
        self.num_layers = num_layers
        total = num_layers + 1 if num_layers and self.lm_head else num_layers
        what = "Quantizing layers and lm_head" if total != num_layers else "Quantizing layers"  # (the head: no layer)
        self.task = self.progress.add_task(what, total=total or None, detail="loading model")

    def subset(self, layer: int, modules: list[str], stage: str) -> None:
        if self.task is not None:
            verb = "solving" if stage.startswith("quant") else "capturing inputs of"
            self.progress.update(self.task, detail=f"{self._name(layer)}: {verb} {', '.join(modules)}")

    def layer_done(self, layer: int) -> None:
        if self.task is not None:
            self.progress.advance(self.task)
            self.console.log(f"{self._name(layer)} quantized")
            task = self.progress.tasks[0]
            if task.total is not None and task.completed >= task.total:  # GPTQModel saves the checkpoint next
                self.progress.update(self.task, detail="saving")

    def _name(self, layer: int) -> str:
        return "lm_head" if self.lm_head and self.num_layers and layer >= self.num_layers else f"layer {layer}"

    def stop(self, outcome: str = "done") -> None:
        """End the bar with how the run ended: "done", "interrupted" or "failed" (not "saving" after an error)."""
        if self.task is not None:
            self.progress.update(self.task, detail=outcome)
        if self.progress.live.is_started:  # rich prints an empty line for a bar never started (an error before it)
            self.progress.stop()


def report_table(result: QuantizeResult) -> Table:
    table = Table(title=f"Quantization error per module ({REPORT_NAME})")
    for col in ("layer", "module", "loss", "samples", "seconds"):
        table.add_column(col, justify="left" if col == "module" else "right")
    for row in result.report.itertuples(index=False):
        table.add_row(str(row.layer), row.module, f"{row.loss:.3e}", str(row.samples), f"{row.seconds:.3f}")
    return table


def quantize(
    model: Annotated[str, typer.Argument(help=f"A float Hugging Face model folder, or {o.BUILTIN_HELP}.",
                                         show_default=False)],
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder to write the GPTQ checkpoint into.",
                                         show_default=False, parser=o.folder_path, metavar="<path>")],
    bits: Annotated[int, typer.Option(help="Bits per weight: 4 or 8.", rich_help_panel=GPTQ)] = 4,
    group_size: Annotated[int, typer.Option(help="Weights sharing one scale and zero point along the input "
                                                 "dimension: 32, 64, 128, or -1 for one group per row.",
                                            rich_help_panel=GPTQ)] = 128,
    desc_act: Annotated[bool, typer.Option("--desc-act/--no-desc-act", help="Quantize columns in order of "
                                           "decreasing activation (act-order): better accuracy, a g_idx "
                                           "permutation at run time. A Phi-3 then keeps gate_proj and up_proj "
                                           "apart, which transformers and vLLM cannot load (infer can).",
                                           rich_help_panel=GPTQ)] = False,
    sym: Annotated[bool, typer.Option("--sym/--no-sym", help="Symmetric quantization (zero point in the "
                                      "middle); --no-sym fits a zero point per group.", rich_help_panel=GPTQ)] = True,
    damp: Annotated[float, typer.Option(help="Hessian dampening, as a fraction of its mean diagonal.",
                                        rich_help_panel=GPTQ)] = 0.05,
    lm_head: Annotated[bool, typer.Option("--lm-head/--no-lm-head", help="Quantize the output head too (GPTQModel's "
                                          "lm_head=True, which writes it at 8 bits); not for a head tied to the "
                                          "embeddings.", rich_help_panel=GPTQ)] = False,
    calibration: Annotated[Optional[list[Path]], typer.Option(
        help="Calibration text: .txt (one sample per paragraph, or per line) or .jsonl (objects with \"text\", "
             "\"prompt\" or \"messages\"). Default: a small built-in English/code text set.",
        rich_help_panel=CALIB, show_default=False)] = None,
    num_samples: Annotated[int, typer.Option(help="Most calibration windows.", rich_help_panel=CALIB)] = 128,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration window.", rich_help_panel=CALIB)] = 512,
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors file; bigger models are sharded. "
                                                     "KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024, a "
                                                     "plain number is bytes.")] = "4GB",
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it already holds a model.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show GPTQModel's own console output.")] = False,
) -> None:
    """Quantize a float model to GPTQ int4/int8 with GPTQModel and write a standard GPTQ checkpoint.

    The checkpoint (qweight/qzeros/scales/g_idx, format "gptq", quantize_config.json) loads unchanged in
    transformers (with optimum + gptqmodel), vLLM and `infer run`. A Phi-3's MLP is written as one gate_up_proj,
    as transformers and vLLM have it (GPTQModel.load itself reads only its split gate_proj/up_proj), except with
    --desc-act: gate and up then have different g_idx, so GPTQModel's split layout stays, which infer and GPTQModel
    read but transformers and vLLM do not. A mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE) gets every expert's
    projections quantized, its router left float; an expert that calibration routes too few tokens to is quantized by
    round-to-nearest (GPTQModel's fallback), which the summary names. OUTPUT also gets quantization_report.csv
    with each module's quantization error and time. Needs the extra: pip install 'infer[quantize]'.

    Example: infer quantize ./Llama-3.2-1B -o ./Llama-3.2-1B-gptq --bits 4 --group-size 128 --calibration chats.jsonl
    """
    from ..models.resolve import resolve_model, source_name
    calibration = o.one_path("--calibration", calibration, lambda given: (
        f"put the texts in one file of one kind (.txt or .jsonl) and give that, e.g. cat {' '.join(map(str, given))} "
        f"> calibration{given[0].suffix}"))
    options = QuantizeOptions(bits=bits, group_size=group_size, desc_act=desc_act, sym=sym, num_samples=num_samples,
                              seq_len=seq_len, damp_percent=damp, max_shard_size=max_shard_size, lm_head=lm_head)
    options.validate()
    src = resolve_model(model)  # a bad MODEL fails before the quantize extra is looked for
    if (src / "config.json").is_file():  # a model infer cannot run is refused before calibration, not after
        from ..models.loader import load_config
        from ..models.registry import check_supported
        cfg = load_config(src)
        check_supported(cfg)
        from ..errors import UnsupportedModelError
        from ..models.classifier import is_classifier
        if is_classifier(cfg):  # (GPTQModel quantizes a causal LM: the score head would be lost)
            raise UnsupportedModelError(
                f"{src} is a classifier ({cfg.architectures[0]}): infer quantize writes causal language models and "
                "would drop its score head", "quantize the base causal LM, then add the float score.weight and "
                "the ForSequenceClassification config.json to the GPTQ folder (infer loads it as a classifier)")
    with terminate_as_interrupt():
        result = run_quantization(src, output, options, calibration, overwrite=overwrite, verbose=verbose,
                                  source=source_name(model))
    print_summary(result, options)


def run_quantization(src: Path, output: Path, options: QuantizeOptions, calibration: Path | None, *,
                     overwrite: bool, verbose: bool, source: str | None = None) -> QuantizeResult:
    """Quantize with a progress bar; GPTQModel's own console output goes to a log unless `verbose`."""
    from ..models.loader import check_weights
    from ..quant.quantize import quantize_model
    with tempfile.TemporaryDirectory(prefix="infer-quantize-log-") as logdir:
        with captured_output(Path(logdir) / "gptqmodel.log", enabled=not verbose) as terminal:
            observer = RichObserver(Console(file=terminal, log_path=False), lm_head=options.lm_head)
            outcome = "failed"
            try:
                result = quantize_model(src, output, options, calibration, observer, overwrite=overwrite,
                                        check_weights=check_weights, source_name=source)
                outcome = "done"
                return result
            except KeyboardInterrupt:  # Ctrl-C, and SIGTERM (cli.entry.Terminated)
                outcome = "interrupted"
                raise
            finally:
                observer.stop(outcome)


def print_summary(result: QuantizeResult, options: QuantizeOptions) -> None:
    """The per-module error table, the worst module, and where the checkpoint went."""
    console = Console()
    console.print(report_table(result))
    worst = result.report.loc[result.report["loss"].idxmax()] if len(result.report) else None
    if worst is not None:
        console.print(f"Largest error: {module_name(worst)} (loss {worst.loss:.3e})")
    console.print(f"Wrote {result.out} ({options.bits}-bit, group size {options.group_size}) in "
                  f"{result.seconds:.1f} s", soft_wrap=True)  # a long path stays on one line (not wrapped at 80)
    for note in [*options.interop_notes(), *result.notes]:
        console.print(f"[yellow]Note:[/yellow] {note}", highlight=False)
