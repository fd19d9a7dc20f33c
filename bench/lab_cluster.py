"""A splitserve cluster spread over the hosts of a network lab (``launch/netlab.py``), each
role started by its own launch script inside its host's namespace, as on separate machines:

- ``e1``..``e3``: a three-member etcd cluster (membership);
- ``c1``, ``c2``: coordinators learning the workers from etcd;
- ``g``: the gateway, balancing over both coordinators;
- ``p1``: a prefill worker; ``d1``, ``d2``: decode workers (simulated engines, or real ones
  with ``engine="model"``), KV between hosts over UCX's TCP transport.

``LabCluster(lab, workdir)`` starts everything (``start``) and reports what each coordinator
sees (``members``, ``recoveries``); the lab's close stops the processes. Every process gets
the cluster credential through its environment.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.membership import MemberStatus
from splitserve.coordinator import PUBLIC_READY
from splitserve.discovery.etcd_server import etcd_binary
from splitserve.launch.child_process import python_module_argv
from splitserve.launch.members import wait_for_members
from splitserve.launch.netlab import Lab
from splitserve.proto.cluster_auth import TOKEN_ENV, ClusterCredential
from splitserve.proto.membership_client import MembershipClient
from splitserve.proto.server import open_channel

HOSTS = ("e1", "e2", "e3", "c1", "c2", "g", "p1", "d1", "d2")
ETCD_HOSTS, COORDINATOR_HOSTS, WORKER_HOSTS = HOSTS[:3], HOSTS[3:5], HOSTS[6:]
PORT, INTERNAL_PORT, METRICS_PORT, HTTP_PORT = 50051, 50052, 9400, 8000
RECOVERIES_METRIC = "splitserve_request_recoveries"
START_TIMEOUT_S = 120.0


class LabCluster:
    """See the module docstring."""

    def __init__(
        self,
        lab: Lab,
        workdir: Path,
        engine: str = "sim",
        worker_flags: Sequence[str] = (),
    ) -> None:
        self.lab = lab
        self.workdir = workdir
        self.engine = engine
        self.worker_flags = tuple(worker_flags)
        self.credential = ClusterCredential.generate()
        self.env = {TOKEN_ENV: self.credential.token}
        address = {name: host.address for name, host in lab.hosts.items()}
        self.etcd_endpoints = ",".join(f"{address[h]}:2379" for h in ETCD_HOSTS)
        self.coordinators = [f"{address[h]}:{PORT}" for h in COORDINATOR_HOSTS]
        self.internals = [f"{address[h]}:{INTERNAL_PORT}" for h in COORDINATOR_HOSTS]
        self.metrics_urls = [
            f"http://{address[h]}:{METRICS_PORT}/metrics" for h in COORDINATOR_HOSTS
        ]
        self.gateway_url = f"http://{address['g']}:{HTTP_PORT}"

    def start(self) -> None:
        """Start every role, each once what it needs is up; return once both coordinators
        route to every worker."""
        self._start_etcd()
        membership = [f"--etcd-endpoints={self.etcd_endpoints}", "--cluster-name=lab"]
        for host in COORDINATOR_HOSTS:
            process = self.lab.start(
                host,
                python_module_argv(
                    "splitserve.coordinator.main",
                    f"--host={self.lab.hosts[host].address}",
                    f"--port={PORT}",
                    f"--internal-port={INTERNAL_PORT}",
                    f"--metrics-port={METRICS_PORT}",
                    *membership,
                ),  # fmt: skip
                self.env,
                name=host,
            )
            process.wait_ready(PUBLIC_READY, START_TIMEOUT_S)
        workers = []
        for host in WORKER_HOSTS:
            role = "prefill" if host.startswith("p") else "decode"
            engine = ["--engine=sim", "--sim-startup-s=0"] if self.engine == "sim" else []
            workers.append(
                self.lab.start(
                    host,
                    python_module_argv(
                        f"splitserve.{role}.main",
                        f"--host={self.lab.hosts[host].address}",
                        f"--worker-id={host}",
                        "--ucx-tls=tcp",
                        "--metrics-port=-1",
                        "--speculative-tokens=0",
                        *engine,
                        *membership,
                        *self.worker_flags,
                    ),  # fmt: skip
                    self.env,
                    name=host,
                )
            )
        for worker in workers:
            worker.wait_ready(None, START_TIMEOUT_S)
        gateway = self.lab.start(
            "g",
            python_module_argv(
                "splitserve.gateway.main",
                f"--host={self.lab.hosts['g'].address}",
                f"--port={HTTP_PORT}",
                f"--coordinator={','.join(self.coordinators)}",
            ),  # fmt: skip
            self.env,
            name="g",
        )
        gateway.wait_ready(None, START_TIMEOUT_S)
        asyncio.run(
            wait_for_members(self.internals, set(WORKER_HOSTS), START_TIMEOUT_S, self.credential)
        )

    def _start_etcd(self) -> None:
        address = {h: self.lab.hosts[h].address for h in ETCD_HOSTS}
        initial = ",".join(f"{h}=http://{address[h]}:2380" for h in ETCD_HOSTS)
        for host in ETCD_HOSTS:
            self.lab.start(
                host,
                [
                    str(etcd_binary()), f"--name={host}", f"--data-dir={self.workdir / host}",
                    f"--listen-client-urls=http://{address[host]}:2379",
                    f"--advertise-client-urls=http://{address[host]}:2379",
                    f"--listen-peer-urls=http://{address[host]}:2380",
                    f"--initial-advertise-peer-urls=http://{address[host]}:2380",
                    f"--initial-cluster={initial}", "--initial-cluster-state=new",
                    "--initial-cluster-token=lab", "--log-level=error",
                ],
                name=host,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        for host in ETCD_HOSTS:
            while not _etcd_healthy(address[host]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd on {host} is not healthy")
                time.sleep(0.2)

    async def members(self, timeout_s: float = 5.0) -> dict[str, list[MemberStatus] | str]:
        """What each coordinator lists (``ListWorkers``), or why it did not answer."""
        seen: dict[str, list[MemberStatus] | str] = {}
        for host, internal in zip(COORDINATOR_HOSTS, self.internals, strict=True):
            try:
                async with open_channel(internal, None) as channel:
                    client = MembershipClient(channel, self.credential)
                    seen[host] = await client.list_workers(timeout_s)
            except Exception as error:  # noqa: BLE001 - reported, not raised
                seen[host] = repr(error)
        return seen

    def recoveries(self) -> float:
        """Requests' recoveries counted by both coordinators so far."""
        total = 0.0
        for url in self.metrics_urls:
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310
                    text = reply.read().decode()
            except OSError:
                continue
            total += sum(
                sample.value
                for family in text_string_to_metric_families(text)
                if family.name == RECOVERIES_METRIC
                for sample in family.samples
                if sample.name.endswith("_total")
            )
        return total


def _etcd_healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}:2379/health", timeout=1) as reply:  # noqa: S310
            return json.loads(reply.read()).get("health") == "true"
    except (OSError, ValueError):
        return False
