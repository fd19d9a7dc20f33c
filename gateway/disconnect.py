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
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
CLIENT_STALL_TIMEOUT_S = 30.0
"""How long an SSE frame may wait for a client that reads nothing (the coordinator's own
``--client-stall-timeout`` for the gRPC clients it streams to)."""
logger = logging.getLogger(__name__)


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
    ``aclose()`` on every exit path (end, disconnect, stall, send failure).
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
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
        body: dict[str, Any]
        async for frame in self._events:
            body = {"type": "http.response.body", "body": frame, "more_body": True}
            try:
                async with asyncio.timeout(self._send_timeout_s):
                    await send(body)
            except TimeoutError:
                logger.warning(
                    "an HTTP client read nothing for %g s: stream ended", self._send_timeout_s
                )
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
