"""A coordinator whose decode workers are all known but none routable (each marked failed:
a stall, a failed call, a late heartbeat under overload) refuses new requests with a retry
hint (429 through the gateway), not as if it had none (UNAVAILABLE, 503); with none known at
all it says so."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.common.errors import OverloadedError, WorkerUnavailableError
from splitserve.common.membership import Role
from splitserve.common.model_files import load_tokenizer, resolve_model_path
from splitserve.common.sampling_params import AskedSampling, SamplingParams
from splitserve.coordinator.request_record import RequestAsk
from splitserve.coordinator.service import (
    RECOVERING_RETRY_AFTER_S,
    Coordinator,
    CoordinatorConfig,
)
from splitserve.proto.cluster_access import ClusterAccess
from tests.cluster import CREDENTIAL
from tests.test_router import _worker


async def _first_chunk(coordinator: Coordinator) -> None:
    sampling = AskedSampling(4, 0, lambda n: SamplingParams(max_tokens=n))
    stream = coordinator.generate(RequestAsk("Hello there", sampling, request_id="r1"))
    async for _ in stream:
        return


def test_known_but_unroutable_workers_mean_retry_soon_not_unavailable() -> None:
    tokenizer = load_tokenizer(resolve_model_path("default"))
    coordinator = Coordinator(
        CoordinatorConfig(model_name="m"), tokenizer, ClusterAccess(CREDENTIAL)
    )
    with pytest.raises(WorkerUnavailableError, match="no decode worker is registered"):
        asyncio.run(_first_chunk(coordinator))
    coordinator.registry.register(_worker("d", Role.DECODE))
    coordinator.registry.mark_failed("d")
    with pytest.raises(OverloadedError, match="recovering") as refused:
        asyncio.run(_first_chunk(coordinator))
    assert refused.value.retry_after_s == RECOVERING_RETRY_AFTER_S
