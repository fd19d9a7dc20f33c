"""In-process KV transport for unit tests: same contract as UCX, memory copies underneath.

All transports must live on one asyncio loop. A send to a tag nobody receives yet is kept as an
unexpected message (copied) until a matching receive is posted, like UCX's eager protocol. A
message must fill its receive buffer exactly: any other size, an empty message included, is a
``TransferError`` of that receive. A receive into CUDA memory completes once the copy ran (as a
UCX receive completes once the data is in device memory). A withdrawal is no message at all
(``None`` in the mailbox), so a peer cannot pass one off.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import torch

from splitserve.common.errors import TransferError
from splitserve.transfer.transport import KvEndpoint, KvTransport

_REGISTRY: dict[bytes, InProcessTransport] = {}
_NEXT_ID = itertools.count()


@dataclass
class _PostedRecv:
    buffer: torch.Tensor
    done: asyncio.Future[None]


@dataclass
class _Mailbox:
    posted: dict[int, _PostedRecv] = field(default_factory=dict)
    unexpected: dict[int, torch.Tensor | None] = field(default_factory=dict)
    """Messages (copies) that came before their receive; ``None``: a withdrawal."""


class InProcessTransport(KvTransport):
    """A transport whose peers are other ``InProcessTransport`` objects of this process."""

    name = "inprocess"

    def __init__(self) -> None:
        self._address = f"inprocess-{next(_NEXT_ID)}".encode()
        self._mailbox = _Mailbox()
        _REGISTRY[self._address] = self

    @property
    def address(self) -> bytes:
        return self._address

    async def connect(self, address: bytes) -> KvEndpoint:
        peer = _REGISTRY.get(address)
        if peer is None:
            raise TransferError(f"no in-process transport at {address!r}")
        return _InProcessEndpoint(peer)

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        if tag in self._mailbox.posted:
            raise TransferError(f"a receive for tag {tag:#x} is already posted")
        if tag in self._mailbox.unexpected:
            _copy_message(self._mailbox.unexpected.pop(tag), buffer, tag)
            return
        done = asyncio.get_running_loop().create_future()
        self._mailbox.posted[tag] = _PostedRecv(buffer, done)
        try:
            await done
        finally:
            self._mailbox.posted.pop(tag, None)

    async def withdraw(self, tag: int) -> None:
        self.deliver(tag, None)

    def deliver(self, tag: int, message: torch.Tensor | None) -> None:
        """Peer side of a send (``None``: this transport's own withdrawal): complete a posted
        receive or keep the message."""
        posted = self._mailbox.posted.pop(tag, None)
        if posted is None:
            self._mailbox.unexpected[tag] = None if message is None else message.clone()
            return
        try:
            _copy_message(message, posted.buffer, tag)
        except TransferError as error:
            posted.done.set_exception(error)
        else:
            posted.done.set_result(None)

    async def close(self) -> None:
        _REGISTRY.pop(self._address, None)


class _InProcessEndpoint(KvEndpoint):
    def __init__(self, peer: InProcessTransport) -> None:
        self._peer = peer

    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        if _REGISTRY.get(self._peer.address) is not self._peer:
            raise TransferError("the peer transport was closed")
        self._peer.deliver(tag, buffer)
        await asyncio.sleep(0)


def _copy_message(message: torch.Tensor | None, buffer: torch.Tensor, tag: int) -> None:
    """Fill ``buffer`` with ``message``; ``TransferError`` unless the sizes are equal."""
    if message is None:
        return  # a withdrawal
    if message.numel() != buffer.numel():
        raise TransferError(
            f"message tagged {tag:#x} has {message.numel()} bytes, receive buffer {buffer.numel()}"
        )
    buffer.copy_(message)
    if buffer.is_cuda:  # complete once the data is in device memory, as a UCX receive is
        torch.cuda.current_stream(buffer.device).synchronize()
