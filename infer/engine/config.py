"""EngineConfig: every engine option, declared once, validated in one place.

Each field is the one declaration of an option: its default here is the only default, and its `metadata` (help
text, help panel, flag spelling) is what `infer.cli.options.engine_options` turns into the command-line options
shared by run / serve / bench / warmup. Fields without `help` metadata are API-only.
"""

from __future__ import annotations

import numbers
import os
import random
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from ..checks import parse_size
from ..errors import ConfigError, read_utf8
from ..lora.targets import parse_target_modules
from ..memory.sizes import gib
from .pooling import RUNNERS, classifier_folder, parse_pooler_config
from .speculative import parse_speculative_config

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype spellings, as torch names them
_SHORT_DTYPES = {"fp16": "float16", "f16": "float16", "bf16": "bfloat16", "fp32": "float32", "f32": "float32"}


def _dtype_advice(dtype) -> str:
    """What a refused --dtype meant: a short name (fp16), or a quantized type (int4), which no --dtype gives."""
    name = str(dtype).lower().replace("torch.", "")
    if name in _SHORT_DTYPES:
        return f" (did you mean {_SHORT_DTYPES[name]}?)"
    if any(q in name for q in ("int", "gptq", "awq", "q4", "q8", "fp8", "nf4")):
        return (": --dtype is the float type of activations and unquantized weights; int4/int8 weights come from a "
                "GPTQ checkpoint (make one with `infer quantize MODEL -o OUT --bits 4`, then serve OUT)")
    return ""
ENGINE, LORA = "Engine options", "LoRA options"


def option(default, help: str, panel: str = ENGINE, flag: str | None = None, cli_type=None, metavar=None,
           vllm: str | None = None, **kw):
    """A dataclass field that is also a command-line option: `flag` overrides the spelling (--field-name),
    `cli_type` the type the command line reads (e.g. str for a size given as '8GB'), `metavar` its placeholder in
    --help, `vllm` vLLM's spelling where it differs (taken too, not shown apart: the help text names it)."""
    meta = {"help": help, "panel": panel, "flag": flag, "cli_type": cli_type, "metavar": metavar, "vllm": vllm}
    if isinstance(default, (dict, list)):
        return field(default_factory=type(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)




def parse_loras(items: dict[str, str] | list[str] | None) -> dict[str, str]:
    """['name=path', ...] (the command line's --lora) or {name: path} -> {name: path}, each path a folder."""
    if isinstance(items, str):  # one adapter given as a plain string (the Python API)
        items = [items]
    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items or []:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                bare = item if not sep else path  # a folder without its name: the hint names it after the folder
                label = Path(bare).expanduser().name if bare else ""
                example = f"--lora {label}={bare}" if bare and label not in ("", ".", "..") and " " not in bare \
                    else "--lora support=./adapters/support"
                raise ConfigError(f"--lora {item!r} is not NAME=PATH",
                                  f"give the adapter a name, e.g. {example}; requests pick it by that name"
                                  if bare else f"give the adapter's folder, e.g. --lora {name or 'support'}="
                                  "./adapters/support")
            pairs.append((name, path))
    out: dict[str, str] = {}
    for name, path in pairs:
        if name in out:
            raise ConfigError(f"--lora name {name!r} is given twice", "give each adapter its own name")
        if not isinstance(name, str) or not isinstance(path, (str, Path)):
            raise ConfigError(f"--lora {name!r}: {path!r} is not a folder path", "map each adapter name (a string) to "
                                                                                  "its PEFT folder")
        if isinstance(path, Path):  # a quoted --lora "a=~/x" reaches infer unexpanded
            path = path.expanduser()
        elif path.startswith("~"):
            path = os.path.expanduser(path)
        if not Path(path).is_dir():
            from ..lora.adapter import file_given_hint, not_found_hint
            hint = file_given_hint(Path(path)) if Path(path).exists() else not_found_hint(Path(path), str(path))
            raise ConfigError(f"--lora {name}: {path} is not a folder", hint)
        out[name] = str(path)
    return out


def command_line_template(value: str | None, name: str = "--chat-template") -> str | None:
    """A --chat-template value as vLLM reads the command line's: the template text itself (not an existing file)
    has its backslash escapes decoded (`\\n` typed in the shell is a newline, as vLLM's codecs "unicode_escape"), so the
    same command line renders the same prompt; other characters stay as typed (vLLM's decoding garbles non-ASCII).
    A file's text, and a template given through the Python API or to a replica, are taken as they are."""
    if not isinstance(value, str) or ("{{" not in value and "{%" not in value) or "\\" not in value:
        return value
    try:
        if Path(value).expanduser().is_file():
            return value
    except (OSError, ValueError):  # template text too long for a path, or with a NUL
        pass
    try:
        return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: the template text has a bad backslash escape ({e.reason})",
                          "escape a literal backslash as \\\\, or give the template as a file") from None


