"""Huge-page backed host tensors: same values as torch's, pages advised where Linux allows."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from splitserve.engine.host_memory import HUGE_PAGE_BYTES, empty_huge_pages, zeros_huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_usable() -> bool:
    """THP in "always" or "madvise" mode on Linux."""
    if not sys.platform.startswith("linux") or not THP_MODE.exists():
        return False
    return "[never]" not in THP_MODE.read_text()


def huge_page_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings overlapping ``tensor``'s memory."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, overlapping = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        mapping = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if mapping:
            low, high = int(mapping[1], 16), int(mapping[2], 16)
            overlapping = low < end and high > start
        elif overlapping and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_zeros_huge_pages_is_zeros_of_the_asked_shape() -> None:
    tensor = zeros_huge_pages((3, 2, 700, 16, 3, 64), torch.bfloat16, "cpu")
    assert tensor.shape == (3, 2, 700, 16, 3, 64) and tensor.dtype == torch.bfloat16
    assert tensor.is_contiguous() and not tensor.any()
    small = zeros_huge_pages((4,), torch.float32, "cpu")  # no whole huge page inside: plain
    assert torch.equal(small, torch.zeros(4))


def test_empty_huge_pages_is_writable() -> None:
    tensor = empty_huge_pages((5 * HUGE_PAGE_BYTES,), torch.uint8, "cpu")
    tensor.fill_(7)
    assert int(tensor.sum()) == 7 * 5 * HUGE_PAGE_BYTES


def test_large_tensors_start_on_a_huge_page_boundary() -> None:
    tensor = empty_huge_pages((3 * HUGE_PAGE_BYTES // 4,), torch.float32, "cpu")
    if sys.platform.startswith("linux"):
        assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    views = [empty_huge_pages((HUGE_PAGE_BYTES,), torch.uint8, "cpu") for _ in range(3)]
    for index, view in enumerate(views):
        view.fill_(index)  # separate memory each
    assert [int(view[0]) for view in views] == [0, 1, 2]


@pytest.mark.skipif(not thp_usable(), reason="transparent huge pages unavailable here")
def test_zeros_huge_pages_gets_huge_pages_where_the_kernel_has_them() -> None:
    tensor = zeros_huge_pages((16 * HUGE_PAGE_BYTES,), torch.uint8, "cpu")
    # The kernel may be short of free 2 MiB pages (fragmentation): at least some must come.
    assert huge_page_kib(tensor) >= HUGE_PAGE_BYTES // 1024
