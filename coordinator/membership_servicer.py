"""gRPC ``Membership`` service (the coordinator's internal plane): workers register, heartbeat
their load and leave when they drain (nothing new is routed to them from then on; the
``on_leave`` callback lets the router forget them); operators list them. Served only on
``--internal-port``, behind the cluster credential check, so only processes holding the
cluster token can join or look."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from splitserve.common.errors import InvalidRequestError
from splitserve.common.kv_events import KvEvents
from splitserve.coordinator.dial_check import DialCheck
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry, record_of, routable
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2
from splitserve.proto.status import abort_with

logger = logging.getLogger(__name__)
HEARTBEAT_INTERVAL_MS = 500


class MembershipServicer(coordinator_pb2_grpc.MembershipServicer):
    def __init__(
        self,
        registry: WorkerRegistry,
        on_leave: Callable[[str], None] = lambda worker_id: None,
        dial_check: DialCheck | None = None,
        on_kv_events: Callable[[str, KvEvents], None] = lambda worker_id, events: None,
    ) -> None:
        """``dial_check``: dial each registered worker back before it is routed to
        (``dial_check.py``); None: route to it at once. ``on_kv_events``: a known worker's
        prefix-cache changes, as each heartbeat brings them (the router's view of them)."""
        self._registry = registry
        self._on_leave = on_leave
        self._dial_check = dial_check
        self._on_kv_events = on_kv_events

    async def RegisterWorker(
        self, request: coordinator_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterWorkerResponse:
        try:
            info = convert.worker_info_from_proto(request.worker)
        except InvalidRequestError as error:
            await abort_with(context, error)
        refusal = self._registry.refusal(info)
        if refusal is not None:
            logger.warning("refused worker %s (%s): %s", info.worker_id, info.address, refusal)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        self._registry.register(record_of(info, dialled=self._dial_check is None))
        if self._dial_check is not None:
            self._dial_check.verify(info.worker_id, info.address)
        return coordinator_pb2.RegisterWorkerResponse(heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS)

    async def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        report = convert.report_from_proto(request.load)
        known = self._registry.heartbeat(
            request.worker_id, report.load, report.ready, report.adapters
        )
        if known and request.HasField("kv_events"):
            self._on_kv_events(request.worker_id, convert.kv_events_from_proto(request.kv_events))
        return coordinator_pb2.HeartbeatResponse(known=known)

    async def LeaveCluster(
        self, request: coordinator_pb2.LeaveClusterRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.LeaveClusterResponse:
        record = self._registry.remove(request.worker_id)
        if record is not None:
            logger.info("worker %s (%s) left to drain", record.worker_id, record.address)
            self._on_leave(record.worker_id)
        return coordinator_pb2.LeaveClusterResponse(known=record is not None)

    async def ListWorkers(
        self, request: coordinator_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListWorkersResponse:
        records = self._registry.workers(healthy_only=False)
        now = time.monotonic()
        return coordinator_pb2.ListWorkersResponse(workers=[_status(r, now) for r in records])


def _status(record: WorkerRecord, now: float) -> coordinator_pb2.WorkerStatus:
    return coordinator_pb2.WorkerStatus(
        worker=worker_pb2.WorkerInfo(
            worker_id=record.worker_id,
            role=convert.ROLE_TO_PROTO[record.role],
            address=record.address,
            num_blocks=record.num_blocks,
            max_model_len=record.max_model_len,
            adapters=convert.adapters_to_proto(sorted(record.adapters, key=lambda a: a.name)),
        ),
        load=convert.load_to_proto(record.load, ready=record.healthy),
        ms_since_heartbeat=int((now - record.last_heartbeat) * 1000),
        routable=routable(record, now),
    )
