"""``splitserve up``'s workers run below the front end's CPU priority (issue 60): a child the
``Supervisor`` starts as an engine runs, with every thread (one it made after its start too)
and, where the kernel has autogroups, its session's autogroup, at ``engine_nice``, again after
a restart; a front-end child keeps the default. Real child processes
(``tests/draining_child.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from splitserve.launch import supervisor as supervisor_module
from splitserve.launch.cpu_priority import autogroup_nice, autogroups_enabled, lower_priority
from splitserve.launch.supervisor import Child, Supervisor

CHILD = ["tests.draining_child"]
NICE = 7


def thread_nices(pid: int) -> list[int]:
    """Field 19 of ``/proc/<pid>/task/<tid>/stat`` (niceness) of each of ``pid``'s threads."""
    nices = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        fields = stat.read_text().rsplit(")", 1)[1].split()
        nices.append(int(fields[16]))  # field 19 of stat; fields[0] here is field 3
    return nices


def expect(child: Child, nice: int) -> None:
    nices = thread_nices(child.process.pid)
    assert len(nices) >= 2, "the child's own thread has started"
    assert nices == [nice] * len(nices), child.name
    if autogroups_enabled():
        assert autogroup_nice(child.process.pid) == nice, child.name


def test_engines_run_at_their_nice_and_the_front_end_at_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(supervisor_module, "RESTART_BASE_S", 0.05)

    async def run() -> None:
        children = Supervisor(asyncio.get_running_loop(), {}, drain_timeout_s=1.0, engine_nice=NICE)
        stop = asyncio.Event()
        supervising = asyncio.ensure_future(children.supervise(stop))
        try:
            worker = children.start("decode-0", CHILD, engine=True)
            gateway = children.start("gateway", CHILD)
            for child in (worker, gateway):
                await children.wait_ready(child, stop)
            expect(worker, NICE)
            expect(gateway, 0)
            first = worker.process
            first.popen.kill()
            while worker.process is first:  # restarted after the (shortened) back-off
                await asyncio.sleep(0.02)
            await children.wait_ready(worker, stop)
            expect(worker, NICE)
        finally:
            stop.set()
            await supervising
            await children.stop_all()

    asyncio.run(asyncio.wait_for(run(), 20))


def test_nice_zero_changes_nothing_and_out_of_range_is_refused() -> None:
    assert lower_priority(1, 0) == []
    with pytest.raises(ValueError, match="0 to 19"):
        lower_priority(1, 20)
