"""The GPU end-to-end benchmark in one command, with random weights of real shapes built on the device:

    python -m infer.bench.gpu_e2e --out bench-results/gpu-e2e

For each of Llama-2-7B and Qwen1.5-14B (shapes only: nothing is downloaded) it builds the model directly on the GPU
with GPTQ int4 g128 weights (random but valid qweight/qzeros/scales; fp16 weights, said so in the table, when
infer.quant.gptq_linear is missing or --fp16 is given), runs 16 concurrent requests of 44 random prompt tokens and
256 output tokens (EOS ignored) through infer's engine without adapters and with 16 different rank-16 adapters
(one per request, every attention and MLP projection), and the same requests through transformers (fp16 weights,
`generate` at batch 16). It prints output tokens/s and TPOT, and the decode roofline: the bytes one decode step
must read (weights + the KV of the batch at its mean context + the batch's adapters) over the device-to-device
copy bandwidth measured in the same run, and the fraction of it reached. Tables: DIR/results.csv, DIR/results.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from ..models.shapes import ModelShapes

SHAPES = {
    "llama-2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    "qwen1.5-14b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13696, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40, vocab_size=152064,
                        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        tie_word_embeddings=False),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COLUMNS = ["model", "weights", "lora", "engine", "output_tok_s", "mean_tpot_ms", "mean_ttft_ms", "step_MB",
           "copy_GB_s", "roofline_tpot_ms", "roofline_tok_s", "fraction_of_roofline", "start_s", "lora_swaps"]


# ----------------------------------------------------------------------------------------------- models
def hf_config(name: str, **overrides):
    from transformers import AutoConfig
    kw = {**SHAPES[name], **overrides}
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg.dtype = "float16"
    return cfg


def gptq_method_factory(group_size: int = 128):
    """names -> GPTQLinearMethod (int4), or None when the GPTQ linear method is not in this tree."""
    try:
        from ..quant.config import GPTQConfig
        from ..quant.gptq_linear import GPTQLinearMethod
    except ImportError:
        return None
    config = GPTQConfig(bits=4, group_size=group_size)
    return lambda names: GPTQLinearMethod(config)


def _random_shards(layer, gen_scale: float = 0.02) -> list[tuple[str, int, torch.Tensor]]:
    """Random tensors for every shard of a MergedLinear, in the checkpoint's shapes (GPTQ or float)."""
    k, out = layer.in_features, []
    gptq = getattr(layer, "qweight", None) is not None
    dev = layer.qweight.device if gptq else layer.weight.device
    for shard, n in enumerate(layer.out_sizes):
        if gptq:
            groups = layer.scales.shape[0]
            out.append(("qweight", shard, torch.randint(-2**31, 2**31, (k // 8, n), dtype=torch.int32, device=dev)))
            out.append(("qzeros", shard, torch.randint(-2**31, 2**31, (groups, n // 8), dtype=torch.int32,
                                                       device=dev)))
            # |q - z| is about 5 on average: scales of gen_scale / 5 give weights of about gen_scale
            scales = (torch.rand(groups, n, device=dev) + 0.5) * (gen_scale / 5)
            out.append(("scales", shard, scales.half()))
        else:
            out.append(("weight", shard, torch.randn(n, k, device=dev, dtype=layer.dtype) * gen_scale))
        if layer.bias is not None:
            out.append(("bias", shard, torch.randn(n, device=dev, dtype=layer.dtype) * gen_scale))
    return out


def build_model(cfg, dtype: torch.dtype, device, quantized: bool = True, seed: int = 0):
    """(infer model with random weights built on `device`, weights label). Layers are filled through
    MergedLinear.load_shard, the loader's own path, so their checks and finish_loading run as for a checkpoint."""
    from ..models.layers import MergedLinear
    from ..models.registry import model_class
    method_for = gptq_method_factory() if quantized else None
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(cfg)(cfg, dtype, method_for)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MergedLinear):
                for name, shard, tensor in _random_shards(module):
                    module.load_shard(name, shard, tensor)
                module.finish_loading()
        model.embed_tokens.weight.normal_(0, 0.02)
        if not model.tie_word_embeddings:
            model.lm_head.weight.normal_(0, 0.02)
    model.finish_loading()
    plain = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype).split(".")[-1])
    label = "gptq-int4-g128" if method_for else (f"{plain} (GPTQ linear method missing)" if quantized else plain)
    return model.eval(), label


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer whose token i is the word t<i>: enough for the engine's detokenizer and for HF."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def write_random_adapters(cfg, out: Path, num: int, rank: int, seed: int = 0) -> dict[str, str]:
    """`num` PEFT LoRA folders (adapter_config.json + adapter_model.safetensors) for `cfg`, random A and B."""
    from safetensors.torch import save_file
    shapes = ModelShapes.from_config(cfg)
    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, shapes.q_size, shapes.kv_size
    io = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
          "up_proj": (h, inter), "down_proj": (inter, h)}
    paths = {}
    for a in range(num):
        g = torch.Generator().manual_seed(seed + a)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for proj in TARGETS:
                parent = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                base = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
                fan_in, fan_out = io[proj]
                tensors[f"{base}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) * 0.02).half()
                tensors[f"{base}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.02).half()
        path = out / f"lora{a}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none"}))
        paths[f"lora{a}"] = str(path)
    return paths


