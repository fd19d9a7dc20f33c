"""Who a worker is on the network."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    address: str
    """host:port of its gRPC server, as peers and the coordinator dial it."""
