"""Who had the CPUs in each window of a run, process by process: ``ProcessCpu(pids_of)``
takes a reading at each ``mark(label)`` (``pids_of()``: the processes to read then, e.g. a
``cluster_process.LocalCluster``'s ``pids``) and ``windows()`` reports, for each pair of
consecutive marks, every process's CPU as a number of cores (CPU seconds over the window's
wall seconds, all threads: 1.0 is one core kept busy), with its niceness and its autogroup's
(``launch/cpu_priority.py``) as read at its first mark, and the machine's busy cores. A
process is named by its role (``coordinator``, ``gateway``, the worker's ``--worker-id``,
``up``; else its command's first word). One that appears later counts from its first
reading; one gone before a mark counts up to its last.

Used by ``bench_crowd.py`` to show that the engines kept their cores busy while a crowd was
being refused (issue 60: the front end must not starve behind saturated engines).
"""

from __future__ import annotations

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


@dataclass
class Reading:
    label: str
    at: float
    machine: tuple[int, int]
    ticks: dict[int, int]


@dataclass
class ProcessCpu:
    """Readings at marks; see the module docstring."""

    pids_of: Callable[[], Sequence[int]]
    readings: list[Reading] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    nices: dict[int, dict[str, int | None]] = field(default_factory=dict)

    def mark(self, label: str) -> None:
        ticks = {}
        for pid in self.pids_of():
            if pid not in self.names:
                self.names[pid] = process_name(pid)
                self.nices[pid] = {"nice": nice_of(pid), "autogroup_nice": autogroup_nice(pid)}
            ticks[pid] = process_ticks(pid)
        last = self.readings[-1].ticks if self.readings else {}
        gone = {pid: t for pid, t in last.items() if pid not in ticks or ticks[pid] == 0}
        self.readings.append(Reading(label, time.monotonic(), machine_ticks(), ticks | gone))

    def windows(self) -> list[Json]:
        """One entry per pair of consecutive marks; see the module docstring."""
        cpus = os.cpu_count() or 1
        entries = []
        for before, after in zip(self.readings, self.readings[1:], strict=False):
            wall_s = max(after.at - before.at, 1e-9)
            busy = after.machine[0] - before.machine[0]
            total = max(after.machine[1] - before.machine[1], 1)
            processes: Json = {}
            for pid, ticks in after.ticks.items():
                cpu_s = max(ticks - before.ticks.get(pid, 0), 0) / CLK_TCK
                name = self.names[pid]
                if name in processes:
                    name = f"{name} (pid {pid})"
                processes[name] = {"cores": round(cpu_s / wall_s, 2), **self.nices[pid]}
            entries.append({
                "window": f"{before.label} to {after.label}",
                "wall_s": round(wall_s, 2),
                "machine_busy_cores": round(busy / total * cpus, 2),
                "processes": processes,
            })  # fmt: skip
        return entries