def build_engine(model, cfg, tokenizer, device, adapters: dict[str, str], rank: int, concurrency: int,
                 max_len: int, eager: bool = False, slots: int | None = None):
    """An LLMEngine over an in-memory model (decode CUDA graphs unless `eager`); `slots` GPU adapter slots (default:
    one per adapter; fewer makes the engine swap adapters, counted in stats()["lora_swaps"])."""
    slots = max(1, slots or len(adapters))
    from ..engine import llm_engine
    from ..engine.config import EngineConfig
    from ..memory.plan import plan_memory
    from ..engine.setup import EngineParts
    dtype = model.embed_tokens.weight.dtype
    blocks = concurrency * -(-max_len // 16) + concurrency
    config = EngineConfig(f"random-{cfg.model_type}", dtype=str(dtype).split(".")[-1], device=str(device),
                          max_num_seqs=concurrency, max_model_len=max_len, num_kv_blocks=blocks, loras=adapters,
                          max_loras=slots, max_lora_rank=rank, enforce_eager=eager)
    manager = None
    if adapters:
        from ..lora.manager import LoRAManager
        manager = LoRAManager(model, slots, rank, device=device, dtype=dtype)
        for name, path in adapters.items():
            manager.register(name, path)
    plan = plan_memory(config, cfg, model, dtype, torch.device(device), max_len)
    parts = EngineParts(Path("."), model, cfg, tokenizer, dtype, torch.device(device), max_len, set(),
                        plan.num_blocks, plan, manager)
    return llm_engine.LLMEngine(config, parts)


def make_requests(vocab: int, num: int, prompt_len: int, output_len: int, adapters: list[str], seed: int = 0):
    from .datasets import BenchRequest
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (num, prompt_len), generator=g).tolist()
    return [BenchRequest(None, ids[i], output_len, lora=adapters[i % len(adapters)] if adapters else None,
                         ignore_eos=True) for i in range(num)]


def run_engine(engine, requests, concurrency: int) -> dict:
    """Metrics of one measured run, after an unmeasured short run of the same batch (Triton compiles, caches)."""
    from .driver import run_in_process
    run_in_process(engine, [replace(r, output_len=8) for r in requests], concurrency, progress=False)
    return run_in_process(engine, requests, concurrency, progress=False).metrics()


