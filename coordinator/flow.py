"""One request's journey through the workers: the coordinator's request state machine.

States (``FlowState``): ADMITTED -> (PREFILLING ->) DECODING -> FINISHED, with RESUMING
between attempts and FAILED when no attempt can succeed. An attempt opens the decode
worker's ``Generate`` stream; with a prefill worker routed, the decode worker first answers
with a KV reservation and the coordinator calls the prefill worker's ``Prefill`` with it.
The first token goes to the client when ``Prefill`` returns (TTFT); later tokens come from
the decode stream (tokens already emitted are recognised by the cumulative counts, so the
first token is never doubled).

Failure handling (the client sees one uninterrupted stream):
- a failed prefill (worker gone, transfer failed, layouts incompatible) cancels the decode
  stream, which frees the reservation, and the next attempt prefills on the decode worker;
- a failed decode stream (worker gone) marks the worker unhealthy and the request resumes on
  another decode worker from prompt + tokens already streamed, with the remaining budget;
- errors that are the request's fault (INVALID_ARGUMENT, ...) end the request with that error.
Every exit path (finish, stop string, client cancel, failure) ends the worker calls, which
releases the request's blocks on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from splitserve.common.detokenizer import TokenDecoder
from splitserve.common.errors import InvalidRequestError, WorkerUnavailableError
from splitserve.common.output_processor import RequestTracker, StreamChunk
from splitserve.common.request_update import FinishReason, RequestUpdate
from splitserve.common.sampling_params import SamplingParams
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry
from splitserve.coordinator.router import Router
from splitserve.coordinator.worker_clients import WorkerClients
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

_REQUEST_FAULTS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


class FlowState(enum.Enum):
    ADMITTED = "admitted"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    RESUMING = "resuming"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class FlowConfig:
    max_attempts: int = 3
    prefill_timeout_s: float = 300.0
    request_timeout_s: float = 3600.0
    abort_timeout_s: float = 2.0


class _PrefillFailed(Exception):
    pass


class _DecodeFailed(Exception):
    pass


class RequestFlow:
    """Runs one request; iterate ``run()`` for its stream chunks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decoder: TokenDecoder,
        special_token_ids: frozenset[int],
        registry: WorkerRegistry,
        router: Router,
        clients: WorkerClients,
        config: FlowConfig,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.state = FlowState.ADMITTED
        self.tracker = RequestTracker(request_id, prompt_token_ids, params, decoder)
        self.num_cached_tokens = 0
        self._special_token_ids = special_token_ids
        self._registry = registry
        self._router = router
        self._clients = clients
        self._config = config
        self._local_prefill_only = False
        self._aborted = False
        self._events: asyncio.Queue[tuple[str, object]] | None = None
        self.stage_seconds: list[tuple[str, float]] = []
        """(stage, seconds) as they completed: reserve (decode worker reserved blocks),
        prefill (reservation -> first token, KV pushed), local_prefill (no prefill worker)."""
        self.recoveries: list[str] = []
        """prefill_fallback / decode_resume, each time a worker failed this request."""

    def abort(self) -> None:
        """End the request as aborted: its stream gets a final ABORT chunk, workers free it."""
        self._aborted = True
        if self._events is not None:
            self._events.put_nowait(("abort", None))

    @property
    def num_completion_tokens(self) -> int:
        return len(self.tracker.token_ids)

    async def run(self) -> AsyncIterator[StreamChunk]:
        excluded: list[str] = []
        for _attempt in range(self._config.max_attempts):
            if self._aborted:
                yield self.tracker.abort()
                return
            prompt = self.prompt_token_ids + self.tracker.token_ids
            remaining = self.params.max_tokens - self.num_completion_tokens
            route = self._router.route(prompt, remaining, exclude=excluded)
            if route is None:
                break
            prefill = None if self._local_prefill_only or self.tracker.token_ids else route.prefill
            try:
                async for chunk in self._attempt(route.decode, prefill, prompt, remaining):
                    yield chunk
                self.state = FlowState.FINISHED
                return
            except _PrefillFailed:
                self._local_prefill_only = True
                self.recoveries.append("prefill_fallback")
            except _DecodeFailed:
                self.recoveries.append("decode_resume")
                excluded.append(route.decode.worker_id)
                self._registry.mark_failed(route.decode.worker_id)
            self.state = FlowState.RESUMING
        self.state = FlowState.FAILED
        raise WorkerUnavailableError(
            f"request {self.request_id}: no worker could serve it "
            f"({self.num_completion_tokens} tokens were streamed)"
        )

    async def _attempt(
        self,
        decode: WorkerRecord,
        prefill: WorkerRecord | None,
        prompt: list[int],
        remaining: int,
    ) -> AsyncIterator[StreamChunk]:
        already = self.num_completion_tokens
        worker_params = dataclasses.replace(
            self.params,
            max_tokens=remaining,
            min_tokens=max(0, self.params.min_tokens - already),
            stop=(),
        )
        call = self._clients.decode(decode.address).Generate(
            worker_pb2.WorkerGenerateRequest(
                request_id=self.request_id,
                prompt_token_ids=prompt,
                sampling=convert.sampling_to_proto(worker_params, include_stop=False),
                remote_prefill=prefill is not None,
            ),
            timeout=self._config.request_timeout_s,
        )
        self.state = FlowState.PREFILLING if prefill is not None else FlowState.DECODING
        events: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self._events = events
        if self._aborted:
            events.put_nowait(("abort", None))
        reader = asyncio.create_task(_pump(call, events))
        prefill_task: asyncio.Task[None] | None = None
        decode.pending_requests += 1
        started = reserved = time.monotonic()
        try:
            while True:
                kind, item = await events.get()
                if kind == "reservation":
                    assert prefill is not None
                    reserved = time.monotonic()
                    self.stage_seconds.append(("reserve", reserved - started))
                    reservation = item  # type: ignore[assignment]
                    prefill_task = asyncio.create_task(
                        self._prefill(prefill, prompt, worker_params, reservation, events)
                    )
                elif kind == "first":
                    self.stage_seconds.append(("prefill", time.monotonic() - reserved))
                    chunk = self._first_token(item)  # type: ignore[arg-type]
                    if chunk is not None:
                        yield chunk
                elif kind == "tokens":
                    if prefill is None and self.num_completion_tokens == already:
                        self.stage_seconds.append(("local_prefill", time.monotonic() - started))
                    chunk = self._decoded(item, already)  # type: ignore[arg-type]
                    if chunk is not None:
                        yield chunk
                    if self.tracker.finished:
                        if chunk is not None and chunk.stop_reason in self.params.stop:
                            await self._stop_on_worker(decode)
                        return
                elif kind == "abort":
                    yield self.tracker.abort()
                    return
                elif kind == "prefill_error":
                    logger.warning(
                        "%s: prefill failed (%s); prefilling locally", self.request_id, item
                    )
                    raise _PrefillFailed()
                elif kind == "decode_error":
                    self._raise_decode_error(item)  # type: ignore[arg-type]
                elif kind == "decode_end":
                    raise _DecodeFailed("decode stream ended before the request finished")
        finally:
            self._events = None
            decode.pending_requests -= 1
            for task in (reader, prefill_task):
                if task is not None:
                    task.cancel()
            call.cancel()

    async def _prefill(
        self,
        worker: WorkerRecord,
        prompt: list[int],
        params: SamplingParams,
        reservation: worker_pb2.KvReservation,
        events: asyncio.Queue[tuple[str, object]],
    ) -> None:
        worker.pending_prefill_tokens += len(prompt)
        try:
            response = await self._clients.prefill(worker.address).Prefill(
                worker_pb2.PrefillRequest(
                    request_id=self.request_id,
                    prompt_token_ids=prompt,
                    sampling=convert.sampling_to_proto(params, include_stop=False),
                    target=reservation,
                ),
                timeout=self._config.prefill_timeout_s,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self._registry.mark_failed(worker.worker_id)
            events.put_nowait(("prefill_error", f"{error.code().name}: {error.details()}"))
            return
        finally:
            worker.pending_prefill_tokens -= len(prompt)
        events.put_nowait(("first", response))

    def _first_token(self, response: worker_pb2.PrefillResponse) -> StreamChunk | None:
        """Emit the prefill's token at once unless it may end the request (the decode worker
        then reports it together with the finish reason)."""
        self.state = FlowState.DECODING
        self.num_cached_tokens = response.num_cached_tokens
        token = response.first_token_id
        if self.tracker.token_ids or token in self._special_token_ids:
            return None
        if token in self.params.stop_token_ids or self.params.max_tokens == 1:
            return None
        logprobs = ()
        if response.HasField("first_logprob"):
            logprobs = convert.logprobs_from_proto([response.first_logprob])
        return self._apply((token,), None, None, logprobs)

    def _decoded(self, message: worker_pb2.WorkerTokens, already: int) -> StreamChunk | None:
        """New tokens of a decode message (tokens emitted before are skipped)."""
        self.num_cached_tokens = max(self.num_cached_tokens, message.usage.cached_tokens)
        emitted_here = self.num_completion_tokens - already
        num_new = message.usage.completion_tokens - emitted_here
        token_ids = tuple(message.token_ids)[max(0, len(message.token_ids) - num_new) :]
        logprobs = convert.logprobs_from_proto(message.logprobs)[-len(token_ids) :]
        finish = convert.FINISH_REASON_FROM_PROTO[message.finish_reason]
        stop_token = message.stop_token_id if message.HasField("stop_token_id") else None
        if not token_ids and finish is None:
            return None
        return self._apply(token_ids, finish, stop_token, logprobs if token_ids else ())

    def _apply(
        self,
        token_ids: tuple[int, ...],
        finish: FinishReason | None,
        stop_token_id: int | None,
        logprobs: tuple,
    ) -> StreamChunk:
        update = RequestUpdate(
            request_id=self.request_id,
            new_token_ids=token_ids,
            finish_reason=finish,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self.num_completion_tokens + len(token_ids),
            stop_token_id=stop_token_id,
        )
        return self.tracker.process(update, logprobs)

    def _raise_decode_error(self, error: grpc.aio.AioRpcError) -> None:
        if error.code() in _REQUEST_FAULTS:
            raise error
        if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
            raise InvalidRequestError(error.details() or "the decode worker refused the request")
        logger.warning("%s: decode stream failed: %s", self.request_id, error.code())
        raise _DecodeFailed(str(error.code()))

    async def _stop_on_worker(self, decode: WorkerRecord) -> None:
        """A stop string matched here: end the request on the decode worker as STOP."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._clients.decode(decode.address).Abort(
                worker_pb2.WorkerAbortRequest(request_id=self.request_id, as_stopped=True),
                timeout=self._config.abort_timeout_s,
            )


async def _pump(call: object, events: asyncio.Queue[tuple[str, object]]) -> None:
    """Move a decode stream's messages into the attempt's event queue."""
    try:
        async for message in call:  # type: ignore[attr-defined]
            if message.HasField("reservation"):
                events.put_nowait(("reservation", message.reservation))
            else:
                events.put_nowait(("tokens", message.tokens))
    except grpc.aio.AioRpcError as error:
        events.put_nowait(("decode_error", error))
        return
    events.put_nowait(("decode_end", None))
