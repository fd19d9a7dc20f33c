"""The server side of a multiplexed streams call: many request streams on one gRPC call.

Used by ``Coordinator.GenerateStreams`` (the gateway's streams) and
``DecodeWorker.GenerateStreams`` (a coordinator's decode streams). Both calls speak the same
shape: the caller sends ``start`` (a ``key`` of its choosing and the request) and ``cancel``
(a key); the server answers with batches (``items``), each item one stream's next
``response`` or its ``end`` (``common.proto``'s ``StreamEnd``: the status the stream's own
call would have ended with), or, on the coordinator's call, that its request was
``admitted`` (``Outlet.admitted``).

Why: a gRPC message costs about the same whatever it carries (grpc.aio's write of one
response and its completion from gRPC's own thread were half of the coordinator's CPU when
every token of every stream went out as its own message). Here every stream's responses go
into one outbox, and one writer sends what the outbox holds as one batch each time its last
write finished: at low load a batch is one response (no added latency), under load it
carries every stream's responses of that moment.

Contract (``StreamsCall.serve``):

- A ``start`` runs its request through ``run`` (the same code as the stream's own call);
  its responses become items under the stream's key, in order, then one end: OK when
  ``run`` returned, else the status of the ``SplitserveError`` it raised
  (``proto/status.py:status_of``, an overload refusal's hint as ``retry_after_ms``, and
  ``OverloadedError.refuses_all_s`` as ``refuses_all_ms``).
- ``cancel`` of a running key cancels its task (as a cancelled call would be), and nothing
  more is sent under that key.
- While ``draining()``, a new stream ends UNAVAILABLE at once, and the call ends once its
  streams have.
- The call ends when the caller has half-closed and every stream has ended; the caller's
  cancel (or a lost connection) cancels every stream. A write that waits longer than
  ``send_timeout_s`` (a caller that reads nothing) raises ``ClientStalled`` after
  cancelling every stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

import grpc

from splitserve.common.errors import OverloadedError, SplitserveError
from splitserve.proto.splitserve.v1 import common_pb2
from splitserve.proto.status import retry_after_ms_of, status_of

logger = logging.getLogger(__name__)

Request = TypeVar("Request")
Response = TypeVar("Response")

RELAYS = ("multiplexed", "per-stream")
"""How a process's streams reach the next: many on each ``GenerateStreams`` call, or a
``Generate`` call each (``--relay`` of the gateway and the coordinator)."""

MAX_BATCH_ITEMS = 4096
"""Items per batch at most (a batch stays far below the message size limit)."""


class ClientStalled(Exception):
    """The caller read nothing for the send timeout."""


class Outlet(Generic[Response]):
    """Where one stream's responses go, in order: awaited as ``send(response)`` (as a
    ``Generate`` call's write would be), or made in place with ``fill()``, which returns the
    next response's message, empty, inside the batch it will be written in (no copy: building
    a response and copying it into its item and its batch cost about three times filling it
    there). ``fill`` never waits: a caller may use it outside the stream's task
    (``coordinator/attempt.py``'s inline chunks); once the stream was cancelled it returns a
    message that is never sent (its caller forgot the key)."""

    __slots__ = ("_call", "_key")

    def __init__(self, call: StreamsCall[Any, Response], key: int) -> None:
        self._call = call
        self._key = key

    async def __call__(self, response: Response) -> None:
        self._call._item_of(self._key).response.CopyFrom(response)

    def fill(self) -> Response:
        if not self._running():
            return self._call._response_type()
        return self._call._item_of(self._key).response

    def admitted(self, max_queued: int) -> None:
        """Tell the caller the stream's request was admitted (an ``admitted`` item: only
        the coordinator's call has one); never waits."""
        if self._running():
            self._call._item_of(self._key).admitted.max_queued = max_queued

    def _running(self) -> bool:
        """The stream runs and was not cancelled: what it makes is sent."""
        task = self._call._tasks.get(self._key)
        return task is not None and not task.cancelling()


class _Start(Protocol[Request]):
    key: int
    request: Request


class StreamsCall(Generic[Request, Response]):
    """One multiplexed streams call: its running streams, keyed as the caller named them, and
    the outbox their items wait in for the next write. ``item_type`` and ``batch_type``: the
    call's item and batch messages (``StreamItem`` / ``StreamsResponse`` of its service)."""

    def __init__(
        self,
        run: Callable[[Request, Outlet[Response]], Awaitable[None]],
        draining: Callable[[], bool],
        batch_type: Callable[[], Any],
        response_type: Callable[[], Response],
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        """``run(request, outlet)``: runs one stream, its responses to ``outlet``;
        ``on_batch``: told each written batch's item count (a metric)."""
        self._run = run
        self._on_batch = on_batch
        self._draining = draining
        self._batch_type = batch_type
        self._response_type = response_type
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._outbox: list[Any] = []
        """Batches to write, in order; items are added to the last until it is full."""
        self._ready = asyncio.Event()
        """Set when the outbox got items or a stream ended (the writer then looks)."""
        self._reading = True

    async def serve(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, send_timeout_s: float
    ) -> None:
        reader = asyncio.create_task(self._read(requests))
        try:
            await self._write(context, send_timeout_s)
        finally:
            tasks = [reader, *self._tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for message in requests:
                if message.HasField("start"):
                    self._start(message.start)
                else:
                    task = self._tasks.get(message.cancel)
                    if task is not None:
                        task.cancel()
        finally:
            self._reading = False
            self._ready.set()

    def _start(self, start: _Start[Request]) -> None:
        key = start.key
        if key in self._tasks:
            self._end(key, grpc.StatusCode.INVALID_ARGUMENT, f"stream key {key} is in use")
        elif self._draining():
            self._end(key, grpc.StatusCode.UNAVAILABLE, "draining: no new streams")
        else:
            self._tasks[key] = asyncio.create_task(self._stream(key, start.request))

    def _item_of(self, key: int) -> Any:
        """A new item under ``key`` at the end of the outbox (the writer is told)."""
        outbox = self._outbox
        if not outbox or len(outbox[-1].items) >= MAX_BATCH_ITEMS:
            outbox.append(self._batch_type())
        self._ready.set()
        return outbox[-1].items.add(key=key)

    async def _stream(self, key: int, request: Request) -> None:
        try:
            await self._run(request, Outlet(self, key))
        except SplitserveError as error:
            code, message, param = status_of(error)
            refuses_all_ms = 0
            if isinstance(error, OverloadedError):
                refuses_all_ms = int(error.refuses_all_s * 1000)
            self._end(key, code, message, param, retry_after_ms_of(error) or 0, refuses_all_ms)
        except asyncio.CancelledError:
            self._tasks.pop(key, None)
            self._ready.set()
            raise
        except Exception as error:  # a bug: end this stream, keep the others
            logger.exception("stream %d failed", key)
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
        refuses_all_ms: int = 0,
    ) -> None:
        end = common_pb2.StreamEnd(
            code=code.value[0],
            message=message,
            param=param,
            retry_after_ms=retry_after_ms,
            refuses_all_ms=refuses_all_ms,
        )
        self._item_of(key).end.CopyFrom(end)
        self._tasks.pop(key, None)
        self._ready.set()

    async def _write(self, context: grpc.aio.ServicerContext, send_timeout_s: float) -> None:
        """Send the outbox, a batch per write, until the call is over (see the module)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._outbox:
                batch = self._outbox.pop(0)
                if self._on_batch is not None:
                    self._on_batch(len(batch.items))
                try:
                    async with asyncio.timeout(send_timeout_s):
                        await context.write(batch)
                except TimeoutError:
                    raise ClientStalled from None
            if not self._tasks and (not self._reading or self._draining()):
                return
