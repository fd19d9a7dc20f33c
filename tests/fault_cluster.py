"""A cluster of single-role processes for fault tests, each started through its launch entry
point (``python -m splitserve.<role>.main``) so that a test can signal any one of them and
start it again the way a supervisor (systemd, Kubernetes) would.

``FaultCluster.start(tmp_dir, ...)``: a real etcd (``tests/etcd.py``), coordinators on fixed
ports watching it, prefill and decode workers announcing themselves in it (they know no
coordinator), and the OpenAI gateway balancing over every coordinator. Every process shares
``tests/cluster.py:CREDENTIAL``.

``RoleProcess``: one process that can be started again with the same command line (the same
ports for coordinators and the gateway, which others dial; workers take new free ports and
announce them). ``FaultCluster.whole()`` says whether the cluster is back at full strength:
every process running, every coordinator SERVING and listing every worker with a fresh
heartbeat, the gateway healthy, every worker's key in etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from splitserve.coordinator import INTERNAL_READY
from splitserve.discovery.etcd_keys import worker_id_of, workers_prefix
from splitserve.launch.child_process import ChildProcess, python_module_argv
from splitserve.proto.cluster_auth import TOKEN_ENV
from splitserve.proto.etcd_client import EtcdClient, EtcdError
from tests.cluster import CREDENTIAL, START_TIMEOUT_S, STOP_GRACE_S, remember_internal
from tests.cluster import worker_loads as listed_loads
from tests.etcd import EtcdServer, free_port

CLUSTER_NAME = "fault-test"
RECOVERIES_METRIC = "splitserve_request_recoveries"
"""The coordinators' counter of failures a request survived (``coordinator/metrics.py``)."""


HA_WORKER_FLAGS = ("--dtype=float32", "--num-blocks=400", "--threads=1", "--metrics-port=-1")
"""Workers of the shared ``ha_cluster``: float32 (greedy output is batch invariant, so a
stream that moved equals its uninterrupted reference), 400 KV blocks, one thread each."""


@contextlib.contextmanager
def ha_cluster() -> Iterator[FaultCluster]:
    """The cluster the fault tests share (``tests/shared.py``): etcd, 2 coordinators, 2
    prefill and 2 decode workers (``HA_WORKER_FLAGS``) and the gateway; each test that kills
    something leaves it to ``FaultCluster.heal`` (the conftest calls it after each test)."""
    with (
        tempfile.TemporaryDirectory(prefix="splitserve-ha-") as tmp_dir,
        FaultCluster.start(Path(tmp_dir), 2, 2, 2, HA_WORKER_FLAGS) as cluster,
    ):
        yield cluster


@dataclass
class RoleProcess:
    """One role's process; ``start`` runs ``argv`` (a module and its flags) and waits for its
    ready line containing ``marker``. Invariant: at most one process of it runs at a time."""

    name: str
    argv: list[str]
    marker: str
    address: str = ""
    """What its ready line announced (the public address, or the gateway's URL)."""
    metrics_url: str = ""
    child: ChildProcess | None = field(default=None, repr=False)
    exiting: bool = False
    """It was sent SIGTERM or SIGKILL since it last started."""

    def start(self) -> str:
        assert self.child is None or self.child.returncode is not None, f"{self.name} runs"
        self.exiting = False
        self.child = ChildProcess(
            python_module_argv(*self.argv),
            name=self.name,
            env={TOKEN_ENV: CREDENTIAL.token},
            tail_excludes=("UCX  WARN",),
        )
        self.address = self.child.wait_ready(self.marker, START_TIMEOUT_S)
        announced = self.child.announcements()
        if INTERNAL_READY in announced:
            remember_internal(self.address, announced[INTERNAL_READY])
        self.metrics_url = next((u for w, u in announced.items() if w.endswith("metrics")), "")
        return self.address

    @property
    def pid(self) -> int:
        assert self.child is not None
        return self.child.pid

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.returncode is None

    def send(self, signum: signal.Signals) -> None:
        assert self.child is not None
        self.exiting = self.exiting or signum in (signal.SIGTERM, signal.SIGKILL)
        self.child.popen.send_signal(signum)

    def wait_exit(self, timeout_s: float) -> int:
        """The exit status, once the process ended (``TimeoutExpired`` after ``timeout_s``)."""
        assert self.child is not None
        return self.child.popen.wait(timeout_s)

    def stop(self) -> int | None:
        """SIGTERM and reap (SIGKILL after the grace); the status, None if it had to be killed."""
        if self.child is None:
            return None
        stopped = self.child.stop(STOP_GRACE_S)
        return None if stopped.killed else stopped.status

    def tail(self) -> str:
        return "" if self.child is None else self.child.tail()


