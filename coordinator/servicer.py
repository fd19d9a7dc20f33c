"""gRPC ``Coordinator`` service (the public plane): proto <-> domain at the edge, nothing else.

Errors before the first response end the call with a status (``proto/status.py``); a failure
after tokens were streamed arrives as a final ``error`` message, so the client keeps what it
received.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from prometheus_client import CollectorRegistry

from splitserve.common.api_keys import ApiKeys, Caller
from splitserve.common.errors import InvalidRequestError, SplitserveError
from splitserve.common.membership import Role
from splitserve.common.metrics import RequestTimer
from splitserve.common.output_processor import StreamChunk
from splitserve.common.prompt import Prompt, check_in_vocab
from splitserve.coordinator.flow import RequestFlow
from splitserve.coordinator.metrics import CoordinatorMetrics
from splitserve.coordinator.placement import LatencyTargets
from splitserve.coordinator.request_record import RequestAsk
from splitserve.coordinator.service import Coordinator
from splitserve.proto import convert
from splitserve.proto.api_key_auth import caller_of
from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.status import abort_with, status_of
from splitserve.proto.streams_server import ClientStalled, Outlet, StreamsCall

GenerateResponse = coordinator_pb2.GenerateResponse

SEND_TIMEOUT_S = 30.0
"""How long one response may wait for a client that does not read (``Generate``)."""


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        coordinator: Coordinator,
        metrics: CoordinatorMetrics | None = None,
        keys: ApiKeys | None = None,
        send_timeout_s: float = SEND_TIMEOUT_S,
    ) -> None:
        """``keys``: the API keys calls are scoped by (the server's ``ApiKeyInterceptor``
        refuses calls without one); None: anonymous callers. ``send_timeout_s``: see
        ``Generate``."""
        self._coordinator = coordinator
        self._send_timeout_s = send_timeout_s
        self.draining = False
        """Set when the server drains: ``GenerateStreams`` ends new streams UNAVAILABLE (new
        ``Generate`` calls are refused by the stopping server itself)."""
        self._keys = keys or ApiKeys()
        self._metrics = metrics or CoordinatorMetrics(
            CollectorRegistry(), coordinator.config.model_name, coordinator.registry
        )
        coordinator.flow_observer = self._metrics.record_flow

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream the request's responses, each written within ``send_timeout_s``: a client
        that stops reading for that long (its flow-control window full: what waits for it
        is bounded by the window) loses the call, ABORTED, and its request is aborted, which
        frees its blocks on every worker."""
        caller = await caller_of(self._keys, context)
        try:
            await self.run_stream(request, caller, functools.partial(self._send, context))
        except SplitserveError as error:  # refused or failed before any response
            await abort_with(context, error)
        except ClientStalled:
            await self._cut_stalled(context, "request aborted")

    async def GenerateStreams(
        self,
        request_iterator: AsyncIterator[coordinator_pb2.StreamsRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Many ``Generate`` streams of one caller on one call
        (``proto/streams_server.py``): each runs as ``Generate`` would, its
        responses batched with the others'. A caller that reads nothing for
        ``send_timeout_s`` loses the call, ABORTED, and every stream on it is aborted."""
        caller = await caller_of(self._keys, context)
        max_queued = self._coordinator.config.admission.max_queued_requests

        def run(
            request: coordinator_pb2.GenerateRequest, outlet: Outlet[GenerateResponse]
        ) -> Awaitable[None]:
            admitted = functools.partial(outlet.admitted, max_queued)
            return self.run_stream(request, caller, outlet, outlet.fill, admitted)

        streams = StreamsCall(
            run,
            lambda: self.draining,
            coordinator_pb2.StreamsResponse,
            coordinator_pb2.GenerateResponse,
            self._metrics.relay_batch_items.observe,
        )
        try:
            await streams.serve(request_iterator, context, self._send_timeout_s)
        except ClientStalled:
            await self._cut_stalled(context, "streams aborted")

    async def _cut_stalled(self, context: grpc.aio.ServicerContext, what: str) -> None:
        """End the call of a client that read nothing for ``send_timeout_s``, ABORTED."""
        self._metrics.stalled_clients.inc()
        message = f"the client read nothing for {self._send_timeout_s:g} s; {what}"
        await context.abort(grpc.StatusCode.ABORTED, message)

    async def run_stream(
        self,
        request: coordinator_pb2.GenerateRequest,
        caller: Caller,
        send: Callable[[GenerateResponse], Awaitable[None]],
        fill: Callable[[], GenerateResponse] | None = None,
        admitted: Callable[[], None] | None = None,
    ) -> None:
        """Run one request as ``caller``, handing its responses to ``send`` in order, the
        last a completion or an in-stream error. Raises the ``SplitserveError`` of a request
        refused or failed before any response was sent (the call ends with its status).
        ``fill``: makes the next response in place, without waiting (a multiplexed call's
        ``Outlet.fill``): responses are then made there, and the request's steady decode is
        relayed inline, as its decode stream's messages arrive (``Coordinator.generate``), in
        the same order as the rest. ``admitted``: called when admission lets the request in
        (``Outlet.admitted``: the gateway counts what still waits)."""
        responder = _Responder(
            self._fill_responses, self._metrics.requests.start(), request.request_id
        )
        inline = None
        if fill is not None:

            def inline(flow: RequestFlow, chunk: StreamChunk) -> None:
                responder.respond(flow, chunk, fill)

        made: list[GenerateResponse] = []

        def new_response() -> GenerateResponse:
            made.append(GenerateResponse())
            return made[-1]

        try:
            stream = self._coordinator.generate(
                ask_from_proto(request), caller, inline=inline, on_admitted=admitted
            )
            async with contextlib.aclosing(stream):
                async for flow, chunk in stream:
                    if fill is not None:
                        responder.respond(flow, chunk, fill)
                        continue
                    responder.respond(flow, chunk, new_response)
                    for response in made:
                        await send(response)
                    made.clear()
        except SplitserveError as error:  # worker failures arrive as domain errors
            responder.timer.finish("error")
            if not responder.sent_any:
                raise
            code, message, param = status_of(error)
            await send(
                GenerateResponse(
                    request_id=request.request_id,
                    error=common_pb2.Error(code=code.value[0], message=message, param=param),
                ),
            )
        finally:
            responder.timer.finish("abort")  # no-op unless the caller cancelled (or stalled)

    async def _send(self, context: grpc.aio.ServicerContext, response: GenerateResponse) -> None:
        try:
            async with asyncio.timeout(self._send_timeout_s):  # no task per write, unlike wait_for
                await context.write(response)
        except TimeoutError:
            raise ClientStalled from None

    def _fill_responses(
        self,
        new: Callable[[], GenerateResponse],
        request_id: str,
        flow: RequestFlow,
        chunk: StreamChunk,
    ) -> bool:
        """Make ``chunk``'s responses, each in a message from ``new()``: its tokens (with the
        usage so far), then its completion when it finishes the request. ``request_id``: the
        caller's id for the request (the flow's is scoped by tenant). False: none made."""
        made = False
        if chunk.new_token_ids or chunk.text or chunk.prompt_logprobs:
            response = new()
            response.request_id = request_id
            tokens = response.chunk
            tokens.token_ids.extend(chunk.new_token_ids)
            tokens.text = chunk.text
            if chunk.logprobs or chunk.prompt_logprobs:
                texts = self._token_texts(chunk)
                tokens.logprobs.extend(convert.logprob_to_proto(lp, texts) for lp in chunk.logprobs)
                if chunk.prompt_logprobs:
                    tokens.prompt_logprobs.extend(
                        convert.logprob_to_proto(lp, texts) for lp in chunk.prompt_logprobs
                    )
                    first = flow.prompt_token_ids[0]
                    tokens.prompt_first_token.token_id = first
                    tokens.prompt_first_token.text = self._token_text(first)
            self._fill_usage(response.usage, flow)
            made = True
        if chunk.finish_reason is not None:
            response = new()
            response.request_id = request_id
            completion = response.completion
            completion.finish_reason = convert.FINISH_REASON_TO_PROTO[chunk.finish_reason]
            if isinstance(chunk.stop_reason, str):
                completion.stop_string = chunk.stop_reason
            elif isinstance(chunk.stop_reason, int):
                completion.stop_token_id = chunk.stop_reason
            self._fill_usage(response.usage, flow)
            made = True
        return made

    @staticmethod
    def _fill_usage(usage: common_pb2.Usage, flow: RequestFlow) -> None:
        usage.prompt_tokens = len(flow.prompt_token_ids)
        usage.completion_tokens = flow.num_completion_tokens
        usage.cached_tokens = flow.num_cached_tokens

    def _token_texts(self, chunk: StreamChunk) -> dict[int, str]:
        """The text of each token the chunk's logprobs name (the prompt's included)."""
        records = (*chunk.logprobs, *chunk.prompt_logprobs)
        ids = {lp.token_id for lp in records}
        ids.update(token for lp in records for token, _ in lp.top)
        return {token: self._token_text(token) for token in ids}

    def _token_text(self, token: int) -> str:
        return self._coordinator.tokenizer.decode([token], skip_special_tokens=False)

    async def Abort(
        self, request: coordinator_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.AbortResponse:
        caller = await caller_of(self._keys, context)
        aborted = self._coordinator.abort(request.request_id, caller)
        return coordinator_pb2.AbortResponse(aborted=aborted)

    async def Tokenize(
        self, request: coordinator_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.TokenizeResponse:
        """The ids ``Generate`` would see for this prompt (tokenized on a thread, as there)."""
        await caller_of(self._keys, context)
        try:
            token_ids = await asyncio.to_thread(
                self._coordinator.encode, _prompt_of(request), _add_special_tokens(request)
            )
        except SplitserveError as error:
            await abort_with(context, error)
        return coordinator_pb2.TokenizeResponse(
            token_ids=token_ids, max_model_len=self._coordinator.max_model_len
        )

    async def Detokenize(
        self, request: coordinator_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.DetokenizeResponse:
        await caller_of(self._keys, context)
        tokenizer = self._coordinator.tokenizer
        ids = list(request.token_ids)
        try:
            check_in_vocab(ids, tokenizer.vocab_size, "token ids", "tokens")
        except SplitserveError as error:
            await abort_with(context, error)
        text = tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
        return coordinator_pb2.DetokenizeResponse(text=text)

    async def LoadLoraAdapter(
        self, request: coordinator_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.LoadLoraAdapterResponse:
        await self._check_lora_admin(context)
        try:
            loaded = await self._coordinator.runtime_adapters.load(
                request.lora_name, request.lora_path, replace=request.load_inplace
            )
        except SplitserveError as error:
            await abort_with(context, error)
        return coordinator_pb2.LoadLoraAdapterResponse(
            adapter=convert.adapters_to_proto([loaded.adapter])[0], workers=loaded.workers
        )

    async def UnloadLoraAdapter(
        self,
        request: coordinator_pb2.UnloadLoraAdapterRequest,
        context: grpc.aio.ServicerContext,
    ) -> coordinator_pb2.UnloadLoraAdapterResponse:
        await self._check_lora_admin(context)
        try:
            workers = await self._coordinator.runtime_adapters.unload(request.lora_name)
        except SplitserveError as error:
            await abort_with(context, error)
        return coordinator_pb2.UnloadLoraAdapterResponse(workers=workers)

    async def _check_lora_admin(self, context: grpc.aio.ServicerContext) -> None:
        """End the call PERMISSION_DENIED unless its caller may change the served LoRA
        adapters (``CoordinatorConfig.lora_admin_tenants``; anyone where no key is needed)."""
        caller = await caller_of(self._keys, context)
        admins = self._coordinator.config.lora_admin_tenants
        if self._keys.required and caller.tenant not in admins:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "this API key may not load or unload LoRA adapters: the coordinator's "
                "--lora-admin-tenants names the tenants that may",
            )

    async def GetModelInfo(
        self, request: coordinator_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ModelInfo:
        coordinator = self._coordinator
        decode = coordinator.registry.workers(Role.DECODE)
        eos = coordinator.tokenizer.eos_token_id
        return coordinator_pb2.ModelInfo(
            model=coordinator.config.model_name,
            aliases=coordinator.config.model_aliases,
            checkpoint=coordinator.config.checkpoint,
            adapters=sorted(coordinator.registry.adapter_names()),
            max_model_len=coordinator.max_model_len,
            vocab_size=coordinator.tokenizer.vocab_size,
            eos_token_ids=[] if eos is None else [eos],
            dtype=decode[0].dtype if decode else "",
            tool_call_format=coordinator.config.tool_call_format,
            reasoning_format=coordinator.config.reasoning_format,
        )


ResponseFiller = Callable[[Callable[[], GenerateResponse], str, RequestFlow, StreamChunk], bool]
"""``CoordinatorServicer._fill_responses``: makes a chunk's responses; False: none made."""


