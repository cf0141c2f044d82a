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
