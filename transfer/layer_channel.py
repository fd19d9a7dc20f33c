"""One request's KV, pushed layer by layer: ``LayerSender`` (prefill) and ``LayerReceiver``
(decode), on top of a ``KvTransport``.

The unit of transfer is one layer of one request: ``[2, num_blocks, block_size, kv_heads,
head_dim]`` (K then V of the prompt's blocks, contiguous), sent as one message tagged
``layer_tag(transfer_id, layer)``.

State machine of both sides (``TransferState``): PENDING -> ACTIVE -> DONE, or FAILED
(transport error, timeout) / ABORTED (cancelled locally) from PENDING or ACTIVE. Terminal
states never change. No wait is unbounded: ``LayerSender.finish`` and ``LayerReceiver.wait``
take a timeout, so a dead peer turns into ``TransferTimeoutError``.

Thread contract: ``LayerSender.offer`` may be called from the engine thread (it copies nothing
and hands the tensor to the loop); everything else runs on the transport's event loop. The
receiver scatters each landed layer with a caller-supplied function on a caller-supplied
executor; after ``abort()`` returns, that function is not running and will not run again, so
the caller may free the destination blocks.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import enum
from collections.abc import Callable

import torch

from splitserve.transfer.errors import (
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from splitserve.transfer.transport import KvEndpoint, KvTransport, layer_tag

_ORPHANED_BUFFERS: collections.deque[list[torch.Tensor]] = collections.deque(maxlen=64)
"""Receive buffers of aborted transfers, kept alive a while: a receive already posted to the
transport cannot be withdrawn, so a late message must still land in memory we own."""


class TransferState(enum.Enum):
    PENDING = "pending"
    ACTIVE = "active"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.ABORTED)


def as_transfer_bytes(kv: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 view of a KV tensor (copies only if ``kv`` is not contiguous)."""
    return kv.contiguous().view(-1).view(torch.uint8)


