"""Many ``stream()`` calls over few gRPC calls: the client side of ``GenerateStreams``.

``StreamMultiplexer`` keeps, per API key, ``width`` open ``Coordinator.GenerateStreams`` calls
on one channel (round robin over the coordinators of a several-address target, as gRPC
balances calls) and starts each stream on the next of them. A stream is a
``MultiplexedStream``: to ``continuation.StreamContinuation`` it is a ``Generate`` call (an
async iterator of ``GenerateResponse`` that fails with a ``grpc.RpcError`` carrying the code,
details and trailing metadata the coordinator's ``Generate`` would have given, and
``cancel()``), so continuing after a lost coordinator works as with ``Generate``.

Why: a gRPC message costs the same whatever it carries; the coordinator sends every ready
stream's responses as one message (``coordinator/streams_servicer.py``), and this side reads one
message for all of them.

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
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
from collections.abc import AsyncIterator

import grpc

from splitserve.client.errors import RetryPolicy
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.status import PARAM_METADATA_KEY, RETRY_AFTER_METADATA_KEY

Metadata = tuple[tuple[str, str], ...]

DNS_RELAY_WIDTH = 4
"""Calls per API key to a DNS target, which may resolve to several coordinators."""

_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
_OK = grpc.StatusCode.OK.value[0]


def relay_width(target: str) -> int:
    """How many ``GenerateStreams`` calls per API key spread streams over ``target``'s
    coordinators (gRPC balances calls, not streams within one): one per address of a list,
    ``DNS_RELAY_WIDTH`` for a DNS name, else 1."""
    if target.startswith("dns:"):
        return DNS_RELAY_WIDTH
    return len([address for address in target.split(",") if address.strip()]) or 1


class MultiplexedStreamError(grpc.RpcError):
    """How a multiplexed stream failed, as a failed ``Generate`` call reports it (what
    ``ClientError.from_call`` reads)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, param: str = "", retry_after_ms: int = 0
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        metadata: list[tuple[str, str]] = []
        if param:
            metadata.append((PARAM_METADATA_KEY, param))
        if retry_after_ms > 0:
            metadata.append((RETRY_AFTER_METADATA_KEY, str(retry_after_ms)))
        self._metadata = tuple(metadata)
        self.retry_after_ms = retry_after_ms

    @classmethod
    def of_end(cls, end: coordinator_pb2.StreamEnd) -> MultiplexedStreamError:
        code = _CODES_BY_NUMBER.get(end.code, grpc.StatusCode.UNKNOWN)
        return cls(code, end.message or code.name, end.param, end.retry_after_ms)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Metadata:
        return self._metadata


class StreamMultiplexer:
    """The open ``GenerateStreams`` calls of one channel, ``width`` per API key; its streams
    are retried by ``retry`` (the policy the channel was built with, for its other calls)."""

    def __init__(self, channel: grpc.aio.Channel, retry: RetryPolicy, width: int = 1) -> None:
        self._stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self._retry = retry
        self._width = max(1, width)
        self._calls: dict[Metadata | None, list[_StreamsCall | None]] = {}
        self._turn = itertools.count()

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

    def _call_for(self, metadata: Metadata | None) -> _StreamsCall:
        """The next open call for ``metadata``'s key, opened now where there is none."""
        slots = self._calls.setdefault(metadata, [None] * self._width)
        index = next(self._turn) % self._width
        call = slots[index]
        if call is None or not call.accepting:
            call = slots[index] = _StreamsCall(self._stub, metadata)
        return call