def load_chat_template(value: str | Path | None, name: str = "--chat-template",
                       error: type = ConfigError) -> str | None:
    """vLLM's rule for --chat-template: a path to a file that exists is read; else text that looks like a template
    (it holds `{{` or `{%`) is the template itself; else an error naming the problem (`name`, raised as `error`).
    The template must parse as the Jinja transformers renders. Its text is returned, so a config carries the
    template itself (to Ray replicas on other machines too) and reading it again returns it unchanged."""
    if value is None:
        return None
    if not isinstance(value, (str, Path)):
        raise error(f"{name} must be a file path or the template text, got {type(value).__name__}")
    if not str(value).strip():  # Path('') is the current folder: it was refused as "a folder"
        raise error(f"{name} is empty", "give the path of a Jinja file, or the template text itself (`--chat-template "
                                        "\"$VAR\"` with VAR unset?)")
    path = Path(value).expanduser()
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except (OSError, ValueError):  # template text too long for a path, or with a NUL
        is_file = is_dir = False
    if is_dir:
        raise error(f"{name} {value} is a folder", "give the template's file, e.g. its chat_template.jinja")
    try:
        text = read_utf8(path, f"{name} file") if is_file else str(value)
    except OSError as e:
        raise error(f"cannot read {name} file {value}: {e.strerror or e}") from None
    where = f"{name} file {value}" if is_file else name
    if "{{" not in text and "{%" not in text:
        if not is_file:
            raise error(f"{name} {value!r} is neither an existing file nor a template",
                        "give the path of a Jinja file, or the template text itself (it holds {{ ... }} or "
                        "{% ... %})")
        raise error(f"{where} holds no Jinja ({{{{ ... }}}} or {{% ... %}}), so it would ignore the messages",
                    "give the chat template's file (e.g. a .jinja file)")
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: its apply_chat_template reports the problem per request
        return text
    import jinja2
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as e:
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise error(f"{where} is not a valid Jinja template{line}: {e.message or e}",
                    "fix its syntax; transformers renders it with Jinja2") from None
    except RecursionError:  # expressions nested deeper than Jinja's recursive parser reads
        raise error(f"{where} is not a valid Jinja template: it nests deeper than Jinja can parse",
                    "fix its syntax; transformers renders it with Jinja2") from None
    return text


# Integer options and their ranges (the command line shows and checks them too).
RANGES = {"max_num_seqs": (1, 65536), "max_num_batched_tokens": (1, None), "block_size": (1, 256),
          "max_model_len": (2, None), "num_kv_blocks": (1, None), "max_loras": (1, None), "max_lora_rank": (1, 256),
          "max_cpu_loras": (1, None), "seed": (0, 2 ** 63 - 1),
          "cuda_graph_max_tokens": (0, 8192), "max_logprobs": (-1, None),
          "state_snapshots": (0, None)}
OPTIONAL = {"max_model_len", "num_kv_blocks", "max_cpu_loras", "state_snapshots",  # None: chosen for you
            "overlap", "lora_epilogue", "lora_streams", "pdl", "graph_priority"}
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy values
# vLLM's --kv-cache-dtype values (auto: the model's dtype) and the torch dtype K and V are stored in
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
BOOLS = ("enable_prefix_caching", "enforce_eager", "enable_lora", "overlap", "lora_epilogue", "lora_streams",
         "lora_expand_beside", "lora_expand_fused", "lora_expand_in_norm", "silu_in_gate_up", "pdl", "graph_priority",
         "enable_sleep_mode")


