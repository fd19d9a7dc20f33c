"""``common/loop_lag.py``: an event loop's lag is measured, and a stall check leaves out the
time its own process was too busy to read (``coordinator/attempt.py:Attempt._check_stall``)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from splitserve.common import loop_lag
from splitserve.common.request_update import FinishReason
from splitserve.coordinator.attempt import AttemptTimeouts, DecodeStalled
from tests.cluster import Served
from tests.test_attempt import _attempt, _output, _Workers


def test_a_blocked_loop_is_counted_as_lag_from_when_it_blocked() -> None:
    async def body() -> tuple[float, float, float]:
        meter = loop_lag.LoopLag.start(interval_s=0.02)
        assert loop_lag.current() is meter
        await asyncio.sleep(0.1)
        before = time.monotonic()
        time.sleep(0.5)  # the loop runs nothing meanwhile
        await asyncio.sleep(0.1)
        after = time.monotonic()
        await asyncio.sleep(0.1)
        meter.stop()
        return meter.lag_since(before), meter.lag_since(after), loop_lag.lag_since(before)

    since_block, since_after, module_figure = asyncio.run(body())
    assert 0.4 <= since_block <= 1.0
    assert since_after < 0.1
    assert module_figure == pytest.approx(since_block, abs=0.05)


def test_no_meter_counts_no_lag() -> None:
    async def body() -> float:
        return loop_lag.lag_since(time.monotonic() - 10)

    assert asyncio.run(body()) == 0.0


def test_a_coordinator_too_busy_to_read_does_not_call_its_worker_stalled() -> None:
    """The decode stream's limit is 0.3 s; the coordinator's loop then blocks for 1 s while
    the worker's next token waits to be read. Without a meter that silence is a stall; with
    one, the blocked second is the coordinator's own and the stream goes on to its end."""

    async def body(metered: bool) -> bool:
        meter = loop_lag.LoopLag.start(interval_s=0.02) if metered else None
        workers = _Workers()
        timeouts = AttemptTimeouts(stall_factor=10.0, stall_floor_s=0.3)
        attempt, _ = _attempt(workers, remote=False, timeouts=timeouts)

        async def consume() -> None:
            async for _ in attempt.run():
                pass

        task = asyncio.create_task(consume())
        workers.call.items.put_nowait(_output((1,), 1))
        await asyncio.sleep(0.1)
        time.sleep(1.0)  # the loop is blocked: the worker's next token waits unread
        await asyncio.sleep(0)  # the overdue stall check runs before the token is read
        workers.call.items.put_nowait(_output((2,), 2))
        await asyncio.sleep(0.05)
        workers.call.items.put_nowait(_output((3,), 3, FinishReason.LENGTH))
        try:
            await asyncio.wait_for(task, 5)
        except DecodeStalled:
            return True
        finally:
            if meter is not None:
                meter.stop()
        return False

    assert not asyncio.run(body(metered=True))
    assert asyncio.run(body(metered=False))


def test_the_coordinator_exports_its_loop_lag(served_cluster: Served) -> None:
    """The running coordinator's metrics carry its loop's lag as a counter."""
    text = httpx.get(served_cluster.metrics_urls["coordinator"], timeout=10).text
    lines = [
        line
        for line in text.splitlines()
        if line.startswith('splitserve_event_loop_lag_seconds_total{role="coordinator"}')
    ]
    assert len(lines) == 1
    assert float(lines[0].rsplit(" ", 1)[1]) >= 0.0