class _Responder:
    """One request's responses as ``run_stream`` makes them: counts its tokens and its end
    in the request metrics, and whether any response was made (``sent_any``: then a later
    failure is an in-stream error, not the call's status)."""

    def __init__(self, fill: ResponseFiller, timer: RequestTimer, request_id: str) -> None:
        self._fill = fill
        self._request_id = request_id
        """The caller's id for the request ("": the flow's is shown)."""
        self.timer = timer
        self.sent_any = False

    def respond(
        self, flow: RequestFlow, chunk: StreamChunk, new: Callable[[], GenerateResponse]
    ) -> None:
        """Make ``chunk``'s responses, each in a message from ``new()``."""
        self.timer.tokens(len(chunk.new_token_ids))
        if chunk.finish_reason is not None:
            num_prompt_tokens = len(flow.prompt_token_ids)
            self.timer.finish(
                chunk.finish_reason.value, num_prompt_tokens, flow.num_completion_tokens
            )
        public_id = self._request_id or flow.request_id
        made = self._fill(new, public_id, flow, chunk)
        self.sent_any = made or self.sent_any


def ask_from_proto(request: coordinator_pb2.GenerateRequest) -> RequestAsk:
    """The request as its caller asked, parsed from the wire: the one place each field of
    ``GenerateRequest`` becomes the coordinator's (``request_record.py``). Raises
    ``InvalidRequestError`` for a field malformed on its own (no prompt, a bad target)."""
    return RequestAsk(
        prompt=_prompt_of(request),
        add_special_tokens=_add_special_tokens(request),
        truncate_prompt_tokens=(
            request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
        ),
        sampling=convert.asked_sampling_from_proto(request.sampling),
        request_id=request.request_id,
        model=request.model,
        continue_after=tuple(convert.token_ids(request.continue_after.ids)),
        priority=request.priority,
        targets=_targets_of(request),
        traceparent=request.traceparent,
        session_id=request.session_id,
        max_queue_wait_s=_positive_ms(
            request.latency_targets.max_queue_wait_ms, "latency_targets.max_queue_wait_ms"
        ),
    )