@dataclass
class EngineConfig:
    model: str
    dtype: str = option("auto", "auto | float32 | float16 | bfloat16 (auto: the checkpoint's dtype on GPU, float32 "
                                "on CPU; vLLM's half and float are float16 and float32).")
    device: str = option("auto", "auto | cpu | cuda | cuda:N.")
    max_num_seqs: int = option(64, "Most sequences in one step.")
    max_num_batched_tokens: int = option(4096, "Most tokens (prefill + decode) in one step (8k is 8,000, "
                                                      "8K 8,192, as vLLM reads them).")
    block_size: int = option(16, "Tokens per KV cache block.")
    max_model_len: int | None = option(None, "Context limit (default: the model's; 32k is 32,000, 32K "
                                                  "32,768, as vLLM reads them).")
    seed: int | None = option(0, "Seed for sampling of requests without their own seed.")
    enable_prefix_caching: bool = option(True, "Reuse the KV of shared prompt prefixes (vLLM's "
                                               "--[no-]enable-prefix-caching too).",
                                         flag="--prefix-caching/--no-prefix-caching",
                                         vllm="--enable-prefix-caching/--no-enable-prefix-caching")
    state_snapshots: int | None = option(None, "A hybrid model's (Qwen3.5, Qwen3-Next, Granite 4.0, Nemotron-H) "
                                               "prefix cache of its linear-attention states: how many snapshots of a "
                                               "sequence's states at block-aligned prompt positions are kept (each "
                                               "the size of a sequence's states; least recently used evicted first; "
                                               "default: half of --max-num-seqs; 0: no prefix caching for such a "
                                               "model). Other models ignore it.")
    scheduling_policy: str = option("fcfs", "fcfs | priority: the order waiting requests are admitted in, and which "
                                            "running one is preempted when the KV cache runs out (priority: by "
                                            "each request's priority, lower first, then by arrival; the lowest "
                                            "priority, latest arrived is preempted; as vLLM's).")
    kv_cache_dtype: str = option("auto", "auto | fp8 | fp8_e4m3 | fp8_e5m2: the type K and V are stored in (auto: "
                                         "the model's --dtype; fp8 is fp8_e4m3). fp8 takes 1 byte an element: about "
                                         "twice the KV blocks of a float16 model in the same memory, at some accuracy "
                                         "(values rounded to 3 or 2 mantissa bits, saturated to +-448 or +-57344, "
                                         "scale 1.0 as vLLM's default).")
    speculative_config: dict | None = option(None, "vLLM's speculative decoding as JSON: n-gram (prompt lookup), "
                                                   "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                                                   "3, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}', or a "
                                                   "draft model of the target's vocabulary, e.g. '{\"model\": "
                                                   "\"./small\", \"num_speculative_tokens\": 3}', or an EAGLE-3 "
                                                   "head, e.g. '{\"method\": \"eagle3\", \"model\": \"./head\", "
                                                   "\"num_speculative_tokens\": 3}' (default: off).",
                                             cli_type=str, metavar="JSON")
    runner: str = option("auto", "auto | generate | pooling (vLLM's --runner): pooling serves embeddings (LLM.embed, "
                                 "POST /v1/embeddings, infer run lines with url /v1/embeddings), or a classifier's "
                                 "classes and scores (LLM.classify, LLM.score, POST /classify, /score, /rerank), and "
                                 "no text generation; auto: pooling for a *ForSequenceClassification model, else "
                                 "generate.")
    pooler_config: dict | None = option(None, "--runner pooling: how to pool, as JSON, e.g. '{\"pooling_type\": "
                                              "\"MEAN\", \"normalize\": false}' (LAST, MEAN or CLS; default: the "
                                              "model's sentence-transformers modules.json, else LAST, normalized); "
                                              "a classifier's '{\"use_activation\": false}' gives its raw logits "
                                              "instead of probabilities.",
                                        cli_type=str, metavar="JSON")
    num_kv_blocks: int | None = None  # API only; None: sized from the memory budget
    # API only: prepare and hand out step n's results while step n+1 runs on the device (None: on for CUDA, off on
    # CPU, where one processor does both and nothing can overlap)
    overlap: bool | None = None
    # API only: on the int4 kernel path, whether the LoRA expand is added in the int4 matmul's epilogue (no launch
    # of its own): None where that is cheap (one row, or few slots: kernels.gptq_gemm.fuses_lora), True wherever the
    # kernel can, False never (gpu_e2e --compare-lora-epilogue runs the mixed adapters with True)
    lora_epilogue: bool | None = None
    # API only: in CUDA graphs, launch each layer's LoRA shrink on a second stream beside the base matmul, so that
    # the GPU runs the two at once (None: on; gpu_e2e --compare-lora-streams runs the mixed adapters without)
    lora_streams: bool | None = None
    # API only: with lora_streams, the expand on the second stream too, into a float32 delta that the main stream
    # adds to the matmul's output (an add instead of the expand after the matmul); off until timed on a GPU
    # (gpu_e2e --compare-lora-streams runs it)
    lora_expand_beside: bool = False
    # API only: on the GPU, in steps of up to 64 tokens, the MLP's gate_up LoRA expand added by the silu_and_mul
    # kernel that reads the gate_up output, and in decode steps the qkv expand by decode_attention (LoRALayer.deferred:
    # two launches fewer per layer). Off: on the H100 (2026-11-27) those two kernels took longer with the delta than
    # the expands they replace (7B, 16 mixed adapters: 5.25 vs 5.10 ms a step at 16 concurrent, 11.0 vs 8.4 ms at
    # 64; gpu_e2e --compare-lora-fused runs the mixed adapters so)
    lora_expand_fused: bool = False
    # API only: on the GPU, in steps of up to 64 tokens, the o_proj and down_proj expands each added by the rms_norm
    # after its layer (two launches fewer per layer); False: those two launched after their matmuls (gpu_e2e
    # --compare-lora-fused runs the mixed adapters with every expand so)
    lora_expand_in_norm: bool = True
    # API only: on the int4 kernel path (GPU), the MLP's SiLU-and-multiply (Gemma's GeGLU too: gelu_tanh_and_mul;
    # the name kept from when silu was the only one) applied by the gate_up matmul's epilogue in steps without
    # adapters, in tiles of up to 32 rows (kernels.gptq_gemm.gated_fits): one launch fewer per layer, half the
    # gate_up output written; False: silu_and_mul / gelu_tanh_and_mul launched after the matmul (gpu_e2e
    # --compare-silu runs both)
    silu_in_gate_up: bool = True
    # API only: CUDA, launch the step's Triton kernels with programmatic dependent launch, so that each kernel's
    # programs start (and the int4 matmuls prefetch their first weights into L2) while the kernel before finishes
    # (kernels.pdl; True: on for compute capability 9.0+ when a probe graph replays correctly; None: off, as it
    # measured 7-11% slower per decode step on an H100; gpu_e2e --compare-pdl runs engines with True beside)
    pdl: bool | None = None
    # API only: CUDA, record the CUDA graphs on a high-priority stream, so that where a graph has two branches (a
    # layer's LoRA shrink on the second stream beside its base matmul, `lora_streams`) the GPU gives free SMs to the
    # main branch's programs first and the shrink fills the rest (torch instantiates graphs with each kernel's
    # priority). True: every graph; False: none (the shrink, recorded first, may push a matmul that nearly fills the
    # GPU into a second partial wave); None (auto): with adapters, the graphs of at least
    # memory.graph_buckets.PRIORITY_AUTO_TOKENS tokens (on an H200, 2026-12-04, 7B int4 with 16 mixed adapters, all
    # at high priority: 0.835x the throughput at 16 concurrent, 0.937x at 32, 1.099x at 64; gpu_e2e
    # --compare-priority runs engines with True and False beside)
    graph_priority: bool | None = None
    memory_limit: int | None = option(None, "CPU memory budget for weights, activations and KV cache, e.g. 8GB "
                                            "(default: half the available RAM).", cli_type=str)
    gpu_memory_utilization: float = option(0.90, "Fraction of the GPU's memory the engine may use, in (0, 1].")
    enforce_eager: bool = option(False, "CUDA: no CUDA graphs at all (decode or piecewise: "
                                        "--cuda-graph-max-tokens is then unused); every step runs eagerly "
                                        "(slower; for debugging; vLLM's --enforce-eager too).", flag="--eager",
                                 vllm="--enforce-eager")
    enable_sleep_mode: bool = option(False, "vLLM's sleep mode: LLM.sleep(level=1) moves the weights to host "
                                            "memory and frees the KV cache, level 2 frees both, wake_up() takes "
                                            "them back (infer serve: POST /sleep?level=N, POST /wake_up, GET "
                                            "/is_sleeping).", flag="--enable-sleep-mode")
    cuda_graph_max_tokens: int = option(512, "CUDA: steps that are not all decodes (prefills, prefill chunks beside "
                                             "decodes) of up to this many tokens replay per-layer CUDA graphs around "
                                             "an eager attention; 0: they run eagerly.")
    max_logprobs: int = option(20, "Most logprobs a request may ask for per token (logprobs, prompt_logprobs, "
                                   "top_logprobs), as vLLM's --max-logprobs; -1: the whole vocabulary, and then a "
                                   "request's -1 asks for every token's.")
    chat_template: str | None = option(None, "The chat template for chat messages instead of the tokenizer's: a "
                                             "Jinja file, or the template text itself (for a model without one, "
                                             "or with a wrong one).", flag="--chat-template")
    loras: dict[str, str] = option({}, "An adapter as NAME=PATH (PEFT folder); repeat for more.", panel=LORA,
                                   flag="--lora", cli_type=list[str], metavar="NAME=PATH")
    enable_lora: bool = option(False, "Reserve the adapter slots even with no --lora, so that adapters can be added "
                                      "while the engine runs (LLM.add_lora; infer serve --allow-runtime-lora).",
                               panel=LORA, flag="--enable-lora")
    max_loras: int = option(4, "Adapters resident on the device at once.", panel=LORA)
    max_lora_rank: int = option(64, "Largest adapter rank (slots are padded to it).", panel=LORA)
    max_cpu_loras: int | None = option(None, "Adapters kept in CPU memory (default: all registered).", panel=LORA)
    lora_target_modules: list[str] | None = option(
        None, "Only these modules get adapter slots (vLLM's --lora-target-modules; repeat it or separate names with "
              "commas): q_proj, k_proj, v_proj (infer's fused qkv_proj: all three or none), o_proj, gate_proj, "
              "up_proj (gate_up_proj: both or none), down_proj, experts (a mixture of experts' stacked experts), "
              "shared_expert (Qwen2-MoE's); default: every module. An adapter with weights on another module is "
              "refused.", panel=LORA, cli_type=list[str], metavar="MODULE")

    def __post_init__(self) -> None:
        if self.seed is None:  # vLLM's seed=None: not reproducible; a drawn seed, kept in the config (and records)
            self.seed = random.SystemRandom().randrange(2 ** 63)
        for name in RANGES:  # a numpy integer is an integer (it was refused as "must be an integer, got np.int64(8)")
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                setattr(self, name, int(value))
        util = self.gpu_memory_utilization
        if isinstance(util, numbers.Real) and not isinstance(util, bool):
            self.gpu_memory_utilization = float(util)  # a numpy float32 too
        if isinstance(self.dtype, str):  # one name per dtype from here on (records, --resume's fingerprint)
            self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        limit, self.memory_limit = self.memory_limit, parse_size(self.memory_limit, "--memory-limit")
        # --memory-limit 8 was 8 bytes, refused later as "a budget of 0.0 MiB" without a word of the unit (an int,
        # as dataclasses.replace passes the parsed size again, stays a number of bytes)
        if isinstance(limit, (str, float)) and re.fullmatch(r"\s*[0-9.e]+\s*", str(limit)) \
                and self.memory_limit < 2 ** 20:
            raise ConfigError(f"--memory-limit {str(limit).strip()} is {self.memory_limit} byte(s): a size without "
                              f"a unit counts bytes", f"give the unit, e.g. --memory-limit {str(limit).strip()}GB")
        self.loras = parse_loras(self.loras)
        self.lora_target_modules = parse_target_modules(self.lora_target_modules)
        self.chat_template = load_chat_template(self.chat_template)
        self.speculative_config = parse_speculative_config(self.speculative_config)
        self.pooler_config = parse_pooler_config(self.pooler_config)
        if self.runner in ("auto", "generate") and classifier_folder(self.model):  # (vLLM's: a classifier pools)
            if self.runner == "generate":
                raise ConfigError(f"{self.model} is a classifier (a *ForSequenceClassification or "
                                  "*ForTokenClassification model): it has a "
                                  "score head, no language-model head, and generates no text",
                                  "use --runner pooling (or auto) and classify or score with it")
            self.runner = "pooling"
        for msg in self._problems():  # the CLI adds "see `infer <the command> --help`" to an error without a hint
            raise ConfigError(*msg) if isinstance(msg, tuple) else ConfigError(msg)  # msg: a message or (it, hint)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device} was asked but no CUDA GPU is visible", "use --device cpu")
        if self.device.startswith("cuda:") and int(self.device[5:]) >= torch.cuda.device_count():
            raise ConfigError(f"--device {self.device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                              f"numbered from 0", "use --device cuda:0 (or cuda for the first)")
        self._check_fp8_device()

    def _check_fp8_device(self) -> None:
        """float8 e4m3 needs compute capability 8.9+ in the Triton kernels (Ada, Hopper and later; e5m2 compiles
        for older GPUs too): refused here rather than as a compile error at the first step."""
        if KV_CACHE_DTYPES[self.kv_cache_dtype] != torch.float8_e4m3fn or self.torch_device().type != "cuda":
            return
        cap = torch.cuda.get_device_capability(self.torch_device())
        if cap < (8, 9):
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype} (float8 e4m3) needs a GPU of compute "
                              f"capability 8.9 or more; this one has {cap[0]}.{cap[1]}",
                              "use --kv-cache-dtype fp8_e5m2 (or auto) on this GPU")

    def _problems(self):
        if not isinstance(self.model, (str, Path)) or not str(self.model).strip():
            yield f"the model must be a built-in name, a folder or a Hugging Face id, got {self.model!r}"
        for name, (lo, hi) in RANGES.items():
            value = getattr(self, name)
            if value is None and name not in OPTIONAL:
                yield f"{flag_of(name)} must be an integer, got None"
            elif value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                yield f"{flag_of(name)} must be an integer, got {value!r}"
            elif value is not None and (value < lo or (hi is not None and value > hi)):
                bound = f"in {lo}..{hi}" if hi is not None else f"at least {lo}"
                yield f"{flag_of(name)} must be {bound}, got {value}"
        tokens, seqs = self.max_num_batched_tokens, self.max_num_seqs
        if isinstance(tokens, int) and isinstance(seqs, int) and tokens < seqs:
            yield batched_tokens_below_seqs(tokens, seqs)
        cpu, slots, lora_on = self.max_cpu_loras, self.max_loras, bool(self.loras) or self.enable_lora is True
        if lora_on and isinstance(cpu, int) and isinstance(slots, int) and not isinstance(cpu, bool) and cpu < slots:
            # vLLM refuses it too (where adapters are on): an adapter in a device slot keeps its CPU copy
            yield (f"--max-cpu-loras {cpu} is below --max-loras {slots}: every adapter in a device slot is kept in "
                   f"CPU memory too", f"pass --max-cpu-loras {slots} or more (or lower --max-loras to {cpu})")
        for name in BOOLS:
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name in OPTIONAL):
                what = "True, False or None" if name in OPTIONAL else "True or False"
                yield f"{name} must be {what}, got {value!r}"
        if not isinstance(self.dtype, str) or self.dtype not in ("auto", *_DTYPES):
            yield f"--dtype {self.dtype!r} is not one of auto, float32, float16, bfloat16" + _dtype_advice(self.dtype)
        if not isinstance(self.scheduling_policy, str) or self.scheduling_policy not in SCHEDULING_POLICIES:
            yield (f"--scheduling-policy {self.scheduling_policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}",
                   "fcfs: first come, first served; priority: requests' priority (lower first), then arrival")
        yield from self._runner_problems()
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            yield (f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}",
                   "auto keeps K and V in the model's --dtype; fp8 (fp8_e4m3) and fp8_e5m2 store them in 1 byte")
        if not isinstance(self.device, str) or not valid_device(self.device):
            yield (f"--device {self.device!r} is not one of auto, cpu, cuda, cuda:N",
                   _device_advice(self.device))
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)):
            yield f"--gpu-memory-utilization must be a number in (0, 1], got {util!r}"
        elif not 0 < util <= 1:
            yield f"--gpu-memory-utilization must be in (0, 1], got {util}"

    def _runner_problems(self):
        if not isinstance(self.runner, str) or self.runner not in RUNNERS:
            yield (f"--runner {self.runner!r} is not one of {', '.join(RUNNERS)}",
                   "generate: text generation; pooling: embeddings (POST /v1/embeddings, LLM.embed)")
        elif self.runner != "pooling" and self.pooler_config is not None:
            yield "--pooler-config is for --runner pooling", "add --runner pooling, or leave --pooler-config out"

    def pooling(self) -> bool:
        """Whether the engine pools (embeddings) instead of generating."""
        return self.runner == "pooling"

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device().type == "cpu":
            return torch.float32
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.float16

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the KV cache's elements for a model computing in `model_dtype` (--kv-cache-dtype)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    def use_overlap(self) -> bool:
        if self.speculative_config is not None or self.pooling():  # a speculative step is verified on the host
            return False  # before the next; a pooling step samples nothing to overlap
        return self.torch_device().type == "cuda" if self.overlap is None else self.overlap

    def use_cuda_graphs(self) -> bool:
        return self.torch_device().type == "cuda" and not self.enforce_eager

    def unused_memory_option(self, device_type: str) -> str | None:
        """What to warn of when the memory option set (not its default) is not the one `device_type`'s budget
        reads: --gpu-memory-utilization on a CPU, --memory-limit on a GPU (memory.plan.budget_bytes). Not refused,
        so that one command line with both serves --device auto on either machine. A value equal to the default
        (which the command line always passes) counts as unset."""
        util = self.gpu_memory_utilization
        if device_type == "cpu" and util != _field_default("gpu_memory_utilization"):
            budget = f"here {gib(self.memory_limit)}" if self.memory_limit else "default: half the available RAM"
            return (f"--gpu-memory-utilization {util:g} does not apply on cpu: the CPU budget is --memory-limit "
                    f"({budget})")
        if device_type == "cuda" and self.memory_limit is not None:
            return (f"--memory-limit {gib(self.memory_limit)} does not apply on cuda: the GPU budget is "
                    f"--gpu-memory-utilization ({util:g} of the GPU's memory)")
        return None

    def piecewise_tokens(self) -> int:
        """The most tokens of a step the piecewise graphs take (0: none): --cuda-graph-max-tokens, at most a step's
        token budget."""
        return min(self.cuda_graph_max_tokens, self.max_num_batched_tokens)


