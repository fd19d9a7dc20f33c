"""The coordinator's registry of workers (torch-free).

Workers register with their role, address and KV layout, then heartbeat with load figures.
A worker silent for ``expiry_s`` is dropped; one whose call failed is marked unhealthy until
its next heartbeat (so routing avoids it at once). ``pending_*`` counters are the
coordinator's own bookkeeping of work dispatched since the last heartbeat, so that a burst of
requests does not all land on the worker that looked idlest a moment ago.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitserve.common.load import EngineLoad


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class WorkerRecord:
    worker_id: str
    role: Role
    address: str
    compat_hash: str
    block_size: int
    dtype: str
    num_blocks: int
    max_model_len: int
    load: EngineLoad = field(default_factory=EngineLoad)
    last_seen: float = field(default_factory=time.monotonic)
    healthy: bool = True
    pending_requests: int = 0
    """Requests dispatched here and not finished (coordinator's count)."""
    pending_prefill_tokens: int = 0
    """Prompt tokens sent here for prefill and not yet returned (coordinator's count)."""


class WorkerRegistry:
    """Registered workers by id."""

    def __init__(self, expiry_s: float = 10.0) -> None:
        self.expiry_s = expiry_s
        self._workers: dict[str, WorkerRecord] = {}

    def register(self, record: WorkerRecord) -> None:
        """Add or replace a worker (a restarted worker registers again under its id)."""
        previous = self._workers.get(record.worker_id)
        if previous is not None:
            record.pending_requests = previous.pending_requests
            record.pending_prefill_tokens = previous.pending_prefill_tokens
        self._workers[record.worker_id] = record

    def heartbeat(self, worker_id: str, load: EngineLoad) -> bool:
        """Record a heartbeat; False when the worker is unknown (it must register again)."""
        record = self._workers.get(worker_id)
        if record is None:
            return False
        record.load = load
        record.last_seen = time.monotonic()
        record.healthy = True
        return True

    def mark_failed(self, worker_id: str) -> None:
        record = self._workers.get(worker_id)
        if record is not None:
            record.healthy = False

    def expire(self, now: float | None = None) -> list[WorkerRecord]:
        """Drop workers silent for longer than ``expiry_s``; returns them."""
        now = time.monotonic() if now is None else now
        dead = [w for w in self._workers.values() if now - w.last_seen > self.expiry_s]
        for record in dead:
            del self._workers[record.worker_id]
        return dead

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def workers(self, role: Role | None = None, healthy_only: bool = True) -> list[WorkerRecord]:
        return [
            w
            for w in self._workers.values()
            if (role is None or w.role is role) and (w.healthy or not healthy_only)
        ]
