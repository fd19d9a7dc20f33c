"""Who a worker is on the network, and the cluster credential it proves membership with."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.proto.cluster_auth import ClusterCredential


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    address: str
    """host:port of its gRPC server, as peers and the coordinator dial it."""
    credential: ClusterCredential | None = None
    """The cluster credential its own calls to peers carry (a worker that calls no peer, as
    in tests of a decode worker alone, may have none)."""
