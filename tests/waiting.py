"""Waiting in tests for the thing awaited, never for a guessed time: polling a condition until
it holds (``wait_until`` on a thread, ``until`` on an event loop), or starting a coroutine and
going on once it waits inside (``suspended_task``). A wait that can time out fails the test
with a message naming what it waited for. (For an ``asyncio.Event`` with a bound:
``common/event_wait.py:wait_event``.)"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

POLL_S = 0.005
"""How often ``wait_until`` and ``until`` look at their condition."""

T = TypeVar("T")


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Return once ``condition()`` holds, looked at every ``POLL_S`` on this thread; after
    ``timeout_s`` an ``AssertionError`` saying it timed out waiting for ``what``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(POLL_S)


async def until(
    condition: Callable[[], bool | Awaitable[bool]], timeout_s: float, what: str
) -> None:
    """``wait_until`` on the running event loop, which it never blocks: return once
    ``condition()`` (awaited when it returns an awaitable) holds, looked at every ``POLL_S``;
    after ``timeout_s``, the condition's own awaits included, an ``AssertionError`` saying it
    timed out waiting for ``what``."""
    try:
        async with asyncio.timeout(timeout_s) as bound:
            while True:
                held = condition()
                if inspect.isawaitable(held):
                    held = await held
                if held:
                    return
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        if not bound.expired():
            raise  # the condition's own error
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}") from None


async def suspended_task(coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run ``coroutine`` as a task and return the task once the coroutine has run up to its
    first suspension (or to its end): it then waits inside, e.g. for a receive it posted or
    for a command it queued. The task sets an event as it starts; the caller, woken by it,
    runs only after the task's first step has ended, that is once the coroutine suspended.
    Awaiting the task is awaiting the coroutine (it runs in the task itself)."""
    entered = asyncio.Event()

    async def run() -> T:
        entered.set()
        return await coroutine

    task = asyncio.ensure_future(run())
    await entered.wait()
    return task
