"""A real single-member etcd server for tests, on free localhost ports.

``EtcdServer(tmp_dir)`` picks a client and a peer port once; ``start()`` runs
``etcd_binary()`` on them with its data in ``tmp_dir`` and returns when ``/health`` answers;
``stop()`` sends SIGTERM and waits. ``stop()`` then ``start()`` again is an outage: the same
ports and data dir, so keys, leases and revisions survive and clients reconnect to the same
address (``wipe()`` in between: etcd comes back empty). ``compact(revision)`` drops history.
``running_etcd`` is the context manager the ``etcd`` fixture (conftest) uses.

Closed to strangers: ``EtcdServer(tmp_dir, tls=certificates)`` serves TLS and asks every
client for a certificate the same CA signed (etcd's ``--client-cert-auth``);
``enable_auth(root_password)`` turns on etcd's user/password auth (a ``root`` user, as etcd
requires) and ``add_user(name, password, prefix)`` makes a user whose role may read and write
the keys under ``prefix`` and nothing else. Auth and users live in the data dir: they survive
a restart (tokens do not: etcd hands out new ones after it).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from splitserve.discovery.etcd_server import etcd_binary
from tests.certs import CertificateSet

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

    def __init__(self, tmp_dir: Path, tls: CertificateSet | None = None) -> None:
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = tmp_dir / "etcd-data"
        self.log_path = tmp_dir / "etcd.log"
        self.tls = tls
        self._root_password: str | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """host:port of the client (gRPC) listener, as ``EtcdClient`` takes it."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def _client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def _argv(self) -> list[str]:
        client_url = self._client_url
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.tls is not None:
            tls = [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
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
            *tls,
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
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.cert, self.tls.key)
        try:
            url = f"{self._client_url}/health"
            with urllib.request.urlopen(url, timeout=1, context=context) as reply:
                return bool(json.load(reply).get("health") == "true")
        except OSError:
            return False

    def etcdctl(self, *args: str) -> str:
        """Run ``etcdctl`` (next to the binary) on this server, as ``root`` once auth is
        on; its output. Raises ``CalledProcessError`` (with etcdctl's message) on failure."""
        argv = [str(etcd_binary().with_name("etcdctl")), f"--endpoints={self.endpoint}"]
        if self.tls is not None:
            argv += [f"--cacert={self.tls.ca}", f"--cert={self.tls.cert}", f"--key={self.tls.key}"]
        if self._root_password is not None:
            argv.append(f"--user=root:{self._root_password}")
        done = subprocess.run(
            [*argv, *args], check=True, capture_output=True, text=True, timeout=STOP_TIMEOUT_S
        )
        return done.stdout

    def compact(self, revision: int) -> None:
        """Drop the history before ``revision`` (``etcdctl compact``)."""
        self.etcdctl("compact", str(revision))

    def enable_auth(self, root_password: str) -> None:
        """Turn on etcd's auth, with a ``root`` user of ``root_password`` (etcd refuses
        ``auth enable`` without one); later ``etcdctl`` calls log in as it."""
        self.etcdctl("user", "add", "root", f"--new-user-password={root_password}")
        self.etcdctl("user", "grant-role", "root", "root")
        self.etcdctl("auth", "enable")
        self._root_password = root_password

    def add_user(self, name: str, password: str, prefix: str) -> None:
        """A user (and its own role, ``<name>-rw``) that may read and write every key under
        ``prefix``, and no other key."""
        role = f"{name}-rw"
        self.etcdctl("role", "add", role)
        self.etcdctl("role", "grant-permission", role, "--prefix=true", "readwrite", prefix)
        self.etcdctl("user", "add", name, f"--new-user-password={password}")
        self.etcdctl("user", "grant-role", name, role)

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
def running_etcd(tmp_dir: Path, tls: CertificateSet | None = None) -> Iterator[EtcdServer]:
    """A started ``EtcdServer`` in ``tmp_dir``, stopped on exit whatever state it is in."""
    server = EtcdServer(tmp_dir, tls)
    server.start()
    try:
        yield server
    finally:
        server.stop()
