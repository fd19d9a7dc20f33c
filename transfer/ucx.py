"""UCX KV transport through ``ucxx``: tagged messages between worker addresses.

One ``ucxx`` application context per process (``ucxx.init``), created on the worker's event
loop; UCX progress runs on ucxx's progress thread. The receive side posts tag receives on its
worker; a sender creates one endpoint per peer from the peer's worker address (received in the
gRPC handshake) and sends with forced tags.

Settings (``UcxSettings``): ``tls`` restricts UCX transports (``UCX_TLS``); with
``error_handling`` on, UCX reports a dead peer as an endpoint error but then excludes
transports that cannot detect peer failure (shared memory among them), so on one machine
traffic falls back to TCP. The default is off; a dead peer is then detected by the timeouts
every caller puts on its waits (``layer_channel``), never by a hang.

Sizes: UCX completes a tag receive with a *shorter* message as a success and ucxx reports
nothing about it: ``ucxx``'s ``recv`` returns None, its request has no received length
(ucxx's C++ tag-receive callback ignores ``ucp_tag_recv_info_t.length``), and only a *longer*
message fails, with ``UCXXMessageTruncatedError`` (ucxx then keeps the failed request and its
error). So ``send`` follows every message with an 8-byte *size receipt* (the message's length,
little-endian) tagged ``_size_tag(tag)``, a hash of the message's tag; ``recv`` posts the
message's receive, then the receipt's, and raises ``TransferError`` when the message failed
or the receipt differs from the buffer's size. ``withdraw`` sends empty messages to both tags;
an empty receipt leaves the receipt buffer at ``_NO_SIZE``, which marks the receive withdrawn
(a peer's empty message carries a receipt of 0: a size error). The receipt is the sender's
word: it catches a sender that cut the KV otherwise than planned (a bug, a version skew), not
a holder of the secret who lies, who could write any bytes at the planned size anyway. Cost:
one more 8-byte eager message per message (``bench/bench_kv_transfer.py``: about 15-20 us per
message on a 2-core VM, most visible on small, fragmented transfers).

Authentication: none in UCX. Any process that holds this worker's address (or can list its
TCP ports) and can reach one of the interfaces in it may open an endpoint and send tagged
messages; UCX neither authenticates nor authorizes peers, and a posted receive matches any
sender. The defences are above UCX: (1) the worker address is handed out only in the
``KvHandshake`` reply, a gRPC call carrying the cluster credential; (2) a message lands only
in a receive posted under its exact 64-bit tag, and tags are keyed hashes of a per-transfer
128-bit secret that only the reservation carries (``plan.message_tag``), so a guessed tag hits
nothing (the chance of hitting any open receive is about ``open receives / 2**64`` per try).
Messages to tags nobody receives sit in UCX's unexpected-message queue; their memory is the
remaining exposure (a flood of them), not the KV cache.

Binding: the worker's ``--host`` binds its gRPC server only. UCX's TCP transport opens its own
listening socket on *every* network interface UCX uses, each bound to that interface's address
with an ephemeral port (``UCX_TCP_PORT_RANGE`` picks the range; seen with ``ss -ltnp``: one
socket on 127.0.0.1 and one on the eth0 address by default, only the first with
``NET_DEVICES=lo``), and the worker address lists them all; shared-memory transports (posix,
sysv, cma) are reachable by local processes the kernel lets map or ptrace this one. ucxx has
no bind-address argument for a worker address; the interfaces are chosen by UCX
configuration: ``UCX_NET_DEVICES`` (e.g. ``lo`` or ``eth1``, also as
``ucxx.init(options={"NET_DEVICES": ...})``) restricts TCP (and RDMA) to the named devices,
and ``UCX_TLS`` (``UcxSettings.tls``) the transports. To keep the KV plane on the internal
network, set ``UCX_NET_DEVICES`` to that network's device in the worker's environment.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.common.errors import TransferError
from splitserve.transfer.transport import KvEndpoint, KvTransport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UcxSettings:
    """How this process's UCX context is configured."""

    tls: str | None = None
    """UCX_TLS value, e.g. "sm,self" or "tcp"; None lets UCX choose."""
    error_handling: bool = False
    """Peer-failure detection on endpoints (forces failure-capable transports)."""


