"""The answer to a generation request from its merged choice streams: an error status when
the first item fails, else the whole body as JSON or, streamed, SSE frames in the endpoint's
framing (``SseFraming``: chat and completions ``data: {json}\n\n`` ... ``data: [DONE]``;
the Responses API ``event: <type>\ndata: {json}\n\n``, no end marker); 499 when the HTTP
client went away first. The request's metrics are recorded as its items arrive
(``common/metrics.py:RequestTimer``). Every event an item makes goes out in one write.

A failure after tokens were streamed ends the stream with the builders' error events (chat and
completions: ``data: {"error": ...}`` and ``data: [DONE]``); a client that goes away
mid-stream ends it (its request aborted).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import grpc
import orjson
from opentelemetry.trace import Span
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from splitserve.client import Chunk, ClientError, Finish
from splitserve.common.metrics import RequestMetrics, RequestTimer
from splitserve.common.tracing import NO_SPAN, traceparent_of
from splitserve.gateway import schemas
from splitserve.gateway.choices import Choices
from splitserve.gateway.disconnect import (
    ClientDisconnected,
    EventStreamResponse,
    unless_disconnected,
)
from splitserve.gateway.errors import from_client_error
from splitserve.gateway.responses import usage_dict


def _sse(payload: dict[str, Any]) -> bytes:
    """One SSE frame of ``payload`` (orjson: a tenth of ``json.dumps``'s time a token; UTF-8,
    not ASCII escapes)."""
    return b"data: " + orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


def _typed_sse(payload: dict[str, Any]) -> bytes:
    """One SSE frame named by the payload's ``type`` (the Responses API's events)."""
    name = str(payload["type"]).encode()
    data = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


@dataclass(frozen=True)
class SseFraming:
    """How one endpoint's stream writes its events: each as ``frame`` gives it, then ``done``
    after the last."""

    frame: Callable[[dict[str, Any]], bytes]
    done: bytes


DATA_FRAMING = SseFraming(_sse, b"data: [DONE]\n\n")
"""Chat and completions: unnamed ``data:`` events, then ``data: [DONE]``."""
TYPED_FRAMING = SseFraming(_typed_sse, b"")
"""The Responses API: each event named by its ``type``; the stream ends with its last event."""


_HEADER_SAFE = "".join(chr(code) for code in range(0x21, 0x7F) if chr(code) != "%")


def header_value(text: str) -> str:
    """``text`` as an HTTP header's value: as it is where it is visible ASCII (spaces
    between), else percent-encoded as UTF-8 (a body's ``request_id`` may hold any
    character; a header holds neither line breaks nor, portably, non-ASCII)."""
    if all(" " <= char <= "~" for char in text) and text == text.strip():
        return text
    return quote(text, safe=_HEADER_SAFE)


async def respond(
    metrics: RequestMetrics,
    request: Request,
    request_id: str,
    events: AsyncGenerator[tuple[int, Chunk | Finish], None],
    choices: Choices,
    stream: bool,
    stream_options: schemas.StreamOptions | None,
    stall_timeout_s: float,
    span: Span = NO_SPAN,
    framing: SseFraming = DATA_FRAMING,
    finished: Callable[[], Awaitable[None]] | None = None,
) -> Response:
    """The response to the merged choice streams ``events``: an error status when one fails
    before the first item, else SSE frames (``stream``) or the whole body; 499 when the HTTP
    client went away first; an SSE frame the client leaves unread ``stall_timeout_s`` ends
    the stream; ``framing``: the endpoint's. ``span``: the request's, ended with it (its
    ``traceparent`` is returned); ``metrics``: the model's. ``finished`` is awaited once
    every choice has finished, before the last events or the body go out (the Responses
    API stores the response there: ``gateway/stored_responses.py``)."""
    timer = metrics.start(span)
    headers = {"x-request-id": header_value(request_id)}
    if traceparent := traceparent_of(span):
        headers["traceparent"] = traceparent
    try:
        first = await unless_disconnected(request.receive, anext(events))
    except ClientError as error:
        timer.finish("error")
        await events.aclose()
        raise from_client_error(error) from error
    except ClientDisconnected:
        timer.finish("abort")
        await events.aclose()
        return Response(status_code=499)
    except BaseException:
        timer.finish("error")
        await events.aclose()
        raise
    if stream:
        frames = _stream_frames(choices, first, events, timer, stream_options, framing, finished)
        return EventStreamResponse(frames, headers, stall_timeout_s)
    try:
        await unless_disconnected(request.receive, _fold(choices, first, events, timer))
    except ClientError as error:
        timer.finish("error")
        raise from_client_error(error) from error
    except ClientDisconnected:
        timer.finish("abort")
        return Response(status_code=499)
    finally:
        await events.aclose()
    if finished is not None:
        await finished()
    return JSONResponse(choices.whole(), headers=headers)


def record_item(timer: RequestTimer, choices: Choices, item: Chunk | Finish) -> None:
    """Metrics of an item already folded into ``choices``: tokens, and the request's end
    once every choice finished."""
    if isinstance(item, Chunk):
        timer.tokens(len(item.token_ids))
    elif choices.all_finished:
        usage = choices.usage()
        timer.finish(item.finish_reason, usage.prompt_tokens, usage.completion_tokens)


async def _fold(
    choices: Choices,
    first: tuple[int, Chunk | Finish],
    events: AsyncIterator[tuple[int, Chunk | Finish]],
    timer: RequestTimer,
) -> None:
    entry: tuple[int, Chunk | Finish] | None = first
    while entry is not None:
        index, item = entry
        choices.add(index, item)
        record_item(timer, choices, item)
        if choices.all_finished:
            return
        entry = await anext(events, None)
    raise ClientError(grpc.StatusCode.INTERNAL, "the stream ended without a finish message")


async def _stream_frames(
    choices: Choices,
    first: tuple[int, Chunk | Finish],
    events: AsyncGenerator[tuple[int, Chunk | Finish], None],
    timer: RequestTimer,
    options: schemas.StreamOptions | None,
    framing: SseFraming,
    finished: Callable[[], Awaitable[None]] | None,
) -> AsyncIterator[bytes]:
    """SSE frames; the choices' events in arrival order, the usage chunk if asked, then
    ``framing.done``; ``finished`` awaited before the events of the last choice's end."""
    continuous = bool(options and options.include_usage and options.continuous_usage_stats)
    frame = framing.frame
    try:
        if opening := choices.opening_chunks():
            yield b"".join(frame(event) for event in opening)
        entry: tuple[int, Chunk | Finish] | None = first
        while entry is not None:
            index, item = entry
            bodies = choices.add(index, item)
            record_item(timer, choices, item)
            if finished is not None and choices.all_finished:
                await finished()
            if bodies:
                if continuous:
                    usage = usage_dict(choices.usage())  # the item's usage, on each of its events
                    for body in bodies:
                        body["usage"] = usage
                yield b"".join(frame(body) for body in bodies)
            if choices.all_finished:
                break
            entry = await anext(events, None)
        if options and options.include_usage:
            yield frame(choices.usage_chunk())
    except ClientError as error:
        timer.finish("error")
        yield b"".join(frame(body) for body in choices.error_events(from_client_error(error)))
    except BaseException:
        timer.finish("abort")  # the client went away (cancelled) mid-stream
        raise
    finally:
        await events.aclose()
    if framing.done:
        yield framing.done
