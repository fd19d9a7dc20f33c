"""The coordinator's registry of workers (torch-free).

Workers register with their role, address and KV layout, then heartbeat with load figures.
A worker silent for ``expiry_s`` (no heartbeat, no streamed message, no prefill reply) is
dropped; one whose call failed is marked unhealthy until
its next heartbeat (so routing avoids it at once), and its ``CircuitBreaker``
(``coordinator/circuit_breaker.py``) keeps it out of routing after several failed calls in a
row, whatever its heartbeats say, until a back-off passed; one this coordinator has not dialled
back yet (``WorkerRecord.dialled``) is not routed to. The registry holds what workers report;
the work this coordinator dispatched and that no report reflects yet is the router's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from splitserve.common.adapter_id import AdapterId
from splitserve.common.load import EngineLoad
from splitserve.common.membership import Role, WorkerInfo
from splitserve.coordinator.circuit_breaker import CircuitBreaker


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
    pulls_cached_kv_min_blocks: int = 0
    """A prefill worker that pulls a decode worker's cached prefix when it would get at
    least this many blocks so (``WorkerInfo``); 0: it does not."""
    adapters: frozenset[AdapterId] = frozenset()
    """The LoRA adapters it serves: ``WorkerInfo.adapters`` at registration, then as its load
    reports say (``heartbeat``) and as this coordinator's runtime loads and unloads leave
    them (``coordinator/runtime_adapters.py``)."""
    load: EngineLoad = field(default_factory=EngineLoad)
    last_heartbeat: float = field(default_factory=time.monotonic)
    """When ``load`` was last reported (registration or heartbeat)."""
    last_seen: float = field(default_factory=time.monotonic)
    """The latest sign of life: a heartbeat, or a message or reply on a call (``seen``)."""
    healthy: bool = True
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    dialled: bool = True
    """This coordinator reached the worker at ``address`` (a registration that has not been
    dialled back yet is not routed to: a wrong advertised address or a one-way partition
    would fail every first attempt)."""

    def seen(self) -> None:
        """The worker answered one of this coordinator's calls (a streamed message, a
        prefill's reply): it is alive, whatever its heartbeats do. A coordinator relaying
        thousands of streams may take its heartbeat calls late (a worker gives each
        ``HEARTBEAT_TIMEOUT_S``); it must not expire a worker whose streams it is reading.
        The load figures still come with heartbeats only."""
        self.last_seen = time.monotonic()


def routable(record: WorkerRecord, now: float) -> bool:
    """Whether requests may be routed to the worker now: dialled, healthy and not held off by
    its circuit breaker."""
    return record.dialled and record.healthy and record.breaker.allows(now)


def record_of(info: WorkerInfo, dialled: bool = True) -> WorkerRecord:
    """A fresh registry record for a worker that just registered (no load reported yet);
    ``dialled=False``: not routed to until ``WorkerRegistry.mark_dialled``."""
    return WorkerRecord(
        dialled=dialled,
        worker_id=info.worker_id,
        role=info.role,
        address=info.address,
        compat_hash=info.layout.compat_hash,
        block_size=info.layout.block_size,
        dtype=info.layout.dtype,
        num_blocks=info.num_blocks,
        max_model_len=info.max_model_len,
        pulls_cached_kv_min_blocks=info.pulls_cached_kv_min_blocks,
        adapters=frozenset(info.adapters),
        load=EngineLoad(num_total_blocks=info.num_blocks),
    )


class WorkerRegistry:
    """Registered workers by id, all of one model: ``model`` (a checkpoint's name, "" for
    any) is the only one whose workers ``accepts``."""

    def __init__(self, expiry_s: float = 10.0, model: str = "") -> None:
        self.expiry_s = expiry_s
        self.model = model
        self._workers: dict[str, WorkerRecord] = {}

    def accepts(self, info: WorkerInfo) -> bool:
        """Whether ``info``'s worker may join (``refusal`` says why not)."""
        return self.refusal(info) is None

    def refusal(self, info: WorkerInfo) -> str | None:
        """Why ``info``'s worker may not join, None when it may: it serves another model than
        this registry's (a worker or a registry that names none is taken to), or a LoRA
        adapter under a name another registered worker serves with other files (its digest).
        Callers check before ``register``: a coordinator routes within one model
        (``proto/.../worker.proto``: ``WorkerInfo.model``), and a request of an adapter may
        have its prompt computed by one worker and decoded by another."""
        if info.model and self.model and info.model != self.model:
            return (
                f"this coordinator serves the model {self.model!r}, not {info.model!r}: "
                "register with that model's coordinators"
            )
        for adapter in info.adapters:
            for worker in self._workers.values():
                if worker.worker_id == info.worker_id:
                    continue
                theirs = {a.digest for a in worker.adapters if a.name == adapter.name}
                if theirs and adapter.digest not in theirs:
                    return (
                        f"its LoRA adapter {adapter.name!r} differs from the one worker "
                        f"{worker.worker_id} serves under that name (other files): give each "
                        "adapter one name across the cluster"
                    )
        return None

    def adapter_names(self) -> set[str]:
        """The LoRA adapters the routable workers serve, by name."""
        return {adapter.name for worker in self.workers() for adapter in worker.adapters}

    def register(self, record: WorkerRecord) -> None:
        """Add or replace a worker (a restarted worker registers again under its id)."""
        self._workers[record.worker_id] = record

    def heartbeat(
        self,
        worker_id: str,
        load: EngineLoad,
        ready: bool = True,
        adapters: Iterable[AdapterId] | None = None,
    ) -> bool:
        """Record a heartbeat; False when the worker is unknown (it must register again).
        ``ready``: the worker makes progress; a worker that reports it stalled is kept (it
        may recover) but not routed to. ``adapters``: the LoRA adapters it serves now
        (``LoadReport.adapters``; None: unchanged)."""
        record = self._workers.get(worker_id)
        if record is None:
            return False
        record.load = load
        if adapters is not None:
            record.adapters = frozenset(adapters)
        record.last_heartbeat = record.last_seen = time.monotonic()
        record.healthy = ready
        return True

    def remove(self, worker_id: str) -> WorkerRecord | None:
        """Drop a worker that left (it drains); returns its record, None when unknown."""
        return self._workers.pop(worker_id, None)

    def mark_failed(self, worker_id: str, now: float | None = None) -> None:
        """A call to the worker failed: unhealthy until its next heartbeat, and one more
        failure for its circuit breaker."""
        record = self._workers.get(worker_id)
        if record is not None:
            record.healthy = False
            record.breaker.record_failure(time.monotonic() if now is None else now)

    def mark_succeeded(self, worker_id: str) -> None:
        """A call to the worker did its work: its circuit breaker closes."""
        record = self._workers.get(worker_id)
        if record is not None:
            record.breaker.record_success()

    def mark_dialled(self, worker_id: str, address: str) -> bool:
        """This coordinator reached the worker at ``address``; False when the worker is
        unknown or registered again at another address meanwhile."""
        record = self._workers.get(worker_id)
        if record is None or record.address != address:
            return False
        record.dialled = True
        return True

    def expire(self, now: float | None = None) -> list[WorkerRecord]:
        """Drop workers silent for longer than ``expiry_s``; returns them."""
        now = time.monotonic() if now is None else now
        dead = [w for w in self._workers.values() if now - w.last_seen > self.expiry_s]
        for record in dead:
            del self._workers[record.worker_id]
        return dead

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def workers(
        self, role: Role | None = None, healthy_only: bool = True, now: float | None = None
    ) -> list[WorkerRecord]:
        """Workers of ``role`` (any when None); with ``healthy_only``, those routable now
        (``routable``)."""
        now = time.monotonic() if now is None else now
        return [
            w
            for w in self._workers.values()
            if (role is None or w.role is role) and (not healthy_only or routable(w, now))
        ]
