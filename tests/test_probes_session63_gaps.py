"""Session 63, small gaps: Granite 4.0's Mamba-2 SSD scan holds its [H, L, L] score and decay temporaries for a
group of chunks at a time (bit-identical to one group of every chunk), and memory.sizes.mamba_scan_bytes counts
that bounded peak; the adapter slots of the gated-attention families (q_proj twice the query's width) and of the
hybrids' linear-attention layers are what memory.sizes.lora_slot_bytes counts; an ERNIE 4.5 MoE checkpoint
without its routers' moe_statics bias loads zeros, as transformers."""

from __future__ import annotations

import logging
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from infer import LLM, SamplingParams
from infer.kernels import mamba2
from infer.memory.sizes import lora_slot_bytes, mamba_scan_bytes
from infer.models.loader import load_config
from infer.models.tiny import ensure_builtin

from helpers import check_equal_transformers, hf_model
from test_probes_session63_moe35 import build_ernie


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors the ops under it create and keep alive (by storage), and the largest one's
    elements."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.largest = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # (the dead first: a new tensor at a freed tensor's address is counted, whatever the allocator reuses)
        self.live = {k: (r, n) for k, (r, n) in self.live.items() if r() is not None}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.live.setdefault(storage.data_ptr(), (weakref.ref(t), storage.nbytes()))
                self.largest = max(self.largest, t.numel())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _scan_inputs(tokens: int, heads: int, p: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(tokens, heads, p), r(tokens, heads), -torch.rand(heads, generator=g), r(tokens, 1, n), r(tokens, 1, n),
            r(heads), r(heads)), r(heads, p, n)


@pytest.mark.parametrize("chunks", [5, 9, 12, 2, 1])
@pytest.mark.parametrize("heads,p,n,chunk", [(4, 16, 8, 8), (8, 4, 6, 16)])
def test_ssd_scan_in_groups_of_chunks_is_bit_identical_to_one_group(monkeypatch, chunks, heads, p, n, chunk):
    """Groups of SCAN_GROUP_CHUNKS chunks (a last group of one chunk folded into the one before: einsum contracts a
    single chunk by another kernel) give the output and final state of every chunk at once, bit for bit (a partial
    last chunk too)."""
    args, state = _scan_inputs(chunks * chunk - 3, heads, p, n)
    grouped = mamba2.chunk_scan(*args, chunk=chunk, state=state)
    monkeypatch.setattr(mamba2, "SCAN_GROUP_CHUNKS", 10 ** 6)
    whole = mamba2.chunk_scan(*args, chunk=chunk, state=state)
    assert torch.equal(grouped[0], whole[0]) and torch.equal(grouped[1], whole[1])


def test_ssd_scan_temporaries_are_bounded_and_counted():
    """A scan of 32 chunks of tiny-granite4's shape holds no [H, c, L, L] tensor of every chunk: its largest
    temporary is a group's scores, a per-token tensor or the chunk-to-chunk carry, and the peak of its live
    temporaries is what mamba_scan_bytes counts (within 1.3x), less than the whole sequence's three [H, T, L]."""
    cfg = load_config(ensure_builtin("tiny-granite4"))
    cfg.mamba_chunk_size = chunk = 128
    heads, p, n = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state
    chunks = 32
    tokens = chunks * chunk
    args, state = _scan_inputs(tokens, heads, p, n)
    with _LiveBytes() as meter:
        mamba2.chunk_scan(*args, chunk=chunk, state=state)
    group = (mamba2.SCAN_GROUP_CHUNKS + 1) * chunk * chunk
    assert meter.largest <= heads * max(group, tokens * max(p, n), (chunks + 1) ** 2)
    formula = mamba_scan_bytes(cfg, tokens)
    assert meter.peak <= formula <= 1.3 * meter.peak, (meter.peak, formula)
    assert meter.peak < 3 * heads * tokens * chunk * 4


@pytest.mark.parametrize("model", ["tiny-qwen3_5", "tiny-qwen3-next", "tiny-qwen3_5-moe"])
@pytest.mark.parametrize("targets", [None, ["qkv_proj"], ["o_proj", "down_proj"]])
def test_gated_attention_and_linear_layer_slots_are_counted(model, targets):
    """The slots allocated on a gated-attention family (q_proj's query and gate: twice the query's width; the
    Gated DeltaNet layers' own slots with every layer's) are lora_slot_bytes' count, byte for byte."""
    with LLM(model, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, device="cpu",
             lora_target_modules=targets) as llm:
        got = llm.engine.lora_manager.device_bytes()
        assert got == lora_slot_bytes(llm.engine.runner.model.config, 2, 4, torch.float32, targets)


def test_ernie_checkpoint_without_the_router_bias_loads_zeros_as_transformers(tmp_path, caplog):
    """An ERNIE 4.5 MoE folder without moe_statics.e_score_correction_bias (drawn, then left out): transformers
    initialises it to zeros and runs; infer loads zeros too, says so in a log line, and gives transformers' greedy
    tokens and logprobs (the bias drawn first: a folder of zeros would not tell it from the drawn one)."""
    build_ernie(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    kept = {k: v for k, v in stored.items() if not k.endswith("e_score_correction_bias")}
    assert len(kept) < len(stored) and any(v.abs().sum() > 0 for k, v in stored.items() if k not in kept)
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = hf_model(str(tmp_path))
    assert all(m.mlp.gate.moe_statics.e_score_correction_bias.abs().sum() == 0 for m in hf.model.layers
               if hasattr(m.mlp, "gate"))
    prompts = [[5, 9, 100, 33, 7], list(range(40, 53))]
    with caplog.at_level(logging.INFO, logger="infer"), LLM(str(tmp_path), block_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3))
    assert "no moe_statics.e_score_correction_bias for 2 layers: zeros, as transformers" in caplog.text
    check_equal_transformers(hf, prompts, outs, 8, "ernie-no-bias")
