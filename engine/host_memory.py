"""Large host tensors backed by transparent huge pages.

The KV cache is the one large, long-lived host allocation of a worker. Backed by 2 MiB pages
it costs fewer TLB misses in attention and, above all, fewer page pins when UCX moves KV
between processes (CMA: ``process_vm_readv`` pins every page it copies); so does the prefill
worker's staging copy of a prompt's KV. Measured on the 2-core dev machine, 60 messages of
384 KiB between two processes: 4.0-4.4 GB/s with 4 KiB pages on both sides, 5.6-6.6 GB/s with
huge pages.

Linux with THP in "madvise" mode (the common default) gives huge pages only to ranges marked
``MADV_HUGEPAGE`` *before* they are first touched; torch's CPU allocator does not mark them,
and may hand out heap memory already touched as 4 KiB pages. So ``empty_huge_pages`` maps
fresh anonymous memory of its own (private, 2 MiB aligned), marks it, and wraps it in a
tensor; the first write faults it in as huge pages, and the mapping is unmapped when the last
tensor viewing it is freed. Elsewhere (no madvise, THP off, other OS, CUDA, under 2 MiB) these
are plain ``torch.empty`` / ``torch.zeros``: huge pages are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20


def empty_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``torch.empty(shape)`` (contiguous), on CPU in fresh memory advised huge: it becomes
    huge pages when first written (see the module docstring)."""
    device = torch.device(device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if device.type != "cpu" or advice is None or num_bytes < HUGE_PAGE_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    try:
        mapping = mmap.mmap(
            -1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        mapping.madvise(advice)
    except (OSError, ValueError) as error:
        logger.debug("no huge-page mapping (%s): plain allocation", error)
        return torch.empty(shape, dtype=dtype, device=device)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[offset : offset + num_bytes].view(dtype).view(shape)


def zeros_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``torch.zeros(shape)``, on CPU backed by huge pages where the kernel grants them."""
    return empty_huge_pages(shape, dtype, device).zero_()


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Loading a model frees hundreds of MB of temporaries in pieces of a few MB (dequantized
    float32 arrays, the loader's dense weights once the model packed its own), which glibc
    keeps in its heap: the default model's workers held ~230 MB of RSS that way (measured on
    the AMD EPYC, bench/log/2026-11.md, quantized weights section)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
