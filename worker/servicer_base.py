"""What every worker servicer shares: readiness gating and load figures on the wire."""

from __future__ import annotations

from typing import Generic, TypeVar

import grpc

from splitserve.engine.engine_core import EngineLoad
from splitserve.proto.splitserve.v1 import worker_pb2

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


def load_to_proto(load: EngineLoad, ready: bool = True) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(
        num_total_blocks=load.num_total_blocks,
        num_used_blocks=load.num_used_blocks,
        num_running_requests=load.num_running_requests,
        num_waiting_requests=load.num_waiting_requests,
        num_reserved_requests=load.num_reserved_requests,
        num_running_tokens=load.num_running_tokens,
        num_pending_prefill_tokens=load.num_pending_prefill_tokens,
        num_finished_requests=load.num_finished_requests,
        ready=ready,
    )
