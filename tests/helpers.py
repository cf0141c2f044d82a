"""Shared helpers for tests: HF oracle generation on the same weights."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.generation_config.eos_token_id = None  # never stop (nor suppress EOS): compare with ignore_eos
    m.eval()
    return m


def hf_greedy(path: str, prompt: list[int], n: int, **kw) -> list[int]:
    m = hf_model(str(path))
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def interpreted_module(name: str):
    """Yields module `name` with its Triton kernels interpreted on CPU when there is no GPU (TRITON_INTERPRET is read
    when kernels are decorated and when they are launched, so it stays set until the generator resumes)."""
    import importlib
    import os
    if torch.cuda.is_available():
        yield importlib.import_module(name)
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield importlib.reload(importlib.import_module(name))
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old
