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
executor (runs of consecutive landed layers in one job); after ``abort()`` returns, that
function is not running and will not run again, so the caller may free the destination blocks.
The receiver's ring buffers are leased from a ``BufferPool`` (reused across transfers: already
faulted in and registered) and go back to it only once no receive can land in them any more
(``LayerReceiver``'s buffer invariant).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import functools
from collections.abc import Callable

import torch

from splitserve.transfer.buffer_pool import BufferPool, process_buffer_pool
from splitserve.transfer.errors import (
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from splitserve.transfer.transport import KvEndpoint, KvTransport, layer_tag

_ORPHANED_BUFFERS: list[torch.Tensor] = []
"""Receive buffers never to be reused: their receive was cancelled (only a loop shut down under
it does that), and a receive posted to UCX cannot be withdrawn, so a late message may still
land in them. Kept for the life of the process."""
_UNSETTLED_RECEIVES: set[asyncio.Future[None]] = set()
"""Receives still posted by finished receivers (kept alive here until they settle, when their
buffer goes back to the pool)."""


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


RECEIVE_WINDOW_BYTES = 16 << 20
"""Receive buffer bytes a transfer keeps posted by default (its ring: at least 2 buffers, at
most one per layer), leased from the pool from the receiver's creation (the reservation) to
its end. A UCX receive took ~1-2 ms from posting to completion on the 2-core dev machine even
with its message already waiting (progress thread, notifier thread, event loop hops), so with
two buffers a transfer of small layers is latency-bound: 30 layers of a 128-token prompt
moved at 0.25 GB/s with 2 buffers, ~1 GB/s with all 30 posted."""


def ring_size(num_layers: int, layer_nbytes: int, window_bytes: int = RECEIVE_WINDOW_BYTES) -> int:
    """Receive buffers for a transfer: ``window_bytes`` worth, at least 2, at most one per
    layer."""
    wanted = -(-window_bytes // max(layer_nbytes, 1))
    return min(num_layers, max(2, wanted))


class LayerReceiver:
    """Receives the layers of one request into a ring of pooled buffers and scatters them.

    The ring keeps up to ``num_buffers`` receives posted (layer ``l`` lands in buffer
    ``l % num_buffers``); layers are scattered in order, each run of consecutive landed
    layers by one executor job, and a buffer's next receive is posted as soon as its layer
    was scattered.

    Buffer invariant: a ring buffer goes back to its pool only when (a) the receiver is done
    with it (every layer scattered, or stopped with no scatter running) and (b) no receive
    posted into it can still land in it. A receive posted to UCX cannot be withdrawn (ucxx has
    no per-request cancel), so the receiver never cancels its receives: when it ends FAILED or
    ABORTED, a receive still posted stays posted and returns its buffer to the pool when it
    completes (a late message landed) or fails (the transport was torn down). A receive
    cancelled by someone else (a loop shut down under it) may not have been withdrawn: its
    buffer is never reused, it stays in ``_ORPHANED_BUFFERS`` for the life of the process.
    """

    def __init__(
        self,
        transport: KvTransport,
        transfer_id: int,
        num_layers: int,
        layer_nbytes: int,
        scatter: ScatterFn,
        executor: concurrent.futures.Executor,
        num_buffers: int | None = None,
        pool: BufferPool | None = None,
    ) -> None:
        """``num_buffers``: ring size (default ``ring_size``: ``RECEIVE_WINDOW_BYTES`` worth);
        ``pool``: where the ring buffers come from (default: the process's host pool)."""
        self.transfer_id = transfer_id
        self.num_layers = num_layers
        self.state = TransferState.PENDING
        self._transport = transport
        self._scatter = scatter
        self._executor = executor
        self._pool = pool if pool is not None else process_buffer_pool()
        if num_buffers is None:
            num_buffers = ring_size(num_layers, layer_nbytes)
        if num_buffers < 1:
            raise ValueError(f"a receiver needs at least one buffer, got {num_buffers}")
        # ring slot -> [layer_nbytes] uint8, leased from the pool
        self._buffers = [
            self._pool.acquire(layer_nbytes) for _ in range(min(num_buffers, num_layers))
        ]
        self._receives: dict[int, asyncio.Future[None]] = {}  # layer -> posted, not scattered
        self._posted: dict[int, asyncio.Future[None]] = {}  # slot -> its latest receive
        self._num_posted = 0  # receives are posted in layer order
        self._finished = False  # no scatter runs or will run: settled buffers may go back
        self._disowned: set[int] = set()  # slots whose buffer was released or orphaned
        self._scatter_job: concurrent.futures.Future[None] | None = None
        self._scattered = 0  # written by scatter jobs only
        self._stopping = False  # read by scatter jobs: stop before the next layer
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())

    @property
    def layers_received(self) -> int:
        """Layers landed and scattered so far (all of them once DONE)."""
        return self._scattered

    async def _run(self) -> None:
        self._post_through(len(self._buffers))
        try:
            first = 0
            while first < self.num_layers:
                self._post_through(first + 1)  # a no-op: the scatter of first - ring posted it
                await asyncio.shield(self._receives[first])  # cancelling _run leaves it posted
                end = first + 1
                while end < self._num_posted and self._receives[end].done():
                    end += 1
                for layer in range(first, end):
                    self._receives.pop(layer).result()  # a failed receive fails the transfer
                self.state = TransferState.ACTIVE
                self._scatter_job = self._executor.submit(self._scatter_layers, first, end)
                await asyncio.wrap_future(self._scatter_job)
                first = end
        except asyncio.CancelledError:
            raise  # _stop returns the buffers once the scatter in flight has returned
        except BaseException:
            self._return_buffers()  # nothing is scattering: the failure came from an await
            raise
        self._return_buffers()
        self.state = TransferState.DONE

    def _scatter_layers(self, first: int, end: int) -> None:
        """Executor: scatter the landed layers ``first..end-1`` in order, each freed buffer's
        next receive posted at once (by the loop); returns early once the receiver stops."""
        ring = len(self._buffers)
        for layer in range(first, end):
            if self._stopping:
                return
            self._scatter(layer, self._buffers[layer % ring])
            self._scattered = layer + 1
            if layer + ring < self.num_layers:
                self._loop.call_soon_threadsafe(self._post_through, layer + ring + 1)

    def _post_through(self, end: int) -> None:
        """Post, in layer order, the receives of the layers before ``end`` not posted yet
        (each into its ring slot, whose previous layer was scattered); none once stopping."""
        if self._stopping or self._finished:
            return
        ring = len(self._buffers)
        while self._num_posted < min(end, self.num_layers):
            layer, slot = self._num_posted, self._num_posted % ring
            tag = layer_tag(self.transfer_id, layer)
            receive = asyncio.ensure_future(self._transport.recv(tag, self._buffers[slot]))
            receive.add_done_callback(functools.partial(self._on_receive_settled, slot))
            self._receives[layer] = receive
            self._posted[slot] = receive
            self._num_posted += 1

    def _on_receive_settled(self, slot: int, receive: asyncio.Future[None]) -> None:
        _UNSETTLED_RECEIVES.discard(receive)
        if receive.cancelled():
            self._disown(slot, reusable=False)
            return
        receive.exception()  # retrieved: _run reports the failures of receives it awaits
        if self._finished and self._posted.get(slot) is receive:
            self._disown(slot, reusable=True)

    def _return_buffers(self) -> None:
        """Called once no scatter runs or will run: give back every buffer no receive can land
        in any more; the others go back when their receive settles (the buffer invariant)."""
        self._finished = True
        for slot in range(len(self._buffers)):
            receive = self._posted.get(slot)
            if receive is not None and not receive.done():
                _UNSETTLED_RECEIVES.add(receive)  # its callback gives the buffer back
            else:
                self._disown(slot, reusable=receive is None or not receive.cancelled())

    def _disown(self, slot: int, reusable: bool) -> None:
        if slot in self._disowned:
            return
        self._disowned.add(slot)
        if reusable:
            self._pool.release(self._buffers[slot])
        else:
            _ORPHANED_BUFFERS.append(self._buffers[slot])

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
        self._stopping = True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        job = self._scatter_job
        if job is not None and not job.cancel():
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(job)
        self._return_buffers()
