"""gRPC ``Membership`` service (the coordinator's internal plane): workers register and
heartbeat their load; operators list them. Served only on ``--internal-port``, behind the
cluster credential check, so only processes holding the cluster token can join or look."""

from __future__ import annotations

import time

import grpc

from splitserve.common.errors import InvalidRequestError
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry, record_of
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2
from splitserve.proto.status import abort_with

HEARTBEAT_INTERVAL_MS = 500


class MembershipServicer(coordinator_pb2_grpc.MembershipServicer):
    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry

    async def RegisterWorker(
        self, request: coordinator_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterWorkerResponse:
        try:
            info = convert.worker_info_from_proto(request.worker)
        except InvalidRequestError as error:
            await abort_with(context, error)
        self._registry.register(record_of(info))
        return coordinator_pb2.RegisterWorkerResponse(heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS)

    async def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        known = self._registry.heartbeat(request.worker_id, convert.load_from_proto(request.load))
        return coordinator_pb2.HeartbeatResponse(known=known)

    async def ListWorkers(
        self, request: coordinator_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListWorkersResponse:
        records = self._registry.workers(healthy_only=False)
        return coordinator_pb2.ListWorkersResponse(workers=[_status(r) for r in records])


def _status(record: WorkerRecord) -> coordinator_pb2.WorkerStatus:
    return coordinator_pb2.WorkerStatus(
        worker=worker_pb2.WorkerInfo(
            worker_id=record.worker_id,
            role=convert.ROLE_TO_PROTO[record.role],
            address=record.address,
            num_blocks=record.num_blocks,
            max_model_len=record.max_model_len,
        ),
        load=convert.load_to_proto(record.load, ready=record.healthy),
        ms_since_heartbeat=int((time.monotonic() - record.last_seen) * 1000),
    )
