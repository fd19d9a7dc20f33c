"""Typed client of the coordinator's membership calls (``RegisterWorker``, ``Heartbeat``,
``LeaveCluster``, ``ListWorkers``): the only code outside the coordinator that builds or
reads their proto messages. A failed call raises
the domain error ``status.error_from_rpc`` maps it to."""

from __future__ import annotations

import grpc

from splitserve.common.kv_events import KvEvents
from splitserve.common.load import LoadReport
from splitserve.common.membership import MemberStatus, WorkerInfo
from splitserve.proto import convert
from splitserve.proto.cluster_auth import ClusterCredential
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.status import call_internal


class MembershipClient:
    """Calls the coordinator's internal port with the cluster credential."""

    def __init__(self, channel: grpc.aio.Channel, credential: ClusterCredential) -> None:
        self._stub = coordinator_pb2_grpc.MembershipStub(channel)
        self._metadata = credential.metadata

    async def register(self, info: WorkerInfo, timeout_s: float) -> float:
        """Announce the worker; returns the heartbeat interval the coordinator asks for, in
        seconds."""
        request = coordinator_pb2.RegisterWorkerRequest(worker=convert.worker_info_to_proto(info))
        reply = await call_internal(
            self._stub.RegisterWorker(request, timeout=timeout_s, metadata=self._metadata)
        )
        return reply.heartbeat_interval_ms / 1000

    async def heartbeat(
        self,
        worker_id: str,
        report: LoadReport,
        timeout_s: float,
        kv_events: KvEvents | None = None,
    ) -> bool:
        """Report the worker's load and readiness, and its prefix cache's changes
        (``kv_events``, None: none sent); False when the coordinator does not know the worker
        (it restarted): register again."""
        request = coordinator_pb2.HeartbeatRequest(
            worker_id=worker_id, load=convert.report_to_proto(report)
        )
        if kv_events is not None:
            request.kv_events.CopyFrom(convert.kv_events_to_proto(kv_events))
        reply = await call_internal(
            self._stub.Heartbeat(request, timeout=timeout_s, metadata=self._metadata)
        )
        return reply.known

    async def leave(self, worker_id: str, timeout_s: float) -> bool:
        """Tell the coordinator the worker drains: nothing new is routed to it; False when
        the coordinator did not know it."""
        request = coordinator_pb2.LeaveClusterRequest(worker_id=worker_id)
        reply = await call_internal(
            self._stub.LeaveCluster(request, timeout=timeout_s, metadata=self._metadata)
        )
        return reply.known

    async def routable_members(self, timeout_s: float) -> frozenset[str]:
        """The ids of the workers the coordinator routes requests to now (``ListWorkers``:
        registered, dialled back, healthy, circuit closed)."""
        members = await self.list_workers(timeout_s)
        return frozenset(member.info.worker_id for member in members if member.routable)

    async def list_workers(self, timeout_s: float) -> list[MemberStatus]:
        """Every worker the coordinator has registered, with its latest load."""
        reply = await call_internal(
            self._stub.ListWorkers(
                coordinator_pb2.ListWorkersRequest(), timeout=timeout_s, metadata=self._metadata
            )
        )
        return [
            MemberStatus(
                info=convert.worker_info_from_proto(status.worker),
                load=convert.load_from_proto(status.load),
                ready=status.load.ready,
                ms_since_heartbeat=status.ms_since_heartbeat,
                routable=status.routable,
            )
            for status in reply.workers
        ]
