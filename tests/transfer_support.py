"""What the KV transfer tests share (``test_transfer.py``, ``test_transfer_messages.py``, and
``test_transfer_security.py`` through ``test_transfer.py``): the fake decode-side KV cache and
its layout, a one-way link over either transport, a link that counts its messages, and the
bounds every wait keeps.

The receiving side is a fake paged KV cache ``[layers, 2, blocks, block_size, kv_heads,
head_dim]`` of zeros; the sending side random bf16 bytes of the same shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import torch

from splitserve.common.errors import TransferError
from splitserve.common.kv_layout import KvLayout
from splitserve.transfer.inprocess import InProcessTransport
from splitserve.transfer.layer_channel import LayerSender
from splitserve.transfer.transport import KvEndpoint, KvTransport

NUM_LAYERS = 6
CACHE_BLOCKS = 24
"""Blocks of the fake decode-side KV cache; a transfer reserves some of them."""
SCATTERED = [9, 10, 11, 3, 4, 20, 19, 0]
"""A block table in allocation order: sorted it is four runs (0; 3-4; 9-11; 19-20), two of
them reversed or split in the table."""
SMOLLM2_BF16 = KvLayout(
    model="SmolLM2-135M-Instruct",
    dtype="bfloat16",
    block_size=16,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)
"""The default model's KV layout; tests send ``NUM_LAYERS`` layers of it."""
WAIT_S = 10.0
"""Bound on waits that are expected to succeed (a hang turns into a failure, not a stall)."""
LATE_S = 0.3
"""Room for a late message to land, which must not."""

_transfer_ids = itertools.count(1)


@dataclass
class Link:
    """A one-way path: ``endpoint`` sends to ``receiver``."""

    receiver: KvTransport
    endpoint: KvEndpoint


@contextlib.asynccontextmanager
async def open_link(kind: str) -> AsyncIterator[Link]:
    """Transports for ``kind`` on the running loop; closed on exit."""
    transports: list[KvTransport]
    if kind == "ucx":
        from splitserve.transfer.ucx import UcxTransport

        transports = [UcxTransport()]  # one per process: it sends to its own address
    else:
        transports = [InProcessTransport(), InProcessTransport()]
    sender_side, receiver_side = transports[0], transports[-1]
    try:
        endpoint = await sender_side.connect(receiver_side.address)
        yield Link(receiver_side, endpoint)
    finally:
        for transport in transports:
            await transport.close()


def kv_shape(num_blocks: int) -> tuple[int, ...]:
    layout = SMOLLM2_BF16
    return (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)


def random_kv(num_blocks: int) -> torch.Tensor:
    """Random bytes viewed as ``NUM_LAYERS`` layers of bf16 KV:
    ``[layers, 2, blocks, block_size, kv_heads, head_dim]``."""
    raw = torch.randint(
        0, 256, (NUM_LAYERS, SMOLLM2_BF16.layer_bytes(num_blocks)), dtype=torch.uint8
    )
    return raw.view(torch.bfloat16).view(NUM_LAYERS, *kv_shape(num_blocks))


def new_cache() -> torch.Tensor:
    """The decode worker's KV cache, all zero: ``[layers, 2, CACHE_BLOCKS, ...]``."""
    return torch.zeros(NUM_LAYERS, *kv_shape(CACHE_BLOCKS), dtype=torch.bfloat16)


def as_bytes(kv: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view, so that comparisons are bitwise (random bf16 bytes include NaNs)."""
    return kv.reshape(-1).view(torch.uint8)


def assert_zero(kv: torch.Tensor) -> None:
    assert not as_bytes(kv).any()


def unreserved(block_ids: Sequence[int]) -> list[int]:
    return [block for block in range(CACHE_BLOCKS) if block not in set(block_ids)]


async def let_late_sends_run(sender: LayerSender) -> None:
    """Give a sender's messages (to withdrawn tags) time to arrive, then stop it. Its sends
    may never complete (UCX rendezvous with no receive), so this never waits on them."""
    finish = asyncio.ensure_future(sender.finish(LATE_S))
    await asyncio.wait([finish], timeout=LATE_S + 1.0)
    sender.abort()
    with contextlib.suppress(TransferError):
        await finish


class CountingEndpoint(KvEndpoint):
    """``inner``, counting the messages sent through it."""

    def __init__(self, inner: KvEndpoint) -> None:
        self.sent = 0
        self._inner = inner

    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        self.sent += 1
        await self._inner.send(tag, buffer)


class ForwardingTransport(KvTransport):
    """``inner`` as it is; subclasses watch or hold up its receives."""

    def __init__(self, inner: KvTransport) -> None:
        self.name = inner.name
        self.inner = inner

    @property
    def address(self) -> bytes:
        return self.inner.address

    async def connect(self, address: bytes) -> KvEndpoint:
        return await self.inner.connect(address)

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        await self.inner.recv(tag, buffer)

    async def withdraw(self, tag: int) -> None:
        await self.inner.withdraw(tag)


class CountingTransport(ForwardingTransport):
    """``inner``'s receive side, counting the receives posted and the most of them posted and
    not yet returned at once."""

    def __init__(self, inner: KvTransport) -> None:
        super().__init__(inner)
        self.posted = 0
        self.most_at_once = 0
        self._open = 0

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        self.posted += 1
        self._open += 1
        self.most_at_once = max(self.most_at_once, self._open)
        try:
            await self.inner.recv(tag, buffer)
        finally:
            self._open -= 1


@contextlib.asynccontextmanager
async def counting_link(
    kind: str,
) -> AsyncIterator[tuple[Link, CountingEndpoint, CountingTransport]]:
    """``open_link(kind)`` with its endpoint and its receiving side counted."""
    async with open_link(kind) as link:
        endpoint, receiver = CountingEndpoint(link.endpoint), CountingTransport(link.receiver)
        yield Link(receiver, endpoint), endpoint, receiver


class _StalledEndpoint(KvEndpoint):
    """An endpoint whose sends never complete (a peer that stopped reading)."""

    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        await asyncio.Event().wait()
