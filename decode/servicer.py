"""gRPC ``DecodeWorker`` service: proto <-> domain at the edge, nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from splitserve.common.errors import SplitserveError
from splitserve.decode.worker import DecodeWorker, Reservation
from splitserve.engine.engine_core import StepOutput
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.proto.status import abort_with
from splitserve.worker.servicer_base import WorkerServicerBase


class DecodeServicer(WorkerServicerBase[DecodeWorker], worker_pb2_grpc.DecodeWorkerServicer):
    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        worker = await self.ready(context)
        try:
            params = convert.sampling_from_proto(request.sampling)
        except SplitserveError as error:
            await abort_with(context, error)
        events = worker.generate(
            request.request_id,
            convert.token_ids(request.prompt_token_ids),
            params,
            request.remote_prefill,
        )
        try:
            async for event in events:
                if isinstance(event, Reservation):
                    yield worker_pb2.WorkerGenerateResponse(reservation=_reservation(worker, event))
                else:
                    yield worker_pb2.WorkerGenerateResponse(tokens=_tokens(event))
        except SplitserveError as error:
            await abort_with(context, error)
        finally:
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
        return worker_pb2.KvHandshakeResponse(
            layout=convert.layout_to_proto(layout),
            ucx_address=worker.transport.address,
            transport=worker.transport.name,
        )

    async def CompleteKv(
        self, request: worker_pb2.CompleteKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CompleteKvResponse:
        worker = await self.ready(context)
        try:
            first_logprob = None
            if request.HasField("first_logprob"):
                (first_logprob,) = convert.logprobs_from_proto([request.first_logprob])
            await worker.complete_kv(
                request.transfer_id, request.request_id, request.first_token_id, first_logprob
            )
        except SplitserveError as error:
            await abort_with(context, error)
        return worker_pb2.CompleteKvResponse()

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        worker = await self.ready(context)
        return convert.load_to_proto(await worker.load())


def _reservation(worker: DecodeWorker, reservation: Reservation) -> worker_pb2.KvReservation:
    return worker_pb2.KvReservation(
        transfer_id=reservation.transfer_id,
        decode_address=worker.identity.address,
        decode_worker_id=worker.identity.worker_id,
        num_blocks=reservation.num_blocks,
        num_tokens=reservation.num_tokens,
        compat_hash=reservation.compat_hash,
        block_order=reservation.plan.block_order,
        run_lengths=reservation.plan.run_lengths,
    )


def _tokens(output: StepOutput) -> worker_pb2.WorkerTokens:
    update = output.update
    message = worker_pb2.WorkerTokens(
        token_ids=list(update.new_token_ids),
        logprobs=[convert.logprob_to_proto(logprob) for logprob in output.logprobs],
        finish_reason=convert.FINISH_REASON_TO_PROTO[update.finish_reason],
        usage=common_pb2.Usage(
            prompt_tokens=update.num_prompt_tokens,
            completion_tokens=update.num_output_tokens,
            cached_tokens=update.num_cached_tokens,
        ),
    )
    if update.stop_token_id is not None:
        message.stop_token_id = update.stop_token_id
    return message