class UcxTransport(KvTransport):
    """KV transport over UCX tag messages; create it on the event loop that will use it."""

    name = "ucx"

    def __init__(self, settings: UcxSettings = UcxSettings()) -> None:
        import ucxx

        options = {"TLS": settings.tls} if settings.tls else {}
        # Python futures: a pending receive then waits on an event instead of busy-polling the
        # event loop (which took a whole core from a decode worker while KV was awaited).
        ucxx.init(options=options, enable_python_future=True)
        self._ucxx = ucxx
        self._futures_pool = _futures_pool_filler(ucxx)
        self._settings = settings
        self._address = ucxx.get_worker_address().tobytes()
        self._endpoints: dict[bytes, _UcxEndpoint] = {}
        self._connecting: dict[bytes, asyncio.Lock] = {}
        logger.info("UCX transport ready: %s, %s", settings, ucxx.get_active_transports())

    @property
    def address(self) -> bytes:
        return self._address

    async def connect(self, address: bytes) -> KvEndpoint:
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            endpoint = self._endpoints.get(address)
            if endpoint is None:
                try:  # the address comes from a peer: a malformed one is its failure
                    peer = self._ucxx.get_ucx_address_from_buffer(address)
                    raw = await self._ucxx.create_endpoint_from_worker_address(
                        peer, endpoint_error_handling=self._settings.error_handling
                    )
                except Exception as error:
                    raise TransferError(f"cannot reach UCX peer: {error}") from error
                endpoint = _UcxEndpoint(raw, self._futures_pool)
                self._endpoints[address] = endpoint
            return endpoint

    def forget(self, address: bytes) -> None:
        endpoint = self._endpoints.pop(address, None)
        if endpoint is not None:
            endpoint.abort()

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        failure = await self._receive_with_size(tag, buffer)
        if failure is not None:  # raised here, with no UCX error chained (it pins ucxx frames)
            raise TransferError(failure)

    async def _receive_with_size(self, tag: int, buffer: torch.Tensor) -> str | None:
        """Receive the message (posted now) and its size receipt (posted next); what went
        wrong, or None when the message filled ``buffer`` or the receive was withdrawn."""
        receipt = bytearray(_NO_SIZE.to_bytes(_SIZE_BYTES, "little"))  # until a receipt lands
        receipt_error = asyncio.ensure_future(self._receive_one(_size_tag(tag), receipt))
        # a failed data receive returns at once: its receipt, still posted, writes only there
        data_error = await self._receive_one(tag, _ucx_buffer(buffer))
        if data_error is not None:
            return f"UCX receive of tag {tag:#x} ({buffer.numel()} bytes) failed: {data_error}"
        if (error := await receipt_error) is not None:
            return f"UCX receive of the size of tag {tag:#x} failed: {error}"
        size = int.from_bytes(receipt, "little")
        if size in (_NO_SIZE, buffer.numel()):
            return None
        return f"message tagged {tag:#x} has {size} bytes, receive buffer {buffer.numel()}"

    async def _receive_one(self, tag: int, buffer: object) -> str | None:
        """One tag receive into ``buffer`` (what ucxx takes); its error as text (the
        exception is not kept), or None."""
        self._futures_pool()
        try:
            await self._ucxx.recv(buffer, tag=tag)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            # ucxx keeps a failed request's future, and with it this error: drop its traceback
            # so that it pins no frame (nor, through one, the application context)
            error.__traceback__ = None
            return str(error) or type(error).__name__
        return None

    async def withdraw(self, tag: int) -> None:
        await self.connect(self._address)  # cached like any peer's endpoint
        own = self._endpoints[self._address]
        await asyncio.gather(own.send_one(tag, _EMPTY), own.send_one(_size_tag(tag), _EMPTY))

    async def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.abort()
        self._endpoints.clear()
        # The notifier thread behind Python futures is not a daemon: stop it or the process
        # never exits.
        self._ucxx.stop_notifier_thread()


