"""``Supervisor.guard``: what ``splitserve up`` awaits while its children start (the wait for
the coordinators to route to every worker) ends early, with the reason, on Ctrl-C or when a
child dies; real child processes."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.launch.child_process import ChildExited
from splitserve.launch.supervisor import Stopped, Supervisor


async def _guarded(start: list[str] | None, stop_after_s: float | None) -> object:
    loop = asyncio.get_running_loop()
    children = Supervisor(loop, {}, restart=False)
    if start is not None:
        children.start("short-lived", start)
    stop = asyncio.Event()
    if stop_after_s is not None:
        loop.call_later(stop_after_s, stop.set)
    try:
        return await children.guard(asyncio.sleep(60, result="waited"), stop)
    finally:
        await children.stop_all()


def test_the_guarded_work_returns_its_result() -> None:
    async def run() -> object:
        children = Supervisor(asyncio.get_running_loop(), {})
        return await children.guard(asyncio.sleep(0, result="done"), asyncio.Event())

    assert asyncio.run(run()) == "done"


def test_ctrl_c_ends_the_wait() -> None:
    with pytest.raises(Stopped):
        asyncio.run(asyncio.wait_for(_guarded(None, 0.1), 10))


def test_a_child_that_dies_ends_the_wait_and_is_named() -> None:
    with pytest.raises(ChildExited, match="short-lived exited with status 2"):
        asyncio.run(asyncio.wait_for(_guarded(["calendar", "--no-such-flag"], None), 30))
