"""A ``splitserve up`` cluster as a child process, and who used the CPUs while it ran.

``LocalCluster`` starts ``splitserve up --port P --http-port H <flags>`` on free ports
(optionally with extra environment variables, which the coordinator and workers inherit)
with its output in a log file, waits for the ``splitserve ready at`` line (raising
``ClusterError`` with the log's tail if the process exits or the line does not come in
time) and stops it with SIGTERM (SIGKILL of its process group after a grace period); it is
a context manager doing both.

``CpuMeter`` splits the machine's busy CPU time over an interval (``/proc/stat``) into the
cluster's (``up`` and its child processes: coordinator and workers), this process's (the load
generator) and everyone else's; the last, as a share of all CPUs, says how much other
processes disturbed a measurement on a shared machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from timing_stats import Json

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
    ) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port()
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        """The OpenAI-compatible gateway's base URL."""
        self.argv = [
            str(splitserve),
            "up",
            "--port",
            str(self.port),
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
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start ``up`` and wait for its ready line."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=os.environ | self.env,
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while READY_LINE not in self.log_path.read_text(errors="replace"):
            if self.process.poll() is not None:
                raise ClusterError(
                    f"{self.argv} exited ({self.process.returncode}):\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ClusterError(
                    f"{self.argv} not ready in {self.ready_timeout_s}s:\n{self.tail()}"
                )
            time.sleep(0.25)

    def stop(self) -> int | None:
        """SIGTERM ``up`` (it stops its children), SIGKILL the group after the grace period."""
        process = self.process
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(self.stop_grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            return process.wait()

    def tail(self, num_lines: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def log_lines(self, needle: str) -> list[str]:
        return [
            line
            for line in self.log_path.read_text(errors="replace").splitlines()
            if needle in line
        ]

    def pids(self) -> list[int]:
        """``up`` and its direct children (the coordinator and the workers)."""
        if self.process is None:
            return []
        return [self.process.pid, *_children(self.process.pid)]

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


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in task.read_text().split()]
    return children


def _process_ticks(pid: int) -> int:
    """utime + stime of a process (all its threads), in clock ticks; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(values)
    return total - values[3] - values[4], total


@dataclass
class CpuMeter:
    """CPU use over an interval: ``start()``, run, ``stop()`` -> shares of all CPUs' time."""

    cluster: LocalCluster

    def start(self) -> None:
        self._pids = self.cluster.pids()
        self._cluster0 = sum(_process_ticks(p) for p in self._pids)
        self._self0 = _process_ticks(os.getpid())
        self._busy0, self._total0 = _machine_ticks()

    def stop(self) -> Json:
        busy1, total1 = _machine_ticks()
        total = max(total1 - self._total0, 1)
        busy = busy1 - self._busy0
        cluster = sum(_process_ticks(p) for p in self._pids) - self._cluster0
        own = _process_ticks(os.getpid()) - self._self0
        return {
            "busy_share": round(busy / total, 3),
            "cluster_share": round(cluster / total, 3),
            "loadgen_share": round(own / total, 3),
            "other_share": round(max(busy - cluster - own, 0) / total, 3),
        }
