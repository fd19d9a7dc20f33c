"""A per-process pool of uint8 transfer buffers, reused so that KV lands in (or leaves from)
memory that is already faulted in and known to the transport (UCX's registration cache).

Fresh buffers cost page faults (and, on RDMA/GPU transports, registration) on first touch: in
``bench/bench_kv_transfer.py`` (two processes, UCX shared memory / CMA) a 64 MiB layer moved at
1.3 GB/s into fresh buffers and 4.1 GB/s into pooled ones. Smaller fresh buffers were often
recycled heap memory already (glibc reuses freed chunks below its mmap threshold, at most 32
MiB); the pool makes reuse deterministic for every size.

Size classes: ``acquire(nbytes)`` is served by a buffer of ``size_class(nbytes)`` bytes: a
page multiple, and above four pages a multiple of a quarter of the power of two below
``nbytes`` (at most 25% slack), so that requests of similar lengths share buffers. KV layers
of whole blocks usually fit a class exactly (3 MiB, 768 KiB, 96 KiB).

Bound: idle buffers (released, not leased) total at most ``max_retained_bytes``; a release
that would exceed it frees the least recently released idle buffers first. Leased buffers are
not counted: the pool never refuses an ``acquire``.

Ownership (the invariant callers keep): a buffer is released exactly once, and only when no
transport operation can still read or write it. A receive posted to UCX cannot be withdrawn,
so a buffer whose receive was cancelled before it completed must never be released (see
``layer_channel.LayerReceiver``). After ``release`` the caller must not touch its view.

Thread contract: every method may be called from any thread (one lock; no allocation,
touching or freeing under it). Today only ``LayerReceiver`` uses it, on the event loop; the
lock lets another thread (say, a prefill engine thread staging KV) acquire what the loop
releases.
"""

from __future__ import annotations

import collections
import mmap
import threading
from dataclasses import dataclass

import torch

PAGE_BYTES = mmap.PAGESIZE
DEFAULT_MAX_RETAINED_BYTES = 256 << 20


def size_class(nbytes: int) -> int:
    """Capacity of the pooled buffer that serves ``nbytes`` (see the module docstring)."""
    if nbytes < 0:
        raise ValueError(f"negative buffer size {nbytes}")
    if nbytes <= 4 * PAGE_BYTES:
        return max(1, -(-nbytes // PAGE_BYTES)) * PAGE_BYTES
    step = 1 << ((nbytes - 1).bit_length() - 3)  # a quarter of the power of two below
    return -(-nbytes // step) * step


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's counters."""

    retained_bytes: int
    """Bytes of idle buffers (kept for reuse)."""
    idle_buffers: int
    leased_buffers: int
    hits: int
    """Acquires served by an idle buffer."""
    misses: int
    """Acquires that allocated a new buffer."""
    freed: int
    """Released buffers dropped to stay within the bound."""


class BufferPool:
    """Pooled contiguous uint8 buffers by size class; see the module docstring."""

    def __init__(
        self,
        max_retained_bytes: int = DEFAULT_MAX_RETAINED_BYTES,
        *,
        pretouch: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        """``pretouch``: write one byte per page of each new buffer in ``acquire`` (host
        memory), so that its page faults are paid there instead of during a transfer."""
        if max_retained_bytes < 0:
            raise ValueError(f"max_retained_bytes must be >= 0, got {max_retained_bytes}")
        self.max_retained_bytes = max_retained_bytes
        self.pretouch = pretouch
        self.device = torch.device(device)
        self._lock = threading.Lock()
        # size class -> idle buffers as (release sequence number, buffer), oldest first
        self._idle: dict[int, collections.deque[tuple[int, torch.Tensor]]] = {}
        self._leased: dict[int, torch.Tensor] = {}  # data_ptr -> backing buffer [capacity]
        self._sequence = 0
        self._retained_bytes = 0
        self._hits = self._misses = self._freed = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A contiguous uint8 view of exactly ``nbytes`` (``[nbytes]``) on a pooled buffer,
        leased to the caller until ``release``. Its contents are undefined."""
        capacity = size_class(nbytes)
        buffer = None
        with self._lock:
            idle = self._idle.get(capacity)
            if idle:
                _, buffer = idle.pop()  # the most recently released: warmest
                self._retained_bytes -= capacity
                self._hits += 1
            else:
                self._misses += 1
        if buffer is None:
            buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)  # [capacity]
            if self.pretouch and self.device.type == "cpu":
                buffer[::PAGE_BYTES].zero_()
        with self._lock:
            self._leased[buffer.data_ptr()] = buffer
        return buffer[:nbytes]

    def release(self, view: torch.Tensor) -> None:
        """Give back a view returned by ``acquire`` (see the ownership invariant).

        Raises ``ValueError`` for a tensor this pool did not lease, or one released twice.
        """
        dropped: list[torch.Tensor] = []  # freed after the lock is released
        with self._lock:
            buffer = self._leased.pop(view.untyped_storage().data_ptr(), None)
            if buffer is None:
                raise ValueError("release of a buffer this pool has not leased (or twice)")
            capacity = buffer.numel()
            if capacity > self.max_retained_bytes:
                dropped.append(buffer)
            else:
                self._sequence += 1
                self._idle.setdefault(capacity, collections.deque()).append(
                    (self._sequence, buffer)
                )
                self._retained_bytes += capacity
                while self._retained_bytes > self.max_retained_bytes:
                    dropped.append(self._evict_oldest())
            self._freed += len(dropped)
        dropped.clear()

    def _evict_oldest(self) -> torch.Tensor:
        """Remove the least recently released idle buffer (lock held)."""
        capacity = min(
            (capacity for capacity, idle in self._idle.items() if idle),
            key=lambda capacity: self._idle[capacity][0][0],
        )
        _, buffer = self._idle[capacity].popleft()
        self._retained_bytes -= capacity
        return buffer

    def clear(self) -> None:
        """Free every idle buffer (leased ones stay leased)."""
        with self._lock:
            idle, self._idle = self._idle, {}
            self._retained_bytes = 0
        idle.clear()

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                retained_bytes=self._retained_bytes,
                idle_buffers=sum(len(idle) for idle in self._idle.values()),
                leased_buffers=len(self._leased),
                hits=self._hits,
                misses=self._misses,
                freed=self._freed,
            )


_process_pool: BufferPool | None = None
_process_pool_lock = threading.Lock()


def process_buffer_pool() -> BufferPool:
    """This process's pool of host transfer buffers (created on first use).

    No pre-touch: receivers acquire on the event loop, where touching a new 16 MiB ring took
    ~9 ms on the dev VM (a stall for every stream the worker serves); a new buffer's faults
    are paid once instead, by the transport thread that first writes it."""
    global _process_pool
    with _process_pool_lock:
        if _process_pool is None:
            _process_pool = BufferPool()
        return _process_pool
