"""The decode roofline of the GPU end-to-end benchmark: the bytes one decode step must read (weights, the batch's
KV at its mean context, the batch's adapters) over the device-to-device copy bandwidth measured in the same run."""

from __future__ import annotations

import torch


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
