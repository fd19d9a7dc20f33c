"""A lab of hosts on one machine: each host a Linux network namespace with its own address on
one bridge, its link shaped and cut by the lab, its processes started inside it.

``Lab(hosts)`` is a context manager: on entry it creates a bridge (``sl<id>-br``, address
``<subnet>.254``, so this namespace reaches every host) and per host a namespace
(``sl<id>-<name>``) whose ``eth0`` (``<subnet>.<index + 1>``) is a veth pair's end, the other
end on the bridge; on exit it stops every process it started and deletes every namespace,
veth and the bridge (also after a failure half way). Names carry a per-lab id, so labs of
concurrent test runs do not meet.

Links (``launch/netlab_rules.py`` holds the commands):

- ``shape(host, gbit)``: ``tc`` token bucket (tbf) on both directions of the host's link,
  so traffic between two shaped hosts crosses two buckets of its rate;
- ``cut(host, peers=None, direction="both")``: ``nft`` drops in the bridge (so neither end
  learns of it but by silence, as in a real partition): frames to (``in``), from (``out``)
  or both ways between the host and each peer (everyone, this namespace included, when
  ``peers`` is None: partitioned from everything, alive, its loopback untouched);
- ``lose(host, percent, peers=None)``: drops that share of the frames arriving at the host
  from the peers (nft ``numgen random``);
- ``heal(host)``: removes the host's rules (the shaping stays; ``unshape(host)`` removes it).

There is no added latency: this kernel has no ``netem``, and a tbf's queue delays only past
its rate. ``missing()`` says why a lab cannot be made here (not root, a tool missing, no
namespaces), for tests to skip with.
"""

from __future__ import annotations

import collections
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from splitserve.launch.child_process import ChildProcess
from splitserve.launch.netlab_rules import (
    Drop,
    bridge_ruleset,
    cut_drops,
    loss_drops,
    tbf_commands,
)

SUBNET = "10.77.0"
ROOT = "root"
"""The peer name of this (the root) namespace, which reaches the hosts over the bridge."""
TOOLS = ("ip", "tc", "nft")
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class Host:
    """One host of a lab: its name, namespace, address and the bridge end of its link."""

    name: str
    netns: str
    address: str
    bridge_end: str


def missing() -> str | None:
    """Why a lab cannot be made on this machine (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"missing {', '.join(absent)} (Debian: iproute2, nftables)"
    probe = f"slprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    bridge = subprocess.run(
        ["ip", "link", "add", probe, "type", "bridge"], capture_output=True, text=True
    )
    if bridge.returncode != 0:
        return f"cannot create a bridge: {bridge.stderr.strip()}"
    subprocess.run(["ip", "link", "del", probe], capture_output=True)
    checked = subprocess.run(
        ["nft", "-c", "-f", "-"], input=bridge_ruleset(probe, []), capture_output=True, text=True
    )
    if checked.returncode != 0:
        return f"nft cannot filter bridged frames: {checked.stderr.strip()}"
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


class Lab:
    """See the module docstring. ``hosts``: their names, in address order."""

    def __init__(self, hosts: Sequence[str], subnet: str = SUBNET) -> None:
        if len(set(hosts)) != len(hosts) or not 0 < len(hosts) < 254 or ROOT in hosts:
            raise ValueError(f"hosts need distinct names, 1 to 253 of them: {hosts}")
        self.id = secrets.token_hex(2)
        self.bridge = f"sl{self.id}-br"
        self.gateway_address = f"{subnet}.254"
        """This (the root) namespace's address on the bridge."""
        self.hosts = {
            name: Host(name, f"sl{self.id}-{name}", f"{subnet}.{i + 1}", f"sl{self.id}v{i}")
            for i, name in enumerate(hosts)
        }
        self.processes: list[ChildProcess] = []
        self.table = f"sl{self.id}"
        """The bridge's nft table of drops (``launch/netlab_rules.py``)."""
        self._drops: collections.defaultdict[str, list[Drop]] = collections.defaultdict(list)

    def __enter__(self) -> Lab:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for host in self.hosts.values():
            _run("ip", "netns", "add", host.netns)
            _run(
                "ip", "link", "add", host.bridge_end, "type", "veth",
                "peer", "name", "eth0", "netns", host.netns,
            )  # fmt: skip
            _run("ip", "link", "set", host.bridge_end, "master", self.bridge, "up")
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")

    def start(
        self,
        host: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> ChildProcess:
        """Run ``argv`` inside ``host``'s namespace (``ip netns exec``, which execs it: the
        process is ``argv`` itself), stopped when the lab closes."""
        netns = self.hosts[host].netns
        process = ChildProcess(
            ["ip", "netns", "exec", netns, *argv],
            name=name or f"{host}:{argv[-1]}",
            env=env,
            tail_excludes=("UCX  WARN",),
        )
        self.processes.append(process)
        return process

    def shape(self, host: str, gbit: float) -> None:
        """Both directions of ``host``'s link at ``gbit`` Gbit/s."""
        where = self.hosts[host]
        for command in tbf_commands(where.bridge_end, gbit):
            _run(*command)
        for command in tbf_commands("eth0", gbit):
            _run("ip", "netns", "exec", where.netns, *command)

    def unshape(self, host: str) -> None:
        """Take ``host``'s link back to the bridge's own rate."""
        where = self.hosts[host]
        subprocess.run(["tc", "qdisc", "del", "dev", where.bridge_end, "root"], capture_output=True)
        subprocess.run(
            ["ip", "netns", "exec", where.netns, "tc", "qdisc", "del", "dev", "eth0", "root"],
            capture_output=True,
        )

    def cut(self, host: str, peers: Iterable[str] | None = None, direction: str = "both") -> None:
        """Drop ``host``'s traffic with ``peers`` (host names, ``ROOT`` for this namespace;
        None: everyone), in the bridge: silent for both ends."""
        address = self.hosts[host].address
        self._drops[host] += cut_drops(address, self._addresses(peers), direction)
        self._apply()

    def lose(self, host: str, percent: int, peers: Iterable[str] | None = None) -> None:
        """Drop ``percent`` of the frames ``host`` receives from ``peers`` (None: anyone)."""
        address = self.hosts[host].address
        self._drops[host] += loss_drops(address, self._addresses(peers), percent)
        self._apply()

    def heal(self, host: str) -> None:
        """Remove ``host``'s cuts and losses (the shaping stays)."""
        if self._drops.pop(host, None):
            self._apply()

    def _addresses(self, peers: Iterable[str] | None) -> list[str] | None:
        """The peers' addresses (None: everyone)."""
        if peers is None:
            return None
        return [
            self.gateway_address if peer == ROOT else self.hosts[peer].address for peer in peers
        ]

    def _apply(self) -> None:
        """Replace the bridge's drop table with every host's drops, in one transaction."""
        drops = [drop for host_drops in self._drops.values() for drop in host_drops]
        ruleset = bridge_ruleset(self.table, drops)
        done = subprocess.run(["nft", "-f", "-"], input=ruleset, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nft: {done.stderr.strip()}\n{ruleset}")

    def close(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL), delete every namespace and link."""
        for process in reversed(self.processes):
            process.stop(STOP_GRACE_S)
        self.processes.clear()
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.bridge_end], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        subprocess.run(["nft", "delete", "table", "bridge", self.table], capture_output=True)
