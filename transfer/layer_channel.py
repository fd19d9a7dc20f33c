"""One request's KV, pushed layer by layer: ``LayerSender`` (prefill) and ``LayerReceiver``
(decode), on top of a ``KvTransport``.

The receiver posts every receive up front, straight into the destination memory (the decode
worker's reserved KV blocks): no staging buffer, no scatter copy. A ``TransferPlan`` cuts each
layer into messages that are contiguous there (K or V of a run of consecutive blocks); the
sender gets the prompt's blocks of one layer as ``[2, num_blocks, ...]`` in the plan's
``block_order`` and sends each message as a slice of it.

State machine of both sides (``TransferState``): PENDING -> ACTIVE -> DONE, or FAILED
(transport error, timeout) / ABORTED (cancelled locally) from PENDING or ACTIVE. Terminal
states never change. No wait is unbounded: ``LayerSender.finish`` and ``LayerReceiver.wait``
take a timeout, so a dead peer turns into ``TransferTimeoutError``.

Tags: message ``i`` of a transfer travels under ``plan.message_tag(transfer_secret, i)``; the
``transfer_id`` only names the transfer in errors and logs.

Sizes: every message must fill its destination exactly. The transport checks each received
message's size (``KvTransport.recv``; UCX misses only a message 1 to 7 bytes short, see
``ucx.py``); a receive that fails, whatever its layer, fails the whole transfer at once with a
``TransferError`` naming the message (index and layer), so a short message never counts as
landed.

Thread contract: ``LayerSender.offer`` may be called from the engine thread (it copies nothing
and hands the tensor to the loop); everything else runs on the transport's event loop.

Destination invariant: once a ``LayerReceiver`` is terminal and ``settled`` is True, no message
can land in its destinations any more, so their owner may reuse them. A receive cannot be
cancelled, so a stopping receiver *withdraws* each receive no message matched yet (see
``KvTransport.withdraw``) and waits, bounded by ``SETTLE_TIMEOUT_S``, until all of them
settled. ``settled`` stays False only if some receive is still in flight then (a message
matched but its data has not come): the owner must not reuse that memory before
``until_settled`` returns, which may be never.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence

import torch

from splitserve.common.errors import (
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from splitserve.transfer.plan import TransferPlan, message_tag
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


def layer_messages(plan: TransferPlan, kv: torch.Tensor) -> list[torch.Tensor]:
    """One layer's messages in plan order: ``kv`` is ``[2, num_blocks, ...]`` with its blocks
    in ``plan.block_order``; message ``kv * num_runs + run`` is the K (kv=0) or V (kv=1) of one
    run, a contiguous uint8 view (no copy when ``kv`` is contiguous)."""
    if kv.dim() < 2 or kv.shape[0] != 2 or kv.shape[1] != plan.num_blocks:
        raise ValueError(f"expected [2, {plan.num_blocks}, ...] KV, got {tuple(kv.shape)}")
    kv = kv.contiguous()
    return [
        as_transfer_bytes(kv[half, offset : offset + length])
        for half in range(2)
        for offset, length in zip(plan.run_offsets(), plan.run_lengths, strict=True)
    ]


class LayerSender:
    """Sends the layers of one request to one peer as the engine produces them."""

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
        self.state = TransferState.PENDING
        self.bytes_sent = 0
        self._endpoint = endpoint
        self._loop = loop
        self._sends: dict[int, asyncio.Future[list[None]]] = {}  # layer -> its messages' sends
        self._all_offered = asyncio.Event()

    def offer(self, layer: int, kv: torch.Tensor) -> None:
        """Thread-safe: start sending ``kv`` (``[2, num_blocks, ...]``: this request's blocks of
        ``layer`` in ``plan.block_order``)."""
        self._loop.call_soon_threadsafe(self._start_send, layer, layer_messages(self.plan, kv))

    def _start_send(self, layer: int, messages: list[torch.Tensor]) -> None:
        if self.state.is_terminal or layer in self._sends:
            return
        self.state = TransferState.ACTIVE
        first = self.plan.message_index(layer, 0, 0)
        sends = asyncio.gather(
            *(
                self._endpoint.send(message_tag(self._secret, first + index), message)
                for index, message in enumerate(messages)
            )
        )
        sends.add_done_callback(_retrieve)  # stopped sends nobody awaits log nothing
        self._sends[layer] = sends
        self.bytes_sent += sum(message.numel() for message in messages)
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


def _retrieve(sends: asyncio.Future[list[None]]) -> None:
    """Mark a layer's sends' failure as seen: ``finish`` raises what matters, and a transfer
    stopped before ``finish`` awaited every layer would otherwise leave asyncio's "exception
    was never retrieved" in the log for each of them."""
    if not sends.cancelled():
        sends.exception()


