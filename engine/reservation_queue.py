"""Remote-prefill reservations that found the KV pool short, served in arrival order.

A decode worker reserves blocks for every prompt another worker prefills. When the pool is
short the reservation waits here, in a FIFO, instead of being retried: ``serve`` (called by
the engine thread after every command batch and every step, the only moments blocks come
back) reserves for the waiting ones in order while the oldest fits. Nothing polls; a waiting
reservation costs nothing until the pool can take it, and its request was validated once.

Invariants (engine thread only, like the core it serves):
- Order: a reservation is granted only when every older one was (no overtaking, so a large
  prompt is never starved by a stream of small ones).
- Bound: at most ``max_waiting`` wait; one more is refused at once with ``CapacityError``.
- Every reservation ends exactly once: ``granted`` (blocks reserved and held) or
  ``dropped`` (aborted, refused or shut down), each called on the engine thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.common.errors import CapacityError, InvalidRequestError
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.engine_face import ReservedBlocks
from splitserve.engine.request import Request

DEFAULT_MAX_WAITING = 1024
"""Reservations one decode worker lets wait; admission upstream keeps far fewer there."""


@dataclass
class PendingReservation:
    request: Request
    granted: Callable[[ReservedBlocks], None]
    """Called with the reserved blocks once they are reserved (engine thread)."""
    dropped: Callable[[BaseException | None], None]
    """Called with the reason it will never be granted; None: it was aborted."""


class ReservationQueue:
    """FIFO of reservations waiting for blocks on one engine; see the module docstring."""

    def __init__(self, core: EngineCore, max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        self._core = core
        self._max_waiting = max_waiting
        self._waiting: deque[PendingReservation] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: object) -> bool:
        return any(p.request.request_id == request_id for p in self._waiting)

    def offer(self, pending: PendingReservation) -> None:
        """Grant at once when none waits and the pool has room, else queue it.

        Raises (and queues nothing) ``InvalidRequestError`` for a request id the engine or
        the queue already has, and what the core raises for a request it can never serve;
        ``CapacityError`` when ``max_waiting`` already wait.
        """
        request_id = pending.request.request_id
        if request_id in self:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")
        if not self._waiting:
            try:
                pending.granted(self._core.reserve_request(pending.request))
                return
            except CapacityError:
                pass
        else:  # an older one waits: never overtake it, but refuse what can never fit now
            self._core.check_reservable(pending.request)
        if len(self._waiting) >= self._max_waiting:
            raise CapacityError(f"{len(self._waiting)} KV reservations already wait here")
        self._waiting.append(pending)

    def serve(self) -> int:
        """Grant waiting reservations, oldest first, while the oldest fits the pool; how many
        left the queue (granted or failed)."""
        before = len(self._waiting)
        while self._waiting:
            head = self._waiting[0]
            if not self._core.has_room_for(head.request):
                break
            try:
                reserved = self._core.reserve_request(head.request)
            except CapacityError:  # room by count, not in the runs the transfer needs
                break
            except Exception as error:  # e.g. its id was taken meanwhile: it alone fails
                self._waiting.popleft()
                head.dropped(error)
                continue
            self._waiting.popleft()
            head.granted(reserved)
        return before - len(self._waiting)

    def drop(self, request_id: str) -> bool:
        """Remove a waiting reservation (aborted); False when none waits under that id."""
        for pending in self._waiting:
            if pending.request.request_id == request_id:
                self._waiting.remove(pending)
                pending.dropped(None)
                return True
        return False

    def drop_all(self, reason: BaseException) -> None:
        """End every waiting reservation with ``reason`` (the engine stops)."""
        while self._waiting:
            self._waiting.popleft().dropped(reason)
