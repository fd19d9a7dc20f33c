"""The retry rules and deadline arithmetic shared by the sync and the asyncio client.

A call's deadline covers all of its attempts and the waits between them. After an attempt
failed with ``error``, ``retry_delay`` says how long to wait before the next one, or None to
give up and raise ``error``:

- never after a chunk was delivered (``streamed``): the caller has seen tokens, and a second
  attempt could not continue where the first stopped;
- UNAVAILABLE: exponential backoff;
- RESOURCE_EXHAUSTED, only with ``policy.retry_overloaded``: the server's ``retry-after-ms``
  hint when it sent one, else the backoff;
- any other code (INVALID_ARGUMENT, FAILED_PRECONDITION, DEADLINE_EXCEEDED, ...): never;
- never beyond ``policy.max_attempts`` attempts, nor when the wait would outlast the deadline.
"""

from __future__ import annotations

import random
import time
from types import EllipsisType

import grpc

from splitserve.client.errors import ClientError, RetryPolicy


class Deadline:
    """The end of a call, ``timeout_s`` from now (None: no deadline)."""

    def __init__(self, timeout_s: float | None) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        """Seconds left (never negative), None without a deadline."""
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())


def backoff_s(policy: RetryPolicy, attempt: int) -> float:
    """The wait after failed attempt number ``attempt`` (1-based), jitter included."""
    base = min(policy.max_backoff_s, policy.initial_backoff_s * policy.multiplier ** (attempt - 1))
    return base * random.uniform(1.0 - policy.jitter, 1.0 + policy.jitter)


def retry_delay(
    policy: RetryPolicy,
    error: ClientError,
    attempt: int,
    *,
    streamed: bool,
    deadline: Deadline,
) -> float | None:
    """Seconds to wait before retrying after ``error`` ended attempt ``attempt`` (1-based);
    None when the call must not be retried."""
    if streamed or attempt >= policy.max_attempts:
        return None
    if error.code == grpc.StatusCode.UNAVAILABLE:
        delay = backoff_s(policy, attempt)
    elif error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and policy.retry_overloaded:
        hint = error.retry_after_s
        delay = backoff_s(policy, attempt) if hint is None else hint
    else:
        return None
    remaining = deadline.remaining()
    if remaining is not None and delay >= remaining:
        return None
    return delay


class Attempts:
    """One call's attempts: numbers them and applies ``retry_delay`` with the call's deadline.

    ``start()`` before each attempt returns that attempt's gRPC timeout (the time left of the
    whole call's deadline); ``delay_after(error, streamed=...)`` after a failed one returns the
    wait before the next attempt, or None to raise ``error``.
    """

    def __init__(self, policy: RetryPolicy, timeout_s: float | None) -> None:
        self._policy = policy
        self._deadline = Deadline(timeout_s)
        self.number = 0

    def start(self) -> float | None:
        self.number += 1
        return self._deadline.remaining()

    def delay_after(self, error: ClientError, *, streamed: bool) -> float | None:
        return retry_delay(
            self._policy, error, self.number, streamed=streamed, deadline=self._deadline
        )


def resolve_timeout(override: float | None | EllipsisType, default: float | None) -> float | None:
    """A call's timeout: its own ``override`` unless that is ``...`` (the client's default)."""
    return default if override is ... else override
