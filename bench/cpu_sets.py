"""Separate CPU sets for a benchmark's processes, set from outside after they started.

``CoreSplit.of`` gives each of up to ``most`` measured processes a core of its own and the
remaining cores to everything else, or None where the CPUs this process may use are fewer
than ``most`` plus ``rest_min`` (then nothing is pinned and a benchmark counts each process's
CPU time instead). The split depends only on ``most``, not on how many processes a run has,
so runs of 1 to ``most`` measured processes give the rest the same cores.

``pin_tree`` sets the affinity of every thread of a process and of its descendants (Linux
applies ``sched_setaffinity`` to one thread; threads and children started later inherit it
from their creator). A thread or process that ends meanwhile is skipped.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from cluster_process import child_pids


@dataclass(frozen=True)
class CoreSplit:
    """Measured process ``i`` runs on ``own[i]`` alone; everything else on ``rest``."""

    own: tuple[int, ...]
    rest: frozenset[int]

    @classmethod
    def of(cls, cpus: list[int], most: int, rest_min: int) -> CoreSplit | None:
        """The split of ``cpus`` (in their order) for up to ``most`` measured processes, or
        None where ``len(cpus) < most + rest_min``."""
        if most < 1 or len(cpus) < most + rest_min:
            return None
        return cls(tuple(cpus[:most]), frozenset(cpus[most:]))

    def describe(self) -> str:
        rest = ",".join(str(cpu) for cpu in sorted(self.rest))
        return f"measured process i on core own[i] of {list(self.own)}, the rest on {rest}"


def descendants(pid: int) -> list[int]:
    """``pid``'s children, their children and so on (those alive now)."""
    found, todo = [], [pid]
    while todo:
        children = child_pids(todo.pop())
        found += children
        todo += children
    return found


def pin_tree(pid: int, cpus: frozenset[int] | set[int]) -> None:
    """Every thread of ``pid`` and of its descendants to ``cpus``."""
    for process in (pid, *descendants(pid)):
        for task in Path(f"/proc/{process}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                os.sched_setaffinity(int(task.name), cpus)
