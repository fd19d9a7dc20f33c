"""A multiplexed streams call served in the same process, without gRPC: the client side gets
the server's batches as the very message objects the server made.

Why: where the gateway and the coordinator run in one process (``splitserve frontend``),
every streamed token crossed gRPC twice for nothing: the coordinator serialized each batch
(``StreamsCall._write``), gRPC's core framed and sent it over loopback, and the gateway parsed
it back. With hundreds of streams' tokens in each message that hop costs little a token
(``bench/bench_relay_cpu.py``, 1,024 simulated streams x 256 tokens: 29.4 us a token in one
process against 30.0 in two), more with few streams a message. Here ``LocalStreamsCall``
runs the servicer's streams method (``CoordinatorServicer.GenerateStreams``) as a task on
the running loop, with a
``LocalServicerContext`` whose ``write`` hands each batch to the caller's iterator unchanged.

Contract (what ``proto/streams_client.py:StreamsClientCall`` and the servicer rely on, as
over gRPC):

- The servicer gets the caller's requests iterator and metadata as its call would
  (``invocation_metadata``: the API key the interceptor would have checked; the servicer's own
  ``caller_of`` checks it, so a key the public port refuses is refused here too).
- Batches arrive in the order written; each is owned by the caller once written (the server
  never touches a batch after its write).
- The call ends like a gRPC call: the servicer returned: iteration ends (OK); it aborted:
  iteration raises ``StreamError`` with the abort's code and details; it raised something
  else: ``StreamError`` UNKNOWN naming it; ``cancel()`` cancels the servicer's task (which
  cancels every stream, as a cancelled call does) and iteration raises ``StreamError``
  CANCELLED.
- ``write`` never waits: nothing between the two sides is a network, and the caller's reader
  runs on the same loop (a slow HTTP client is the gateway's to cut, as before).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from splitserve.proto.streams_client import Metadata, StreamError

StreamsMethod = Callable[[AsyncIterator[Any], Any], Awaitable[None]]
"""A servicer's streams method: ``(request_iterator, context)``."""


class _Aborted(Exception):
    """Raised by ``LocalServicerContext.abort`` (as gRPC's abort raises) to end the call."""


class LocalServicerContext:
    """The part of ``grpc.aio.ServicerContext`` a streams method uses, in process."""

    def __init__(self, metadata: Metadata, deliver: Callable[[Any], None]) -> None:
        self._metadata = metadata
        self._deliver = deliver
        self.status: tuple[grpc.StatusCode, str] | None = None
        """The abort's code and details, once aborted."""

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    async def write(self, message: Any) -> None:
        self._deliver(message)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.status = (code, details)
        raise _Aborted(details)


class LocalStreamsCall:
    """One in-process streams call of ``method``: an async iterator of its batches (see the
    module's contract); made inside the running event loop."""

    def __init__(
        self, method: StreamsMethod, requests: AsyncIterator[Any], metadata: Metadata | None
    ) -> None:
        self._batches: collections.deque[Any] = collections.deque()
        self._arrived = asyncio.Event()
        self._context = LocalServicerContext(metadata or (), self._deliver)
        self._task = asyncio.ensure_future(method(requests, self._context))
        self._task.add_done_callback(lambda _task: self._arrived.set())

    def _deliver(self, batch: Any) -> None:
        self._batches.append(batch)
        self._arrived.set()

    def cancel(self) -> bool:
        return self._task.cancel()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._read()

    async def _read(self) -> AsyncIterator[Any]:
        batches = self._batches
        while True:
            while batches:
                yield batches.popleft()
            if self._task.done():
                self._raise_outcome()
                return
            self._arrived.clear()
            await self._arrived.wait()

    def _raise_outcome(self) -> None:
        """Raise how the servicer's task ended, as gRPC would report it; return for OK."""
        task = self._task
        if task.cancelled():
            raise StreamError(grpc.StatusCode.CANCELLED, "the streams' call was cancelled")
        error = task.exception()
        if error is None:
            return
        if isinstance(error, _Aborted) and self._context.status is not None:
            code, details = self._context.status
            raise StreamError(code, details or code.name)
        raise StreamError(grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}")


def local_opener(
    method: StreamsMethod,
) -> Callable[[AsyncIterator[Any], Metadata | None], LocalStreamsCall]:
    """Opens in-process calls of ``method`` (``StreamMultiplexer``'s ``open_streams``)."""

    def open_streams(requests: AsyncIterator[Any], metadata: Metadata | None) -> LocalStreamsCall:
        return LocalStreamsCall(method, requests, metadata)

    return open_streams
