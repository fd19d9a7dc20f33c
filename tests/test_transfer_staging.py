"""Staging rings (``transfer/staging.py``): how deep a receiver's ring is, which slot a layer
goes into, when its slots are made (all at once within the process's budget, else two and
the rest once its first layer landed), and the host slots a process keeps for reuse within
its bound."""

from __future__ import annotations

import pytest
import torch

from splitserve.transfer import staging
from splitserve.transfer.staging import (
    MIN_DEPTH,
    STAGING_BYTES,
    StagingRing,
    kept_bytes,
    made_bytes,
    ring_depth,
)

CPU = torch.device("cpu")
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _own_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept slots and made bytes of this test's own (other tests' are put back after)."""
    monkeypatch.setattr(staging, "_POOL", staging._HostSlots())  # noqa: SLF001 - isolation
    monkeypatch.setattr(staging, "_MADE", staging._Made())  # noqa: SLF001 - isolation


def test_a_ring_holds_what_fits_in_its_bytes_at_least_two_layers_at_most_all() -> None:
    assert ring_depth(30, 96 << 10) == 30  # a 128-token prompt of the default model: all
    assert ring_depth(32, 4 * MiB) == STAGING_BYTES // (4 * MiB) == 8  # Llama-8B, 1,024
    assert ring_depth(32, 32 * MiB) == MIN_DEPTH == 2  # Llama-8B, 8,192: two layers
    assert ring_depth(1, 64 * MiB) == 1  # a single layer
    assert ring_depth(0, 1) == 0
    assert ring_depth(8, 16 * MiB, on_gpu=True) == 8  # Llama-8B, 1,024 tokens in 8 groups
    assert ring_depth(8, 16 * MiB) == MIN_DEPTH  # the same in host memory: two


def test_layer_n_goes_into_slot_n_mod_depth() -> None:
    ring = StagingRing(3, 64, CPU)
    assert ring.made == 3
    slots = [ring.slot(layer).data_ptr() for layer in range(7)]
    assert slots[:3] == slots[3:6] and len(set(slots[:3])) == 3
    assert slots[6] == slots[0]
    assert all(ring.slot(layer).numel() == 64 for layer in range(7))


def test_past_the_eager_budget_a_ring_starts_with_two_slots_and_grows_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(staging, "EAGER_BYTES", 10 * 64)
    first = StagingRing(8, 64, CPU)  # 512 bytes: within the budget, made at once
    assert first.made == 8 and made_bytes() == 8 * 64
    second = StagingRing(8, 64, CPU)  # would pass it: starts with two
    assert second.made == MIN_DEPTH
    assert made_bytes() == 10 * 64
    assert list(second.grow()) == list(range(MIN_DEPTH, 8))  # the layers that go in first
    assert second.made == 8 and list(second.grow()) == []
    first.release()
    second.release()
    assert made_bytes() == 0


def test_released_host_slots_are_reused_within_the_kept_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(staging, "KEEP_BYTES", 3 * 64)
    ring = StagingRing(4, 64, CPU)
    originals = [ring.slot(layer) for layer in range(4)]  # held: no address is reused
    pointers = {slot.data_ptr() for slot in originals}
    ring.release()
    assert kept_bytes() == 3 * 64  # one of four dropped: the bound
    again = StagingRing(4, 64, CPU)
    reused = {again.slot(layer).data_ptr() for layer in range(4)} & pointers
    assert len(reused) == 3 and kept_bytes() == 0
    other = StagingRing(2, 32, CPU)  # another size: a new buffer, never a kept one
    assert {other.slot(layer).data_ptr() for layer in range(2)}.isdisjoint(pointers)
