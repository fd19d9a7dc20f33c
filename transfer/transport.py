"""The byte-moving contract under KV transfer.

A ``KvTransport`` lives once per worker process, on its asyncio loop. The receiving side posts
tagged receives on its own worker (``recv``: no endpoint needed, any peer may match); the
sending side connects to a peer's opaque ``address`` (exchanged over gRPC) and sends tagged
messages. Buffers are contiguous ``torch.uint8`` tensors (host memory; CUDA memory where the
backend supports it). A send or receive either completes, raises ``TransferError``, or is
cancelled by its caller; callers bound every wait with a timeout because a dead peer is not
always detected by the transport (see ``ucx.py``).

Tags: ``layer_tag(transfer_id, layer)`` packs a per-transfer id and a layer index into the
64-bit tag space, so concurrent transfers never match each other's messages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

LAYER_BITS = 12
"""Layer index bits of a tag (up to 4096 layers); the transfer id takes the upper 52."""
MAX_TRANSFER_ID = (1 << (64 - LAYER_BITS)) - 1


def layer_tag(transfer_id: int, layer: int) -> int:
    """The 64-bit tag of one layer's message of one transfer."""
    if not 0 <= transfer_id <= MAX_TRANSFER_ID or not 0 <= layer < (1 << LAYER_BITS):
        raise ValueError(f"tag out of range: transfer {transfer_id}, layer {layer}")
    return (transfer_id << LAYER_BITS) | layer


class KvEndpoint(ABC):
    """A connection to one peer's transport."""

    @abstractmethod
    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        """Send ``buffer`` (contiguous uint8) as one tagged message; returns when it may be
        reused. Raises ``TransferError`` on a transport failure."""


class KvTransport(ABC):
    """One per process: the local receive side and a factory of endpoints to peers."""

    name: str
    """Backend name reported in the handshake (e.g. "ucx", "inprocess")."""

    @property
    @abstractmethod
    def address(self) -> bytes:
        """Opaque bytes a peer passes to ``connect`` to reach this transport."""

    @abstractmethod
    async def connect(self, address: bytes) -> KvEndpoint:
        """An endpoint to the peer at ``address`` (implementations cache one per peer)."""

    @abstractmethod
    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        """Receive the message tagged ``tag`` into ``buffer`` (its size must match)."""

    def forget(self, address: bytes) -> None:  # noqa: B027 - optional hook
        """Drop the cached endpoint to ``address`` (after a failure): the next ``connect``
        creates a fresh one."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources (endpoints, worker)."""
