"""The byte-moving contract under KV transfer.

A ``KvTransport`` lives once per worker process, on its asyncio loop. The receiving side posts
tagged receives on its own worker (``recv``: no endpoint needed, any peer may match); the
sending side connects to a peer's opaque ``address`` (exchanged over gRPC) and sends tagged
messages. Buffers are contiguous ``torch.uint8`` tensors (host memory; CUDA memory where the
backend supports it). A send or receive either completes, raises ``TransferError``, or is
cancelled by its caller; callers bound every wait with a timeout because a dead peer is not
always detected by the transport (see ``ucx.py``).

Tags: ``plan.message_tag(transfer_secret, index)`` is a keyed hash of a message index under a
per-transfer 128-bit secret, so concurrent transfers never match each other's messages and a
party without the secret cannot aim a message at a posted receive. Tags are never reused.
Transports authenticate nothing themselves (see ``ucx.py``): the tag is the capability.

Sizes: a message must fill its receive buffer exactly. ``recv`` raises ``TransferError`` for a
longer message, and for a shorter one (UCX itself completes a receive with a shorter message
without a word): the in-process transport for any other size, UCX for a message that stops at
least 8 bytes short of the buffer's end, found by a random canary it writes there before
posting (``ucx.py``, Sizes: a message 1 to 7 bytes short passes it). So an empty or truncated
message never passes for a landed one. While a receive is posted its buffer's last bytes may
hold that canary; a withdrawn receive gets them back.

A receive posted into memory cannot be taken back (UCX has no per-request cancel in ucxx), so a
receiver that gives up *withdraws* its receives: ``withdraw(tag)`` completes a still-unmatched
receive of ``tag`` without writing into its buffer. Once every receive into a region has
settled (completed, failed or withdrawn), no message can land in that region any more, and its
owner may hand the memory to someone else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


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
        """Receive the message tagged ``tag`` into ``buffer``.

        Returns once the message filled ``buffer`` or the receive was withdrawn; raises
        ``TransferError`` (naming the tag and both sizes) when the message's size differs from
        ``buffer``'s (UCX: see the module docstring, Sizes), or on a transport failure. A
        message of the wrong size may have written part of ``buffer``. The receive is posted
        when the coroutine first runs; cancelling the awaiting task does not withdraw it (use
        ``withdraw``), and may leave the UCX canary in ``buffer``."""

    @abstractmethod
    async def withdraw(self, tag: int) -> None:
        """Make this transport's receive of ``tag`` complete without writing into its buffer,
        unless a message already matched it (that receive then completes or fails on its own).

        A peer's message cannot pass for a withdrawal (a peer's empty message is a size
        error): UCX records the tag as withdrawn on this side and completes the receive with an
        empty message from this transport to itself; the in-process transport uses a marker no
        send produces. If no receive of ``tag`` is posted yet, the next one posted completes
        without writing. A real message of ``tag`` arriving after the withdrawal is never
        received (tags are not reused)."""

    def forget(self, address: bytes) -> None:  # noqa: B027 - optional hook
        """Drop the cached endpoint to ``address`` (after a failure): the next ``connect``
        creates a fresh one."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources (endpoints, worker)."""
