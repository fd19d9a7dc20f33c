"""The callers' side of ``AsyncEngine``: a request's stream of outputs, a submit waiting to be
accepted, and the one way results cross from the engine thread to a caller's event loop.

The engine thread owns each request's ``OutputStream`` record (what the stream interval holds
back) and posts into its ``asyncio.Queue`` through ``loop.call_soon_threadsafe`` only
(``call_soon``, ``put_each``); the caller reads that queue through ``RequestStream``. A caller
whose event loop has closed is waiting for nothing: a post to it is dropped, never raised on
the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from splitserve.common.request_update import StepOutput
from splitserve.engine.engine_face import ReservedBlocks

if TYPE_CHECKING:
    from splitserve.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class OutputStream:
    """A request's stream as the engine thread sees it: its caller's loop and queue."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[StepOutput | BaseException]
    held: StepOutput | None = None
    """Outputs of the last ``held_steps`` steps, not sent yet (``stream_interval``)."""
    held_steps: int = 0
    sent_any: bool = False


OutboxEntry = tuple[str, OutputStream, StepOutput | BaseException]
"""A request id, its stream, and what goes to it with the next report."""


@dataclass
class Submission:
    """One ``submit`` waiting for its engine command (and, for a remote-prefill reservation,
    for blocks): the stream it opens and the future its caller awaits."""

    request_id: str
    stream: OutputStream
    accepted: asyncio.Future[ReservedBlocks | None]
    """Settled on the caller's loop: the reserved blocks (None: a plain request), or the
    refusal; cancelled when the reservation was aborted while waiting."""
    held: list[int] = field(default_factory=list)
    """Blocks held for the caller (``AsyncEngine.release_blocks``); written on the engine
    thread when the reservation is granted."""

    def refuse(self, error: BaseException) -> None:
        """Engine thread: the submitter gets ``error`` (nothing was queued for it)."""
        call_soon(self.stream.loop, settle, self.accepted, error, None)

    def dropped(self, reason: BaseException | None) -> None:
        """Engine thread (``PendingReservation.dropped``): the reservation will never be
        granted; None: aborted while waiting, which the submitter sees as a cancellation."""
        if reason is None:
            call_soon(self.stream.loop, self.accepted.cancel)
        else:
            call_soon(self.stream.loop, settle, self.accepted, reason, None)


class RequestStream:
    """Outputs of one submitted request; iterate until the final output (finish reason set).

    Leaving the iteration early (break, exception, cancellation) aborts the request.
    ``reserved`` holds the reserved blocks of a remote-prefill request (its cached prefix
    first), else None; ``block_table`` all of them.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        stream: OutputStream,
        reserved: ReservedBlocks | None,
    ) -> None:
        self.request_id = request_id
        self.reserved = reserved
        self.block_table = None if reserved is None else reserved.block_ids
        self._engine = engine
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        """Each output as it comes; outputs that queued up while the caller was busy come as
        one (``StepOutput.followed_by``: every token once, in order), so a caller that falls
        behind catches up with one message per request, never one per step it missed."""
        finished = False
        outputs = self._stream.outputs
        held: StepOutput | BaseException | None = None  # taken from the queue, not yet seen
        try:
            while True:
                item = held if held is not None else await outputs.get()
                held = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                while item.update.finish_reason is None and not outputs.empty():
                    later = outputs.get_nowait()
                    if isinstance(later, BaseException):
                        held = later
                        break
                    item = item.followed_by(later)
                finished = item.update.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._engine.abort(self.request_id)


def put_each(entries: list[OutboxEntry]) -> None:
    """On the caller's loop: each item into its request's queue, in the engine's order."""
    for _, stream, item in entries:
        stream.outputs.put_nowait(item)


def call_soon(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object
) -> None:
    """``loop.call_soon_threadsafe`` from the engine thread; a caller whose event loop has
    closed is waiting for nothing, and must not stop the engine thread."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop was closed
        logger.debug("a result was not delivered: its event loop is closed")


def settle(future: asyncio.Future[T], error: BaseException | None, result: T) -> None:
    """On the future's loop: its result or its error, unless it is done already."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
