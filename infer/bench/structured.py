"""What structured outputs cost: constrained requests beside the same requests unconstrained, in one run.

    python -m infer.bench.structured                                   # CPU, tiny-llama, 16 requests x 64 tokens
    python -m infer.bench.structured --device cuda --model ./llama2-7b-gptq --concurrency 16 64
    python -m infer.bench.structured --vocab 32000 128256 --json out.json

Two parts, each printing our figure beside its baseline:
- engine: `concurrency` requests of --tokens tokens each, once constrained by a regex that no reply of that length
  can complete (so every reply is exactly --tokens tokens, as the baseline's with ignore_eos), once without; output
  tokens per second of both and the ratio. It includes the host's mask fill per row and step, the bitmask's copy
  and the masking on the device (on a GPU the constrained rows' masks are filled while the step's forward pass
  runs; a CPU engine does not overlap steps by default).
- mask: the host work per constrained row and step at real vocabulary sizes (a synthetic vocabulary of --vocab
  tokens through xgrammar, a JSON schema's matcher midway through a string value): the rows' bitmasks filled as the
  engine fills them (from 4 rows on, on xgrammar's threads or row by row, whichever it measured faster here) and
  copied to the device, beside each of the two ways, and our masking of a [concurrency, V] logits tensor on the
  device (one Triton kernel on CUDA; mask_torch_us_per_step: the torch ops it replaced) beside the plain `argmax`
  it precedes.

Nothing here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def engine_rows(model: str, device: str, concurrencies: list[int], tokens: int, repeats: int) -> list[dict]:
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams
    from ..engine.structured import StructuredOutputsParams
    rows = []
    with LLM(model, device=device, max_num_seqs=max(concurrencies)) as llm:
        vocab = llm.engine.model_config.vocab_size
        rng = random.Random(0)
        # letters only, longer than any reply of `tokens` tokens can be: the grammar never ends a reply early
        spec = StructuredOutputsParams(regex=f"[a-z]{{{tokens * 64}}}")
        for c in concurrencies:
            prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(c)]
            kinds = {"unconstrained": SamplingParams(max_new_tokens=tokens, ignore_eos=True),
                     "regex": SamplingParams(max_new_tokens=tokens, structured_outputs=spec)}
            llm.generate(prompts[:2], list(kinds.values()))  # warm: compiles, the grammar's first compile
            best = {}
            for _ in range(repeats):
                for name, params in kinds.items():
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    seconds = time.perf_counter() - t0
                    made = sum(len(o.token_ids) for o in outs)
                    assert made == c * tokens, (name, made)  # the same work on both sides
                    best[name] = max(best.get(name, 0.0), made / seconds)
            rows.append({"part": "engine", "concurrency": c, "tokens": tokens,
                         "unconstrained_tok_s": round(best["unconstrained"], 1),
                         "constrained_tok_s": round(best["regex"], 1),
                         "ratio": round(best["regex"] / best["unconstrained"], 3)})
    return rows


def _vocab(size: int, seed: int = 0) -> list[bytes]:
    """A vocabulary like a BPE one: every byte, then pieces of 2-8 letters, digits and punctuation, with and
    without a leading space; about 1% of them with a quote (as `",` or `":`), which inside a JSON string are the
    tokens a matcher must check one by one."""
    rng = random.Random(seed)
    alphabet = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]:,. _-"
    out, seen = [bytes([b]) for b in range(256)], set()
    while len(out) < size:
        piece = (b" " if rng.random() < 0.5 else b"") + bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if rng.random() < 0.01:
            piece = piece + b'"' if rng.random() < 0.5 else b'"' + piece
        if piece not in seen:
            seen.add(piece)
            out.append(piece)
    return out[:size]


def mask_rows(vocabs: list[int], concurrency: int, repeats: int, device: str = "cpu") -> list[dict]:
    import xgrammar as xgr
    from ..engine.structured import PROBES, fill_bitmask
    from ..kernels import apply_bitmask, reference
    rows = []
    for size in vocabs:
        vocab = _vocab(size)
        eos = size - 1
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=size, stop_token_ids=[eos])
        t0 = time.perf_counter()
        compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
        compile_ms = (time.perf_counter() - t0) * 1e3
        matchers = []
        for _ in range(concurrency):  # each midway through a string value, where most tokens are allowed
            m = xgr.GrammarMatcher(compiled)
            assert m.accept_string('{"name": "ab')
            matchers.append(m)
        fills, threaded, singles, masks, torch_masks, argmaxes = [], [], [], [], [], []
        logits = torch.randn(concurrency, size, device=device)
        one = torch.empty(concurrency, (size + 31) // 32, dtype=torch.int32)
        for _ in range(2 * PROBES):  # the engine's choice between the two ways, measured as the engine does
            fill_bitmask(matchers, size)
        sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i, m in enumerate(matchers):  # the baseline: row by row on this thread
                m.fill_next_token_bitmask(one, i)
            singles.append((time.perf_counter() - t0) / concurrency * 1e6)
            t0 = time.perf_counter()
            fill_bitmask(matchers, size, threads=True)
            threaded.append((time.perf_counter() - t0) / concurrency * 1e6)
            sync()
            t0 = time.perf_counter()
            bitmask = fill_bitmask(matchers, size).to(logits.device)
            sync()
            t1 = time.perf_counter()
            masked = apply_bitmask(logits, None, bitmask)
            sync()
            t2 = time.perf_counter()
            masked.argmax(-1)
            sync()
            t3 = time.perf_counter()
            reference.apply_bitmask(logits, None, bitmask)  # the torch ops the kernel replaces (on CUDA)
            sync()
            torch_masks.append((time.perf_counter() - t3) * 1e6)
            fills.append((t1 - t0) / concurrency * 1e6)
            masks.append((t2 - t1) * 1e6)
            argmaxes.append((t3 - t2) * 1e6)
        rows.append({"part": "mask", "device": str(logits.device), "vocab": size, "rows": concurrency,
                     "compile_ms": round(compile_ms, 1),
                     "fill_us_per_row": round(statistics.median(fills), 1),
                     "fill_threads_us_per_row": round(statistics.median(threaded), 1),
                     "fill_one_by_one_us_per_row": round(statistics.median(singles), 1),
                     "mask_us_per_step": round(statistics.median(masks), 1),
                     "mask_torch_us_per_step": round(statistics.median(torch_masks), 1),
                     "argmax_us_per_step": round(statistics.median(argmaxes), 1)})
    return rows


def _device(name: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, nargs="*", default=[32000, 128256],
                    help="vocabulary sizes for the mask part (none: skip it)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = engine_rows(args.model, args.device, args.concurrency, args.tokens, args.repeats)
    if args.vocab:
        rows += mask_rows(args.vocab, max(args.concurrency), max(20, args.repeats * 10), _device(args.device))
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
