"""Who a worker is on the network, and the cluster access it proves membership with."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.proto.cluster_access import ClusterAccess


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    address: str
    """host:port of its gRPC server, as peers and the coordinator dial it."""
    access: ClusterAccess | None = None
    """How its own calls reach peers: the cluster credential they carry, TLS (a worker that
    calls no peer, as in tests of a decode worker alone, may have none)."""
