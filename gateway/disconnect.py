"""Client disconnects end the request: ASGI helpers that race work against ``http.disconnect``.

Contract: when the HTTP client goes away, the coroutine or event stream serving it is
cancelled and the event stream is closed, which cancels its gRPC call; the coordinator then
aborts the request on every worker and their blocks are freed. Nothing keeps generating
for a client that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TypeVar

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.gateway.defaults import CLIENT_STALL_TIMEOUT_S

T = TypeVar("T")
STALL_CHECKS = 4
"""A stalled frame is noticed within ``send_timeout_s`` x (1 + 1 / STALL_CHECKS): the stream's
one watchdog looks every ``send_timeout_s / STALL_CHECKS`` (not a timeout armed per frame:
that was a twentieth of the gateway's CPU per streamed token)."""
RAW_SEND = "splitserve.raw_send"
"""The scope key of the server's own ``send`` (``exposing_raw_send``)."""
logger = logging.getLogger(__name__)


def exposing_raw_send(app: ASGIApp) -> ASGIApp:
    """``app`` with the server's own ``send`` in every HTTP scope (``RAW_SEND``), so an event
    stream's frames skip the middleware wrappers around it: each wrapper only watches a
    response's start (the request counter, the error middleware, the exception handlers),
    and passing every frame through the three of them was 3-4% of the frontend process's CPU
    per streamed token (py-spy, 1,024 simulated streams). Give the server the returned app."""

    async def with_raw_send(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await app(scope, receive, send)

    return with_raw_send


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, cancelling it and raising ``ClientDisconnected`` if the client leaves.

    Only for use after the request body was read (FastAPI has read it by the time a handler
    runs), so every further ``receive`` message is a disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (server shutdown)
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if not task.done() or task.cancelled():
        raise ClientDisconnected()
    return task.result()


class EventStreamResponse(Response):
    """``text/event-stream`` of pre-framed SSE events, cancelled when the client disconnects
    or leaves a frame unread for ``send_timeout_s`` (its socket buffers full: the server's
    write waits for it), which ends the request as a disconnect does.

    ``events`` yields bytes (each a complete ``data: ...\\n\\n`` frame); it is closed with
    ``aclose()`` on every exit path (end, disconnect, stall, send failure). The start goes
    through the middleware; the frames go straight to the server's ``send`` where the app
    was wrapped by ``exposing_raw_send``.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: Mapping[str, str],
        send_timeout_s: float = CLIENT_STALL_TIMEOUT_S,
    ) -> None:
        # Not Response.__init__: it would declare Content-Length: 0 for the empty body.
        self.status_code = 200
        self.background = None
        all_headers = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
            **{name.lower(): value for name, value in headers.items()},
        }
        self.raw_headers = [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in all_headers.items()
        ]
        self._events = events
        self._send_timeout_s = send_timeout_s
        self.frames_sent = 0
        """Frames handed to the server's ``send`` so far (one in flight included)."""
        self.sending = False
        """A frame's ``send`` has not returned yet (the stall watchdog reads it)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        pump = asyncio.ensure_future(self._pump(scope.get(RAW_SEND, send)))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        watchdog = _StallWatch(self, pump, self._send_timeout_s)
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watchdog.cancel()
            for task in (pump, watcher):
                task.cancel()
            try:
                await pump
            except asyncio.CancelledError:
                pass
            except Exception:  # the response already started: all we can do is log it
                logger.exception("event stream failed")
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]

    async def _pump(self, send: Send) -> None:
        async for frame in self._events:
            self.frames_sent += 1
            self.sending = True
            await send({"type": "http.response.body", "body": frame, "more_body": True})
            self.sending = False
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _StallWatch:
    """An event stream's one watchdog (``STALL_CHECKS``): cancels ``pump`` once the same frame
    was in flight at ``STALL_CHECKS + 1`` looks in a row, ``send_timeout_s / STALL_CHECKS``
    apart."""

    def __init__(
        self, response: EventStreamResponse, pump: asyncio.Future[None], send_timeout_s: float
    ) -> None:
        self._response = response
        self._pump = pump
        self._send_timeout_s = send_timeout_s
        self._period_s = send_timeout_s / STALL_CHECKS
        self._seen_sends = -1
        self._stalled_looks = 0
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(self._period_s, self._look)

    def _look(self) -> None:
        response = self._response
        if response.sending and response.frames_sent == self._seen_sends:
            self._stalled_looks += 1
        else:
            self._stalled_looks = 0
            self._seen_sends = response.frames_sent
        if self._stalled_looks >= STALL_CHECKS:
            logger.warning(
                "an HTTP client read nothing for %g s: stream ended", self._send_timeout_s
            )
            self._pump.cancel()
            return
        self._handle = self._loop.call_later(self._period_s, self._look)

    def cancel(self) -> None:
        self._handle.cancel()
