"""Session 55: `infer warmup --estimate`'s activations (memory.sizes.activation_bytes) against the peak `infer warmup`
measures on the CPU (memory.meter.PeakMeter: the growth of the process's peak resident memory) at small shapes:
the measured figure held more than the step's tensors (the heap's history, library code paged in), so it came
out over the formula, which counts the step's tensors (the torch profiler's allocation peak is under it)."""

from __future__ import annotations

import pytest
import torch

from helpers import measured_warmup, save_random_model

SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
             intermediate_size=200)
MODELS = {
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                              decoder_sparse_step=2, norm_topk_prob=True)),
}


@pytest.mark.parametrize("model_type", MODELS)
def test_the_measured_cpu_peak_is_under_the_estimate_at_a_small_step(tmp_path, model_type):
    """Qwen3 and Qwen3-MoE (4 layers, the MoE's sparse every 2nd, intermediate_size 200), a step of 1,020 tokens
    (--max-num-batched-tokens 1024, 4 x 256): the measured peak was 5.5 to 5.8 MB against the formula's 3.95 MB.
    The step's tensors under glibc's 128 KiB mmap threshold (a sequence's K and V slices, the router's rows) came
    from the heap, whose free pages the meter trims before the step and which the step then re-faults page by page
    among older chunks: warmup's meter now serves every allocation of a page or more by mmap
    (memory.meter.fixed_mmap_threshold). Measured in a fresh process, as test_memory's test."""
    arch, extra = MODELS[model_type]
    save_random_model(tmp_path, model_type, arch, {**SHAPE, **extra})
    args = [str(tmp_path), "--max-length", "256", "--concurrency", "4", "--max-num-batched-tokens", "1024"]
    measured = measured_warmup(args)
    peak, formula = measured["activation_peak_bytes"], measured["activation_estimate_bytes"]
    assert peak <= formula <= 1.3 * peak, (formula, peak)


def test_the_cpu_meter_leaves_out_library_code_paged_in_during_the_step(monkeypatch):
    """A library's code paged in while the step runs (resident file pages: a kernel whose pages were dropped since
    its last run) is no activation: about 1 MB of libtorch_cpu.so's text came into the peak on tiny models. The
    meter takes the growth of resident file pages off the peak's."""
    from infer.memory import meter
    mb = 1 << 20
    state = {"rss": 100 * mb, "hwm": 100 * mb, "file": 40 * mb}
    monkeypatch.setattr(meter, "trim_heap", lambda: None)
    monkeypatch.setattr(meter, "reset_peak_rss", lambda: True)
    monkeypatch.setattr(meter, "rss_bytes", lambda: state["rss"])
    monkeypatch.setattr(meter, "peak_rss_bytes", lambda: state["hwm"])
    monkeypatch.setattr(meter, "file_rss_bytes", lambda: state["file"], raising=False)
    with meter.PeakMeter(torch.device("cpu")) as m:
        state.update(hwm=105 * mb, file=41 * mb)  # 4 MB of the step's own, 1 MB of code
    assert m.peak == 4 * mb
    with meter.PeakMeter(torch.device("cpu")) as m:
        state.update(hwm=109 * mb, file=40 * mb)  # (file pages dropped during the step: nothing comes off)
    assert m.peak == 9 * mb
