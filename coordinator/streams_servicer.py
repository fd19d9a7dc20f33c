"""The server side of ``Coordinator.GenerateStreams``: many Generate streams on one call.

Why: a gRPC message costs the coordinator about the same whatever it carries (grpc.aio's
write of one response and its completion from gRPC's own thread were half of the
coordinator's CPU when every token of every stream went out as its own message). Here every
stream's responses go into one outbox, and one writer sends what the outbox holds as one
``StreamsResponse`` each time its last write finished: at low load a batch is one response
(no added latency), under load it carries every stream's tokens of that moment.

Contract (``StreamsCall.serve``):

- A ``StreamStart`` runs its request through ``run`` (``CoordinatorServicer.run_stream``,
  exactly what ``Generate`` runs); its responses become items under the stream's key, in
  order, then one ``StreamEnd``: OK after a completion (or an in-stream error), else the
  status ``Generate`` would have ended with (``proto/status.py:status_of``, with the
  overload hint as ``retry_after_ms``).
- ``cancel`` of a running key cancels its task: the request is aborted on every worker, as
  for a cancelled ``Generate``, and nothing more is sent under that key.
- While the coordinator drains (``draining()``), a new stream ends UNAVAILABLE at once, and
  the call ends once its streams have.
- The call ends when the caller has half-closed and every stream has ended; the caller's
  cancel (or a lost connection) cancels every stream. A write that waits longer than
  ``send_timeout_s`` (a caller that reads nothing) raises ``ClientStalled`` after
  cancelling every stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from splitserve.common.errors import OverloadedError, SplitserveError
from splitserve.proto.splitserve.v1 import coordinator_pb2
from splitserve.proto.status import status_of

logger = logging.getLogger(__name__)

Send = Callable[[coordinator_pb2.GenerateResponse], Awaitable[None]]
RunStream = Callable[[coordinator_pb2.GenerateRequest, Send], Awaitable[None]]
"""Runs one request, handing each response to ``send``; raises the ``SplitserveError`` of a
request refused before any response."""

MAX_BATCH_ITEMS = 4096
"""Items per ``StreamsResponse`` at most (a batch stays far below the message size limit)."""


class ClientStalled(Exception):
    """The caller read nothing for the send timeout."""


class StreamsCall:
    """One ``GenerateStreams`` call: its running streams, keyed as the caller named them,
    and the outbox their items wait in for the next write."""

    def __init__(self, run: RunStream, draining: Callable[[], bool]) -> None:
        self._run = run
        self._draining = draining
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._outbox: list[coordinator_pb2.StreamItem] = []
        self._ready = asyncio.Event()
        """Set when the outbox got items or a stream ended (the writer then looks)."""
        self._reading = True

    async def serve(
        self,
        requests: AsyncIterator[coordinator_pb2.StreamsRequest],
        context: grpc.aio.ServicerContext,
        send_timeout_s: float,
    ) -> None:
        reader = asyncio.create_task(self._read(requests))
        try:
            await self._write(context, send_timeout_s)
        finally:
            reader.cancel()
            tasks = [reader, *self._tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[coordinator_pb2.StreamsRequest]) -> None:
        try:
            async for message in requests:
                if message.HasField("start"):
                    self._start(message.start.key, message.start.request)
                else:
                    task = self._tasks.get(message.cancel)
                    if task is not None:
                        task.cancel()
        finally:
            self._reading = False
            self._ready.set()

    def _start(self, key: int, request: coordinator_pb2.GenerateRequest) -> None:
        if key in self._tasks:
            self._end(key, grpc.StatusCode.INVALID_ARGUMENT, f"stream key {key} is in use")
        elif self._draining():
            self._end(key, grpc.StatusCode.UNAVAILABLE, "the coordinator is draining")
        else:
            self._tasks[key] = asyncio.create_task(self._stream(key, request))

    async def _stream(self, key: int, request: coordinator_pb2.GenerateRequest) -> None:
        async def send(response: coordinator_pb2.GenerateResponse) -> None:
            self._outbox.append(coordinator_pb2.StreamItem(key=key, response=response))
            self._ready.set()

        try:
            await self._run(request, send)
        except SplitserveError as error:
            code, message, param = status_of(error)
            retry_after_s = error.retry_after_s if isinstance(error, OverloadedError) else 0.0
            self._end(key, code, message, param, int(retry_after_s * 1000))
        except asyncio.CancelledError:
            self._tasks.pop(key, None)
            self._ready.set()
            raise
        except Exception as error:  # a bug: end this stream, keep the others
            logger.exception("stream %s failed", request.request_id)
            self._end(key, grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
        else:
            self._end(key, grpc.StatusCode.OK, "")

    def _end(
        self,
        key: int,
        code: grpc.StatusCode,
        message: str,
        param: str = "",
        retry_after_ms: int = 0,
    ) -> None:
        end = coordinator_pb2.StreamEnd(
            code=code.value[0], message=message, param=param, retry_after_ms=retry_after_ms
        )
        self._outbox.append(coordinator_pb2.StreamItem(key=key, end=end))
        self._tasks.pop(key, None)
        self._ready.set()

    async def _write(self, context: grpc.aio.ServicerContext, send_timeout_s: float) -> None:
        """Send the outbox, a batch per write, until the call is over (see the module)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._outbox:
                batch = self._outbox[:MAX_BATCH_ITEMS]
                del self._outbox[:MAX_BATCH_ITEMS]
                try:
                    async with asyncio.timeout(send_timeout_s):
                        await context.write(coordinator_pb2.StreamsResponse(items=batch))
                except TimeoutError:
                    raise ClientStalled from None
            if not self._tasks and (not self._reading or self._draining()):
                return
