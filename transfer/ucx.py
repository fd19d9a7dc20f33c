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
"""

from __future__ import annotations

import asyncio
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
                peer = self._ucxx.get_ucx_address_from_buffer(address)
                try:
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
        self._futures_pool()
        try:
            await self._ucxx.recv(_ucx_buffer(buffer), tag=tag)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            raise TransferError(f"UCX receive of tag {tag:#x} failed: {error}") from error

    async def withdraw(self, tag: int) -> None:
        own = await self.connect(self._address)  # cached like any peer's endpoint
        await own.send(tag, _EMPTY)

    async def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.abort()
        self._endpoints.clear()
        # The notifier thread behind Python futures is not a daemon: stop it or the process
        # never exits.
        self._ucxx.stop_notifier_thread()


_EMPTY = torch.empty(0, dtype=torch.uint8)
"""The zero-byte message that withdraws a receive (UCX completes it without writing)."""


class _UcxEndpoint(KvEndpoint):
    def __init__(self, raw, fill_futures_pool: Callable[[], None]) -> None:  # noqa: ANN001
        self._raw = raw  # ucxx.Endpoint, untyped
        self._fill_futures_pool = fill_futures_pool

    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        self._fill_futures_pool()
        try:
            await self._raw.send(_ucx_buffer(buffer), tag=tag, force_tag=True)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            raise TransferError(f"UCX send of tag {tag:#x} failed: {error}") from error

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
