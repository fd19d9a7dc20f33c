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
error). ``recv`` passes that on: a longer message is a ``TransferError``, a shorter one (an
empty one included) completes the receive, and whoever must know that a buffer was filled
checks it (``layer_channel.LayerReceiver``: a canary per layer, ``canary.py``). A withdrawal
is this transport's empty message to itself under the tag (``withdraw``): it completes the
receive without writing.

CUDA memory: UCX reads and writes it outside CUDA stream order (its own streams, or a peer
process's), so the work queued on a buffer must have run before UCX touches it. A send first
waits, without blocking the event loop, until the work queued so far on the buffer's device's
default stream has run (a buffer still being written by a kernel, e.g. the engine thread's
gather of a layer queued just before ``LayerSender.offer``, would otherwise go out stale): at
once when that stream is idle, else through an event awaited on a worker thread
(``device_order.Fence``). Work on other streams is not covered: whoever writes a send buffer
there synchronizes it first. A receive waits for nothing: its caller posts it only once the
work on its buffer has run (``LayerReceiver`` waits for its fence first).
``bench/bench_kv_transfer.py --device cuda`` exercises this, byte-checked.

Before the layer channel checked sizes, this transport put a canary in every receive's tail:
on host memory it cost nothing measurable, on an H200 its two synchronous 8-byte copies per
message took 9-11 us each (``bench/results/gpu-h200-2026-11-26.json``, ``size_check_copies``).

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
import logging
from collections.abc import Callable
from types import ModuleType

import torch

from splitserve.common.errors import TransferError
from splitserve.transfer.device_order import Fence
from splitserve.transfer.transport import KvEndpoint, KvTransport
from splitserve.transfer.ucx_settings import UcxSettings

logger = logging.getLogger(__name__)


class UcxTransport(KvTransport):
    """KV transport over UCX tag messages; create it on the event loop that will use it."""

    name = "ucx"

    def __init__(self, settings: UcxSettings | None = None) -> None:
        import ucxx

        settings = UcxSettings() if settings is None else settings
        options = {"TLS": settings.tls} if settings.tls else {}
        # Python futures: a pending receive then waits on an event instead of busy-polling the
        # event loop (which took a whole core from a decode worker while KV was awaited).
        ucxx.init(options=options, progress_mode=settings.progress_mode, enable_python_future=True)
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

    @property
    def active_transports(self) -> str:
        """The UCX transports this process's context uses (for the record)."""
        return str(self._ucxx.get_active_transports())

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
        lock = self._connecting.get(address)
        if lock is not None and not lock.locked():
            del self._connecting[address]

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        """See ``KvTransport.recv``: a longer message fails, a shorter one completes the
        receive (module docstring: Sizes)."""
        error = await self._receive_one(tag, _ucx_buffer(buffer))
        if error is not None:
            failure = f"UCX receive of tag {tag:#x} ({buffer.numel()} bytes) failed: {error}"
            raise TransferError(failure)  # with no UCX error chained (it pins ucxx frames)

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
        """See ``KvTransport.withdraw``: an empty message from this transport to itself under
        ``tag``, which completes the receive without writing (or, with no receive posted yet,
        the next one posted)."""
        own = await self.connect(self._address)  # cached like any peer's endpoint
        await own.send(tag, _EMPTY)

    async def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.abort()
        self._endpoints.clear()
        # The notifier thread behind Python futures is not a daemon: stop it or the process
        # never exits. Woken first, it stops at once instead of after its current wait.
        _wake_notifier(self._ucxx)
        self._ucxx.stop_notifier_thread()


def _wake_notifier(ucxx: ModuleType) -> None:
    """End the wait of ucxx's Python-future notifier thread now: it looks for a shutdown
    request only between waits of up to 1 s (``ucxx/_lib_async/notifier_thread.py``), so each
    close (every worker's exit, every UCX test) took a second. Stopping the worker's request
    notifier returns that wait at once. ucxx offers no public call for it: where its private
    context is not as expected, nothing is done and closing takes up to that second again."""
    context = getattr(getattr(ucxx, "core", None), "_ctx", None)
    stop = getattr(getattr(context, "worker", None), "stop_request_notifier_thread", None)
    if stop is not None:
        stop()


_EMPTY = torch.empty(0, dtype=torch.uint8)
"""The zero-byte message that withdraws a receive (UCX completes it without writing)."""


class _UcxEndpoint(KvEndpoint):
    def __init__(self, raw, fill_futures_pool: Callable[[], None]) -> None:  # noqa: ANN001
        self._raw = raw  # ucxx.Endpoint, untyped
        self._fill_futures_pool = fill_futures_pool

    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        self._fill_futures_pool()
        try:
            source = _ucx_buffer(buffer)
            if buffer.device.type == "cuda":
                await Fence(torch.cuda.default_stream(buffer.device)).wait()  # docstring: CUDA
            await self._raw.send(source, tag=tag, force_tag=True)
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
    notifier thread). A sender offered every layer at once starts one request per layer (30
    and more), and a process moves several transfers at a time, which empties the pool between
    refills; ucxx then refills it inline and logs "No Futures available" for every
    such burst. Refilling before each request (a no-op while 50 or more are left) keeps
    worker logs clean. The worker object is reached through ucxx's private application
    context; where that is missing, this does nothing and ucxx's own refill remains.
    """
    context = getattr(getattr(ucxx, "core", None), "_get_ctx", None)
    worker = getattr(context() if context else None, "worker", None)
    populate = getattr(worker, "populate_python_futures_pool", None)
    return populate if populate is not None else (lambda: None)


def _ucx_buffer(buffer: torch.Tensor) -> object:
    """What ucxx accepts: a numpy view of host memory, the tensor itself on CUDA (through its
    ``__cuda_array_interface__``)."""
    if buffer.dtype != torch.uint8 or not buffer.is_contiguous():
        raise TypeError("transfer buffers are contiguous uint8 tensors")
    if buffer.device.type == "cpu":
        return buffer.numpy()
    if buffer.device.type != "cuda":  # ucxx takes host buffers and CUDA arrays only
        raise TypeError(f"transfer buffers live in host or CUDA memory, not {buffer.device}")
    return buffer
