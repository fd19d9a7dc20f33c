"""The clusters ``bench_failover.py`` starts beyond ``bench_security.ServerConfig``'s:
``EtcdConfig``, whose every cluster gets a fresh etcd server for its membership
(``EtcdBacked`` stops both), and the failover cluster of two coordinators on ports P and
P + 2 (``failover_cluster``). ``tests_helper`` loads the repository's test helpers they use
(``tests/etcd.py``'s server, ``tests/cluster.py``'s ``child_pid``).
"""

from __future__ import annotations

import dataclasses
import resource
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_security import REPO_ROOT, ServerConfig
from cluster_process import ClusterError, LocalCluster
from timing_stats import Json


def tests_helper(module: str) -> Any:
    """A module of the repository's ``tests`` package (not installed)."""
    sys.path.insert(0, str(REPO_ROOT))
    return __import__(f"tests.{module}", fromlist=["_"])


class EtcdBacked:
    """A ``LocalCluster`` whose membership lives in its own (running) etcd server: ``stop``
    stops the cluster, then etcd, noting etcd's lifetime CPU seconds; etcd's CPU time counts
    as the cluster's (``pids``). Everything else is the cluster's."""

    def __init__(self, cluster: LocalCluster, etcd: Any, note: Json) -> None:
        self.cluster, self.etcd, self.note = cluster, etcd, note
        self.etcd_pid = etcd._process.pid  # tests/etcd.py keeps the Popen private

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cluster, name)

    def pids(self) -> list[int]:
        return [*self.cluster.pids(), self.etcd_pid]

    def stop(self) -> int | None:
        try:
            return self.cluster.stop()
        finally:
            reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
            self.etcd.stop()
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = usage.ru_utime + usage.ru_stime - reaped.ru_utime - reaped.ru_stime
            self.note["etcd_cpu_s"] = round(cpu, 2)
            self.etcd.wipe()


@dataclass(frozen=True)
class EtcdConfig(ServerConfig):
    """``up --etcd-endpoints``: every ``cluster`` starts a fresh etcd server for it."""

    workdir: Path = Path(tempfile.gettempdir())
    notes: list[Json] = field(default_factory=list)
    """Per run, in order: etcd's endpoint, start time and lifetime CPU seconds."""

    def cluster(self, log_path: Path) -> LocalCluster:
        directory = Path(tempfile.mkdtemp(prefix=f"etcd-{len(self.notes)}-", dir=self.workdir))
        etcd = tests_helper("etcd").EtcdServer(directory)
        started = time.perf_counter()
        etcd.start()
        note = {"endpoint": etcd.endpoint, "etcd_start_s": round(time.perf_counter() - started, 2)}
        self.notes.append(note)
        try:
            flags = (*self.up_flags, f"--etcd-endpoints={etcd.endpoint}")
            cluster = ServerConfig.cluster(dataclasses.replace(self, up_flags=flags), log_path)
        except BaseException:
            etcd.stop()
            raise
        return EtcdBacked(cluster, etcd, note)  # type: ignore[return-value]


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def failover_cluster(config: ServerConfig, log_path: Path) -> LocalCluster:
    """The cluster of ``config`` on a free port P whose P + 2 (coordinator-1) is free too."""
    for _ in range(50):
        cluster = config.cluster(log_path)
        second = cluster.port + 2
        if second != cluster.http_port and port_free(second):
            return cluster
    raise ClusterError("no free port P with P + 2 free")