def _positive_ms(value: float, param: str) -> float | None:
    """Seconds of a positive, finite milliseconds field; None for 0 (unset). Raises
    ``InvalidRequestError`` naming ``param`` otherwise."""
    if value == 0:
        return None
    if not (math.isfinite(value) and value > 0):
        raise InvalidRequestError(f"{param} must be a positive number of ms, not {value}", param)
    return value / 1000


def _targets_of(request: coordinator_pb2.GenerateRequest) -> LatencyTargets:
    """The request's latency targets; a target left 0 is the coordinator's. Raises
    ``InvalidRequestError`` for a negative or non-finite one."""
    targets = request.latency_targets
    return LatencyTargets(ttft_ms=targets.ttft_ms or None, tpot_ms=targets.tpot_ms or None)


def _add_special_tokens(
    request: coordinator_pb2.GenerateRequest | coordinator_pb2.TokenizeRequest,
) -> bool | None:
    """The request's ``add_special_tokens``; None when unset (``encode_prompt``'s default)."""
    return request.add_special_tokens if request.HasField("add_special_tokens") else None


def _prompt_of(
    request: coordinator_pb2.GenerateRequest | coordinator_pb2.TokenizeRequest,
) -> Prompt:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "chat":
        return convert.chat_from_proto(request.chat)
    if kind == "token_ids":
        return list(request.token_ids.ids)  # type: ignore[union-attr]  # Generate's only
    raise InvalidRequestError("one of text, chat or token_ids is required", "prompt")
