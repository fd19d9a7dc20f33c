"""A ``splitserve up`` cluster as a child process, and who used the CPUs while it ran.

``LocalCluster`` starts ``splitserve up --port P --http-port H <flags>`` (or another command
that runs ``up``, e.g. ``python -m splitserve.launch.up`` of an older tree) on free ports as a
``splitserve.launch.child_process.ChildProcess`` (optionally with extra environment
variables, which the coordinator and workers inherit) with its output in a log file, waits
for the ``splitserve ready at`` line (raising ``ClusterError`` with the output's tail if the
process exits or the line does not come in time) and stops it with SIGTERM (SIGKILL of its
process group after a grace period); it is a context manager doing both.

``CpuMeter`` splits the machine's busy CPU time over an interval (``/proc/stat``) into the
cluster's (``up`` and its child processes: coordinator and workers), this process's (the load
generator) and everyone else's; the last, as a share of all CPUs, says how much other
processes disturbed a measurement on a shared machine. Cluster processes that start during
the interval (a restarted child) count from their start; one killed on purpose counts up to
its ``last_reading``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from timing_stats import Json

from splitserve.launch.child_process import ChildExited, ChildProcess, NotReady

READY_LINE = "splitserve ready at "
CLK_TCK = os.sysconf("SC_CLK_TCK")


class ClusterError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalCluster:
    """``splitserve up`` on a free port; ``address`` is the coordinator's once started."""

    def __init__(
        self,
        splitserve: Path,
        up_flags: Sequence[str],
        log_path: Path,
        ready_timeout_s: float = 300.0,
        stop_grace_s: float = 30.0,
        env: dict[str, str] | None = None,
        *,
        up_command: Sequence[str] | None = None,
        internal_port: bool = True,
        https: bool = False,
    ) -> None:
        """``up_command``: what runs ``splitserve up`` instead of ``<splitserve> up`` (e.g.
        ``python -m splitserve.launch.up``); ``internal_port``: pass ``--internal-port 0``
        (False for trees older than the coordinator's internal port); ``https``: the gateway
        serves TLS (``up``'s ``--tls-cert``/``--tls-key`` among ``up_flags``)."""
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port()
        scheme = "https" if https else "http"
        self.http_url = f"{scheme}://127.0.0.1:{self.http_port}"
        """The OpenAI-compatible gateway's base URL."""
        command = [str(splitserve), "up"] if up_command is None else list(up_command)
        self.argv = [
            *command,
            "--port",
            str(self.port),
            *(["--internal-port", "0"] if internal_port else []),
            "--http-port",
            str(self.http_port),
            "--metrics-port-base",
            "0",
            *up_flags,
        ]
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.env = env or {}
        """Extra environment variables of ``up`` (its children inherit them)."""
        self.child: ChildProcess | None = None

    def start(self) -> None:
        """Start ``up`` and wait for its ready line."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.child = ChildProcess(
            self.argv, name=" ".join(self.argv), env=self.env, log_path=self.log_path,
            new_session=True, tail_lines=30,
        )  # fmt: skip
        try:
            self.child.wait_ready(READY_LINE, self.ready_timeout_s)
        except ChildExited as error:
            raise ClusterError(str(error)) from None
        except NotReady as error:
            self.stop()
            raise ClusterError(str(error)) from None

    def stop(self) -> int | None:
        """SIGTERM ``up`` (it stops its children), SIGKILL the group after the grace period;
        ``up``'s exit status (None if it never started)."""
        return None if self.child is None else self.child.stop(self.stop_grace_s).status

    def tail(self, num_lines: int = 30) -> str:
        return "" if self.child is None else self.child.tail(num_lines)

    def log_lines(self, needle: str) -> list[str]:
        return [
            line
            for line in self.log_path.read_text(errors="replace").splitlines()
            if needle in line
        ]

    def pids(self) -> list[int]:
        """``up`` and its direct children (the coordinator and the workers)."""
        if self.child is None:
            return []
        return [self.child.pid, *child_pids(self.child.pid)]

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def child_pids(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in task.read_text().split()]
    return children


def process_ticks(pid: int) -> int:
    """utime + stime of a process (all its threads), in clock ticks; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(values)
    return total - values[3] - values[4], total


@dataclass
class CpuMeter:
    """CPU use over an interval: ``start()``, run, ``stop()`` -> shares of all CPUs' time."""

    cluster: LocalCluster

    def start(self) -> None:
        self._ticks0 = {pid: process_ticks(pid) for pid in self.cluster.pids()}
        self._final: dict[int, int] = {}
        self._self0 = process_ticks(os.getpid())
        self._busy0, self._total0 = machine_ticks()

    def last_reading(self, pid: int) -> None:
        """Count ``pid``'s CPU time up to now: call it just before killing one of the
        cluster's processes (once it is gone, its time cannot be read)."""
        self._final[pid] = process_ticks(pid)

    def stop(self) -> Json:
        busy1, total1 = machine_ticks()
        total = max(total1 - self._total0, 1)
        busy = busy1 - self._busy0
        ticks = {pid: process_ticks(pid) for pid in self.cluster.pids()} | self._final
        cluster = sum(max(t - self._ticks0.get(pid, 0), 0) for pid, t in ticks.items())
        own = process_ticks(os.getpid()) - self._self0
        return {
            "busy_share": round(busy / total, 3),
            "cluster_share": round(cluster / total, 3),
            "loadgen_share": round(own / total, 3),
            "other_share": round(max(busy - cluster - own, 0) / total, 3),
        }
