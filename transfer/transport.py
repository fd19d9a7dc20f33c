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

Sizes: a message longer than its receive buffer fails the receive (``TransferError``). A
shorter one may complete it: UCX reports no received length and completes a receive with a
shorter message, an empty one included, as a success (``ucx.py``, Sizes); the in-process
transport fails any other size. So a completed receive does not say that the buffer was
filled: whoever must know checks it (``layer_channel.LayerReceiver`` with a canary per layer,
``canary.py``).

CUDA memory: UCX reads and writes it outside stream order; a send waits for the work queued on
the default stream first (``ucx.py``), a receive does not: its caller posts it only once the
work queued on its buffer has run.

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

        Returns once a message of at most ``buffer``'s size landed at its start (a shorter one
        may pass: see the module docstring, Sizes) or the receive was withdrawn; raises
        ``TransferError`` (naming the tag) for a longer message (or, in-process, any other
        size), or on a transport failure. A message of the wrong size may have written part
        of ``buffer``. The receive is posted when the coroutine first runs; cancelling the
        awaiting task does not withdraw it (use ``withdraw``)."""

    @abstractmethod
    async def withdraw(self, tag: int) -> None:
        """Make this transport's receive of ``tag`` complete without writing into its buffer,
        unless a message already matched it (that receive then completes or fails on its own).

        UCX completes the receive with an empty message from this transport to itself; the
        in-process transport uses a marker no send produces. Only the receiver withdraws, and
        it looks at no receive it withdrew (a peer's empty message under a tag is no
        withdrawal to it: ``LayerReceiver`` finds it short by its canary). If no receive of
        ``tag`` is posted yet, the next one posted completes without writing. A real message
        of ``tag`` arriving after the withdrawal is never received (tags are not reused)."""

    def forget(self, address: bytes) -> None:  # noqa: B027 - optional hook
        """Drop the cached endpoint to ``address`` (after a failure): the next ``connect``
        creates a fresh one."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources (endpoints, worker)."""
