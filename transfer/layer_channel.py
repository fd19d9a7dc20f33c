"""One request's KV, pushed layer by layer as one tagged message per group of layers (one
layer unless the receiver's plan asks for more, ``plan.py``: Groups): ``LayerSender``
(prefill) and ``LayerReceiver`` (decode), on top of a ``KvTransport``.

The sender gets the prompt's blocks of one layer as ``[2, num_blocks, ...]`` in the plan's
``block_order`` (one contiguous tensor, ``kv_io.gather_layer``, into the layer's row of a
staging buffer) and, once every layer of its group came, sends the group as it lies, tag
``message_tag(secret, m)`` for group ``m`` (``plan.py``): a transfer is ``layers /
layers_per_message`` messages whatever the number of runs its destination has.

The receiver lands each message in its ``KvDestination``: straight, when the destination is
one contiguous region (``KvDestination.whole``: every message's receive is posted at once),
else through a *staging ring* (``staging.py``): message ``n`` is received into slot ``n %
depth``; once its receive completed, the receiver copies the slot into its layers' blocks
(``KvDestination.scatter``) and posts the receive of message ``n + depth`` into the same slot,
in the receive's own task. A message sent before its receive is posted waits: at the sender (UCX
rendezvous moves no data before the receive is posted) or, below UCX's eager threshold, as a
copy in UCX's unexpected-message queue.

Staging memory, per receiving transfer: its ring, at most ``max(staging.STAGING_BYTES, 2
messages)`` (32 MiB: all 30 layers of a 1,024-token prompt of the default model; on a GPU
``staging.DEVICE_STAGING_BYTES``, 128 MiB: all 8 messages of 16 MiB of a 1,024-token Llama-8B
prompt), made with the receiver, or only two messages of it while the process's rings hold
``staging.EAGER_BYTES`` already (the rest once its first message landed); released once
settled (host slots are kept for reuse, ``staging.KEEP_BYTES`` per process). None for a
straight destination. On CUDA it is device memory, and the copy out of it a device copy
queued on the transfer stream (``device_order.py``).

Sizes: a message must fill its buffer exactly. A longer one fails its receive in the transport;
a shorter one UCX completes silently (``ucx.py``, Sizes), so the receiver checks every message
with a canary (``canary.py``), armed in the tail of the message's buffer before its receive is
posted and read back once it completed. Guarantee: no layer counts as received, and the
transfer never ends DONE, when a message stopped at least 8 bytes short of its size (an empty
one included): it fails the transfer with a ``TransferError`` naming the message's layers
("layer n: ... has at most m bytes", "layers 4-7: ...") as soon as that receive completed,
whatever message the receiver is waiting for. A message 1 to 7 bytes short passes
(``canary.py``, Limits). A receive the transport fails (a longer message), whatever its
message, fails the transfer at once, naming its layers. A short message may have been copied
into its blocks before its check: a failed transfer's blocks hold no KV anyone may use (the
decode worker gives them back without a prefix hash), as a short message received straight
into them did.

No synchronous device round trip per message: on CUDA the canary copies and the copy out of
staging are queued on the transfer stream, and a layer's receive task waits, off the event
loop, for the one fence it needs anyway before it reuses the slot (``device_order.Fence``).

Cost on the CPU (``bench/bench_kv_transfer.py``, 2-core Zen 5 VM, shared memory, medians of 5
interleaved runs against the previous format, which received the K and the V of each run
straight into the cache, ``bench/results/kv-transfer-2026-11-29-one-message.json``): the copy
out of staging is a second memcpy of every byte on the receiver, so big contiguous layers lost
(a 1,024-token prompt of the default model 5.51 -> 4.49 GB/s, 4,096 tokens 9.93 -> 6.72, one
64 MiB layer 12.94 -> 6.78) and fragmented or small ones gained (the 1,024-token prompt in 4
runs 2.67 -> 4.47 GB/s, 240 -> 30 messages; 128 tokens 0.94 -> 1.11). In serving the push
overlaps the prefill's compute layer by layer, and what is exposed is one layer's transfer and
copy. On a GPU that copy runs at device bandwidth; what this format removes there is the
per-message cost (36-56 us a message on the H200 before, two synchronous canary copies among
it).

State machine of both sides (``TransferState``): PENDING -> ACTIVE -> DONE, or FAILED
(transport error, size error, timeout) / ABORTED (cancelled locally) from PENDING or ACTIVE.
Terminal states never change. No wait is unbounded: ``LayerSender.finish`` and
``LayerReceiver.wait`` take a timeout, so a dead peer turns into ``TransferTimeoutError``.

Tags: message ``m`` of a transfer travels under ``plan.message_tag(transfer_secret, m)``; the
``transfer_id`` only names the transfer in errors and logs.

Thread contract: ``LayerSender.offer`` may be called from the engine thread (it copies nothing
and hands the tensor to the loop; a group whose parts are not adjacent is joined there, on the
loop); everything else runs on the transport's event loop.

Destination invariant: once a ``LayerReceiver`` is terminal and ``settled`` is True, nothing
of its transfer writes into its destination (nor its staging) any more: no receive is still
posted and no scatter is queued or running, so the owner may reuse that memory. A stopped
receiver scatters and posts nothing more. A receive cannot be cancelled, so a stopping
receiver *withdraws* each posted receive no message matched yet (``KvTransport.withdraw``) and
waits, bounded by ``SETTLE_TIMEOUT_S``, until all of them settled and its last scatter ran.
``settled`` stays False only if some receive is still in flight then (a message matched but
its data has not come): the owner must not reuse that memory before ``until_settled``
returns, which may be never.
"""

