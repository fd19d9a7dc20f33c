"""Waiting for an ``asyncio.Event`` with a bound (torch-free)."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Return once ``event`` is set or ``timeout_s`` passed; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
    return event.is_set()
