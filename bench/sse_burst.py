"""A light client for bursts of streamed completions: many SSE streams at once on little CPU.

An httpx client spends 100-300 us of CPU per streamed token (its own figure in
``bench_relay_cpu.py``), as much as the front end it measures, so at thousands of streams on
a 2-core machine the client, not the server, sets the pace. ``sse_burst`` speaks just enough
HTTP/1.1 over ``asyncio`` protocols (uvloop where installed) to send ``streams`` streamed
completions at once (``Connection: close``, so a stream ends when the server closes it;
at most ``CONNECTING_AT_ONCE`` connections being opened at a time) and
reads each response without parsing its frames: it keeps the status line, counts the SSE
events (``data: `` at the start of a line), notes when the first event came, and takes the
completion tokens from the usage chunk (``stream_options.include_usage``) at the end.

``BurstStream`` is what one stream gave; ``how`` is "ok", "http <status>", "no usage" (closed
before the usage chunk), "no answer" (closed before a status line) or the connection error's
class name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
    uvloop = None

USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
TAIL_BYTES = 4096
"""How much of a response's end is kept to find its usage chunk."""


@dataclass(frozen=True)
class BurstStream:
    """One streamed completion of a burst."""

    tokens: int
    """Completion tokens its usage chunk reported (0 without one)."""
    how: str
    events: int
    """SSE events received (``data:`` lines, ``[DONE]`` included)."""
    first_event_s: float | None
    """Sent -> first SSE event (None: none came)."""
    status_s: float | None
    """Sent -> status line (None: none came): for a refusal, when the 429 arrived."""
    retry_after: bool
    """The response carried a Retry-After header."""
    detail: str = ""
    """A refusal's body (its first 300 bytes); empty for a 200."""


class _StreamProtocol(asyncio.Protocol):
    """One request on one connection; ``done`` resolves to its ``BurstStream``."""

    def __init__(self, request: bytes, done: asyncio.Future[BurstStream]) -> None:
        self.request = request
        self.done = done
        self.sent = 0.0
        self.head = b""
        self.status: int | None = None
        self.status_s: float | None = None
        self.retry_after = False
        self.events = 0
        self.first_event_s: float | None = None
        self.tail = b""
        self.line_start = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.sent = time.perf_counter()
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.status is None:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.head[:end], self.head[end + 4 :]
            self.status = int(head.split(b" ", 2)[1])
            self.status_s = time.perf_counter() - self.sent
            self.retry_after = b"\r\nretry-after:" in head.lower()
        # The body is chunked; chunk-size lines never start with "data: ", so counting
        # event lines in the raw bytes counts the events.
        events = data.count(b"\ndata: ") + (self.line_start and data.startswith(b"data: "))
        if events and self.first_event_s is None:
            self.first_event_s = time.perf_counter() - self.sent
        self.events += events
        self.line_start = data.endswith(b"\n")
        self.tail = (self.tail + data)[-TAIL_BYTES:]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        self.done.set_result(self._result(exc))

    def _result(self, exc: Exception | None) -> BurstStream:
        def ended(how: str, tokens: int = 0) -> BurstStream:
            return BurstStream(
                tokens, how, self.events, self.first_event_s, self.status_s, self.retry_after
            )

        if self.status is None:
            return ended(type(exc).__name__ if exc else "no answer")
        if self.status != 200:
            refused = ended(f"http {self.status}")
            body = self.tail.split(b"\r\n\r\n", 1)[-1][:300]
            return dataclasses.replace(refused, detail=body.decode(errors="replace"))
        found = USAGE.findall(self.tail)
        if not found:
            return ended(type(exc).__name__ if exc else "no usage")
        return ended("ok", int(found[-1]))


def completion_request(url: str, body: dict) -> bytes:
    """A POST of ``body`` to ``url`` as HTTP/1.1 bytes, closing the connection after."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


CONNECTING_AT_ONCE = 1024
"""Connections a burst opens at once at most (each stream's own, kept once open): the
kernel's accept queue (``net.core.somaxconn``, often 4,096) drops what overflows it, and
the client then waits a second for its SYN to be sent again."""


async def one_stream(
    url: str, request: bytes, timeout_s: float, connecting: asyncio.Semaphore
) -> BurstStream:
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[BurstStream] = loop.create_future()
    try:
        async with connecting:
            transport, _ = await loop.create_connection(
                lambda: _StreamProtocol(request, done), parts.hostname, parts.port
            )
    except OSError as error:
        return BurstStream(0, type(error).__name__, 0, None, None, False)
    try:
        return await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        return BurstStream(0, "timeout", 0, None, None, False)
    finally:
        transport.close()


def stream_body(model: str, index: int, max_tokens: int) -> dict:
    """A streamed completion of ``max_tokens`` tokens (EOS ignored), greedy, with usage."""
    return {
        "model": model,
        "prompt": f"Request {index}: tell me a long story about the sea.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def sse_burst(
    base_url: str, model: str, streams: int, max_tokens: int, timeout_s: float = 900.0
) -> list[BurstStream]:
    """``streams`` streamed completions sent at once to ``base_url``/v1/completions."""
    url = f"{base_url}/v1/completions"
    requests = [
        completion_request(url, stream_body(model, index, max_tokens)) for index in range(streams)
    ]
    connecting = asyncio.Semaphore(CONNECTING_AT_ONCE)
    return await asyncio.gather(
        *(one_stream(url, request, timeout_s, connecting) for request in requests)
    )


def run_burst(
    base_url: str, model: str, streams: int, max_tokens: int, timeout_s: float = 900.0
) -> list[BurstStream]:
    """``sse_burst`` on a fresh event loop (uvloop where installed)."""
    coroutine = sse_burst(base_url, model, streams, max_tokens, timeout_s)
    if uvloop is not None:
        return uvloop.run(coroutine)
    return asyncio.run(coroutine)
