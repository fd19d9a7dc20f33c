"""What every worker servicer shares: readiness gating."""

from __future__ import annotations

from typing import Generic, TypeVar

import grpc

Domain = TypeVar("Domain")


class WorkerServicerBase(Generic[Domain]):
    """Holds the role's domain object once the model is loaded (``bind``); before that every
    call fails with UNAVAILABLE."""

    def __init__(self) -> None:
        self._domain: Domain | None = None

    def bind(self, domain: Domain) -> None:
        self._domain = domain

    async def ready(self, context: grpc.aio.ServicerContext) -> Domain:
        if self._domain is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading")
        assert self._domain is not None
        return self._domain
