"""What every worker servicer shares: readiness gating, and counting the calls that carry
work (for draining)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Generic, TypeVar

import grpc

from splitserve.common.event_wait import wait_event

Domain = TypeVar("Domain")


class InFlight:
    """The calls in progress that carry a request's work (a decode worker's ``Generate``
    stream, a ``Prefill``): a draining worker waits for them to end."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def count(self) -> int:
        return self._count

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count the enclosed call while it runs."""
        self._count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._count -= 1
            if self._count == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no tracked call runs; False when some still do after ``timeout_s``."""
        return await wait_event(self._idle, timeout_s)


class WorkerServicerBase(Generic[Domain]):
    """Holds the role's domain object once the model is loaded (``bind``); before that every
    call fails with UNAVAILABLE. ``in_flight`` counts the calls that carry work."""

    def __init__(self) -> None:
        self._domain: Domain | None = None
        self.in_flight = InFlight()

    def bind(self, domain: Domain) -> None:
        self._domain = domain

    async def ready(self, context: grpc.aio.ServicerContext) -> Domain:
        if self._domain is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading")
        assert self._domain is not None
        return self._domain
