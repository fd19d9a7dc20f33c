"""Measure the KV link between two processes over UCX: bandwidth and small-message latency.

``measure_link`` starts a peer process (this module, ``--serve``), which prints its UCX
address and connects back. Then:

- latency: ``pings`` round trips of an 8-byte message (peer echoes each); the one-way
  latency is half the median round trip;
- bandwidth: ``count`` messages of ``size`` bytes sent back to back, as a prefill worker
  pushes a prompt's layers; the peer answers once every one landed. Bandwidth is the bytes
  over the time from the first send to that answer, less one one-way latency.

Both sides use the same ``UcxSettings`` (``--ucx-tls tcp`` measures the TCP path a link
between hosts takes; by default UCX picks what two processes on this host share). Used by
``splitserve profile`` (``launch/profile.py``) for the profile's transfer figures
(``engine/sim_profile.py:SimProfile.transfer_gbps``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.transfer.ucx import UcxTransport
from splitserve.transfer.ucx_settings import UcxSettings

PING_TAG = 1 << 40
PONG_TAG = 2 << 40
DATA_TAG = 3 << 40
DONE_TAG = 4 << 40
SMALL_BYTES = 8
DEFAULT_SETTINGS = UcxSettings()
PEER_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LinkFigures:
    """What ``measure_link`` measured."""

    gbps: float
    """Bandwidth, Gbit/s."""
    latency_s: float
    """One-way time of a small message."""
    transports: str
    """What UCX used (``ucxx.get_active_transports``), for the record."""


async def measure_link(
    settings: UcxSettings = DEFAULT_SETTINGS,
    count: int = 16,
    size: int = 8 << 20,
    pings: int = 50,
) -> LinkFigures:
    """Measure the link to a peer process (module docstring); ``RuntimeError`` when the peer
    does not start or fails."""
    transport = UcxTransport(settings)
    peer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "splitserve.transfer.link_probe",
        "--serve",
        transport.address.hex(),
        f"--count={count}",
        f"--size={size}",
        f"--pings={pings}",
        *([f"--ucx-tls={settings.tls}"] if settings.tls else []),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert peer.stdout is not None
        line = await asyncio.wait_for(peer.stdout.readline(), PEER_START_TIMEOUT_S)
        if not line.strip():
            raise RuntimeError("the link probe's peer exited before it printed its address")
        endpoint = await transport.connect(bytes.fromhex(line.decode().strip()))
        small = torch.zeros(SMALL_BYTES, dtype=torch.uint8)
        round_trips = []
        for index in range(pings):
            started = time.perf_counter()
            await endpoint.send(PING_TAG + index, small)
            await transport.recv(PONG_TAG + index, small)
            round_trips.append(time.perf_counter() - started)
        latency_s = statistics.median(round_trips) / 2
        data = [torch.ones(size, dtype=torch.uint8) for _ in range(count)]
        started = time.perf_counter()
        await asyncio.gather(*(endpoint.send(DATA_TAG + i, d) for i, d in enumerate(data)))
        await transport.recv(DONE_TAG, small)
        elapsed = max(time.perf_counter() - started - latency_s, 1e-9)
        if await peer.wait() != 0:
            raise RuntimeError(f"the link probe's peer failed (exit {peer.returncode})")
        transports = transport.active_transports
    finally:
        if peer.returncode is None:
            peer.kill()
            await peer.wait()
        await transport.close()
    return LinkFigures(count * size * 8 / elapsed / 1e9, latency_s, transports)


async def _serve(parent: bytes, count: int, size: int, pings: int, settings: UcxSettings) -> None:
    """The peer: echo the pings, take the data, say when all of it landed."""
    transport = UcxTransport(settings)
    print(transport.address.hex(), flush=True)
    endpoint = await transport.connect(parent)
    small = torch.zeros(SMALL_BYTES, dtype=torch.uint8)
    for index in range(pings):
        await transport.recv(PING_TAG + index, small)
        await endpoint.send(PONG_TAG + index, small)
    buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(count)]
    await asyncio.gather(*(transport.recv(DATA_TAG + i, b) for i, b in enumerate(buffers)))
    await endpoint.send(DONE_TAG, small)
    await transport.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the peer side of measure_link")
    parser.add_argument("--serve", required=True, help="the measuring process's UCX address")
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--size", type=int, default=8 << 20)
    parser.add_argument("--pings", type=int, default=50)
    parser.add_argument("--ucx-tls", default=None)
    args = parser.parse_args(argv)
    settings = UcxSettings(tls=args.ucx_tls)
    asyncio.run(_serve(bytes.fromhex(args.serve), args.count, args.size, args.pings, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