def batched_tokens_below_seqs(tokens: int, seqs: int, seqs_flag: str = "--max-num-seqs") -> tuple[str, str]:
    """(message, hint) for a step's token budget below its sequences (vLLM's SchedulerConfig refuses it): a step that
    runs max_num_seqs decodes needs a token for each. Long prefills are always chunked, so that is the only bound
    (vLLM's other one, max_model_len, is for chunked prefill off). `seqs_flag`: the option that set the sequences."""
    return (f"--max-num-batched-tokens ({tokens:,}) is below {seqs_flag} ({seqs:,}): a step must have room for one "
            f"decode token of every sequence it runs (vLLM refuses it too)",
            f"raise --max-num-batched-tokens to {seqs:,} or more, or lower {seqs_flag} to {tokens:,} or less")


def _field_default(name: str):
    return next(f.default for f in fields(EngineConfig) if f.name == name)


def _device_advice(device) -> str:
    """What a device spelt as other tools spell it means here (`gpu`, `gpu:1`, `mps`), or the usual choices."""
    text = str(device).strip().lower()
    name, _, index = text.partition(":")
    if name in ("gpu", "nvidia", "cuda") and (not index or index.isdigit()):
        return f"an NVIDIA GPU is --device cuda{':' + index if index else ''} (auto picks cuda whenever one is visible)"
    if name in ("mps", "metal", "rocm", "hip", "xpu", "tpu", "npu"):
        return f"infer runs on NVIDIA GPUs (cuda) and on CPUs (cpu); {name} is not supported"
    return "auto picks cuda when an NVIDIA GPU is visible, else cpu"


def valid_device(name: str) -> bool:
    return name in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", name) is not None


def cli_fields() -> list:
    """The EngineConfig fields that are command-line options, in declaration order."""
    return [f for f in fields(EngineConfig) if f.metadata.get("help")]


def flag_of(name: str) -> str:
    """The command-line spelling of a field: '--max-num-seqs', '--eager', '--prefix-caching'; an API-only field
    (no help, no option: num_kv_blocks) keeps its keyword's name, not a flag no command takes."""
    for f in fields(EngineConfig):
        if f.name == name and f.metadata.get("flag"):
            return f.metadata["flag"].split("/")[0]
        if f.name == name and not f.metadata.get("help"):
            return name
    return "--" + name.replace("_", "-")
