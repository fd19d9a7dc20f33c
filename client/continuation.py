"""One ``stream()`` across coordinators: the state both clients share, ``StreamContinuation``.

A stream's items may come from several ``Generate`` calls: when its coordinator dies
(UNAVAILABLE, CANCELLED) after the stream delivered tokens, the same request goes to another
coordinator of the channel with ``continue_after`` = the token ids the consumer has
(``wire.continuation``), at most ``MAX_CONTINUATIONS`` times, within the stream's one deadline.
The consumer sees one stream: no token twice or missing. This module holds what was streamed,
the request each call sends, when to give up and when the stream is over; each client keeps
only its own I/O, the sync or asyncio iteration of a call::

    stream = StreamContinuation(request, deadline, start_call)
    while stream.needs_call:
        with stream.next_call() as call:
            for response in call:  # ``async for`` in ``AsyncClient``
                if (chunk := stream.receive(response)) is not None:
                    yield chunk
    yield stream.finish()

Invariants: ``Chunk``s are handed out in order, none after the call's ``Finish``; the
``Finish`` is handed out once, after the call that sent it ended with OK; every call is
cancelled when its ``with`` block exits (a no-op once it is over; otherwise the coordinator
aborts the request on every worker).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

import grpc

from splitserve.client import wire
from splitserve.client.errors import ClientError
from splitserve.client.retry import Deadline
from splitserve.client.types import Chunk, Finish
from splitserve.proto.splitserve.v1 import coordinator_pb2

CONTINUABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
"""How a stream ends when its coordinator dies or drains it away: a stream that delivered
tokens goes on through another coordinator."""
MAX_CONTINUATIONS = 3
"""Calls a stream may make after its first one."""


class StreamCall(Protocol):
    """What the clients' ``Generate`` calls (sync and ``grpc.aio``) share: cancelling."""

    def cancel(self) -> bool: ...


Call = TypeVar("Call", bound=StreamCall)
StartCall = Callable[[coordinator_pb2.GenerateRequest, float | None], Call]
"""Starts a ``Generate`` call of a request with a timeout in seconds (None: none)."""


class StreamContinuation(Generic[Call]):
    """One ``stream()``: ``request`` (its id names every call's items), sent by ``start``
    within ``deadline`` (see the module docstring for the loop)."""

    def __init__(
        self,
        request: coordinator_pb2.GenerateRequest,
        deadline: Deadline,
        start: StartCall[Call],
    ) -> None:
        self._request = request
        self._deadline = deadline
        self._start = start
        self._streamed: list[int] = []
        """Token ids of every chunk handed out: what a continuation goes on after."""
        self._continuations = 0
        self._finish: Finish | None = None
        """The current call's finish, handed out once the call ended with OK."""
        self.needs_call = True
        """True until a call ended with OK; then ``finish`` ends the stream."""

    @contextlib.contextmanager
    def next_call(self) -> Iterator[Call]:
        """The stream's next call, started with the request to send now (the continuation
        after the streamed tokens, once there are any) and the time left, and cancelled when
        the block exits. A call that fails as a lost coordinator's does, after tokens were
        streamed and with continuations left, is swallowed: ``needs_call`` stays True. Any
        other failure raises ``ClientError``."""
        request = self._request
        if self._streamed:  # the last coordinator died after delivering tokens: go on elsewhere
            request = wire.continuation(request, self._streamed)
        self._finish = None
        call = self._start(request, self._deadline.remaining())
        try:
            yield call
        except grpc.RpcError as rpc_error:  # grpc.aio.AioRpcError is one too
            if not self._continues(rpc_error.code()):  # type: ignore[attr-defined]
                error = ClientError.from_call(rpc_error, self._request.request_id)  # type: ignore[arg-type]
                raise error from rpc_error
            self._continuations += 1
            return
        finally:
            call.cancel()
        self.needs_call = False

    def _continues(self, code: grpc.StatusCode) -> bool:
        """Whether a call that broke with ``code`` goes on through another coordinator: the
        stream delivered tokens, broke as a dead coordinator's does, and has continuations
        left."""
        return (
            bool(self._streamed) and code in CONTINUABLE and self._continuations < MAX_CONTINUATIONS
        )

    def receive(self, response: coordinator_pb2.GenerateResponse) -> Chunk | None:
        """The chunk of one response to hand out, or None: a ``Finish`` is held for
        ``finish`` and nothing after it is handed out. Raises ``ClientError`` for an
        in-stream error."""
        item = wire.stream_item(response, self._request.request_id)
        if isinstance(item, Finish):
            self._finish = item
            return None
        if self._finish is not None:
            return None
        self._streamed.extend(item.token_ids)
        return item

    def finish(self) -> Finish:
        """The stream's end, once a call ended with OK; ``ClientError`` INTERNAL when that
        call sent none."""
        if self._finish is None:
            raise ClientError(
                grpc.StatusCode.INTERNAL,
                "the stream ended without a completion",
                request_id=self._request.request_id,
            )
        return self._finish
