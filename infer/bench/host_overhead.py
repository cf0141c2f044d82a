"""What the host spends on one engine step of the GPU code path, measured on any machine (a CPU too): every op goes
through its Triton wrapper, as on a GPU, with Triton's kernel launch stubbed out, so nothing computes and a step's
time is infer's own Python plus torch's dispatch of the few torch ops. The Triton launches are counted.

    python -m infer.bench.host_overhead                       # llama-2-7b's 32 layers, 64 concurrent, 16 adapters
    python -m infer.bench.host_overhead --model qwen1.5-14b --concurrency 16 --adapters 0

The widths are shrunk (hidden 512), because a launch's host cost does not depend on them; the layer count, the
projections and the adapters' layout are the model's. Rows: an eager decode step of `concurrency` sequences, and an
eager mixed step (concurrency - 1 decodes beside one prompt of --prompt-len tokens), each without adapters and with
--adapters mixed rank-16 adapters. For the mixed step, `launches_piecewise` is what a step through the piecewise
CUDA graphs launches instead: one replay per piece (layers + 1), the attention's own launches (counted), a copy of
each attention's output, and the step's input copies. Triton's own launch cost comes on top on a GPU (not measured
here). Nothing here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from . import e2e_models

INPUT_COPIES = 8  # a piecewise step's copies into its static buffers (ids, positions, slots, padding, adapter map)


@contextmanager
def gpu_code_path_without_launches():
    """Inside: GPTQ layers load in the kernel layout, every op dispatches to its Triton wrapper, and Triton's
    launches only count themselves (the yielded one-element list). Everything is restored on exit."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    from .. import kernels
    from ..quant.gptq_linear import GPTQLinearMethod
    count = [0]
    saved = (jit.JITFunction.run, interpreter.InterpretedFunction.run, kernels.use_triton,
             GPTQLinearMethod.finish_loading)
    real_finish = saved[3]

    def kernel_layout(self, layer):
        self.use_kernel = True
        real_finish(self, layer)

    def launch(self, *args, **kwargs):
        count[0] += 1

    # (TRITON_INTERPRET=1, as in the tests, makes every kernel an InterpretedFunction: stubbed the same way)
    jit.JITFunction.run = interpreter.InterpretedFunction.run = launch
    kernels.use_triton, GPTQLinearMethod.finish_loading = (lambda t: True), kernel_layout
    try:
        yield count
    finally:
        (jit.JITFunction.run, interpreter.InterpretedFunction.run, kernels.use_triton,
         GPTQLinearMethod.finish_loading) = saved


def _context(decodes: int, prompt: int):
    """(input_ids, positions, ForwardContext) of `decodes` sequences at context 101 and one new prompt of `prompt`
    tokens (the values only have to be well formed: no kernel runs)."""
    from ..models.context import ForwardContext
    lens = [1] * decodes + ([prompt] if prompt else [])
    t, b = sum(lens), len(lens)
    ctx = ForwardContext(query_start_loc=torch.tensor([0] + lens).cumsum(0).to(torch.int32),
                         seq_lens=torch.tensor([101] * decodes + ([prompt] if prompt else []), dtype=torch.int32),
                         block_tables=torch.arange(b * 8, dtype=torch.int32).view(b, 8), slot_mapping=torch.arange(t),
                         max_query_len=max(lens))
    pos = torch.cat([torch.full((decodes,), 100)] + ([torch.arange(prompt)] if prompt else []))
    return torch.randint(1, 999, (t,)), pos, ctx


def measure(model: str = "llama-2-7b", concurrency: int = 64, adapters: int = 16, prompt_len: int = 44,
            repeats: int = 10, num_layers: int | None = None) -> list[dict]:
    from . import gpu_e2e
    overrides = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8,
                     vocab_size=1000, max_position_embeddings=512)
    if num_layers:
        overrides["num_hidden_layers"] = num_layers
    cfg = e2e_models.hf_config(model, **overrides)
    rows = []
    torch.set_grad_enabled(False)
    with gpu_code_path_without_launches() as launches, tempfile.TemporaryDirectory() as tmp:
        net, _ = e2e_models.build_model(cfg, torch.float16, "cpu", quantized=True)
        paths = e2e_models.write_random_adapters(cfg, Path(tmp), adapters, 16) if adapters else {}
        names = list(paths)
        engine = gpu_e2e.build_engine(net, cfg, e2e_models.make_tokenizer(cfg.vocab_size), "cpu", paths, 16,
                                      concurrency, 256)
        manager = engine.lora_manager
        slots = [manager.acquire(n) for n in names]
        layers = len(net.layers)
        for kind, prompt in (("decode", 0), ("mixed", prompt_len)):
            decodes = concurrency if kind == "decode" else concurrency - 1
            ids, pos, ctx = _context(decodes, prompt)
            for lora in ([False, True] if names else [False]):
                ctx.lora = None
                if lora:  # the runner orders a batch's tokens by adapter slot
                    per_seq = sorted(slots[i % len(slots)] for i in range(decodes + bool(prompt)))
                    per_token = per_seq[:decodes] + [per_seq[-1]] * prompt if prompt else per_seq
                    ctx.lora = manager.make_batch(per_token)
                net(ids, pos, ctx)  # first call: caches and plans
                times, counts = [], []
                for _ in range(repeats):
                    before = launches[0]
                    t0 = time.perf_counter()
                    net(ids, pos, ctx)
                    times.append(time.perf_counter() - t0)
                    counts.append(launches[0] - before)
                before = launches[0]
                for layer in net.layers:  # what the attentions alone launch (the piecewise step runs them eagerly)
                    layer.self_attn.attend(torch.zeros(ids.shape[0], layer.self_attn.q_size, dtype=torch.float16),
                                           ctx)
                attention = launches[0] - before
                ms, n = statistics.median(times) * 1e3, statistics.median(counts)
                rows.append({"model": model, "layers": layers, "step": kind, "tokens": int(ids.shape[0]),
                             "adapters": f"{len(names)} mixed" if lora else "none", "host_ms": round(ms, 2),
                             "launches": int(n), "us_per_launch": round(ms * 1e3 / n, 1),
                             "launches_piecewise": layers + 1 + attention + layers + INPUT_COPIES
                             if kind == "mixed" else None})
        engine.close()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.bench.host_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-2-7b", choices=list(e2e_models.SHAPES))
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=44)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    import pandas as pd
    rows = measure(args.model, args.concurrency, args.adapters, args.prompt_len, args.repeats)
    print(pd.DataFrame(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
