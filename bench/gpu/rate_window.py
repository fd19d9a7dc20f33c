"""One request rate for a bounded time, through the project's gRPC ``AsyncClient``.

``run_window`` sends each request of a window at its arrival time (``workload.py``'s
``RequestSpec``: Poisson arrivals, all before the window's end) as a stream of exactly its
output length (``max_tokens = min_tokens``, greedy, ``ignore_eos``, prompt as token ids),
stamping every streamed token on arrival (``serving_stats.RequestRecord``: a chunk of ``k``
tokens is ``k`` arrivals at one time). At ``deadline_s`` after the start every stream still
open is cancelled (the coordinator then aborts it on every worker).

No silent loss: every request comes back as exactly one record, completed (finish reason
``length`` or ``stop``) or failed with its reason in ``error``: the client's error
(``ClientError``: status and message), a finish other than a completion, or
``UNFINISHED`` for a stream the deadline cut.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from serving_stats import RequestRecord
from workload import RequestSpec

from splitserve.client import AsyncClient, Chunk, ClientError, Finish, Sampling

UNFINISHED = "unfinished at the deadline (window + drain): cancelled"


def sampling_of(request: RequestSpec) -> Sampling:
    """Exactly ``output_len`` tokens, greedy, as load generators ask for them (aiperf's
    ``min_tokens`` and ``ignore_eos``). ``min_tokens`` keeps EOS masked until then (as vLLM's
    does, ``ignore_eos`` or not); the served H200 run of 2026-11-30 launched no decode step
    ahead because of it (``steps_ahead_fraction`` 0), which steps launched ahead now mask on
    the device (``decided_on_device``)."""
    return Sampling(
        max_tokens=request.output_len,
        min_tokens=request.output_len,
        temperature=0.0,
        ignore_eos=True,
    )


async def send(client: AsyncClient, request: RequestSpec, record: RequestRecord) -> None:
    """Stream ``request`` now, filling ``record`` (its error set on any failure)."""
    record.send_time = time.perf_counter()
    try:
        async for item in client.stream(
            token_ids=request.prompt_token_ids, sampling=sampling_of(request)
        ):
            now = time.perf_counter()
            if isinstance(item, Chunk):
                record.token_times.extend([now] * len(item.token_ids))
            elif isinstance(item, Finish):
                record.finish_reason, record.end_time = item.finish_reason, now
    except ClientError as error:
        record.error = f"{error.code.name}: {error.message}"[:300]
    if not record.end_time:
        record.end_time = time.perf_counter()
        record.error = record.error or "stream ended without a finish"


async def _send_at(
    client: AsyncClient, request: RequestSpec, start: float, record: RequestRecord
) -> None:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    await send(client, request, record)


async def run_window(
    client: AsyncClient, requests: Sequence[RequestSpec], deadline_s: float
) -> list[RequestRecord]:
    """Every request sent at its arrival (seconds after now), each one's record in order;
    streams still open ``deadline_s`` after now are cancelled and recorded ``UNFINISHED``."""
    records = [
        RequestRecord(request.index, len(request.prompt_token_ids), request.output_len)
        for request in requests
    ]
    start = time.perf_counter()
    tasks = [
        asyncio.create_task(_send_at(client, request, start, record))
        for request, record in zip(requests, records, strict=True)
    ]
    _, pending = await asyncio.wait(tasks, timeout=deadline_s) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    cut = time.perf_counter()
    for record in records:
        if record.finish_reason is None and record.error is None:
            record.error, record.end_time = UNFINISHED, cut
            record.send_time = record.send_time or cut  # never sent: counted all the same
    return records
