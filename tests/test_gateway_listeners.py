"""Several gateway processes on one port (``gateway/listeners.py``, ``up --gateways N``):
the kernel spreads connections over them, each answers on a port of its own too, and a port
held without ``SO_REUSEPORT`` is never shared."""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from splitserve.gateway.listeners import Listeners, shared_port_listeners


@contextlib.contextmanager
def _listeners(port: int) -> Iterator[Listeners]:
    listeners = shared_port_listeners("127.0.0.1", port, 128)
    try:
        yield listeners
    finally:
        for sock in listeners.sockets:
            sock.close()


def _accept_all(sockets: list[socket.socket], expected: int) -> dict[socket.socket, int]:
    """Accept ``expected`` connections across ``sockets``; how many each took."""
    taken = dict.fromkeys(sockets, 0)
    accepted: list[socket.socket] = []
    while sum(taken.values()) < expected:
        ready, _, _ = select.select(sockets, [], [], 5.0)
        assert ready, f"only {sum(taken.values())} of {expected} connections arrived"
        for sock in ready:
            with contextlib.suppress(BlockingIOError):
                accepted.append(sock.accept()[0])
                taken[sock] += 1
    for conn in accepted:
        conn.close()
    return taken


def test_two_listeners_share_the_port_and_the_kernel_spreads_connections() -> None:
    with _listeners(0) as first:
        port = first.shared.getsockname()[1]
        with _listeners(port) as second:
            assert second.shared.getsockname()[1] == port
            assert first.instance_port not in (port, second.instance_port)
            clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
            try:
                taken = _accept_all([first.shared, second.shared], len(clients))
            finally:
                for client in clients:
                    client.close()
    # by a hash of each connection's addresses: 40 all to one of two has odds of 2**-39
    assert all(count > 0 for count in taken.values()), taken


def test_a_port_held_without_reuse_port_is_not_shared() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        with pytest.raises(OSError):
            shared_port_listeners("127.0.0.1", holder.getsockname()[1], 128)
    finally:
        holder.close()


def test_gateway_processes_share_a_port_and_answer_on_their_own() -> None:
    """Two real gateway processes with ``--reuse-port`` (no coordinator behind them: the
    HTTP side alone); the second gets the port the first printed."""
    processes: list[subprocess.Popen[str]] = []
    announced: list[dict[str, str]] = []
    port = "0"
    try:
        for _ in range(2):
            process = subprocess.Popen(
                [sys.executable, "-m", "splitserve.gateway.main", "--reuse-port",
                 f"--port={port}", "--coordinator=127.0.0.1:1"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            processes.append(process)
            lines: dict[str, str] = {}
            assert process.stdout is not None
            while "ready" not in lines:
                line = process.stdout.readline()
                assert line, "the gateway exited before it was ready"
                if line.startswith("splitserve gateway "):
                    kind, _, url = line.split()[2:5]
                    lines[kind] = url
            announced.append(lines)
            port = lines["ready"].rsplit(":", 1)[1]
        assert announced[0]["ready"] == announced[1]["ready"]
        for lines in announced:
            assert lines["instance"] != lines["ready"]
            response = httpx.get(f"{lines['instance']}/v1/models", timeout=10)
            # the HTTP side answers on each process's own port (its coordinator is unreachable)
            assert response.status_code in (200, 503), response.text
            assert response.headers["content-type"].startswith("application/json")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