_EMPTY = bytearray()
"""The zero-byte message that withdraws a receive (UCX completes it without writing)."""
_SIZE_BYTES = 8
"""A size receipt: the message's length in bytes, little-endian."""
_NO_SIZE = (1 << 64) - 1
"""What a receipt buffer holds when an empty message (a withdrawal) completed its receive."""
_SIZE_TAG_PERSON = b"splitserve-kvlen"


def _discard_outcome(task: asyncio.Future[None]) -> None:
    """Mark a finished task's outcome as seen (nobody awaits it any more)."""
    if not task.cancelled():
        task.exception()


def _size_tag(tag: int) -> int:
    """The tag of the size receipt of the message tagged ``tag``: a hash of it, as unguessable
    as the tag itself and, like it, never reused."""
    digest = hashlib.blake2b(tag.to_bytes(8, "big"), digest_size=8, person=_SIZE_TAG_PERSON)
    return int.from_bytes(digest.digest(), "big")


class _UcxEndpoint(KvEndpoint):
    def __init__(self, raw, fill_futures_pool: Callable[[], None]) -> None:  # noqa: ANN001
        self._raw = raw  # ucxx.Endpoint, untyped
        self._fill_futures_pool = fill_futures_pool

    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        """The message (posted now), then its size receipt (posted next; see the module
        docstring)."""
        receipt = bytearray(buffer.numel().to_bytes(_SIZE_BYTES, "little"))
        receipt_sent = asyncio.ensure_future(self.send_one(_size_tag(tag), receipt))
        try:
            await self.send_one(tag, _ucx_buffer(buffer))
        except BaseException:  # the data's failure (or cancellation) is what the caller hears
            receipt_sent.add_done_callback(_discard_outcome)
            raise
        await receipt_sent

    async def send_one(self, tag: int, buffer: object) -> None:
        """One tagged message from ``buffer`` (what ucxx takes), no receipt (``withdraw``
        sends its empty messages so)."""
        self._fill_futures_pool()
        try:
            await self._raw.send(buffer, tag=tag, force_tag=True)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            error.__traceback__ = None  # kept by ucxx with the failed request (see recv)
            failure = f"UCX send of tag {tag:#x} failed: {error}"
        else:
            return
        raise TransferError(failure)

    def abort(self) -> None:
        try:
            self._raw.abort()
        except Exception:  # already closed or errored
            logger.debug("UCX endpoint abort failed", exc_info=True)


def _futures_pool_filler(ucxx) -> Callable[[], None]:  # noqa: ANN001 - the ucxx module
    """A function to call before each request: tops up ucxx's pool of Python futures.

    Every request takes a future from the worker's pool (100, refilled below 50 by ucxx's
    notifier thread). A transfer posts 60 and more requests at once, which empties the pool
    between refills; ucxx then refills it inline and logs "No Futures available" for every
    such burst. Refilling before each request (a no-op while 50 or more are left) keeps
    worker logs clean. The worker object is reached through ucxx's private application
    context; where that is missing, this does nothing and ucxx's own refill remains.
    """
    context = getattr(getattr(ucxx, "core", None), "_get_ctx", None)
    worker = getattr(context() if context else None, "worker", None)
    populate = getattr(worker, "populate_python_futures_pool", None)
    return populate if populate is not None else (lambda: None)


def _ucx_buffer(buffer: torch.Tensor) -> object:
    """What ucxx accepts: a numpy view of host memory, the tensor itself on CUDA."""
    if buffer.dtype != torch.uint8 or not buffer.is_contiguous():
        raise TypeError("transfer buffers are contiguous uint8 tensors")
    return buffer.numpy() if buffer.device.type == "cpu" else buffer