def profile_steps(engine, requests, steps: int = 20, out: Path | None = None) -> dict:
    """One prefill step of every request, then `steps` steady decode steps under torch.profiler: the prefill
    step's time, and per decode step the host (wall) time against the GPU-busy time (sum of kernel times); the
    top kernels by GPU time go to `out` (a text table)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from ..engine.sampling_params import SamplingParams
    for i, r in enumerate(requests):
        engine.add_request(f"prof-{i}", r.prompt_token_ids, SamplingParams(max_new_tokens=steps + 8,
                                                                           ignore_eos=True), r.lora)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - t0) * 1e3 / steps
    while engine.has_unfinished_requests():
        engine.step()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in events) / 1e3 / steps
    if out is not None:
        out.write_text(prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=70))
    return {"prefill_step_ms": round(prefill_ms, 2), "decode_step_host_ms": round(host_ms, 3),
            "decode_step_gpu_busy_ms": round(busy_ms, 3), "gpu_busy_fraction": round(busy_ms / host_ms, 3)}


# ----------------------------------------------------------------------------------------------- roofline
def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the best of `repeats` copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000.0)
    del src, dst
    return 2 * nbytes / best


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of weights one decode step of `batch` tokens reads: every linear layer (GPTQ: qweight, qzeros, scales,
    g_idx unless the kernel skips it), norms, the output head, and `batch` rows of the (untied) embedding."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    total, seen = 0, set()
    for module in model.modules():
        if getattr(module, "qweight", None) is not None:
            names = ["qweight", "qzeros", "scales"] + ([] if getattr(module, "gptq_group_size", None) else ["g_idx"])
            total += sum(getattr(module, n).nbytes for n in names)
        for name, p in module.named_parameters(recurse=False):
            if p.data_ptr() in seen or (name == "weight" and getattr(module, "qweight", None) is not None):
                continue
            seen.add(p.data_ptr())
            rows_only = isinstance(module, torch.nn.Embedding) and not tied
            total += batch * p.shape[1] * p.element_size() if rows_only else p.nbytes
    return total


def lora_bytes_per_adapter(model) -> int:
    """Bytes of one adapter slot (A and B of every adapted layer), as the shrink/expand kernels read it."""
    layers = [m.lora for m in model.modules() if getattr(m, "lora", None) is not None]
    return sum(lay.lora_a[0].nbytes + sum(b[0].nbytes for b in lay.lora_b) for lay in layers)


def decode_roofline(weight_bytes: int, kv_bytes_per_token: int, batch: int, mean_context: float,
                    adapter_bytes: int, num_adapters: int, bandwidth: float) -> dict:
    """The fastest a memory-bound decode step can be: everything it must read, once, at the copy bandwidth."""
    step = weight_bytes + kv_bytes_per_token * batch * mean_context + adapter_bytes * num_adapters
    step_s = step / bandwidth
    return {"step_bytes": step, "step_s": step_s, "tok_s": batch / step_s}


def result_row(model: str, weights: str, lora: str, engine: str, metrics: dict, roof: dict, bw: float) -> dict:
    tpot_s = metrics["mean_tpot_ms"] / 1000.0
    return {"model": model, "weights": weights, "lora": lora, "engine": engine,
            "output_tok_s": round(metrics["output_throughput"], 1), "mean_tpot_ms": round(metrics["mean_tpot_ms"], 2),
            "mean_ttft_ms": round(metrics["mean_ttft_ms"], 1), "step_MB": round(roof["step_bytes"] / 1e6, 1),
            "copy_GB_s": round(bw / 1e9, 1), "roofline_tpot_ms": round(roof["step_s"] * 1000, 2),
            "roofline_tok_s": round(roof["tok_s"], 1),
            "fraction_of_roofline": float(f"{roof['step_s'] / tpot_s:.3g}") if tpot_s > 0 else float("nan")}


def adapter_costs(rows: list[dict]) -> list[str]:
    """For each engine row with adapters: its throughput cost against the same model without adapters, and the cost
    the adapters' own bytes explain (the same ratio of the two rooflines)."""
    lines = []
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["engine"] == r["engine"]
                     and b["lora"] == "none"), None)
        if base is None or r["lora"] == "none" or not base["output_tok_s"]:
            continue
        cost = 1 - r["output_tok_s"] / base["output_tok_s"]
        explained = 1 - r["roofline_tok_s"] / base["roofline_tok_s"]
        lines.append(f"{r['model']} {r['engine']}, {r['lora']}: costs {cost:.0%} of the throughput without adapters; "
                     f"the adapters' bytes alone explain {explained:.0%}")
    return lines


def write_tables(rows: list[dict], out: Path, notes: list[str]) -> str:
    import csv
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    md = "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"
    (out / "results.md").write_text(md)
    return md


