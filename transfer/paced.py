"""A transport whose sends take the time a real model's KV would take over a measured link.

A simulated worker's KV cache holds a stand-in of a few bytes a token (``engine/sim_runner.py``),
so its transfers over UCX take next to nothing. ``PacedTransport`` wraps the real transport and
delays each send as if the message carried ``bytes_scale`` times its bytes over a link of
``gbps`` with one-way ``latency_s`` (``LinkModel``, from the simulation profile's measured
figures: ``engine/sim_profile.py:SimProfile``): the messages to one peer share its link one
after another, as a prefill worker's layer pushes share the wire, so a prompt's KV lands
``latency + bytes / bandwidth`` after its last layer was offered, less what overlapped the
prompt's compute (the layer pushes start as the simulated layers complete, as for real).
Receives are the real transport's. The bytes sent are the real ones: nothing else changes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from splitserve.transfer.transport import KvEndpoint, KvTransport


@dataclass(frozen=True)
class LinkModel:
    """A link as the simulation sees it."""

    gbps: float
    """Bandwidth, Gbit/s (> 0)."""
    latency_s: float
    """One-way time of a message, added to its last byte's."""
    bytes_scale: float
    """Real bytes per byte sent (the real model's KV per token over the stand-in's)."""

    def occupancy_s(self, num_bytes: int) -> float:
        """How long ``num_bytes`` sent keep the link busy."""
        return num_bytes * self.bytes_scale * 8 / (self.gbps * 1e9)


class _PacedEndpoint(KvEndpoint):
    """Sends to one peer, in order on its link (``LinkModel``)."""

    def __init__(self, inner: KvEndpoint, link: LinkModel) -> None:
        self._inner = inner
        self._link = link
        self._free_at = 0.0
        """When (the loop's clock) the link has carried every send started so far."""

    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        loop = asyncio.get_running_loop()
        start = max(loop.time(), self._free_at)
        self._free_at = start + self._link.occupancy_s(buffer.numel() * buffer.element_size())
        delay_s = self._free_at + self._link.latency_s - loop.time()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        await self._inner.send(tag, buffer)


class PacedTransport(KvTransport):
    """``inner`` with each peer's sends paced by ``link`` (module docstring)."""

    def __init__(self, inner: KvTransport, link: LinkModel) -> None:
        if link.gbps <= 0:
            raise ValueError(f"a paced link needs a positive bandwidth, not {link.gbps}")
        self._inner = inner
        self._link = link
        self._endpoints: dict[bytes, _PacedEndpoint] = {}
        self.name = inner.name  # the handshake compares backends: pacing is not one

    @property
    def address(self) -> bytes:
        return self._inner.address

    async def connect(self, address: bytes) -> KvEndpoint:
        inner = await self._inner.connect(address)
        paced = self._endpoints.get(address)
        if paced is None or paced._inner is not inner:  # noqa: SLF001 - its own class
            paced = self._endpoints[address] = _PacedEndpoint(inner, self._link)
        return paced

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        await self._inner.recv(tag, buffer)

    async def withdraw(self, tag: int) -> None:
        await self._inner.withdraw(tag)

    def forget(self, address: bytes) -> None:
        self._endpoints.pop(address, None)
        self._inner.forget(address)

    async def close(self) -> None:
        await self._inner.close()
