"""A lower CPU priority for ``splitserve up``'s engine workers, so that its front end (the
coordinators and the gateways, at the default priority) takes a core whenever it has work,
however busy the engines keep every core (issue 60: a crowd's 429s must not wait behind the
engines' steps).

``lower_priority(pid, nice)`` runs on the launcher right after the child has started
(``Popen`` returns once the child has exec'd, before it has started any thread of its own),
a child in a session of its own (``ChildProcess(new_session=True)``: its autogroup is its
alone):

- every thread process ``pid`` has then gets niceness ``nice``; threads it makes later (the
  engine's step and OpenMP threads) inherit their creator's, so the whole process runs at
  ``nice``;
- where the kernel schedules sessions as groups (``/proc/sys/kernel/sched_autogroup_enabled``
  is 1, as on most desktop and VM kernels), ``pid``'s session's autogroup gets ``nice`` too
  (``/proc/<pid>/autogroup``): ``up`` starts each child in a session of its own, and two
  autogroups share a core by their own nice values, not their threads', so without this the
  threads' niceness would change nothing against the front end's processes.

Only ever lowers the priority (``nice`` from 0, a no-op, to 19): any user may do that to their
own processes, while raising the front end's would need ``CAP_SYS_NICE``. A process that has
already ended is skipped. Returns what it could not do (e.g. a kernel without the autogroup
file's write permission), one line each, for the caller to print: a worker at the default
priority still serves, only its front end may then wait behind it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

MAX_NICE = 19
"""The lowest priority Linux has."""
AUTOGROUP_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")


def lower_priority(pid: int, nice: int) -> list[str]:
    """Give process ``pid`` (each of its threads now, and its session's autogroup where
    autogroups are on) niceness ``nice`` (0..``MAX_NICE``; 0 does nothing); see the module
    docstring. Returns the problems met, one line each (none when all went well)."""
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"a niceness from 0 to {MAX_NICE}, not {nice}")
    if nice == 0:
        return []
    problems = []
    for tid in _threads(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)  # Linux: PRIO_PROCESS takes a thread id
        except ProcessLookupError:
            continue  # the thread (or the process) has ended
        except OSError as error:
            problems.append(f"pid {pid} thread {tid}: nice {nice}: {error}")
    if autogroups_enabled():
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            try:
                Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")
            except OSError as error:
                problems.append(f"pid {pid}: autogroup nice {nice}: {error}")
    return problems


def autogroups_enabled() -> bool:
    """Whether the kernel groups each session's processes for scheduling."""
    try:
        return AUTOGROUP_ENABLED.read_text().strip() == "1"
    except OSError:
        return False


def niceness(pid: int) -> int:
    """Process ``pid``'s (its main thread's) niceness; ``ProcessLookupError`` once it has
    ended."""
    return os.getpriority(os.PRIO_PROCESS, pid)


def autogroup_nice(pid: int) -> int | None:
    """The nice value of ``pid``'s autogroup (``/proc/<pid>/autogroup``: "/autogroup-N nice
    K"); None where the kernel has no autogroups."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _threads(pid: int) -> list[int]:
    """Process ``pid``'s thread ids (``pid`` itself where ``/proc`` cannot say)."""
    try:
        return sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return [pid]
