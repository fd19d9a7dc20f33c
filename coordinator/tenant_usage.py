"""What each tenant uses now, against what it may (``tenants.py:TenantLimits``): its requests
in flight (admitted or waiting) and its tokens per minute (a ``TokenBucket`` per tenant with a
budget, made on its first request).

A request's cost is its prompt plus ``max_tokens``: taken from the bucket when it is admitted
(``take``), and the output it did not generate given back when it ends (``leave``). A request
counts in flight from ``enter`` (admitted or waiting) to ``leave`` (ended, refused while
waiting, or cancelled). Single event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from splitserve.common.errors import InvalidRequestError
from splitserve.coordinator.tenants import TenantLimits, TokenBucket

TenantRefusalReason = Literal["tenant_inflight", "tenant_tokens"]


@dataclass(frozen=True)
class TenantRefusal:
    """A request its tenant may not start now: refuse it with this retry hint."""

    reason: TenantRefusalReason
    message: str
    retry_after_s: float


class TenantUsage:
    """Per tenant: requests in flight and its token bucket. Invariant: a tenant is in
    ``_inflight`` only while it has requests in flight (the count is then >= 1)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._inflight: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}

    def inflight(self, tenant: str) -> int:
        return self._inflight.get(tenant, 0)

    def check(
        self,
        tenant: str,
        limits: TenantLimits,
        cost: int,
        priority: int,
        next_end_s: Callable[[], float],
    ) -> TenantRefusal | None:
        """Why ``tenant`` may not start a request of ``cost`` tokens at ``priority`` now
        (None: it may); raises ``InvalidRequestError`` for what it may never ask (a priority
        above its ``max_priority``, a cost above its minute's budget). ``next_end_s``: when
        the tenant's soonest request is predicted to end (read only to refuse for requests
        in flight). Takes nothing."""
        if priority > limits.max_priority:
            raise InvalidRequestError(
                f"priority {priority} is above this key's highest, {limits.max_priority}",
                "priority",
            )
        inflight = self.inflight(tenant)
        if limits.max_inflight and inflight >= limits.max_inflight:
            return TenantRefusal(
                "tenant_inflight",
                f"this key has {inflight} requests in flight (limit {limits.max_inflight})",
                next_end_s(),
            )
        if limits.tokens_per_minute:
            if cost > limits.tokens_per_minute:
                raise InvalidRequestError(
                    f"the prompt and max_tokens come to {cost} tokens, more than this key's "
                    f"{limits.tokens_per_minute} per minute",
                    "max_tokens",
                )
            wait_s = self._bucket(tenant, limits).wait_s(cost)
            if wait_s > 0:
                return TenantRefusal(
                    "tenant_tokens",
                    f"this key's {limits.tokens_per_minute} tokens per minute are used up",
                    wait_s,
                )
        return None

    def enter(self, tenant: str) -> None:
        """A request of ``tenant`` is admitted or waits."""
        self._inflight[tenant] = self.inflight(tenant) + 1

    def take(self, tenant: str, cost: int) -> None:
        """A request of ``tenant`` was admitted: its cost leaves the tenant's bucket."""
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            bucket.take(cost)

    def leave(self, tenant: str, unused_tokens: int) -> None:
        """A request of ``tenant`` left (ended, refused while waiting, or cancelled); the
        ``unused_tokens`` taken for it go back to the tenant's bucket."""
        left = self.inflight(tenant) - 1
        if left > 0:
            self._inflight[tenant] = left
        else:
            self._inflight.pop(tenant, None)
        bucket = self._buckets.get(tenant)
        if bucket is not None and unused_tokens > 0:
            bucket.give_back(unused_tokens)

    def _bucket(self, tenant: str, limits: TenantLimits) -> TokenBucket:
        """The tenant's bucket, made anew (full) when its budget changed."""
        bucket = self._buckets.get(tenant)
        if bucket is None or bucket.capacity != limits.tokens_per_minute:
            bucket = self._buckets[tenant] = TokenBucket(limits.tokens_per_minute, self._clock)
        return bucket