# ----------------------------------------------------------------------------------------------- the run
def bench_model(name: str, args, bandwidth: float, device: str = "cuda", dtype: torch.dtype = torch.float16,
                **shape_overrides) -> list[dict]:
    """infer without and with adapters, then transformers, on one model shape; a result row for each."""
    from ..memory.sizes import kv_bytes_per_token
    from .hf_baseline import HFModel, run_hf_generate
    cfg, b = hf_config(name, **shape_overrides), args.concurrency
    tok = make_tokenizer(cfg.vocab_size)
    model, label = build_model(cfg, dtype, device, quantized=not args.fp16)
    mean_ctx = args.input_len + args.output_len / 2
    kv_tok = kv_bytes_per_token(cfg, dtype)
    rows, max_len = [], args.input_len + args.output_len + 8
    wbytes = weight_bytes_per_step(model, b)
    # no adapters: an engine without LoRA (graphs, and eagerly too with --compare-eager); then one with them
    modes = [("none", {}, args.eager)] + ([("none", {}, True)] if args.compare_eager and not args.eager else [])
    with tempfile.TemporaryDirectory() as tmp:
        if args.num_adapters:
            adapters = write_random_adapters(cfg, Path(tmp), args.num_adapters, args.rank)
            modes.append((f"{len(adapters)} mixed r{args.rank}", adapters, args.eager))
            if args.max_loras and args.max_loras < len(adapters):
                modes.append((f"{len(adapters)} mixed r{args.rank} via {args.max_loras} slots", adapters, args.eager))
        for lora, adapters, eager in modes:
            slots = args.max_loras if "slots" in lora else None
            engine = build_engine(model, cfg, tok, device, adapters, args.rank, b, max_len, eager, slots)
            engine.warmup()  # compiles every kernel path (prefix-cached prefill too) before anything is timed
            names = list(adapters)
            abytes = lora_bytes_per_adapter(model) if names else 0
            reqs = make_requests(cfg.vocab_size, args.num_prompts, args.input_len, args.output_len, names)
            roof = decode_roofline(wbytes, kv_tok, b, mean_ctx, abytes, min(len(names), b), bandwidth)
            label_engine = "infer --eager" if eager else "infer"
            rows.append(result_row(name, label, lora, label_engine, run_engine(engine, reqs, b), roof, bandwidth))
            rows[-1]["start_s"] = round(sum(engine.start_times.values()), 2)
            rows[-1]["lora_swaps"] = engine.stats()["lora_swaps"]
            print(json.dumps(rows[-1]), flush=True)
            if args.profile:
                tag = f"{name}-{lora.split()[0]}-{'eager' if eager else 'graphs'}-c{b}"
                prof = profile_steps(engine, reqs[:b], out=args.out / f"profile-{tag}.txt")
                print(json.dumps({"profile": tag, **prof}), flush=True)
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        reqs = make_requests(cfg.vocab_size, args.num_prompts, args.input_len, args.output_len, [])
        handle = HFModel(hf, tok, torch.device(device))
        roof = decode_roofline(weight_bytes_per_step(hf, b), kv_tok, b, mean_ctx, 0, 0, bandwidth)
        plain = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype).split(".")[-1])
        # the plain generate, and the strong one (static cache: transformers compiles its step), both warmed
        for cache, label_hf in ((None, "hf generate"), ("static", "hf generate, static cache")):
            if cache and device != "cuda":
                continue
            # the static cache is sized by the output length: warm it with the measured batch's own lengths
            warm = reqs[:b] if cache else [replace(r, output_len=8) for r in reqs[:b]]
            run_hf_generate(handle, warm, b, progress=False, cache_implementation=cache)
            metrics = run_hf_generate(handle, reqs, b, progress=False, cache_implementation=cache).metrics()
            rows.append(result_row(name, plain, "none", label_hf, metrics, roof, bandwidth))
            print(json.dumps(rows[-1]), flush=True)
        del hf, handle
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.bench.gpu_e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for results.csv and results.md")
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=44)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=0,
                   help="also run the adapters through this many GPU slots (swaps), e.g. 8 for 16 adapters")
    p.add_argument("--fp16", action="store_true", help="fp16 weights instead of GPTQ int4")
    p.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    p.add_argument("--eager", action="store_true", help="infer without decode CUDA graphs")
    p.add_argument("--compare-eager", action="store_true", help="also run infer --eager without adapters")
    p.add_argument("--profile", action="store_true",
                   help="also profile one prefill and 20 decode steps of each engine (host vs GPU-busy time)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_e2e needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth("cuda")
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = [row for name in args.models for row in bench_model(name, args, bandwidth)]
    notes = [f"{torch.cuda.get_device_name()}; {args.num_prompts} requests at concurrency {args.concurrency}, "
             f"{args.input_len} prompt tokens, {args.output_len} output tokens (EOS ignored), random weights",
             "roofline: (decode-step weight bytes + KV bytes of the batch at the mean context + adapter bytes) / "
             "measured device-to-device copy bandwidth; fraction = roofline TPOT / measured mean TPOT"]
    notes += adapter_costs(rows)
    print(write_tables(rows, args.out, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
