"""Large host tensors backed by transparent huge pages.

The KV cache is the one large, long-lived host allocation of a worker. Backed by 2 MiB pages
it costs fewer TLB misses in attention and, above all, fewer page pins when UCX moves KV
between processes (CMA: ``process_vm_readv`` pins every page it copies); so does the prefill
worker's staging copy of a prompt's KV. Measured on the 2-core dev machine, 60 messages of
384 KiB between two processes: 4.0-4.4 GB/s with 4 KiB pages on both sides, 5.6-6.6 GB/s with
huge pages.

Linux with THP in "madvise" mode (the common default) gives huge pages only to ranges marked
``MADV_HUGEPAGE`` *before* they are first touched; torch's CPU allocator does not mark them
(unless ``THP_MEM_ALLOC_ENABLE=1``). ``empty_huge_pages`` allocates and marks the 2 MiB-aligned
interior; the first write faults the pages in as huge pages. Elsewhere (no madvise, THP off,
other OS, CUDA) these are plain ``torch.empty`` / ``torch.zeros``: huge pages are a speed-up,
never a requirement.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14
"""Linux ``madvise`` advice (``mmap.MADV_HUGEPAGE`` where Python exposes it)."""


def empty_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``torch.empty(shape)``, on CPU with its pages advised huge: they become huge pages when
    first written (see the module docstring)."""
    device = torch.device(device)
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu" and sys.platform.startswith("linux"):
        _advise_huge_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    return tensor


def zeros_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``torch.zeros(shape)``, on CPU backed by huge pages where the kernel grants them."""
    return empty_huge_pages(shape, dtype, device).zero_()


def _advise_huge_pages(address: int, num_bytes: int) -> bool:
    """Mark the 2 MiB-aligned pages inside ``[address, address + num_bytes)``; False if the
    range holds none or the kernel refused."""
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + num_bytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advice = getattr(mmap, "MADV_HUGEPAGE", MADV_HUGEPAGE)
    if libc.madvise(start, end - start, advice) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return False
    return True