@dataclass
class FaultCluster:
    """See the module docstring. ``workers``: prefill ones first, then decode ones."""

    etcd: EtcdServer
    coordinators: list[RoleProcess]
    workers: list[RoleProcess]
    gateway: RoleProcess

    @classmethod
    @contextlib.contextmanager
    def start(
        cls,
        tmp_dir: Path,
        num_coordinators: int,
        num_prefill: int,
        num_decode: int,
        worker_flags: Sequence[str],
    ) -> Iterator[FaultCluster]:
        """Start everything (etcd, coordinators, workers, then the gateway, each once the
        previous is ready) and wait until the cluster is whole; stops everything on exit."""
        etcd = EtcdServer(tmp_dir)
        membership = [f"--etcd-endpoints={etcd.endpoint}", f"--cluster-name={CLUSTER_NAME}"]
        coordinators = [
            RoleProcess(
                f"coordinator-{index}",
                [
                    "splitserve.coordinator.main",
                    f"--port={free_port()}",
                    f"--internal-port={free_port()}",
                    "--metrics-port=0",
                    *membership,
                ],
                "splitserve coordinator ready at",
            )
            for index in range(num_coordinators)
        ]
        roles = [("prefill", i) for i in range(num_prefill)]
        roles += [("decode", i) for i in range(num_decode)]
        workers = [
            RoleProcess(
                f"{role}-{index}",
                [f"splitserve.{role}.main", "--port=0", f"--worker-id={role}-{index}"]
                + [*membership, *worker_flags],
                f"splitserve {role} ready at",
            )
            for role, index in roles
        ]
        gateway = RoleProcess(
            "gateway",
            ["splitserve.gateway.main", f"--port={free_port()}"],
            "splitserve gateway ready at",
        )
        cluster = cls(etcd, coordinators, workers, gateway)
        try:
            etcd.start()
            _start_together([*coordinators, *workers])
            gateway.argv.append(f"--coordinator={','.join(cluster.coordinator_addresses)}")
            gateway.start()
            cluster.wait_whole()
            yield cluster
        finally:
            statuses = {p.name: p.stop() for p in [gateway, *workers, *coordinators]}
            etcd.stop()
        unclean = {name: status for name, status in statuses.items() if status not in (0, None)}
        assert not unclean or all(s == -signal.SIGKILL for s in unclean.values()), unclean

    @property
    def processes(self) -> list[RoleProcess]:
        return [*self.coordinators, *self.workers, self.gateway]

    @property
    def coordinator_addresses(self) -> list[str]:
        return [c.address for c in self.coordinators]

    @property
    def worker_ids(self) -> set[str]:
        return {w.name for w in self.workers}

    def named(self, name: str) -> RoleProcess:
        return next(p for p in self.processes if p.name == name)

    def whole(self) -> bool:
        """Every process runs and serves; see the module docstring."""
        if not all(p.running for p in self.processes) or not self._gateway_healthy():
            return False
        if self._etcd_worker_ids() != self.worker_ids:
            return False
        try:
            return all(
                set(listed_loads(address)) == self.worker_ids
                for address in self.coordinator_addresses
            )
        except Exception:  # noqa: BLE001 - a coordinator still starting: not whole yet
            return False

    def heal(self) -> None:
        """Start again whatever is not running (etcd included; a victim that is still exiting
        is waited for first), then wait until the cluster is whole: what a test that killed
        or stopped processes of a shared cluster leaves behind (``tests/shared.py``)."""
        if not self.etcd.running:
            self.etcd.start()
        for process in self.processes:
            if process.running and process.exiting:
                process.wait_exit(STOP_GRACE_S)
        _start_together([process for process in self.processes if not process.running])
        self.wait_whole()

    def wait_whole(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Seconds until ``whole()``; ``AssertionError`` after ``timeout_s``."""
        started = time.monotonic()
        while not self.whole():
            assert time.monotonic() - started < timeout_s, "the cluster did not become whole"
            time.sleep(0.1)
        return time.monotonic() - started

    def recoveries(self) -> dict[str, float]:
        """Each running coordinator's total of requests' recoveries (every kind), keyed by
        ``<name>@<pid>`` so that a restarted coordinator, whose counters start at 0, is
        another key."""
        totals = {}
        for coordinator in self.coordinators:
            if not coordinator.running:
                continue
            with urllib.request.urlopen(coordinator.metrics_url, timeout=10) as reply:
                text = reply.read().decode()
            total = sum(
                sample.value
                for family in text_string_to_metric_families(text)
                if family.name == RECOVERIES_METRIC
                for sample in family.samples
                if sample.name.endswith("_total")
            )
            totals[f"{coordinator.name}@{coordinator.pid}"] = total
        return totals

    def _gateway_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.gateway.address}/health", timeout=5) as reply:
                return reply.status == 200
        except OSError:
            return False

    def _etcd_worker_ids(self) -> set[str]:
        async def listing() -> set[str]:
            prefix = workers_prefix(CLUSTER_NAME)
            async with EtcdClient([self.etcd.endpoint]) as client:
                pairs, _ = await client.get_prefix(prefix)
            return {worker_id_of(prefix, kv.key) for kv in pairs}

        try:
            return asyncio.run(asyncio.wait_for(listing(), 5))
        except (EtcdError, TimeoutError, OSError):
            return set()


def _start_together(processes: Sequence[RoleProcess]) -> None:
    """Start each process and wait until all are ready, their starts overlapping (imports and
    model loads: the workers know the coordinators through etcd, so none waits on another)."""
    with ThreadPoolExecutor(max(1, len(processes))) as pool:
        list(pool.map(RoleProcess.start, processes))