class LayerSender:
    """Sends the layers of one request to one peer as the engine produces them."""

    def __init__(
        self,
        endpoint: KvEndpoint,
        transfer_id: int,
        num_layers: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.transfer_id = transfer_id
        self.num_layers = num_layers
        self.state = TransferState.PENDING
        self.bytes_sent = 0
        self._endpoint = endpoint
        self._loop = loop
        self._sends: dict[int, asyncio.Task[None]] = {}
        self._all_offered = asyncio.Event()

    def offer(self, layer: int, kv: torch.Tensor) -> None:
        """Thread-safe: start sending ``kv`` (this request's blocks of ``layer``)."""
        self._loop.call_soon_threadsafe(self._start_send, layer, as_transfer_bytes(kv))

    def _start_send(self, layer: int, data: torch.Tensor) -> None:
        if self.state.is_terminal or layer in self._sends:
            return
        self.state = TransferState.ACTIVE
        tag = layer_tag(self.transfer_id, layer)
        self._sends[layer] = self._loop.create_task(self._endpoint.send(tag, data))
        self.bytes_sent += data.numel()
        if len(self._sends) == self.num_layers:
            self._all_offered.set()

    async def finish(self, timeout_s: float) -> int:
        """Wait until every layer was offered and sent; returns the bytes sent.

        Raises ``TransferTimeoutError`` (then the transfer is FAILED and its sends cancelled),
        ``TransferError`` for a transport failure, ``TransferAbortedError`` after ``abort``.
        """
        try:
            async with asyncio.timeout(timeout_s):
                await self._all_offered.wait()
                if self.state is TransferState.ABORTED:
                    raise TransferAbortedError(f"transfer {self.transfer_id} was aborted")
                await asyncio.gather(*self._sends.values())
        except TimeoutError:
            self._stop(TransferState.FAILED)
            raise TransferTimeoutError(
                f"transfer {self.transfer_id}: {len(self._sends)}/{self.num_layers} layers "
                f"offered, sends not complete after {timeout_s:.1f}s (peer gone?)"
            ) from None
        except TransferError:
            self._stop(TransferState.FAILED)
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.state is TransferState.ABORTED and task is not None and not task.cancelling():
                # abort() cancelled the sends we were gathering; the caller was not cancelled
                raise TransferAbortedError(f"transfer {self.transfer_id} was aborted") from None
            self._stop(TransferState.ABORTED)
            raise
        self.state = TransferState.DONE
        return self.bytes_sent

    def abort(self) -> None:
        """Cancel every send; a pending ``finish`` raises ``TransferAbortedError``."""
        self._stop(TransferState.ABORTED)

    def _stop(self, state: TransferState) -> None:
        if self.state.is_terminal:
            return
        self.state = state
        for task in self._sends.values():
            task.cancel()
        self._all_offered.set()


ScatterFn = Callable[[int, torch.Tensor], None]
"""``scatter(layer, data)``: store one landed layer (uint8, ``layer_nbytes``) in the cache."""


class LayerReceiver:
    """Receives the layers of one request into a ring of buffers and scatters each one."""

    def __init__(
        self,
        transport: KvTransport,
        transfer_id: int,
        num_layers: int,
        layer_nbytes: int,
        scatter: ScatterFn,
        executor: concurrent.futures.Executor,
        num_buffers: int = 2,
        device: torch.device | str = "cpu",
    ) -> None:
        self.transfer_id = transfer_id
        self.num_layers = num_layers
        self.layers_received = 0
        self.state = TransferState.PENDING
        self._transport = transport
        self._scatter = scatter
        self._executor = executor
        self._buffers = [
            torch.empty(layer_nbytes, dtype=torch.uint8, device=device)
            for _ in range(min(num_buffers, num_layers))
        ]
        self._scatter_job: concurrent.futures.Future[None] | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        ring = len(self._buffers)
        receives = {layer: asyncio.ensure_future(self._receive(layer)) for layer in range(ring)}
        try:
            for layer in range(self.num_layers):
                await receives.pop(layer)
                self.state = TransferState.ACTIVE
                buffer = self._buffers[layer % ring]
                self._scatter_job = self._executor.submit(self._scatter, layer, buffer)
                await asyncio.wrap_future(self._scatter_job)
                self.layers_received = layer + 1
                if layer + ring < self.num_layers:
                    receives[layer + ring] = asyncio.ensure_future(self._receive(layer + ring))
        finally:
            for pending in receives.values():
                pending.cancel()
        self.state = TransferState.DONE

    async def _receive(self, layer: int) -> None:
        buffer = self._buffers[layer % len(self._buffers)]
        await self._transport.recv(layer_tag(self.transfer_id, layer), buffer)

    async def wait(self, timeout_s: float) -> None:
        """Wait until every layer landed; ``TransferTimeoutError`` (FAILED) after the timeout."""
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            await self._stop(TransferState.FAILED)
            raise TransferTimeoutError(
                f"transfer {self.transfer_id}: {self.layers_received}/{self.num_layers} layers "
                f"arrived within {timeout_s:.1f}s (peer gone?)"
            ) from None
        except asyncio.CancelledError:
            if self._task.cancelled() or self.state is TransferState.ABORTED:
                raise TransferAbortedError(f"transfer {self.transfer_id} was aborted") from None
            raise
        except Exception as error:  # transport or scatter failure: end FAILED, never ACTIVE
            await self._stop(TransferState.FAILED)
            if isinstance(error, TransferError):
                raise
            raise TransferError(f"transfer {self.transfer_id} failed: {error}") from error

    async def abort(self) -> None:
        """Stop receiving; on return no scatter is running and none will start."""
        await self._stop(TransferState.ABORTED)

    async def _stop(self, state: TransferState) -> None:
        if not self.state.is_terminal:
            self.state = state
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        job = self._scatter_job
        if job is not None and not job.cancel():
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(job)
        if state is not TransferState.DONE and self.layers_received < self.num_layers:
            _ORPHANED_BUFFERS.append(self._buffers)
