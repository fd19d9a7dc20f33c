"""Who had the CPUs in a window of a run, process by process: ``ProcessCpu(pids_of)`` takes
a reading at each ``mark()`` (``pids_of()``: the processes to read then, e.g. a
``cluster_process.LocalCluster``'s ``pids``; ``sample`` marks every ``interval_s`` until
cancelled), and ``window(name, start, end)`` reports, between the last reading at or before
wall time ``start`` and the first at or after ``end``, every process's CPU as a number of
cores (CPU seconds over the window's wall seconds, all threads: 1.0 is one core kept busy)
and the seconds its main thread (a role's event loop) was ready to run but waited for a core
(``/proc/<pid>/schedstat``: what a lower priority for the others should shorten), with its
niceness and its autogroup's (``launch/cpu_priority.py``) as read at its first
reading, and the machine's busy cores. A process is named by its role (``coordinator``,
``gateway``, the worker's ``--worker-id``, ``up``; else its command's first word) unless
``names`` names it. One that appears later counts from its first reading; one gone before a
reading counts up to its last.

Used by ``bench_crowd.py`` to show whether the engines kept their cores busy while a crowd
was being refused (issue 60: the front end must not starve behind saturated engines).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cluster_process import CLK_TCK, machine_ticks, process_ticks
from timing_stats import Json

from splitserve.launch.cpu_priority import autogroup_nice, niceness

ROLE_MODULES = {
    "splitserve.coordinator.main": "coordinator",
    "splitserve.gateway.main": "gateway",
    "splitserve.launch.up": "up",
}


def process_name(pid: int) -> str:
    """``pid``'s role in a cluster, from its command line (see the module docstring)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return f"pid {pid}"
    ids = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--worker-id=")]
    ids += [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--worker-id"]
    if ids:
        return ids[-1]
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        return ROLE_MODULES.get(module, module)
    if len(argv) > 1 and argv[1] == "up":
        return "up"
    return Path(argv[0]).name or f"pid {pid}"


def nice_of(pid: int) -> int | None:
    """``pid``'s niceness; None once it has ended."""
    try:
        return niceness(pid)
    except ProcessLookupError:
        return None


def main_thread_wait_ns(pid: int) -> int:
    """Nanoseconds ``pid``'s main thread has spent runnable on a run queue, not running
    (field 2 of ``/proc/<pid>/schedstat``); 0 once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


@dataclass
class Reading:
    at: float
    """Wall-clock time (``time.time()``)."""
    machine: tuple[int, int]
    ticks: dict[int, int]
    waits: dict[int, int]


@dataclass
class ProcessCpu:
    """Readings; see the module docstring."""

    pids_of: Callable[[], Sequence[int]]
    names: dict[int, str] = field(default_factory=dict)
    readings: list[Reading] = field(default_factory=list)
    nices: dict[int, dict[str, int | None]] = field(default_factory=dict)

    def mark(self) -> None:
        ticks, waits = {}, {}
        for pid in self.pids_of():
            if pid not in self.nices:
                self.names.setdefault(pid, process_name(pid))
                self.nices[pid] = {"nice": nice_of(pid), "autogroup_nice": autogroup_nice(pid)}
            ticks[pid], waits[pid] = process_ticks(pid), main_thread_wait_ns(pid)
        if self.readings:  # a process gone since keeps its last figures
            last = self.readings[-1]
            ticks |= {pid: t for pid, t in last.ticks.items() if ticks.get(pid, 0) == 0}
            waits |= {pid: w for pid, w in last.waits.items() if waits.get(pid, 0) == 0}
        self.readings.append(Reading(time.time(), machine_ticks(), ticks, waits))

    async def sample(self, interval_s: float) -> None:
        """``mark`` every ``interval_s`` until cancelled."""
        while True:
            self.mark()
            await asyncio.sleep(interval_s)

    def window(self, name: str, start: float, end: float) -> Json:
        """CPU per process over [``start``, ``end``] (wall-clock times, widened to the
        readings around them); see the module docstring."""
        before = next((r for r in reversed(self.readings) if r.at <= start), self.readings[0])
        after = next((r for r in self.readings if r.at >= end), self.readings[-1])
        wall_s = max(after.at - before.at, 1e-9)
        busy = after.machine[0] - before.machine[0]
        total = max(after.machine[1] - before.machine[1], 1)
        processes: Json = {}
        for pid, ticks in after.ticks.items():
            cpu_s = max(ticks - before.ticks.get(pid, 0), 0) / CLK_TCK
            waited_s = max(after.waits[pid] - before.waits.get(pid, 0), 0) / 1e9
            label = self.names[pid]
            label = f"{label} (pid {pid})" if label in processes else label
            processes[label] = {
                "cores": round(cpu_s / wall_s, 2),
                "main_thread_waited_s": round(waited_s, 3),
                **self.nices[pid],
            }
        return {
            "window": name,
            "from_s": round(before.at - start, 2),
            "wall_s": round(wall_s, 2),
            "machine_busy_cores": round(busy / total * (os.cpu_count() or 1), 2),
            "processes": processes,
        }
