"""Request records for tests of the coordinator's parts (admission, routing, attempts)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Coroutine, Sequence

from splitserve.common.api_keys import ANONYMOUS, Caller
from splitserve.common.sampling_params import SamplingParams
from splitserve.coordinator.admission import KvAdmission, KvDemand
from splitserve.coordinator.placement import Slo
from splitserve.coordinator.request_record import RequestRecord
from splitserve.coordinator.router import DEFAULT_SLO

NEVER_LATE = Slo(ttft_s=math.inf, tpot_s=math.inf)
"""Targets no request misses (admission never calls it late)."""


def record(
    prompt: Sequence[int] = (),
    max_tokens: int = 16,
    *,
    request_id: str = "r",
    slo: Slo = DEFAULT_SLO,
    session_id: str = "",
    waited_s: float = 0.0,
    params: SamplingParams | None = None,
    caller: Caller = ANONYMOUS,
    priority: int = 0,
    arrived_at: float | None = None,
) -> RequestRecord:
    """A record of ``prompt`` and ``max_tokens`` (``params``: the rest of its sampling, with
    ``max_tokens`` replaced) that arrived ``waited_s`` ago (or at ``arrived_at`` on the
    test's clock)."""
    base = params or SamplingParams()
    return RequestRecord(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        params=dataclasses.replace(base, max_tokens=max_tokens),
        arrived_at=time.monotonic() - waited_s if arrived_at is None else arrived_at,
        slo=slo,
        caller=caller,
        priority=priority,
        session_id=session_id,
    )


def admit(
    admission: KvAdmission,
    request_id: str,
    demand: KvDemand,
    tenant: str = "",
    priority: int = 0,
    ttft_deadline: float | None = None,
    max_queue_wait_s: float | None = None,
) -> Coroutine[None, None, None]:
    """``admission.admit`` for a request of ``tenant`` whose first token is due at
    ``ttft_deadline`` on the admission's clock (None: never late) and that may wait
    ``max_queue_wait_s`` (None: the admission's bound)."""
    slo = NEVER_LATE if ttft_deadline is None else Slo(ttft_s=ttft_deadline, tpot_s=math.inf)
    request = RequestRecord(
        request_id=request_id,
        prompt_token_ids=(),
        params=SamplingParams(max_tokens=max(1, demand.max_tokens)),
        arrived_at=0.0,
        slo=slo,
        caller=Caller(tenant=tenant, key_digest=""),
        priority=priority,
        max_queue_wait_s=max_queue_wait_s,
    )
    return admission.admit(request, demand)
