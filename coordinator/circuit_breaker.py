"""A circuit breaker per worker (torch-free): calls that keep failing keep the worker out of
routing, whatever its heartbeats say.

Closed (routable) until ``threshold`` calls in a row failed; then open (not routable) for a
back-off that starts at ``base_s`` and doubles with every further failure up to ``max_s``;
once that passed, half-open: routable again, so the next attempts probe it. A success closes
it; a failure reopens it for longer. Failures within ``incident_s`` of the last counted one are
one incident (a worker that dies fails every request it held at once: that is one failure, not
sixteen). Heartbeats never touch it: a worker that answers its
heartbeats but fails the calls that carry work (a wrong advertised address, a one-way
partition, a broken engine) stays avoided.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_THRESHOLD = 3
DEFAULT_BASE_S = 2.0
DEFAULT_MAX_S = 60.0
DEFAULT_INCIDENT_S = 0.5


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    threshold: int = DEFAULT_THRESHOLD
    base_s: float = DEFAULT_BASE_S
    max_s: float = DEFAULT_MAX_S
    incident_s: float = DEFAULT_INCIDENT_S
    failures: int = 0
    """Consecutive failed calls."""
    open_until: float = 0.0
    """``time.monotonic()`` before which the worker is not routable."""
    last_failure: float | None = None
    """When the last counted failure happened."""

    def record_failure(self, now: float) -> None:
        if self.last_failure is not None and now - self.last_failure < self.incident_s:
            return  # the same incident
        self.last_failure = now
        self.failures += 1
        if self.failures >= self.threshold:
            backoff = self.base_s * 2 ** (self.failures - self.threshold)
            self.open_until = now + min(backoff, self.max_s)

    def record_success(self) -> None:
        self.failures = 0
        self.open_until = 0.0
        self.last_failure = None

    def allows(self, now: float) -> bool:
        return now >= self.open_until

    def state(self, now: float) -> BreakerState:
        if self.failures < self.threshold:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now < self.open_until else BreakerState.HALF_OPEN
