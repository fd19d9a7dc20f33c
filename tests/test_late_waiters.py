"""Late waiters through the real stack (``splitserve up``, simulated engines, real gRPC): a
request whose TTFT target has passed while it waited for admission lets one that can still
meet its own go first (``coordinator/admission.py``, ``--late-waiters-yield``).

The coordinator's prefill backlog is bounded to almost nothing (``--prefill-backlog`` via its
environment twin), so at most one prompt per prompt-computing worker is admitted at a time and
the rest wait in admission's queue. Five requests with a 1 ms TTFT target queue first (late
the moment they wait), then one with a 10-minute target: it is admitted as soon as the
running prompt is done, ahead of the five, and every request still completes.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.client import AsyncClient, Chunk, LatencyTargets, Sampling
from tests.cluster import cluster, metric_total

SAMPLING = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)
LATE = LatencyTargets(ttft_ms=1)
ON_TIME = LatencyTargets(ttft_ms=600_000)
LATE_REQUESTS = 5


async def _first_token_at(client: AsyncClient, index: int, targets: LatencyTargets) -> float:
    """When the request's first token arrived (monotonic); reads the stream to its end."""
    first = None
    prompt = f"request {index}: " + "word " * 800  # ~1.4 s of prompt on the simulated worker
    async for item in client.stream(prompt, sampling=SAMPLING, targets=targets):
        if first is None and isinstance(item, Chunk):
            first = time.monotonic()
    assert first is not None
    return first


@pytest.mark.slow  # a real cluster; test_admission checks which waiters yield as late by default
def test_a_request_that_can_still_meet_its_target_goes_before_late_ones() -> None:
    lines: dict[str, str] = {}
    env = {"SPLITSERVE_PREFILL_BACKLOG": "0.000001"}
    flags = ("--engine=sim", "--num-blocks=512", "--max-model-len=1024")
    with cluster(1, 1, *flags, ready_lines=lines, env=env, gateway=False) as address:

        async def scenario() -> tuple[list[float], float]:
            async with AsyncClient(address, timeout_s=60) as client:
                await client.wait_ready(timeout_s=30)
                late = [
                    asyncio.create_task(_first_token_at(client, index, LATE))
                    for index in range(LATE_REQUESTS)
                ]
                await asyncio.sleep(0.3)  # the late ones are queued (one admitted)
                on_time = await _first_token_at(client, LATE_REQUESTS, ON_TIME)
                return list(await asyncio.gather(*late)), on_time

        late, on_time = asyncio.run(scenario())
        yielded = metric_total(
            lines["coordinator metrics"], "splitserve_admission_late_waiters_total"
        )
    late.sort()
    # the first late one was admitted before the on-time one arrived; the others yielded
    assert on_time < late[1], (on_time, late)
    assert yielded >= LATE_REQUESTS - 1
