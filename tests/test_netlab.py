"""The network lab itself (``launch/netlab.py``), measured with real sockets between real
namespaces: a shaped link carries about its rate, a cut drops every packet one way or both
(the host stays alive), a heal restores it, a lossy link drops about its share, and closing
the lab leaves no namespace or link behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitserve.launch.netlab import Lab, missing

REASON = missing()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"no network lab: {REASON}"),
]

RECEIVER = """
import socket, sys
kind, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "tcp":
    server = socket.create_server((host, port))
    print("listening", flush=True)
    conn, _ = server.accept()
    total = 0
    while data := conn.recv(1 << 20):
        total += len(data)
    print(total, flush=True)
else:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind((host, port))
    server.settimeout(2.0)
    print("listening", flush=True)
    total = 0
    try:
        while True:
            server.recv(2048)
            total += 1
    except TimeoutError:
        print(total, flush=True)
"""
SENDER = """
import socket, sys, time
kind, host, port, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if kind == "tcp":
    conn = socket.create_connection((host, port), timeout=5)
    block = b"x" * (1 << 20)
    began = time.perf_counter()
    for _ in range(count):
        conn.sendall(block)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
    print(count * len(block) * 8 / (time.perf_counter() - began) / 1e9, flush=True)
else:
    conn = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(count):
        conn.sendto(b"y" * 512, (host, port))
        time.sleep(0.0005)
"""


def _exchange(lab: Lab, kind: str, count: int, timeout_s: float = 30) -> tuple[str, str]:
    """(what the sender on "a" printed, what the receiver on "b" printed)."""
    b = lab.hosts["b"]
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", b.netns, sys.executable, "-c", RECEIVER, kind, b.address, "9000"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "listening"
        sent = subprocess.run(
            ["ip", "netns", "exec", lab.hosts["a"].netns, sys.executable, "-c", SENDER, kind,
             b.address, "9000", str(count)],
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        try:
            received = receiver.communicate(timeout=timeout_s)[0]
        except subprocess.TimeoutExpired:  # nothing arrived: the receiver still waits
            received = ""
    finally:
        receiver.kill()
    return sent.stdout.strip() or sent.stderr.strip(), received.strip()


def test_shaped_cut_healed_and_lossy_links() -> None:
    with Lab(["a", "b"]) as lab:
        names = (lab.bridge, *(h.bridge_end for h in lab.hosts.values()))
        open_gbit = float(_exchange(lab, "tcp", 200)[0])
        lab.shape("b", 0.5)
        shaped_gbit = float(_exchange(lab, "tcp", 40)[0])
        assert 0.35 < shaped_gbit < 0.6, (open_gbit, shaped_gbit)
        assert open_gbit > 2 * shaped_gbit

        lab.cut("b", ["a"], direction="in")
        sent, _ = _exchange(lab, "tcp", 1, timeout_s=8)
        assert "timed out" in sent  # a's SYN never reaches b
        lab.heal("b")
        assert float(_exchange(lab, "tcp", 4)[0]) > 0

        lab.cut("b")  # from everyone: this namespace cannot reach it either
        pinged = subprocess.run(
            [sys.executable, "-c", "import socket; socket.create_connection("
             f"('{lab.hosts['b'].address}', 9), timeout=2)"], capture_output=True, text=True,
        )  # fmt: skip
        assert "timed out" in pinged.stderr
        lab.heal("b")

        lab.lose("b", 30, ["a"])
        received = int(_exchange(lab, "udp", 2000)[1])
        assert 1100 < received < 1700, received  # about 70% of 2,000 datagrams
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not [name for name in names if name in links]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"sl{lab.id}-" not in namespaces
