"""gRPC ``Coordinator`` service: proto <-> domain at the edge, nothing else.

Errors before the first response end the call with a status (``proto/status.py``); a failure
after tokens were streamed arrives as a final ``error`` message, so the client keeps what it
received.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
from prometheus_client import CollectorRegistry

from splitserve.common.errors import InvalidRequestError, SplitserveError
from splitserve.common.membership import Role
from splitserve.common.output_processor import StreamChunk
from splitserve.common.prompt import Prompt
from splitserve.coordinator.flow import RequestFlow
from splitserve.coordinator.metrics import CoordinatorMetrics
from splitserve.coordinator.registry import WorkerRecord, record_of
from splitserve.coordinator.service import Coordinator
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    worker_pb2,
)
from splitserve.proto.status import abort_with, status_of

HEARTBEAT_INTERVAL_MS = 500


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator, metrics: CoordinatorMetrics | None = None) -> None:
        self._coordinator = coordinator
        self._metrics = metrics or CoordinatorMetrics(
            CollectorRegistry(), coordinator.config.model_name, coordinator.registry
        )
        coordinator.flow_observer = self._metrics.record_flow

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        sent_any = False
        timer = self._metrics.requests.start()
        try:
            sampling = request.sampling
            fill_context = not sampling.HasField("max_tokens")
            if fill_context:  # provisional, valid with min_tokens; replaced by the fill
                sampling = common_pb2.SamplingParams()
                sampling.CopyFrom(request.sampling)
                sampling.max_tokens = max(16, sampling.min_tokens)
            params = convert.sampling_from_proto(sampling)
            stream = self._coordinator.generate(
                request.request_id, _prompt_of(request), params, fill_context=fill_context
            )
            async for flow, chunk in stream:
                timer.tokens(len(chunk.new_token_ids))
                if chunk.finish_reason is not None:
                    timer.finish(
                        chunk.finish_reason.value,
                        len(flow.prompt_token_ids),
                        flow.num_completion_tokens,
                    )
                for response in self._responses(flow, chunk):
                    sent_any = True
                    yield response
        except SplitserveError as error:  # worker failures arrive as domain errors
            timer.finish("error")
            if not sent_any:
                await abort_with(context, error)
            code, message, param = status_of(error)
            yield coordinator_pb2.GenerateResponse(
                request_id=request.request_id,
                error=common_pb2.Error(code=code.value[0], message=message, param=param),
            )
        finally:
            timer.finish("abort")  # no-op unless the client cancelled the call

    def _responses(
        self, flow: RequestFlow, chunk: StreamChunk
    ) -> list[coordinator_pb2.GenerateResponse]:
        usage = convert.usage(
            len(flow.prompt_token_ids), flow.num_completion_tokens, flow.num_cached_tokens
        )
        responses = []
        if chunk.new_token_ids or chunk.text:
            texts = self._token_texts(chunk)
            responses.append(
                coordinator_pb2.GenerateResponse(
                    request_id=flow.request_id,
                    chunk=coordinator_pb2.TokenChunk(
                        token_ids=list(chunk.new_token_ids),
                        text=chunk.text,
                        logprobs=[convert.logprob_to_proto(lp, texts) for lp in chunk.logprobs],
                    ),
                    usage=usage,
                )
            )
        if chunk.finish_reason is not None:
            completion = coordinator_pb2.Completion(
                finish_reason=convert.FINISH_REASON_TO_PROTO[chunk.finish_reason]
            )
            if isinstance(chunk.stop_reason, str):
                completion.stop_string = chunk.stop_reason
            elif isinstance(chunk.stop_reason, int):
                completion.stop_token_id = chunk.stop_reason
            responses.append(
                coordinator_pb2.GenerateResponse(
                    request_id=flow.request_id, completion=completion, usage=usage
                )
            )
        return responses

    def _token_texts(self, chunk: StreamChunk) -> dict[int, str]:
        ids = {lp.token_id for lp in chunk.logprobs}
        ids.update(token for lp in chunk.logprobs for token, _ in lp.top)
        decode = self._coordinator.tokenizer.decode
        return {token: decode([token], skip_special_tokens=False) for token in ids}

    async def Abort(
        self, request: coordinator_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.AbortResponse:
        return coordinator_pb2.AbortResponse(aborted=self._coordinator.abort(request.request_id))

    async def GetModelInfo(
        self, request: coordinator_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ModelInfo:
        coordinator = self._coordinator
        decode = coordinator.registry.workers(Role.DECODE)
        eos = coordinator.tokenizer.eos_token_id
        return coordinator_pb2.ModelInfo(
            model=coordinator.config.model_name,
            max_model_len=coordinator.max_model_len,
            vocab_size=coordinator.tokenizer.vocab_size,
            eos_token_ids=[] if eos is None else [eos],
            dtype=decode[0].dtype if decode else "",
        )

    async def RegisterWorker(
        self, request: coordinator_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterWorkerResponse:
        try:
            info = convert.worker_info_from_proto(request.worker)
        except InvalidRequestError as error:
            await abort_with(context, error)
        self._coordinator.registry.register(record_of(info))
        return coordinator_pb2.RegisterWorkerResponse(heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS)

    async def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        known = self._coordinator.registry.heartbeat(
            request.worker_id, convert.load_from_proto(request.load)
        )
        return coordinator_pb2.HeartbeatResponse(known=known)

    async def ListWorkers(
        self, request: coordinator_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListWorkersResponse:
        records = self._coordinator.registry.workers(healthy_only=False)
        return coordinator_pb2.ListWorkersResponse(workers=[_status(r) for r in records])


def _prompt_of(request: coordinator_pb2.GenerateRequest) -> Prompt:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "chat":
        if not request.chat.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        return [{"role": m.role, "content": m.content} for m in request.chat.messages]
    if kind == "token_ids":
        return list(request.token_ids.ids)
    raise InvalidRequestError("one of text, chat or token_ids is required", "prompt")


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
