"""Host -> device copies that never wait for the device.

`torch.tensor(data, device="cuda")` copies with non_blocking=False, which in PyTorch is an asynchronous copy
followed by a synchronisation of the stream: the host waits until every kernel queued before it has run. One such
call in a step's preparation and the GPU drains while Python works, which is exactly what overlapped steps must
avoid. Copying from pinned (page-locked) memory with non_blocking=True queues the copy and returns; PyTorch's
pinned-memory allocator keeps the source alive until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `data` (a list, or a list of rows) on `device`, without a synchronisation."""
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