class LayerReceiver:
    """Receives the layers of one request straight into their destinations.

    ``destinations[layer][i]`` is where message ``i`` of ``layer`` lands (plan order: K of each
    run, then V of each run; contiguous uint8, exactly the message's size). Every receive is
    posted at construction. A layer counts as received when all its messages landed; the
    transfer is DONE when every layer did.
    """

    def __init__(
        self,
        transport: KvTransport,
        transfer_id: int,
        transfer_secret: bytes,
        plan: TransferPlan,
        destinations: Sequence[Sequence[torch.Tensor]],
    ) -> None:
        for layer, buffers in enumerate(destinations):
            if len(buffers) != plan.messages_per_layer:
                raise ValueError(
                    f"layer {layer} has {len(buffers)} destinations, the plan "
                    f"{plan.messages_per_layer} messages"
                )
        self.transfer_id = transfer_id
        self.num_layers = len(destinations)
        self.state = TransferState.PENDING
        self.settled = False
        """True once no receive of this transfer can write into its destinations any more."""
        self._transport = transport
        self._layers_received = 0
        loop = asyncio.get_running_loop()
        self._first_failure: asyncio.Future[asyncio.Future[None]] = loop.create_future()
        """Set to the first receive that failed: the transfer fails at once, whatever layer."""
        # layer -> its messages' receives, posted now (each task posts when it first runs)
        self._receives: list[list[tuple[int, asyncio.Future[None]]]] = []
        for layer, buffers in enumerate(destinations):
            first = plan.message_index(layer, 0, 0)
            posted = []
            for index, buffer in enumerate(buffers):
                tag = message_tag(transfer_secret, first + index)
                receive = asyncio.ensure_future(self._receive(first + index, layer, tag, buffer))
                receive.add_done_callback(self._note_failure)
                posted.append((tag, receive))
            self._receives.append(posted)
        self._task = loop.create_task(self._run())
        self._settle_task: asyncio.Task[None] | None = None

    @property
    def layers_received(self) -> int:
        """Layers 0..n-1 whose every message landed, counted in layer order (all of them once
        DONE)."""
        return self._layers_received

    async def _receive(self, index: int, layer: int, tag: int, buffer: torch.Tensor) -> None:
        """One message's receive; a transport failure (a message of another size among them)
        becomes a ``TransferError`` naming the message."""
        try:
            await self._transport.recv(tag, buffer)
        except TransferError as error:
            message = f"transfer {self.transfer_id}: message {index} (layer {layer}): {error}"
        else:
            return
        raise TransferError(message)  # outside the except: no chained UCX error keeps frames

    def _all_receives(self) -> list[asyncio.Future[None]]:
        return [receive for layer in self._receives for _, receive in layer]

    def _note_failure(self, receive: asyncio.Future[None]) -> None:
        if receive.cancelled() or receive.exception() is None or self._first_failure.done():
            return
        self._first_failure.set_result(receive)

    async def _run(self) -> None:
        for layer, posted in enumerate(self._receives):
            for _, receive in posted:
                if not receive.done():
                    # asyncio.wait cancels nothing: a stop cancelling _run leaves receives posted
                    await asyncio.wait(
                        (receive, self._first_failure), return_when=asyncio.FIRST_COMPLETED
                    )
                if self._first_failure.done():
                    self._first_failure.result().result()  # raises that receive's error
                receive.result()
            self._layers_received = layer + 1
            self.state = TransferState.ACTIVE
        self.settled = True
        self.state = TransferState.DONE

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
        """Stop receiving; on return the receiver is terminal and, if ``settled``, no message
        can land in its destinations any more."""
        await self._stop(TransferState.ABORTED)

    async def _stop(self, state: TransferState) -> None:
        if not self.state.is_terminal:
            self.state = state
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self.settled:
            return
        if self._settle_task is None:  # once: concurrent stops share one withdrawal
            self._settle_task = asyncio.get_running_loop().create_task(self._settle())
        await asyncio.shield(self._settle_task)

    async def _settle(self) -> None:
        """Withdraw every receive no message completed yet, then wait until all settled; both
        within ``SETTLE_TIMEOUT_S``."""
        pending = [(tag, receive) for layer in self._receives for tag, receive in layer]
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
        self.settled = all(receive.done() and not receive.cancelled() for receive in receives)

    async def until_settled(self) -> None:
        """After a stop that left receives in flight: wait, unbounded, until each settled (a
        cancelled one never counts); then ``settled`` is True."""
        while not self.settled:
            receives = [receive for receive in self._all_receives() if not receive.done()]
            if receives:
                await asyncio.wait(receives)
            self._note_settled()
            if not self.settled:  # only cancelled receives are left: they never settle
                await asyncio.Event().wait()
