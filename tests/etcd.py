"""A real single-member etcd server for tests, on free localhost ports.

``EtcdServer(tmp_dir)`` picks a client and a peer port once; ``start()`` runs
``etcd_binary()`` on them with its data in ``tmp_dir`` and returns when ``/health`` answers;
``stop()`` sends SIGTERM and waits. ``stop()`` then ``start()`` again is an outage: the same
ports and data dir, so keys, leases and revisions survive and clients reconnect to the same
address (``wipe()`` in between: etcd comes back empty). ``compact(revision)`` drops history.
``running_etcd`` is the context manager the ``etcd`` fixture (conftest) uses.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from splitserve.discovery.etcd_server import etcd_binary

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
_NAME = "splitserve-test"


FIXED_PORTS = 8000
"""How many ports below the kernel's ephemeral range ``free_port`` picks from."""
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A localhost TCP port nothing listens on (at the time of the call), for a process that
    binds it later (and again after a restart). It lies below the kernel's ephemeral range, so
    no outgoing connection of another process can take it meanwhile (one in the range did,
    once: a coordinator of the fault cluster could not bind); none is handed out twice."""
    high = _ephemeral_low()
    low = max(1024, high - FIXED_PORTS)
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high}")


class EtcdServer:
    """One etcd process at a time on fixed ports; see the module docstring."""

    def __init__(self, tmp_dir: Path) -> None:
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = tmp_dir / "etcd-data"
        self.log_path = tmp_dir / "etcd.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """host:port of the client (gRPC) listener, as ``EtcdClient`` takes it."""
        return f"127.0.0.1:{self.client_port}"

    def _argv(self) -> list[str]:
        client_url = f"http://{self.endpoint}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        return [
            str(etcd_binary()),
            f"--name={_NAME}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={_NAME}={peer_url}",
            "--unsafe-no-fsync",  # test data only: spare the shared disk
            "--log-level=warn",
        ]

    def start(self) -> None:
        """Start etcd and wait until it reports healthy; raises with the log's tail if it
        exits or stays unhealthy for ``START_TIMEOUT_S``."""
        assert self._process is None, "already running"
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(self._argv(), stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            if self._healthy():
                return
            time.sleep(0.05)
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"etcd did not become healthy on {self.endpoint}:\n{tail}")

    @property
    def running(self) -> bool:
        """Started and not stopped (nor exited on its own)."""
        return self._process is not None and self._process.poll() is None

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as reply:
                return bool(json.load(reply).get("health") == "true")
        except OSError:
            return False

    def compact(self, revision: int) -> None:
        """Drop the history before ``revision`` (``etcdctl compact``, next to the binary)."""
        etcdctl = etcd_binary().with_name("etcdctl")
        argv = [str(etcdctl), f"--endpoints={self.endpoint}", "compact", str(revision)]
        subprocess.run(argv, check=True, capture_output=True, timeout=STOP_TIMEOUT_S)

    def wipe(self) -> None:
        """Delete the data dir (stopped server only): the next ``start`` is an empty etcd."""
        assert self._process is None, "stop etcd before wiping its data"
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after ``STOP_TIMEOUT_S``); no-op when not running."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def running_etcd(tmp_dir: Path) -> Iterator[EtcdServer]:
    """A started ``EtcdServer`` in ``tmp_dir``, stopped on exit whatever state it is in."""
    server = EtcdServer(tmp_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
