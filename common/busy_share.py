"""The share of recent wall time an engine spent on one kind of work (torch-free).

``DecayingShare`` answers "of the last ``time_constant_s`` or so, what fraction went to prompt
tokens?": each observation adds the seconds spent, and both those seconds and the wall time
elapsed are weighted by ``exp(-age / time_constant_s)``. Idle time counts as elapsed, so a
worker that stops prefilling sees its share fall back towards 0 whenever it is read. (An
engine reads it into its load figures after each command and step: an idle engine's
reported share is the one of its last activity, which errs towards keeping prompts off it.)

Placement reads a decode worker's prefill share to predict what the prompts it computes itself
cost its decode batch in steady state (``coordinator/placement.py``): a running request's steps
are stretched by every prompt computed during its life, not only by the next one.
"""

from __future__ import annotations

import math

MAX_SHARE = 1.0
"""A share is a fraction of wall time: at most 1, whatever a clock glitch makes the sums."""


class DecayingShare:
    """Exponentially time-weighted fraction of wall time spent on observed work.

    Invariant: ``_work_s`` is the sum of every observation's seconds, each weighted by
    ``exp(-(last - at) / time_constant_s)``, where ``at`` is its time and ``last`` the time
    of the latest observation. Not thread-safe: observe and read on one thread."""

    def __init__(self, started_at: float, time_constant_s: float = 10.0) -> None:
        if time_constant_s <= 0.0:
            raise ValueError("time_constant_s must be positive")
        self.time_constant_s = time_constant_s
        self._started_at = started_at
        self._last = started_at
        self._work_s = 0.0

    def observe(self, now: float, seconds: float) -> None:
        """``seconds`` of the work, ending at ``now`` (monotonic clock)."""
        now = max(now, self._last)
        self._work_s = self._work_s * self._decay(now - self._last) + max(0.0, seconds)
        self._last = now

    def share(self, now: float) -> float:
        """The weighted fraction of wall time since start spent on the work, in [0, MAX_SHARE]."""
        now = max(now, self._last)
        work = self._work_s * self._decay(now - self._last)
        # the weighted wall time: the integral of exp(-(now - t) / tau) over [start, now]
        elapsed = self.time_constant_s * (1.0 - self._decay(now - self._started_at))
        if elapsed <= 0.0:
            return 0.0
        return min(MAX_SHARE, work / elapsed)

    def _decay(self, age_s: float) -> float:
        return math.exp(-age_s / self.time_constant_s)