class _StreamsCall:
    """One ``GenerateStreams`` call: its streams by key and the queue of what to send."""

    def __init__(
        self, stub: coordinator_pb2_grpc.CoordinatorStub, metadata: Metadata | None
    ) -> None:
        self._outgoing: asyncio.Queue[coordinator_pb2.StreamsRequest | None] = asyncio.Queue()
        self._streams: dict[int, MultiplexedStream] = {}
        self._keys = itertools.count(1)
        self.accepting = True
        """False once the call broke, ended or was retired: new streams go elsewhere."""
        self._call = stub.GenerateStreams(self._requests(), metadata=metadata)
        self._reader = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[coordinator_pb2.StreamsRequest]:
        while (message := await self._outgoing.get()) is not None:
            yield message

    def open(self, stream: MultiplexedStream, request: coordinator_pb2.GenerateRequest) -> int:
        key = next(self._keys)
        self._streams[key] = stream
        start = coordinator_pb2.StreamStart(key=key, request=request)
        self._outgoing.put_nowait(coordinator_pb2.StreamsRequest(start=start))
        return key

    def cancel(self, key: int) -> None:
        if self._streams.pop(key, None) is not None and self.accepting:
            self._outgoing.put_nowait(coordinator_pb2.StreamsRequest(cancel=key))
        self._close_if_idle()

    def ended(self, key: int) -> None:
        self._streams.pop(key, None)
        self._close_if_idle()

    def retire(self) -> None:
        """Take no new streams; half-close once the running ones ended."""
        self.accepting = False
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if not self.accepting and not self._streams:
            self._outgoing.put_nowait(None)

    async def _read(self) -> None:
        failure = MultiplexedStreamError(
            grpc.StatusCode.UNAVAILABLE, "the coordinator ended the stream's call"
        )
        try:
            async for batch in self._call:
                for item in batch.items:
                    stream = self._streams.get(item.key)
                    if stream is not None:
                        stream._deliver(item)
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            failure = MultiplexedStreamError(code, error.details() or code.name)  # type: ignore[attr-defined]
        except asyncio.CancelledError:
            failure = MultiplexedStreamError(grpc.StatusCode.CANCELLED, "the client closed")
            raise
        finally:
            self.accepting = False
            streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream._fail(failure)
            self._outgoing.put_nowait(None)


class MultiplexedStream:
    """One stream on a ``_StreamsCall`` (see the module's contracts)."""

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
        self._arrived = asyncio.Event()
        self._outcome: MultiplexedStreamError | None = None
        """How the current attempt ended (code OK: completed); None while it runs."""
        self._responded = False
        self._attempts = 0
        self._call: _StreamsCall | None = None
        self._key = 0
        self._start_attempt()

    def _start_attempt(self) -> None:
        self._attempts += 1
        self._outcome = None
        self._call = self._multiplexer._call_for(self._metadata)
        self._key = self._call.open(self, self._request)

    def _deliver(self, item: coordinator_pb2.StreamItem) -> None:
        if item.HasField("response"):
            self._responses.append(item.response)
        else:
            self._outcome = MultiplexedStreamError.of_end(item.end)
            assert self._call is not None
            self._call.ended(self._key)
            unanswered = not (self._responded or self._responses)
            if self._outcome.code() == grpc.StatusCode.UNAVAILABLE and unanswered:
                self._call.retire()  # a draining coordinator: retries go out on a new call
        self._arrived.set()

    def _fail(self, failure: MultiplexedStreamError) -> None:
        if self._outcome is None:
            self._outcome = failure
            self._arrived.set()

    def __aiter__(self) -> MultiplexedStream:
        return self

    async def __anext__(self) -> coordinator_pb2.GenerateResponse:
        while True:
            if self._responses:
                self._responded = True
                return self._responses.popleft()
            outcome = self._outcome
            if outcome is not None:
                if outcome.code() == grpc.StatusCode.OK:
                    raise StopAsyncIteration
                await self._retry_or_raise(outcome)
                continue
            self._arrived.clear()
            try:
                async with asyncio.timeout_at(self._loop_deadline()):
                    await self._arrived.wait()
            except TimeoutError:
                self.cancel()
                raise MultiplexedStreamError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
                ) from None

    async def _retry_or_raise(self, outcome: MultiplexedStreamError) -> None:
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
            raise MultiplexedStreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        await asyncio.sleep(wait_s)
        self._start_attempt()

    def _loop_deadline(self) -> float | None:
        """The deadline on the event loop's clock."""
        if self._deadline is None:
            return None
        return asyncio.get_running_loop().time() + (self._deadline - time.monotonic())

    def cancel(self) -> bool:
        """Cancel the stream unless it ended (then a no-op, False)."""
        if self._outcome is not None or self._call is None:
            return False
        self._outcome = MultiplexedStreamError(grpc.StatusCode.CANCELLED, "Cancelled")
        self._call.cancel(self._key)
        return True