from __future__ import annotations

import asyncio
import enum
import logging

import torch

from splitserve.common.errors import (
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from splitserve.transfer.canary import LayerCanaries
from splitserve.transfer.destination import KvDestination
from splitserve.transfer.device_order import Fence, follow_current, on_stream, transfer_stream
from splitserve.transfer.plan import TransferPlan, message_tag
from splitserve.transfer.staging import StagingRing, ring_depth
from splitserve.transfer.transport import KvEndpoint, KvTransport

logger = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 5.0
"""How long a stopping receiver waits for its withdrawn or in-flight receives to settle."""


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


def layer_message(plan: TransferPlan, kv: torch.Tensor) -> torch.Tensor:
    """One layer's message: ``kv`` is ``[2, num_blocks, ...]`` with its blocks in
    ``plan.block_order``; a contiguous uint8 view of it (no copy when ``kv`` is contiguous)."""
    if kv.dim() < 2 or kv.shape[0] != 2 or kv.shape[1] != plan.num_blocks:
        raise ValueError(f"expected [2, {plan.num_blocks}, ...] KV, got {tuple(kv.shape)}")
    return as_transfer_bytes(kv)


class LayerSender:
    """Sends the layers of one request to one peer as the engine produces them: one message
    per group of ``plan.layers_per_message`` layers, sent once its last layer was offered.

    A group's parts go as they lie when they are adjacent in memory (the views of one staging
    buffer ``[layers, 2, num_blocks, ...]`` that the workers gather into), else joined by a
    copy."""

    def __init__(
        self,
        endpoint: KvEndpoint,
        transfer_id: int,
        transfer_secret: bytes,
        num_layers: int,
        plan: TransferPlan,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.transfer_id = transfer_id
        self._secret = transfer_secret
        self.num_layers = num_layers
        self.plan = plan
        self.num_messages = plan.messages_for(num_layers)
        self.state = TransferState.PENDING
        self.bytes_sent = 0
        self.messages_sent = 0
        """Messages handed to the endpoint (one per group whose layers were offered in time)."""
        self._endpoint = endpoint
        self._loop = loop
        self._offered: set[int] = set()  # layers offered
        self._parts: dict[int, torch.Tensor] = {}  # layer -> its part, until its group leaves
        self._sends: dict[int, asyncio.Future[None]] = {}  # message -> its send
        self._all_offered = asyncio.Event()

    def offer(self, layer: int, kv: torch.Tensor) -> None:
        """Thread-safe: start sending ``kv`` (``[2, num_blocks, ...]``: this request's blocks of
        ``layer`` in ``plan.block_order``). Its message leaves once every layer of its group
        was offered; a layer offered again is ignored."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} of a transfer of {self.num_layers} layers")
        self._loop.call_soon_threadsafe(self._start_send, layer, layer_message(self.plan, kv))

    def _start_send(self, layer: int, part: torch.Tensor) -> None:
        if self.state.is_terminal or layer in self._offered:
            return
        self.state = TransferState.ACTIVE
        self._offered.add(layer)
        self._parts[layer] = part
        index = layer // self.plan.layers_per_message
        layers = self.plan.layers_of(index)
        if any(other not in self._parts for other in layers):
            return  # the group's message leaves with its last layer
        message = _joined([self._parts.pop(other) for other in layers])
        send = asyncio.ensure_future(self._endpoint.send(message_tag(self._secret, index), message))
        send.add_done_callback(_retrieve)  # stopped sends nobody awaits log nothing
        self._sends[index] = send
        self.messages_sent += 1
        self.bytes_sent += message.numel()
        if len(self._sends) == self.num_messages:
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
                f"transfer {self.transfer_id}: {len(self._offered)}/{self.num_layers} layers "
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


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous uint8 tensor of ``parts`` (each contiguous uint8) in their order: a view
    of their memory where each starts where the one before ends in one storage, else a copy
    (on CUDA queued on the current stream, which the send waits for)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    storage = first.untyped_storage().data_ptr()
    adjacent = all(
        part.untyped_storage().data_ptr() == storage
        and part.data_ptr() == before.data_ptr() + before.numel()
        for before, part in zip(parts, parts[1:], strict=False)
    )
    if not adjacent:
        return torch.cat(parts)
    return first.as_strided((sum(part.numel() for part in parts),), (1,))


def _retrieve(send: asyncio.Future[None]) -> None:
    """Mark a layer's send's failure as seen: ``finish`` raises what matters, and a transfer
    stopped before ``finish`` awaited every layer would otherwise leave asyncio's "exception
    was never retrieved" in the log for each of them."""
    if not send.cancelled():
        send.exception()


class LayerReceiver:
    """Receives the layers of one request into ``destination``, one message per group of
    ``destination.plan.layers_per_message`` layers (see the module docstring: straight or
    through the staging ring, canaries, settling).

    The first receives (every message's when straight, one per slot made of the ring through
    staging) are posted when the receiver's task first runs, after the fence that orders their
    canaries (at once on the CPU); each later one when the message before it in its slot
    landed. A message's layers count as received once it landed in their blocks and passed its
    size check; the transfer is DONE when every message did.
    """

    def __init__(
        self,
        transport: KvTransport,
        transfer_id: int,
        transfer_secret: bytes,
        destination: KvDestination,
    ) -> None:
        self.transfer_id = transfer_id
        self.num_layers = destination.num_layers
        self.num_messages = destination.num_messages
        self.state = TransferState.PENDING
        self.settled = False
        """True once nothing of this transfer can write into its destination any more."""
        self._transport = transport
        self._secret = transfer_secret
        self._destination = destination
        self._layers_received = 0
        loop = asyncio.get_running_loop()
        self._first_failure: asyncio.Future[asyncio.Future[None]] = loop.create_future()
        """Set to the first receive that failed: the transfer fails at once, whatever layer."""
        self._receives: dict[int, tuple[int, asyncio.Future[None]]] = {}
        """Message -> its tag and receive, for each message posted so far."""
        device, size = destination.device, destination.message_bytes
        self._canaries = LayerCanaries(self.num_messages, size, device)
        self._straight = self.num_messages == 0 or destination.whole(0) is not None
        on_gpu = device.type == "cuda"
        depth = ring_depth(self.num_messages, size, on_gpu)
        self._depth = self.num_messages if self._straight else depth
        self._ring: StagingRing | None = None  # through staging, until settled
        if not self._straight:
            self._ring = StagingRing(self._depth, size, device)
        self._first_posted = self._depth if self._ring is None else self._ring.made
        self._stream = transfer_stream(device)
        follow_current(self._stream, device)  # staging, destination and canaries made there
        with on_stream(self._stream):
            for message in range(self._first_posted):
                self._canaries.arm(message, self._buffer(message))
            self._fence = Fence(self._stream)
            """The transfer's device work so far (canaries, scatters) on its stream."""
        self._task = loop.create_task(self._run())
        self._settle_task: asyncio.Task[None] | None = None

    @property
    def layers_received(self) -> int:
        """Layers 0..n-1 that landed in their blocks and passed their size check, counted in
        layer order (all of them once DONE)."""
        return self._layers_received

    @property
    def receives_posted(self) -> int:
        """Receives posted so far: at most one per message."""
        return len(self._receives)

    def _buffer(self, message: int) -> torch.Tensor:
        """Where ``message`` is received: its destination, or its slot of the ring (while the
        receiver holds it: until settled)."""
        if self._ring is not None:
            return self._ring.slot(message)
        whole = self._destination.whole(message)
        assert whole is not None, "a receiver through staging has no buffer once settled"
        return whole

    def _named(self, message: int) -> str:
        """The layers ``message`` carries, as errors name them ("layer 3", "layers 4-7")."""
        layers = self._destination.plan.layers_of(message)
        if len(layers) == 1:
            return f"layer {layers.start}"
        return f"layers {layers.start}-{layers.stop - 1}"

    def _post(self, message: int) -> None:
        tag = message_tag(self._secret, message)
        receive = asyncio.ensure_future(self._receive(message, tag, self._buffer(message)))
        receive.add_done_callback(self._note_failure)
        self._receives[message] = (tag, receive)

    async def _receive(self, message: int, tag: int, buffer: torch.Tensor) -> None:
        """One message's receive, then its landing (``_land``); a transport failure (a longer
        message among them) or a short message becomes a ``TransferError`` naming its
        layers."""
        try:
            await self._transport.recv(tag, buffer)
        except TransferError as error:
            failure = f"transfer {self.transfer_id}: {self._named(message)}: {error}"
        else:
            short = await self._land(message, buffer)
            if short is None:
                return
            failure = short
        raise TransferError(failure)  # outside the except: no chained UCX error keeps frames

    async def _land(self, message: int, buffer: torch.Tensor) -> str | None:
        """After ``message`` came into ``buffer``, unless the receiver stopped: read its
        canary, copy it into its blocks (through staging), arm the canary of the message that
        takes the slot next, wait for that work's fence, check the size and post that next
        message's receive. Returns the failure's text for a short message, else None.

        Here, in the receive's own task, so that the next receive into the slot is posted
        without another trip through the event loop; a stopped receiver copies and posts
        nothing more, and its settling waits for this task (so for its fence)."""
        if self.state.is_terminal:
            return None
        following = message + self._depth  # the next message into this buffer, if any
        grown = self._ring.grow() if self._ring is not None else range(0)
        with on_stream(self._stream):
            self._canaries.read(message, buffer)
            if not self._straight:
                self._destination.scatter(message, buffer)
            for later in [*grown, following]:
                if later < self.num_messages:
                    self._canaries.arm(later, self._buffer(later))
            self._fence = fence = Fence(self._stream)  # covers every earlier one (one stream)
        await fence.wait()
        if self._canaries.short(message):
            return self._short_message(message)
        for later in [*grown, following]:
            if later < self.num_messages and not self.state.is_terminal:
                self._post(later)
        return None

    def _all_receives(self) -> list[asyncio.Future[None]]:
        return [receive for _, receive in self._receives.values()]

    def _note_failure(self, receive: asyncio.Future[None]) -> None:
        if receive.cancelled() or receive.exception() is None or self._first_failure.done():
            return
        self._first_failure.set_result(receive)

    async def _run(self) -> None:
        await self._fence.wait()  # the first buffers' canaries are in place
        for message in range(self._first_posted):
            self._post(message)
        for message in range(self.num_messages):
            await self._landed(message)  # posted when message - depth landed, before it returned
            self._layers_received = self._destination.plan.layers_of(message).stop
            self.state = TransferState.ACTIVE
        self._note_settled()  # every receive returned, the last copy ran: True
        self.state = TransferState.DONE

    async def _landed(self, message: int) -> None:
        """Return once ``message``'s receive landed (``_land``); raise the first failed
        receive's error (whatever its message) as soon as there is one."""
        _, receive = self._receives[message]
        if not receive.done():
            # asyncio.wait cancels nothing: a stop cancelling _run leaves receives posted
            await asyncio.wait((receive, self._first_failure), return_when=asyncio.FIRST_COMPLETED)
        if self._first_failure.done():
            self._first_failure.result().result()  # raises that receive's error
        receive.result()

    def _short_message(self, message: int) -> str:
        tag, _ = self._receives[message]
        size, canary = self._destination.message_bytes, self._canaries.size
        return (
            f"transfer {self.transfer_id}: {self._named(message)}: message tagged {tag:#x} has "
            f"at most {size - canary} bytes, receive buffer {size} (its last {canary} bytes "
            "were not written)"
        )

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
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller was cancelled, not the transfer
            if self.state is TransferState.FAILED and self._task.cancelled():
                raise TransferError(f"transfer {self.transfer_id} had failed") from None
            if self._task.cancelled() or self.state is TransferState.ABORTED:
                raise TransferAbortedError(f"transfer {self.transfer_id} was aborted") from None
            raise
        except Exception as error:  # a receive failed: end FAILED, never ACTIVE
            await self._stop(TransferState.FAILED)
            if isinstance(error, TransferError):
                raise
            raise TransferError(f"transfer {self.transfer_id} failed: {error}") from error

    async def abort(self) -> None:
        """Stop receiving; on return the receiver is terminal and, if ``settled``, nothing of
        its transfer can write into its destination any more."""
        await self._stop(TransferState.ABORTED)

    async def _stop(self, state: TransferState) -> None:
        if not self.state.is_terminal:
            self.state = state
        self._task.cancel()  # no scatter nor post after this: _run is the only one to do them
        await asyncio.gather(self._task, return_exceptions=True)
        if self.settled:
            return
        if self._settle_task is None:  # once: concurrent stops share one withdrawal
            self._settle_task = asyncio.get_running_loop().create_task(self._settle())
        await asyncio.shield(self._settle_task)

    async def _settle(self) -> None:
        """Withdraw every receive no message completed yet, then wait until all settled and the
        last scatter ran; all within ``SETTLE_TIMEOUT_S``."""
        pending = [(tag, receive) for tag, receive in self._receives.values()]
        pending = [(tag, receive) for tag, receive in pending if not receive.done()]
        try:
            async with asyncio.timeout(SETTLE_TIMEOUT_S):
                withdrawals = await asyncio.gather(
                    *(self._transport.withdraw(tag) for tag, _ in pending),
                    return_exceptions=True,
                )
                for error in withdrawals:
                    if isinstance(error, BaseException):
                        logger.warning(
                            "transfer %d: a withdrawal failed: %r", self.transfer_id, error
                        )
                if pending:
                    await asyncio.wait([receive for _, receive in pending])
                await self._fence.wait()
        except TimeoutError:
            pass
        self._note_settled()
        if not self.settled:
            logger.error(
                "transfer %d: receives still posted %.1fs after withdrawal; their destination "
                "must not be reused until they settle",
                self.transfer_id,
                SETTLE_TIMEOUT_S,
            )

    def _note_settled(self) -> None:
        receives = self._all_receives()
        for receive in receives:
            if receive.done() and not receive.cancelled():
                receive.exception()  # retrieved: the failure was reported (or is moot)
        # a receive cancelled under us (a loop shut down) may still be posted: not settled
        landed = all(receive.done() and not receive.cancelled() for receive in receives)
        self.settled = landed and self._fence.passed()
        if self.settled and self._ring is not None:
            self._ring.release()  # nothing writes or reads it any more
            self._ring = None

    async def until_settled(self) -> None:
        """After a stop that left receives in flight: wait, unbounded, until each settled (a
        cancelled one never counts) and the last scatter ran; then ``settled`` is True."""
        while not self.settled:
            receives = [receive for receive in self._all_receives() if not receive.done()]
            if receives:
                await asyncio.wait(receives)
            await self._fence.wait()
            self._note_settled()
            if not self.settled:  # only cancelled receives are left: they never settle
                await asyncio.Event().wait()
