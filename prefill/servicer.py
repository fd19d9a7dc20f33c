"""gRPC ``PrefillWorker`` service: proto <-> domain at the edge, nothing else."""

from __future__ import annotations

import grpc

from splitserve.common.errors import SplitserveError
from splitserve.prefill.worker import KvTarget, PrefillWorker
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.proto.status import abort_with
from splitserve.worker.servicer_base import WorkerServicerBase


class PrefillServicer(WorkerServicerBase[PrefillWorker], worker_pb2_grpc.PrefillWorkerServicer):
    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        worker = await self.ready(context)
        target = request.target
        try:
            result = await worker.prefill(
                request.request_id,
                convert.token_ids(request.prompt_token_ids),
                convert.sampling_from_proto(request.sampling),
                KvTarget(
                    decode_address=target.decode_address,
                    transfer_id=target.transfer_id,
                    num_blocks=target.num_blocks,
                    num_tokens=target.num_tokens,
                    compat_hash=target.compat_hash,
                    plan=convert.plan_from_proto(target),
                ),
            )
        except (SplitserveError, grpc.aio.AioRpcError) as error:
            await abort_with(context, error)
        response = worker_pb2.PrefillResponse(
            first_token_id=result.first_token_id,
            num_cached_tokens=result.num_cached_tokens,
            prefill_ms=result.prefill_ms,
            transfer_wait_ms=result.transfer_wait_ms,
            bytes_sent=result.bytes_sent,
        )
        if result.first_logprob is not None:
            response.first_logprob.CopyFrom(convert.logprob_to_proto(result.first_logprob))
        return response

    async def Abort(
        self, request: worker_pb2.WorkerAbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerAbortResponse:
        worker = await self.ready(context)
        worker.engine.abort(request.request_id)
        return worker_pb2.WorkerAbortResponse(aborted=True)

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        worker = await self.ready(context)
        return convert.load_to_proto(await worker.load())
