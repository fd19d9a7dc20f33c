"""Many ``stream()`` calls over few gRPC calls: the client side of ``GenerateStreams``.

``StreamMultiplexer`` keeps, per API key, ``width`` open ``Coordinator.GenerateStreams`` calls
on one channel (round robin over the coordinators of a several-address target, as gRPC
balances calls) and starts each stream on the next of them. A stream is a
``MultiplexedStream``: to ``continuation.StreamContinuation`` it is a ``Generate`` call (an
async iterator of ``GenerateResponse`` that fails with a ``grpc.RpcError`` carrying the code,
details and trailing metadata the coordinator's ``Generate`` would have given, and
``cancel()``), so continuing after a lost coordinator works as with ``Generate``.

Why: a gRPC message costs the same whatever it carries; the coordinator sends every ready
stream's responses as one message (``proto/streams_server.py``), and this side reads one
message for all of them (``proto/streams_client.py``).

Contracts:

- Retries: gRPC cannot retry one stream inside a call, so ``MultiplexedStream`` does what
  ``retry.service_config`` asks of gRPC for ``Generate``, with the same ``RetryPolicy``: a
  stream that ended UNAVAILABLE (or RESOURCE_EXHAUSTED with ``retry_overloaded``) before any
  response starts again after ``min(max_backoff, initial * multiplier**(n - 1))`` times a
  factor in [0.8, 1.2], or exactly the server's ``retry_after_ms`` hint, at most
  ``max_attempts`` attempts in all; a hint that outlasts the deadline is not waited for (the
  refusal is raised with it).
- Deadline: the stream's ``timeout_s`` covers its attempts; when it runs out the stream is
  cancelled and fails with DEADLINE_EXCEEDED.
- A call that breaks fails each of its streams with the call's code (UNAVAILABLE when the
  coordinator died: those that delivered tokens continue elsewhere); a call that ended a
  stream UNAVAILABLE before any response (a draining coordinator) takes no new streams and
  is half-closed, so the stream's retry goes out on a fresh call.
- Cancelling a stream that has not ended sends its ``cancel``: the coordinator aborts its
  request on every worker.
- Refusals at the edge: a stream that ended RESOURCE_EXHAUSTED with ``refuses_all_ms`` (the
  coordinator's admission queue is full, so it refuses every arrival whatever it asks) makes
  its call refuse the streams started on it for that long itself, with that refusal's status
  and message and what is left of its retry hint; a new stream goes to another of the
  ``width`` calls whose coordinator has not said so, and is refused at once only where all
  have (a crowd past the queue is answered without reaching the coordinator: the gateway's
  429s then cost it no gRPC round trip). A call also refuses new streams itself while at
  least the coordinator's admission queue's limit of its streams wait for admission (the
  coordinator's ``admitted`` items say which no longer do, and the limit):
  ``StreamsClientCall.refusal_at``.
- A reader that fell behind gets the token chunks that queued up for it as one chunk
  (``_merge_chunks``): the same tokens, text and logprobs, in fewer pieces.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from splitserve.client.errors import RetryPolicy
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.streams_client import Metadata, StreamError, StreamsClientCall

IDLE_CLOSE_S = 300.0
"""A call that carried no stream this long is half-closed (a fresh one opens on demand)."""
IDLE_SWEEP_S = 30.0
"""How often ``StreamMultiplexer`` looks for idle calls (on a stream's start)."""
OpenStreams = Callable[[AsyncIterator[Any], Metadata | None], Any]
"""Opens a ``GenerateStreams`` call: ``(requests, metadata)`` -> the call (a gRPC
``StreamStreamCall``, or ``proto/local_streams.py:LocalStreamsCall``)."""
DNS_RELAY_WIDTH = 4
"""Calls per API key to a DNS target, which may resolve to several coordinators."""


def relay_width(target: str) -> int:
    """How many ``GenerateStreams`` calls per API key spread streams over ``target``'s
    coordinators (gRPC balances calls, not streams within one): one per address of a list,
    ``DNS_RELAY_WIDTH`` for a DNS name, else 1."""
    if target.startswith("dns:"):
        return DNS_RELAY_WIDTH
    return len([address for address in target.split(",") if address.strip()]) or 1


class StreamMultiplexer:
    """The open ``GenerateStreams`` calls of one channel, ``width`` per API key; its streams
    are retried by ``retry`` (the policy the channel was built with, for its other calls)."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        retry: RetryPolicy,
        width: int = 1,
        open_streams: OpenStreams | None = None,
    ) -> None:
        """``open_streams``: opens each ``GenerateStreams`` call instead of the channel's stub
        (``proto/local_streams.py``: the coordinator of this process, without gRPC)."""
        if open_streams is None:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)

            def open_streams(requests: AsyncIterator[Any], metadata: Metadata | None) -> Any:
                return stub.GenerateStreams(requests, metadata=metadata)

        self._open_streams = open_streams
        self._retry = retry
        self._width = max(1, width)
        self._calls: dict[Metadata | None, list[StreamsClientCall | None]] = {}
        self._turn = itertools.count()
        self._swept_at = time.monotonic()

    def start(
        self,
        request: coordinator_pb2.GenerateRequest,
        timeout_s: float | None,
        metadata: Metadata | None,
    ) -> MultiplexedStream:
        """A stream of ``request`` sent with ``metadata`` (``continuation.StartCall``'s
        contract)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return MultiplexedStream(self, request, deadline, metadata, self._retry)

    def call_for(self, metadata: Metadata | None) -> StreamsClientCall | StreamError:
        """The next open call for ``metadata``'s key (opened now where there is none) whose
        coordinator has not said it refuses every new stream for now; where every one of the
        ``width`` has, the refusal the stream gets at once, without a round trip
        (``StreamsClientCall.refusal_at``)."""
        self._close_idle()
        slots = self._calls.setdefault(metadata, [None] * self._width)
        now = time.monotonic()
        refusal: StreamError | None = None
        for _ in range(self._width):
            index = next(self._turn) % self._width
            call = slots[index]
            if call is None or not call.accepting:
                call = slots[index] = StreamsClientCall(
                    functools.partial(self._open_streams, metadata=metadata),
                    coordinator_pb2.StreamsRequest,
                    coordinator_pb2.StreamStart,
                )
            refusal = call.refusal_at(now)
            if refusal is None:
                return call
        assert refusal is not None  # width >= 1
        return refusal

    def refusal_for(self, metadata: Metadata | None) -> StreamError | None:
        """The refusal a stream started now for ``metadata``'s key would get at once from
        ``call_for`` (every one of the key's ``width`` calls is open and its coordinator said
        it refuses every new stream for now), without starting one; None: it would be sent."""
        slots = self._calls.get(metadata)
        if not slots:
            return None
        now = time.monotonic()
        refusal: StreamError | None = None
        for call in slots:
            if call is None or not call.accepting:
                return None
            refusal = call.refusal_at(now)
            if refusal is None:
                return None
        return refusal

    def _close_idle(self) -> None:
        """Half-close the calls that carried no stream for ``IDLE_CLOSE_S`` (every API key
        that ever streamed would otherwise keep ``width`` calls open); at most once a
        ``IDLE_SWEEP_S``."""
        now = time.monotonic()
        if now - self._swept_at < IDLE_SWEEP_S:
            return
        self._swept_at = now
        for metadata, slots in list(self._calls.items()):
            for index, call in enumerate(slots):
                if call is not None and (not call.accepting or call.idle_s(now) > IDLE_CLOSE_S):
                    call.retire()
                    slots[index] = None
            if not any(slots):
                del self._calls[metadata]


class MultiplexedStream:
    """One stream on a ``StreamsClientCall`` (see the module's contracts)."""

    def __init__(
        self,
        multiplexer: StreamMultiplexer,
        request: coordinator_pb2.GenerateRequest,
        deadline: float | None,
        metadata: Metadata | None,
        retry: RetryPolicy,
    ) -> None:
        self._multiplexer = multiplexer
        self._request = request
        self._deadline = deadline
        self._metadata = metadata
        self._retry = retry
        self._responses: collections.deque[coordinator_pb2.GenerateResponse] = collections.deque()
        self._waiting: asyncio.Future[None] | None = None
        """What ``__anext__`` awaits while nothing arrived (a bare future: an
        ``asyncio.Event`` made and dropped one a token)."""
        self._outcome: StreamError | None = None
        """How the current attempt ended (code OK: completed); None while it runs."""
        self._responded = False
        self._attempts = 0
        self._call: StreamsClientCall | None = None
        self._key = 0
        self._expiry = (
            None
            if deadline is None
            else asyncio.get_running_loop().call_at(_loop_time(deadline), self._expire)
        )
        """One timer for the deadline (not one per wait: the relay's hot path)."""
        self._start_attempt()

    def _start_attempt(self) -> None:
        self._attempts += 1
        self._outcome = None
        chosen = self._multiplexer.call_for(self._metadata)
        if isinstance(chosen, StreamError):  # refused for the coordinators, at once
            self._call = None
            self._outcome = chosen
            self._wake()
            return
        self._call = chosen
        self._key = chosen.open(self, self._request)

    def deliver(self, item: coordinator_pb2.StreamItem) -> None:
        if item.HasField("response"):
            self._responses.append(item.response)
        elif item.HasField("admitted"):
            assert self._call is not None
            self._call.admitted(self._key, item.admitted.max_queued)
            return
        else:
            self._outcome = StreamError.of_end(item.end)
            assert self._call is not None
            self._call.ended(self._key, self._outcome)
            unanswered = not (self._responded or self._responses)
            if self._outcome.code() == grpc.StatusCode.UNAVAILABLE and unanswered:
                self._call.retire()  # a draining coordinator: retries go out on a new call
            if self._outcome.refuses_all_ms > 0:
                self._call.refuse_all(self._outcome)
        self._wake()

    def fail(self, error: StreamError) -> None:
        if self._outcome is None:
            self._outcome = error
            self._wake()

    def _expire(self) -> None:
        """The deadline passed: a running attempt is cancelled; the stream fails."""
        if self._outcome is None or self._outcome.code() != grpc.StatusCode.OK:
            self.cancel()
            self._outcome = StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._responses.clear()
            self._responded = True  # not retried
            self._wake()

    def __aiter__(self) -> MultiplexedStream:
        return self

    async def __anext__(self) -> coordinator_pb2.GenerateResponse:
        while True:
            if self._responses:
                self._responded = True
                return _merge_chunks(self._responses)
            outcome = self._outcome
            if outcome is not None:
                if outcome.code() == grpc.StatusCode.OK:
                    self._stop_expiry()
                    raise StopAsyncIteration
                try:
                    await self._retry_or_raise(outcome)
                except StreamError:
                    self._stop_expiry()
                    raise
                continue
            self._waiting = asyncio.get_running_loop().create_future()
            try:
                await self._waiting
            finally:
                self._waiting = None

    def _wake(self) -> None:
        """Something arrived (a response, the outcome): a waiting ``__anext__`` looks."""
        waiting = self._waiting
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    def _stop_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()

    async def _retry_or_raise(self, outcome: StreamError) -> None:
        """Wait out the retry policy's backoff and start again, or raise ``outcome``."""
        policy = self._retry
        retryable = outcome.code() == grpc.StatusCode.UNAVAILABLE or (
            outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and policy.retry_overloaded
        )
        if self._responded or not retryable or self._attempts >= policy.max_attempts:
            raise outcome
        if outcome.retry_after_ms > 0:
            wait_s = outcome.retry_after_ms / 1000.0
        else:
            backoff = policy.initial_backoff_s * policy.multiplier ** (self._attempts - 1)
            wait_s = min(policy.max_backoff_s, backoff) * random.uniform(0.8, 1.2)
        if self._deadline is not None and time.monotonic() + wait_s >= self._deadline:
            if outcome.retry_after_ms > 0:
                raise outcome  # the hint outlasts the deadline: the refusal, at once
            await asyncio.sleep(max(0.0, self._deadline - time.monotonic()))
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        await asyncio.sleep(wait_s)
        self._start_attempt()

    def cancel(self) -> bool:
        """Cancel the stream unless it ended (then a no-op, False)."""
        self._stop_expiry()
        if self._outcome is not None or self._call is None:
            return False
        self._outcome = StreamError(grpc.StatusCode.CANCELLED, "Cancelled")
        self._call.cancel(self._key)
        return True


def _merge_chunks(
    responses: collections.deque[coordinator_pb2.GenerateResponse],
) -> coordinator_pb2.GenerateResponse:
    """The next response, with the token chunks queued right behind it folded in (a reader
    that fell behind gets one chunk of everything it missed: one SSE frame, not one each):
    token ids, text and logprobs concatenated in order, the prompt's logprobs from the one
    carrying them, the last one's usage."""
    first = responses.popleft()
    if first.WhichOneof("payload") != "chunk":
        return first
    while responses and responses[0].WhichOneof("payload") == "chunk":
        following = responses.popleft()
        first.chunk.token_ids.extend(following.chunk.token_ids)
        first.chunk.text += following.chunk.text
        first.chunk.logprobs.extend(following.chunk.logprobs)
        if following.chunk.prompt_logprobs:  # only the first token's chunk has them
            first.chunk.prompt_logprobs.extend(following.chunk.prompt_logprobs)
            first.chunk.prompt_first_token.CopyFrom(following.chunk.prompt_first_token)
        first.usage.CopyFrom(following.usage)
    return first


def _loop_time(deadline: float | None) -> float | None:
    """``deadline`` (``time.monotonic``'s clock) on the running event loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
