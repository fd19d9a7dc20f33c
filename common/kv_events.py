"""A worker's KV events: which block hashes entered or left its prefix cache, in order, so
every coordinator knows where KV lives (issue 33) without polling or shared storage.

``KvEventLog`` (on the worker) numbers each change (``engine/block_pool.py:BlockPool.
cache_listener``, on the engine thread) and keeps the last ``capacity`` of them and the set
they add up to. Each reader (one per coordinator the worker heartbeats to) keeps a cursor:
``since(cursor)`` returns what changed after it, each hash's last change only (applying changes
to a set is last-writer-wins per hash, so that is the same); a reader with no cursor, or one
older than what the log still holds, gets a reset: the whole cached set. Replaying from an
older cursor onto a newer state gives the newest state too, so a reader advances its cursor
only once a batch was delivered, and resends otherwise.

Torch-free; thread-safe (one lock).
"""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass

from splitserve.common.blocks import BlockHash

DEFAULT_CAPACITY = 65536
"""Changes kept for readers that fell behind (16-byte hashes: about 1 MB with overhead)."""


@dataclass(frozen=True)
class KvEvents:
    """What changed in a worker's prefix cache after a reader's cursor, up to ``seq``."""

    seq: int
    """The log's position this batch brings a reader to (its next cursor)."""
    reset: bool
    """True: ``stored`` is the whole cached set (forget what was known); ``evicted`` empty."""
    stored: tuple[BlockHash, ...] = ()
    evicted: tuple[BlockHash, ...] = ()


class KvEventLog:
    """See the module docstring."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._changes: collections.deque[tuple[BlockHash, bool]] = collections.deque(
            maxlen=capacity
        )
        """The last changes, the newest at the right; the rightmost has number ``_seq``."""
        self._cached: set[BlockHash] = set()

    def record(self, block_hash: BlockHash, stored: bool) -> None:
        """One change (the block pool's listener)."""
        with self._lock:
            self._seq += 1
            self._changes.append((block_hash, stored))
            if stored:
                self._cached.add(block_hash)
            else:
                self._cached.discard(block_hash)

    def since(self, cursor: int | None) -> KvEvents:
        """The changes after ``cursor`` (None: a reset), or a reset when the log no longer
        holds them all."""
        with self._lock:
            oldest = self._seq - len(self._changes)  # the cursor the kept changes follow
            if cursor is None or cursor < oldest or cursor > self._seq:
                return KvEvents(self._seq, True, tuple(self._cached))
            last = dict(itertools.islice(self._changes, cursor - oldest, None))
        # the dict keeps each hash's last change (later pairs overwrite earlier ones)
        stored_hashes = tuple(h for h, is_stored in last.items() if is_stored)
        evicted = tuple(h for h, is_stored in last.items() if not is_stored)
        return KvEvents(self._seq, False, stored_hashes, evicted)
