"""gRPC ``WorkerMonitor`` service, on every worker whatever its role: the worker's load
figures as a stream, for a coordinator that learned of the worker from etcd (its load never
goes through etcd). Before the model is loaded every call fails with UNAVAILABLE."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from splitserve.common.kv_events import KvEventLog
from splitserve.common.load import LoadReport
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.worker.servicer_base import WorkerServicerBase

MIN_INTERVAL_MS = 50
MAX_INTERVAL_MS = 5000

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerMonitor"].full_name
LoadSource = Callable[[], Awaitable[LoadReport]]


class MonitorServicer(WorkerServicerBase[LoadSource], worker_pb2_grpc.WorkerMonitorServicer):
    """Bound to the worker's load report (figures and readiness) once the engine is up.
    ``kv_events``: the worker's prefix-cache changes (set before binding; None: none sent):
    each stream's first message carries the whole cached set, every later one what changed
    since the one before (``common/kv_events.py``; a new stream starts over)."""

    kv_events: KvEventLog | None = None

    def add_to(self, server: grpc.aio.Server) -> str:
        """Register on ``server``; the service's full name (for health and reflection)."""
        worker_pb2_grpc.add_WorkerMonitorServicer_to_server(self, server)
        return SERVICE_NAME

    async def WatchLoad(
        self, request: worker_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerLoad]:
        load = await self.ready(context)
        interval_ms = min(max(request.interval_ms, MIN_INTERVAL_MS), MAX_INTERVAL_MS)
        cursor: int | None = None
        while True:
            report = await load()
            message = convert.report_to_proto(report)
            if self.kv_events is not None:
                events = self.kv_events.since(cursor)
                message.kv_events.CopyFrom(convert.kv_events_to_proto(events))
                cursor = events.seq
            yield message
            await asyncio.sleep(interval_ms / 1000)
