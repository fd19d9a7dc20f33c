"""gRPC ``DecodeWorker`` service: proto <-> domain at the edge (``proto/convert.py``), nothing
else."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry.trace import SpanKind, StatusCode

from splitserve.common.errors import SplitserveError
from splitserve.common.request_update import StepOutput
from splitserve.common.tracing import start_span
from splitserve.decode.worker import DecodeWorker
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.proto.status import abort_with
from splitserve.proto.streams_server import ClientStalled, Outlet, StreamsCall
from splitserve.transfer.reservation import KvHandshake, KvReservation
from splitserve.worker.servicer_base import WorkerServicerBase

STALLED_CALLER_S = 60.0
"""How long a ``GenerateStreams`` write may wait for a coordinator that reads nothing."""


class DecodeServicer(WorkerServicerBase[DecodeWorker], worker_pb2_grpc.DecodeWorkerServicer):
    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        """The request's stream, counted in ``in_flight`` while it runs (a draining worker
        waits for it)."""
        with self.in_flight.track():
            worker = await self.ready(context)
            try:
                async with contextlib.aclosing(self._stream_events(worker, request)) as events:
                    async for event in events:
                        yield _fill(worker_pb2.WorkerGenerateResponse(), event)
            except SplitserveError as error:
                await abort_with(context, error)

    async def GenerateStreams(
        self,
        request_iterator: AsyncIterator[worker_pb2.WorkerStreamsRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Many ``Generate`` streams of one coordinator on one call
        (``proto/streams_server.py``): each runs as ``Generate`` would, counted in
        ``in_flight`` while it runs, its responses batched with the others' (one message
        per engine step, not one per request and step). A coordinator that reads nothing for
        ``STALLED_CALLER_S`` loses the call, ABORTED, and every stream on it is aborted."""
        worker = await self.ready(context)

        async def run(
            request: worker_pb2.WorkerGenerateRequest,
            outlet: Outlet[worker_pb2.WorkerGenerateResponse],
        ) -> None:
            with self.in_flight.track():
                async with contextlib.aclosing(self._stream_events(worker, request)) as events:
                    async for event in events:
                        _fill(outlet.fill(), event)

        streams = StreamsCall(
            run, lambda: False, worker_pb2.WorkerStreamsResponse, worker_pb2.WorkerGenerateResponse
        )
        try:
            await streams.serve(request_iterator, context, STALLED_CALLER_S)
        except ClientStalled:
            message = f"the coordinator read nothing for {STALLED_CALLER_S:g} s; streams aborted"
            await context.abort(grpc.StatusCode.ABORTED, message)

    async def _stream_events(
        self, worker: DecodeWorker, request: worker_pb2.WorkerGenerateRequest
    ) -> AsyncGenerator[KvReservation | StepOutput, None]:
        """The request's stream: its reservation (remote prefill only, first), then its
        step outputs; raises the ``SplitserveError`` it fails with. Traced as ``decode``
        (``common/tracing.py``): events at the reservation and the first tokens, the tokens
        it streamed."""
        params = convert.sampling_from_proto(request.sampling)
        span = start_span("decode", request.request_id, request.traceparent, kind=SpanKind.SERVER)
        span.set_attribute("splitserve.remote_prefill", request.remote_prefill)
        events = worker.generate(
            request.request_id,
            convert.token_ids(request.prompt_token_ids),
            params,
            request.remote_prefill,
            convert.token_ids(request.prior_output_token_ids),
        )
        streamed = 0
        try:
            async for event in events:
                if isinstance(event, KvReservation):
                    span.add_event(
                        "reserved",
                        {"blocks": event.num_blocks, "cached_blocks": event.num_cached_blocks},
                    )
                else:
                    if not streamed:
                        span.add_event("first tokens")
                    streamed += len(event.update.new_token_ids)
                yield event
        except SplitserveError as error:
            span.set_status(StatusCode.ERROR, type(error).__name__)
            raise
        finally:
            span.set_attribute("splitserve.generated_tokens", streamed)
            span.end()
            await events.aclose()

    async def Abort(
        self, request: worker_pb2.WorkerAbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerAbortResponse:
        worker = await self.ready(context)
        aborted = await worker.abort(request.request_id, as_stopped=request.as_stopped)
        return worker_pb2.WorkerAbortResponse(aborted=aborted)

    async def KvHandshake(
        self, request: worker_pb2.KvHandshakeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KvHandshakeResponse:
        worker = await self.ready(context)
        try:
            layout = worker.handshake(convert.layout_from_proto(request.layout))
        except SplitserveError as error:
            await abort_with(context, error)
        transport = worker.transport
        return convert.handshake_to_proto(KvHandshake(layout, transport.name, transport.address))

    async def CompleteKv(
        self, request: worker_pb2.CompleteKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CompleteKvResponse:
        worker = await self.ready(context)
        try:
            first = convert.first_token_from_proto(request)
            await worker.complete_kv(request.transfer_id, request.request_id, first)
        except SplitserveError as error:
            await abort_with(context, error)
        return worker_pb2.CompleteKvResponse()

    async def PushCachedKv(
        self, request: worker_pb2.PushCachedKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushCachedKvResponse:
        worker = await self.ready(context)
        try:
            num_bytes = await worker.push_cached_kv(convert.pull_from_proto(request))
        except SplitserveError as error:
            await abort_with(context, error)
        return worker_pb2.PushCachedKvResponse(bytes_sent=num_bytes)


def _fill(
    response: worker_pb2.WorkerGenerateResponse, event: KvReservation | StepOutput
) -> worker_pb2.WorkerGenerateResponse:
    """Write a stream event into an empty ``response`` (a new one, or one made in place in
    its batch, ``Outlet.fill``); returns it."""
    if isinstance(event, KvReservation):
        response.reservation.CopyFrom(convert.reservation_to_proto(event))
    else:
        convert.fill_step_output(response.tokens, event)
    return response
