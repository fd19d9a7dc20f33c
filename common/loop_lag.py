"""How far behind its own clock an event loop ran: ``LoopLag`` measures it, so that a check
of someone else's silence (a worker's stalled stream) can leave out the time this process
itself was too busy to read.

A task sleeps ``interval_s`` again and again; whatever it wakes late is lag. ``lag_since(t)``
is the lag accumulated since monotonic time ``t`` (to the meter's ``interval_s``
resolution; 0 before the meter started). One meter per event loop, started with
``LoopLag.start()`` and found by ``current()`` (None where none runs: then callers count no
lag).
"""

from __future__ import annotations

import asyncio
import bisect
import time
import weakref

INTERVAL_S = 0.05
HISTORY_S = 600.0
"""How far back ``lag_since`` is exact at least (older times count from the oldest sample
kept)."""

_METERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopLag] = weakref.WeakKeyDictionary()


class LoopLag:
    """The lag of the event loop it was started on (see the module)."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.total_s = 0.0
        """Lag accumulated since the meter started."""
        self._times: list[float] = []
        """Each sample's wake-up time; ``_totals`` the lag accumulated by then."""
        self._totals: list[float] = []
        self._last_wake = time.monotonic()
        self._dropped_total = 0.0
        """The lag accumulated by the last sample dropped from the history."""
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def start(cls, interval_s: float = INTERVAL_S) -> LoopLag:
        """The running loop's meter, started now unless it runs already."""
        loop = asyncio.get_running_loop()
        meter = _METERS.get(loop)
        if meter is None:
            meter = _METERS[loop] = cls(interval_s)
            meter._task = loop.create_task(meter._measure())
        return meter

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _measure(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.interval_s)
            now = self._last_wake = time.monotonic()
            self.total_s += max(0.0, now - before - self.interval_s)
            self._times.append(now)
            self._totals.append(self.total_s)
            if now - self._times[0] > 2 * HISTORY_S:  # drop the older half at once
                keep = bisect.bisect_left(self._times, now - HISTORY_S)
                self._dropped_total = self._totals[keep - 1]
                del self._times[:keep], self._totals[:keep]

    def lag_since(self, since: float) -> float:
        """Seconds the loop ran late since monotonic time ``since``, the meter's own wake-up
        that is overdue now included (a loop just unblocked may run a caller's timer before
        the meter's)."""
        index = bisect.bisect_left(self._times, since)
        before = self._totals[index - 1] if index else self._dropped_total
        overdue_s = max(0.0, time.monotonic() - max(self._last_wake, since) - self.interval_s)
        return self.total_s - before + overdue_s


def current() -> LoopLag | None:
    """The running loop's meter, if one was started."""
    try:
        return _METERS.get(asyncio.get_running_loop())
    except RuntimeError:
        return None


def lag_since(since: float) -> float:
    """The running loop's lag since ``since``; 0 where no meter runs."""
    meter = current()
    return 0.0 if meter is None else meter.lag_since(since)
