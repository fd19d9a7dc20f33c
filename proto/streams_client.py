"""The caller's side of a multiplexed streams call (``streams_server.py`` has the shape):
``StreamsClientCall`` is one open call; each stream on it is a ``StreamSink`` that receives
its items, or the failure that broke the call.

Contract: a stream's items are delivered in order, then nothing after its ``end``; when the
call breaks (its server died, the connection was lost) or ends, every stream still open on
it gets ``fail`` with the call's code (UNAVAILABLE when the server ended the call itself),
and the call takes no new streams (``accepting`` False). ``cancel`` of an open stream sends
its ``cancel`` (the server cancels the stream's work). A retired call takes no new streams
and half-closes once its last stream ended. A stream is waiting for admission from its
``open`` until the server's ``admitted`` item or its end (``refusal_at`` reads the count).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from splitserve.proto.splitserve.v1 import common_pb2
from splitserve.proto.status import PARAM_METADATA_KEY, RETRY_AFTER_METADATA_KEY

Metadata = tuple[tuple[str, str], ...]

QUEUE_FULL_RETRY_AFTER_MS = 1000
"""The retry hint of a refusal for a full admission queue where the server gave none yet."""

_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class StreamError(grpc.RpcError):
    """How a stream on a multiplexed call failed, as a failed call of its own reports it
    (``code()``, ``details()``, ``trailing_metadata()`` with the ``param`` and the overload
    hint: what ``status.error_from_rpc`` and the client's ``ClientError.from_call`` read)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        param: str = "",
        retry_after_ms: int = 0,
        refuses_all_ms: int = 0,
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
        self.refuses_all_ms = refuses_all_ms
        """> 0: the server refuses every new stream for this long (``StreamEnd``)."""

    @classmethod
    def of_end(cls, end: common_pb2.StreamEnd) -> StreamError:
        code = _CODES_BY_NUMBER.get(end.code, grpc.StatusCode.UNKNOWN)
        message = end.message or code.name
        return cls(code, message, end.param, end.retry_after_ms, end.refuses_all_ms)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Metadata:
        return self._metadata


def _hint_left_ms(refusal: StreamError, since: float, now: float) -> int:
    """What is left at ``now`` of the retry hint of ``refusal``, which came at ``since``
    (``time.monotonic``); at least 1 ms."""
    return max(1, refusal.retry_after_ms - int((now - since) * 1000))


class StreamSink(Protocol):
    """One stream of a ``StreamsClientCall``."""

    def deliver(self, item: Any) -> None:
        """The stream's next item (a ``response`` or its ``end``)."""

    def fail(self, error: StreamError) -> None:
        """The call broke (or ended) while the stream was open."""


OpenCall = Callable[[AsyncIterator[Any]], grpc.aio.StreamStreamCall]
"""Opens the streams call with its request iterator (a stub method with its metadata)."""


class StreamsClientCall:
    """One open multiplexed streams call: its streams by key and the queue of what to send.
    ``request_type`` / ``start_type``: the call's request and start messages. Must be made
    inside the running event loop (it starts its reader)."""

    def __init__(
        self, open_call: OpenCall, request_type: Callable[..., Any], start_type: Callable[..., Any]
    ) -> None:
        self._request = request_type
        self._start = start_type
        self._outgoing: asyncio.Queue[Any] = asyncio.Queue()
        self._streams: dict[int, StreamSink] = {}
        self._keys = itertools.count(1)
        self._idle_since: float | None = time.monotonic()
        """When the call's last stream ended (None while it has streams)."""
        self.accepting = True
        """False once the call broke, ended or was retired: new streams go elsewhere."""
        self._refusal: StreamError | None = None
        """The server's last refusal of every new stream (``refuse_all``), while it holds."""
        self._refusing_since = self._refusing_until = 0.0
        self._waiting: set[int] = set()
        """Keys of open streams the server has not said were admitted (``admitted``)."""
        self._max_queued = 0
        """The server's admission queue's limit, as its ``admitted`` items say (0: unknown)."""
        self._overload: StreamError | None = None
        """The last stream the server refused for overload, and when (``_overload_at``)."""
        self._overload_at = 0.0
        self._call = open_call(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[Any]:
        while (message := await self._outgoing.get()) is not None:
            yield message

    def open(self, stream: StreamSink, request: Any) -> int:
        """Start ``request`` as a stream delivering to ``stream``; its key."""
        key = next(self._keys)
        self._streams[key] = stream
        self._waiting.add(key)
        self._idle_since = None
        self._outgoing.put_nowait(self._request(start=self._start(key=key, request=request)))
        return key

    def cancel(self, key: int) -> None:
        """Cancel an open stream (a no-op for one that ended)."""
        self._waiting.discard(key)
        if self._streams.pop(key, None) is not None and self.accepting:
            self._outgoing.put_nowait(self._request(cancel=key))
        self._close_if_idle()

    def ended(self, key: int, outcome: StreamError | None = None) -> None:
        """The stream got its end (``outcome``: what it said, where known)."""
        self._streams.pop(key, None)
        self._waiting.discard(key)
        if outcome is not None and outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._overload, self._overload_at = outcome, time.monotonic()
        self._close_if_idle()

    def admitted(self, key: int, max_queued: int) -> None:
        """The server admitted the stream's request; its queue holds at most ``max_queued``."""
        self._waiting.discard(key)
        self._max_queued = max_queued

    def retire(self) -> None:
        """Take no new streams; half-close once the open ones ended."""
        self.accepting = False
        self._close_if_idle()

    def close(self) -> None:
        """End the call now: every open stream fails CANCELLED."""
        self._call.cancel()

    def refuse_all(self, refusal: StreamError) -> None:
        """The server ended a stream with ``refusal``, which says it refuses every new stream
        for ``refusal.refuses_all_ms``: ``refusal_at`` answers for it until then."""
        self._refusal = refusal
        self._refusing_since = time.monotonic()
        self._refusing_until = self._refusing_since + refusal.refuses_all_ms / 1000.0

    def refusal_at(self, now: float) -> StreamError | None:
        """What the server would answer a stream opened at ``now`` (``time.monotonic``) where
        that is a refusal known here; None: open the stream and ask. Known here:
        - the server said it refuses every new stream until after ``now``: its refusal, the
          retry hint less the time since it came (at least 1 ms);
        - at least its admission queue's limit of this call's streams wait for admission (in
          the queue, or on their way to it): the queue is full, or will be once they arrive,
          and a stream sent now would be refused for it (a stream admitted at once, where
          the KV had room, counts as waiting until its ``admitted`` item comes back: a burst
          on an idle server may be refused here by up to that many early). Its hint: the
          last overload refusal's less the time since it came, else
          ``QUEUE_FULL_RETRY_AFTER_MS``."""
        refusal = self._refusal
        if refusal is not None and now < self._refusing_until:
            return StreamError(
                refusal.code(),
                f"{refusal.details()} (answered for the server, which refuses every new "
                "request for now)",
                retry_after_ms=_hint_left_ms(refusal, self._refusing_since, now),
            )
        waiting, limit = len(self._waiting), self._max_queued
        if limit <= 0 or waiting < limit:
            return None
        hint_ms = QUEUE_FULL_RETRY_AFTER_MS
        if self._overload is not None and self._overload.retry_after_ms > 0:
            hint_ms = _hint_left_ms(self._overload, self._overload_at, now)
        return StreamError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the coordinator's admission queue is full: {waiting} requests already wait for KV "
            f"(limit {limit}); answered without sending the request",
            retry_after_ms=hint_ms,
        )

    def idle_s(self, now: float) -> float:
        """Seconds since the call's last stream ended; 0 while it has streams."""
        return 0.0 if self._idle_since is None else now - self._idle_since

    def _close_if_idle(self) -> None:
        if not self._streams and self._idle_since is None:
            self._idle_since = time.monotonic()
        if not self.accepting and not self._streams:
            self._outgoing.put_nowait(None)

    async def _read(self) -> None:
        failure = StreamError(grpc.StatusCode.UNAVAILABLE, "the server ended the streams' call")
        try:
            async for batch in self._call:
                for item in batch.items:
                    stream = self._streams.get(item.key)
                    if stream is not None:
                        stream.deliver(item)
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            failure = StreamError(code, error.details() or code.name)  # type: ignore[attr-defined]
        except asyncio.CancelledError:
            failure = StreamError(grpc.StatusCode.CANCELLED, "the streams' call was closed")
            raise
        finally:
            self.accepting = False
            self._waiting.clear()
            streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream.fail(failure)
            self._outgoing.put_nowait(None)
