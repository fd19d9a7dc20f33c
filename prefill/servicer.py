"""gRPC ``PrefillWorker`` service: proto <-> domain at the edge (``proto/convert.py``), nothing
else."""

from __future__ import annotations

import grpc
from opentelemetry.trace import SpanKind, StatusCode

from splitserve.common.errors import SplitserveError
from splitserve.common.tracing import start_span
from splitserve.prefill.worker import PrefillWorker
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.proto.status import abort_with
from splitserve.worker.servicer_base import WorkerServicerBase


class PrefillServicer(WorkerServicerBase[PrefillWorker], worker_pb2_grpc.PrefillWorkerServicer):
    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        worker = await self.ready(context)
        span = start_span("prefill", request.request_id, request.traceparent, kind=SpanKind.SERVER)
        try:
            with self.in_flight.track():
                done = await worker.prefill(
                    request.request_id,
                    convert.token_ids(request.prompt_token_ids),
                    convert.sampling_from_proto(request.sampling),
                    convert.reservation_from_proto(request.target),
                    span,
                )
            span.set_attribute("splitserve.cached_tokens", done.num_cached_tokens)
        except SplitserveError as error:
            span.set_status(StatusCode.ERROR, type(error).__name__)
            await abort_with(context, error)
        finally:
            span.end()
        return convert.prefill_done_to_proto(done)
