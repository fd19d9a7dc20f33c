"""The staging ring of a receiver whose destination is not one region: how deep it is, when
its slots are made, and host memory kept for reuse.

A ring has ``depth`` slots of one message each (a layer, or a group of layers: ``plan.py``;
``ring_depth``): message ``n`` is received into slot ``n % depth``, and every slot has a
receive posted from the start. Its slots are all
made with it while this process's rings hold less than ``EAGER_BYTES``; past that a new ring
starts with ``MIN_DEPTH`` slots and makes the others when its transfer's first layer landed
(``grow``), so that reservations whose prefill has not started (queued ones) cannot pile up
staging. Bound: a ring holds at most ``max(STAGING_BYTES, MIN_DEPTH messages)``
(``DEVICE_STAGING_BYTES`` on a GPU); the rings of a process, at most ``EAGER_BYTES`` plus
``MIN_DEPTH`` messages a ring plus what the rings of started transfers grew by.

Why deep, and why made at once: the receive of layer ``n + depth`` is posted only once layer
``n`` was copied out of its slot, one trip through UCX's completion notice and the event loop:
while it lasts, the sender's next messages wait. The deeper the ring, the more bytes flow
meanwhile. A ring that starts with two slots exposes one such trip when its first layer
lands, unless the next layers are still being computed (a prefill worker sends each layer as
it is written, so in serving it mostly is). Measured with the layers offered at once
(``bench/bench_kv_transfer.py``, 2-core VM, 3 interleaved rounds of 11 repetitions): a
1,024-token prompt of the default model at 5.1-5.5 GB/s with its ring made at once, 3.8-4.1
starting with two slots; a 128-token one at 1.3-1.4 against 0.75-0.83.

Host memory kept for reuse: a fresh host allocation of a few MiB is fresh pages, each faulted
in on its first write, and a ring writes every page of its slots once per ``depth`` layers: a
64 MiB layer through a fresh slot moved at 2 GB/s, through a reused one at 5-7 GB/s (2-core
VM). So ``release`` keeps host slots for later rings, at most ``KEEP_BYTES`` per process (the
most recently released first); CUDA slots go back to torch's caching allocator, which keeps
freed device memory for reuse already. A ring is released only once no receive is posted into
it and no copy out of it is queued (``LayerReceiver``, once settled): a slot with a receive in
flight is never reused.

Thread contract: the event loop of the process's transport only (one per process).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

STAGING_BYTES = 32 << 20
"""A ring in host memory has as many slots as messages fit in this (at least ``MIN_DEPTH``)."""
DEVICE_STAGING_BYTES = 128 << 20
"""The same for a ring in GPU memory: a 1,024-token Llama-8B prompt's 8 messages of 16 MiB
(``destination.MIN_MESSAGE_BYTES``) all posted at once, as its 32 layers of 4 MiB were 8 at a
time in 32 MiB; a sliver of a GPU's KV cache."""
MIN_DEPTH = 2
"""Slots of a ring at least (one copied out while the next one is received), and those a
ring made past ``EAGER_BYTES`` starts with."""
EAGER_BYTES = 256 << 20
"""Slots of this process's rings (made, not released) below which a new ring makes all of its
slots at once."""
KEEP_BYTES = 256 << 20
"""Host memory of released slots a process keeps for reuse, at most."""


def ring_depth(num_messages: int, message_bytes: int, on_gpu: bool = False) -> int:
    """Slots of a ring for ``num_messages`` messages of ``message_bytes``: as many as fit in
    ``STAGING_BYTES`` (``DEVICE_STAGING_BYTES`` ``on_gpu``), at least ``MIN_DEPTH``, never
    more than ``num_messages``."""
    room = DEVICE_STAGING_BYTES if on_gpu else STAGING_BYTES
    fitting = room // max(message_bytes, 1)
    return min(num_messages, max(MIN_DEPTH, fitting))


class StagingRing:
    """One receiver's slots: ``depth`` uint8 buffers of ``message_bytes`` on ``device``."""

    def __init__(self, depth: int, message_bytes: int, device: torch.device) -> None:
        self.depth = depth
        self._message_bytes = message_bytes
        self._device = device
        eager = _MADE.bytes + depth * message_bytes <= EAGER_BYTES
        self._slots = [self._take() for _ in range(depth if eager else min(depth, MIN_DEPTH))]

    @property
    def made(self) -> int:
        """Slots made so far: layers ``0 .. made - 1`` may be posted."""
        return len(self._slots)

    def slot(self, layer: int) -> torch.Tensor:
        """The buffer of ``layer``: slot ``layer % depth`` (made already)."""
        return self._slots[layer % self.depth]

    def grow(self) -> range:
        """Make the slots not made yet; returns their indices (empty once grown), which are
        also the layers that go into them first."""
        first = len(self._slots)
        self._slots.extend(self._take() for _ in range(first, self.depth))
        return range(first, self.depth)

    def release(self) -> None:
        """Give the slots back (nothing may use them any more): host slots are kept for later
        rings within ``KEEP_BYTES``."""
        for buffer in self._slots:
            _MADE.bytes -= buffer.numel()
            _POOL.keep(buffer)
        self._slots = []

    def _take(self) -> torch.Tensor:
        """A kept host slot of this size if there is one, else a new buffer."""
        _MADE.bytes += self._message_bytes
        if self._device.type == "cpu":
            kept = _POOL.take(self._message_bytes)
            if kept is not None:
                return kept
        return torch.empty(self._message_bytes, dtype=torch.uint8, device=self._device)


@dataclass
class _Made:
    bytes: int = 0
    """Slots of this process's rings made and not released."""


_MADE = _Made()


class _HostSlots:
    """Released host slots, kept for reuse within ``KEEP_BYTES``, the oldest dropped first."""

    def __init__(self) -> None:
        self._kept: OrderedDict[int, torch.Tensor] = OrderedDict()  # by id, oldest first
        self.kept_bytes = 0

    def take(self, num_bytes: int) -> torch.Tensor | None:
        for key, buffer in reversed(self._kept.items()):  # the most recently kept first
            if buffer.numel() == num_bytes:
                del self._kept[key]
                self.kept_bytes -= num_bytes
                return buffer
        return None

    def keep(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu" or buffer.numel() > KEEP_BYTES:
            return
        self._kept[id(buffer)] = buffer
        self.kept_bytes += buffer.numel()
        while self.kept_bytes > KEEP_BYTES:
            _, dropped = self._kept.popitem(last=False)
            self.kept_bytes -= dropped.numel()


_POOL = _HostSlots()
"""This process's kept host slots."""


def kept_bytes() -> int:
    """Host memory of the slots kept now."""
    return _POOL.kept_bytes


def made_bytes() -> int:
    """Slots of this process's rings made and not released now."""
    return _MADE.bytes
