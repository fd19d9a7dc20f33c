"""Host values onto the device without waiting for the device.

A copy from pageable host memory to CUDA waits for every kernel queued before it; with a
decode step launched ahead (``EngineCore.steps_ahead``) that would make the host wait for the
step it means to overlap. So the engine stages host values in pinned memory and copies them
with ``non_blocking=True``: the copy is queued on the current stream behind what it must
follow, and PyTorch's caching host allocator keeps a pinned block until the copy reading it
has run, so the host may drop or reuse its own tensors at once. Off CUDA copies finish before
they return and nothing is staged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` as a non-blocking copy to ``device`` may read it after the host moves on: a
    pinned copy on CUDA; itself elsewhere."""
    return host.pin_memory() if device.type == "cuda" else host


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``, copied without waiting for the device."""
    return staged(torch.tensor(values, dtype=dtype), device).to(device, non_blocking=True)
