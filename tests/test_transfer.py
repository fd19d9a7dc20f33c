"""KV transfer: layer-wise sender/receiver over the in-process and the UCX transport, one
message per layer into the receiver's KV-cache blocks (through the staging ring, or straight
into a destination that is one region); the transports' ``withdraw``. A layer's message,
destinations, messages of the wrong size and the KV layout check:
``test_transfer_messages.py``; the fake cache and the link both use: ``transfer_support.py``.

Every transport test runs for both backends. UCX runs inside this one process: the transport
sends to its own worker address. ``ucxx`` allows one application context per process, so the
``transport_kind`` fixture (``conftest.py``) resets it after each UCX test; every test body
runs in its own ``asyncio.run`` and creates its transport on that loop. No test may hang: each
carries a timeout, and every wait in the code under test is bounded.

The receiving side is a fake paged KV cache ``[layers, 2, blocks, block_size, kv_heads,
head_dim]`` of zeros: a transfer must write exactly the reserved blocks, bit for bit, and a
receiver that stopped (``settled``) must never let a late message land there.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

import splitserve.transfer.layer_channel as layer_channel
from splitserve.common.errors import (
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from splitserve.common.event_wait import wait_event
from splitserve.transfer import staging
from splitserve.transfer.destination import KvDestination
from splitserve.transfer.layer_channel import (
    LayerReceiver,
    LayerSender,
    TransferState,
)
from splitserve.transfer.plan import TransferPlan, message_tag, new_transfer_secret
from splitserve.transfer.transport import KvEndpoint, KvTransport
from tests.transfer_support import (
    CACHE_BLOCKS,
    LATE_S,
    NUM_LAYERS,
    SCATTERED,
    SMOLLM2_BF16,
    WAIT_S,
    ForwardingTransport,
    Link,
    _StalledEndpoint,
    _transfer_ids,
    as_bytes,
    assert_zero,
    counting_link,
    let_late_sends_run,
    new_cache,
    open_link,
    random_kv,
    unreserved,
)
from tests.waiting import suspended_task, until

pytestmark = pytest.mark.timeout(60)

RING_DEPTH = 4
"""Slots of a receiver's staging ring in these tests: fewer than ``NUM_LAYERS``, so that a
transfer wraps around its ring (by default a ring holds every layer of these small ones)."""


@pytest.fixture(autouse=True)
def _small_rings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rings of ``RING_DEPTH`` slots, all made at once whatever earlier tests left made."""

    def depth(num_layers: int, message_bytes: int, on_gpu: bool = False) -> int:
        return min(num_layers, RING_DEPTH)

    monkeypatch.setattr(layer_channel, "ring_depth", depth)
    monkeypatch.setattr(staging, "EAGER_BYTES", 1 << 62)


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert torch.equal(as_bytes(actual), as_bytes(expected))


@dataclass
class Transfer:
    """One request's transfer into ``block_ids`` of ``cache``; ``kv`` is the prompt's KV in
    block-table order (what must arrive)."""

    block_ids: list[int]
    cache: torch.Tensor
    kv: torch.Tensor
    plan: TransferPlan
    secret: bytes
    sender: LayerSender
    receiver: LayerReceiver

    def landed(self) -> torch.Tensor:
        """The reserved blocks of the cache, in block-table order."""
        return self.cache[:, :, self.block_ids]

    def assert_untouched_elsewhere(self) -> None:
        assert_zero(self.cache[:, :, unreserved(self.block_ids)])


def make_transfer(
    link: Link, block_ids: Sequence[int], cache: torch.Tensor | None = None
) -> Transfer:
    """A receiver posted into ``block_ids`` of a zero cache before its sender, as the decode
    worker reserves before the push."""
    block_ids = list(block_ids)
    cache = new_cache() if cache is None else cache
    destination = KvDestination(cache, block_ids)
    plan = destination.plan
    transfer_id, secret = next(_transfer_ids), new_transfer_secret()
    receiver = LayerReceiver(link.receiver, transfer_id, secret, destination)
    loop = asyncio.get_running_loop()
    sender = LayerSender(link.endpoint, transfer_id, secret, NUM_LAYERS, plan, loop)
    kv = random_kv(len(block_ids))
    return Transfer(block_ids, cache, kv, plan, secret, sender, receiver)


def offer_from_thread(transfer: Transfer, order: Sequence[int]) -> None:
    """Offer each layer of ``order`` from another thread (the engine's), its blocks gathered
    in the plan's order as ``kv_io.gather_layer`` does."""
    ordered = list(transfer.plan.block_order)

    def engine_thread() -> None:
        for layer in order:
            time.sleep(0.001)  # the engine computes the next layer (simulated, not a wait)
            transfer.sender.offer(layer, transfer.kv[layer][:, ordered])

    thread = threading.Thread(target=engine_thread, name="engine")
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive()


async def offer(transfer: Transfer, order: Sequence[int]) -> None:
    await asyncio.to_thread(offer_from_thread, transfer, order)


# ----------------------------------------------------------------------------- arrival


EVERY_BLOCK = list(reversed(range(CACHE_BLOCKS)))
"""A block table of all of the cache's blocks: each layer's destination is one region, so its
message is received straight into the cache (no staging)."""


@pytest.mark.parametrize(
    "block_ids",
    [[5], list(range(8)), SCATTERED, EVERY_BLOCK],
    ids=["one-block", "contiguous", "scattered", "every-block"],
)
def test_layers_offered_from_engine_thread_land_bit_exact_in_the_reserved_blocks(
    transport_kind: str, block_ids: list[int]
) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            transfer = make_transfer(link, block_ids)
            await offer(transfer, range(NUM_LAYERS))
            sent = await transfer.sender.finish(WAIT_S)
            await transfer.receiver.wait(WAIT_S)

            assert_bit_equal(transfer.landed(), transfer.kv)
            transfer.assert_untouched_elsewhere()
            num_blocks = len(block_ids)
            assert sent == NUM_LAYERS * SMOLLM2_BF16.layer_bytes(num_blocks)
            assert sent == transfer.kv.numel() * 2
            receiver = transfer.receiver
            assert transfer.sender.state is receiver.state is TransferState.DONE
            assert receiver.layers_received == NUM_LAYERS and receiver.settled
            await receiver.abort()  # a terminal transfer stays as it is
            assert receiver.state is TransferState.DONE and receiver.settled

    asyncio.run(body())


@pytest.mark.parametrize(
    "block_ids", [list(range(8)), SCATTERED, EVERY_BLOCK], ids=["one-run", "4-runs", "straight"]
)
def test_a_transfer_is_one_message_per_layer_whatever_its_runs(
    transport_kind: str, block_ids: list[int]
) -> None:
    """As many messages as layers, sent and received, whatever the destination's runs; through
    staging at most ``RING_DEPTH`` receives are posted at a time (the ring), straight every
    layer's at once."""

    async def body() -> None:
        async with counting_link(transport_kind) as (link, endpoint, receiver_side):
            transfer = make_transfer(link, block_ids)
            await offer(transfer, range(NUM_LAYERS))
            await transfer.sender.finish(WAIT_S)
            await transfer.receiver.wait(WAIT_S)

            assert_bit_equal(transfer.landed(), transfer.kv)
            transfer.assert_untouched_elsewhere()
            assert transfer.sender.messages_sent == endpoint.sent == NUM_LAYERS
            assert transfer.receiver.receives_posted == receiver_side.posted == NUM_LAYERS
            straight = block_ids is EVERY_BLOCK
            assert receiver_side.most_at_once <= (NUM_LAYERS if straight else RING_DEPTH)

    asyncio.run(body())


def test_a_ring_past_the_eager_budget_grows_once_its_first_layer_landed(
    transport_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver made when the process's rings hold their budget already (queued
    reservations): two receives posted until the first layer landed, then the rest of its
    ring; the transfer lands bit-exact all the same, and its ring is released once DONE."""
    monkeypatch.setattr(staging, "EAGER_BYTES", 0)

    async def body() -> None:
        async with counting_link(transport_kind) as (link, _, receiver_side):
            before = staging.made_bytes()
            transfer = make_transfer(link, SCATTERED)
            receiver = transfer.receiver
            await until(lambda: receiver_side.posted == staging.MIN_DEPTH, WAIT_S, "posted")
            await asyncio.sleep(0.05)  # not a wait: time for a wrong post to show
            assert receiver.receives_posted == staging.MIN_DEPTH
            await offer(transfer, [0])
            await until(lambda: receiver.layers_received == 1, WAIT_S, "layer 0")
            assert receiver.receives_posted == RING_DEPTH + 1  # grown, and layer 4 into slot 0
            await offer(transfer, range(1, NUM_LAYERS))
            await transfer.sender.finish(WAIT_S)
            await receiver.wait(WAIT_S)
            assert_bit_equal(transfer.landed(), transfer.kv)
            transfer.assert_untouched_elsewhere()
            assert staging.made_bytes() == before  # released once settled

    asyncio.run(body())


def test_layers_offered_out_of_order_and_twice_land_bit_exact(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            transfer = make_transfer(link, SCATTERED)
            order = [5, 2, 0, 4, 4, 1, 3, 0]  # a repeated offer of a layer is ignored
            await offer(transfer, order)
            sent = await transfer.sender.finish(WAIT_S)
            await transfer.receiver.wait(WAIT_S)

            assert_bit_equal(transfer.landed(), transfer.kv)
            transfer.assert_untouched_elsewhere()
            assert sent == NUM_LAYERS * SMOLLM2_BF16.layer_bytes(len(SCATTERED))
            assert transfer.sender.state is transfer.receiver.state is TransferState.DONE
            assert transfer.receiver.layers_received == NUM_LAYERS
            assert transfer.receiver.settled

    asyncio.run(body())


def test_concurrent_transfers_into_one_cache_land_in_their_own_blocks(
    transport_kind: str,
) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            cache = new_cache()
            first = make_transfer(link, [7, 1, 2, 14, 20], cache)
            second = make_transfer(link, [3, 0, 15, 16, 8], cache)
            assert first.plan.num_blocks == second.plan.num_blocks  # same sizes, other tags
            await asyncio.gather(offer(second, [0, 1, 2]), offer(first, range(NUM_LAYERS)))
            await offer(second, [3, 4, 5])
            await asyncio.gather(first.sender.finish(WAIT_S), second.sender.finish(WAIT_S))
            await asyncio.gather(first.receiver.wait(WAIT_S), second.receiver.wait(WAIT_S))

            assert_bit_equal(first.landed(), first.kv)
            assert_bit_equal(second.landed(), second.kv)
            assert_zero(cache[:, :, unreserved(first.block_ids + second.block_ids)])

    asyncio.run(body())


# ----------------------------------------------------------------------------- ending early


def test_receiver_without_sender_times_out_and_a_late_message_never_lands(
    transport_kind: str,
) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            transfer = make_transfer(link, SCATTERED)
            receiver = transfer.receiver
            started = time.monotonic()
            with pytest.raises(TransferTimeoutError, match="0/6 layers"):
                await receiver.wait(0.3)
            assert time.monotonic() - started < 5.0
            assert receiver.state is TransferState.FAILED
            assert receiver.layers_received == 0
            assert receiver.settled  # every receive was withdrawn
            with pytest.raises(TransferError, match="had failed") as again:
                await receiver.wait(WAIT_S)  # a second wait reports the failure, not an abort
            assert not isinstance(again.value, TransferAbortedError)

            # The sender never heard of the failure: its messages come late, to withdrawn tags.
            await offer(transfer, range(NUM_LAYERS))
            await let_late_sends_run(transfer.sender)
            assert_zero(transfer.cache)
            assert receiver.state is TransferState.FAILED

    asyncio.run(body())


def test_sender_finish_times_out_when_layers_are_missing(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            transfer = make_transfer(link, SCATTERED)
            sender, receiver = transfer.sender, transfer.receiver
            await offer(transfer, [0, 1, 2])
            with pytest.raises(TransferTimeoutError, match="3/6 layers offered"):
                await sender.finish(0.3)
            assert sender.state is TransferState.FAILED
            await offer(transfer, [3])  # too late: a terminal transfer sends nothing more
            with pytest.raises(TransferTimeoutError, match="3/6 layers arrived"):
                await receiver.wait(0.3)
            assert receiver.state is TransferState.FAILED and receiver.settled
            landed = transfer.landed()
            assert_bit_equal(landed[:3], transfer.kv[:3])
            assert_zero(landed[3:])
            transfer.assert_untouched_elsewhere()

    asyncio.run(body())


def test_receiver_abort_mid_transfer_settles_and_later_layers_never_land(
    transport_kind: str,
) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            transfer = make_transfer(link, SCATTERED)
            receiver = transfer.receiver
            pending_wait = asyncio.ensure_future(receiver.wait(WAIT_S))
            await offer(transfer, [0, 1, 2])
            await until(lambda: receiver.layers_received == 3, WAIT_S, "3 layers received")

            await receiver.abort()
            assert receiver.settled  # on return: nothing can land any more
            assert receiver.state is TransferState.ABORTED
            with pytest.raises(TransferAbortedError):
                await pending_wait
            with pytest.raises(TransferAbortedError):
                await receiver.wait(WAIT_S)

            await offer(transfer, [3, 4, 5])  # the sender did not hear of the abort
            await let_late_sends_run(transfer.sender)
            landed = transfer.landed()
            assert_bit_equal(landed[:3], transfer.kv[:3])
            assert_zero(landed[3:])
            transfer.assert_untouched_elsewhere()
            assert receiver.state is TransferState.ABORTED and receiver.layers_received == 3

    asyncio.run(body())


class _GatedTransport(ForwardingTransport):
    """``inner``'s receive side, whose receives return only once ``gate`` is set: a message
    has landed in its buffer (``landed`` counts them) but the receiver does not know yet."""

    def __init__(self, inner: KvTransport) -> None:
        super().__init__(inner)
        self.landed = 0
        self.gate = asyncio.Event()

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        await self.inner.recv(tag, buffer)
        self.landed += 1
        await self.gate.wait()


def test_receiver_abort_with_layers_in_staging_never_scatters_them(transport_kind: str) -> None:
    """Messages that landed in the staging ring but were not copied into the blocks when the
    receiver stops are never copied there, not even when their receives return after the stop:
    the blocks stay zero, then and after the sender's other layers came."""

    async def body() -> None:
        async with open_link(transport_kind) as link:
            gated = _GatedTransport(link.receiver)
            transfer = make_transfer(Link(gated, link.endpoint), SCATTERED)
            receiver = transfer.receiver
            await offer(transfer, [0, 1])
            await until(lambda: gated.landed == 2, WAIT_S, "layers 0 and 1 in staging")
            stopping = asyncio.ensure_future(receiver.abort())
            await asyncio.sleep(0.05)  # the stop has begun: withdrawn, waiting to settle
            gated.gate.set()  # the receives of layers 0 and 1 return now, after the stop
            await asyncio.wait_for(stopping, WAIT_S)
            assert receiver.state is TransferState.ABORTED and receiver.settled
            assert receiver.layers_received == 0
            assert_zero(transfer.cache)

            await offer(transfer, range(2, NUM_LAYERS))  # the sender did not hear of the abort
            await let_late_sends_run(transfer.sender)
            assert_zero(transfer.cache)
            assert receiver.layers_received == 0

    asyncio.run(body())


def test_receiver_abort_before_any_layer(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            transfer = make_transfer(link, SCATTERED)
            receiver = transfer.receiver
            pending_wait = await suspended_task(receiver.wait(WAIT_S))  # waiting
            await receiver.abort()
            with pytest.raises(TransferAbortedError):
                await pending_wait
            assert receiver.state is TransferState.ABORTED and receiver.settled
            assert receiver.layers_received == 0
            await offer(transfer, range(NUM_LAYERS))
            await let_late_sends_run(transfer.sender)
            assert_zero(transfer.cache)

    asyncio.run(body())


def test_sender_abort_before_all_layers_fails_finish(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            transfer = make_transfer(link, SCATTERED)
            sender = transfer.sender
            await offer(transfer, [0, 1])
            pending_finish = await suspended_task(sender.finish(WAIT_S))  # waiting
            sender.abort()
            with pytest.raises(TransferAbortedError):
                await pending_finish
            with pytest.raises(TransferAbortedError):
                await sender.finish(WAIT_S)
            assert sender.state is TransferState.ABORTED
            await transfer.receiver.abort()
            assert transfer.receiver.settled

    asyncio.run(body())


class _SendsInFlight(_StalledEndpoint):
    """A stalled endpoint that says when its ``sends``-th send is in flight."""

    def __init__(self, sends: int) -> None:
        self.in_flight = 0
        self.all_in_flight = asyncio.Event()
        """Set once ``sends`` sends are in flight (none ever completes)."""
        self._sends = sends

    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        self.in_flight += 1
        if self.in_flight == self._sends:
            self.all_in_flight.set()
        await super().send(tag, buffer)


def test_sender_abort_with_sends_in_flight_fails_finish() -> None:
    async def body() -> None:
        plan = TransferPlan.for_destination([4, 2])  # two runs: still one message per layer
        loop = asyncio.get_running_loop()
        endpoint = _SendsInFlight(NUM_LAYERS)
        sender = LayerSender(endpoint, 1, new_transfer_secret(), NUM_LAYERS, plan, loop)
        for layer in range(NUM_LAYERS):
            sender.offer(layer, torch.zeros(2, 2, 16, dtype=torch.uint8))
        pending_finish = await suspended_task(sender.finish(WAIT_S))
        assert await wait_event(endpoint.all_in_flight, WAIT_S), "every send in flight"
        assert sender.state is TransferState.ACTIVE and not pending_finish.done()
        assert sender.bytes_sent == NUM_LAYERS * 2 * 2 * 16
        sender.abort()
        with pytest.raises(TransferAbortedError):
            await pending_finish
        assert sender.state is TransferState.ABORTED

    asyncio.run(body())


def test_sender_finish_times_out_when_sends_stall() -> None:
    async def body() -> None:
        plan = TransferPlan.for_destination([0])
        loop = asyncio.get_running_loop()
        sender = LayerSender(_StalledEndpoint(), 1, new_transfer_secret(), NUM_LAYERS, plan, loop)
        for layer in range(NUM_LAYERS):
            sender.offer(layer, torch.zeros(2, 1, 8, dtype=torch.uint8))
        with pytest.raises(TransferTimeoutError, match="6/6 layers offered"):
            await sender.finish(0.2)
        assert sender.state is TransferState.FAILED

    asyncio.run(body())


# ----------------------------------------------------------------------------- settling


class _StuckTransport(KvTransport):
    """A transport whose receives never complete and whose ``withdraw`` has no effect: a
    message matched a receive but its data never came. ``all_posted`` is set once
    ``receives`` receives are posted."""

    name = "stuck"

    def __init__(self, receives: int) -> None:
        self.withdrawn: list[int] = []
        self.posted: list[int] = []
        self.all_posted = asyncio.Event()
        self._receives = receives

    @property
    def address(self) -> bytes:
        return b"stuck"

    async def connect(self, address: bytes) -> KvEndpoint:
        return _StalledEndpoint()

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        self._post(tag)
        await asyncio.Event().wait()

    def _post(self, tag: int) -> None:
        self.posted.append(tag)
        if len(self.posted) == self._receives:
            self.all_posted.set()

    async def withdraw(self, tag: int) -> None:
        self.withdrawn.append(tag)


class _LateTransport(_StuckTransport):
    """Receives that complete only when ``release`` is set: data still in flight at the
    settle deadline, landing later."""

    def __init__(self, receives: int) -> None:
        super().__init__(receives)
        self.release = asyncio.Event()

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        self._post(tag)
        await self.release.wait()


def test_receives_in_flight_past_the_deadline_settle_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(layer_channel, "SETTLE_TIMEOUT_S", 0.2)

    async def body() -> None:
        transport = _LateTransport(RING_DEPTH)  # the ring's receives
        destination = KvDestination(new_cache(), SCATTERED)
        receiver = LayerReceiver(transport, next(_transfer_ids), new_transfer_secret(), destination)
        assert await wait_event(transport.all_posted, WAIT_S), "every receive posted"
        await asyncio.gather(receiver.abort(), receiver.abort())  # concurrent stops share one
        assert not receiver.settled
        assert len(transport.withdrawn) == len(set(transport.withdrawn))  # withdrawn once each
        settling = asyncio.ensure_future(receiver.until_settled())
        await asyncio.sleep(0.05)  # not a wait: time for a wrong settle to show
        assert not settling.done()
        transport.release.set()  # the data lands
        await asyncio.wait_for(settling, WAIT_S)
        assert receiver.settled

    asyncio.run(body())


def test_receiver_whose_receives_never_settle_is_not_settled(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(layer_channel, "SETTLE_TIMEOUT_S", 0.2)

    async def body() -> None:
        transport = _StuckTransport(RING_DEPTH)  # the ring's receives
        secret = new_transfer_secret()
        destination = KvDestination(new_cache(), SCATTERED)
        receiver = LayerReceiver(transport, next(_transfer_ids), secret, destination)
        assert await wait_event(transport.all_posted, WAIT_S), "every receive posted"
        started = time.monotonic()
        made = staging.made_bytes()
        await receiver.abort()
        assert time.monotonic() - started < 2.0  # bounded by SETTLE_TIMEOUT_S
        assert receiver.state is TransferState.ABORTED
        assert not receiver.settled  # the owner must quarantine the blocks
        assert staging.made_bytes() == made  # and its ring is never reused
        expected = {message_tag(secret, layer) for layer in range(RING_DEPTH)}
        assert set(transport.withdrawn) == expected  # every posted receive was withdrawn
        assert len(transport.posted) == RING_DEPTH  # and no later layer was posted
        assert "must not be reused until they settle" in caplog.text
        # asyncio.run cancels the stuck receives

    asyncio.run(body())


def test_withdraw_completes_a_posted_receive_without_writing(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            tag = message_tag(new_transfer_secret(), 3)
            buffer = torch.full((4096,), 0xA5, dtype=torch.uint8)
            # posted: a receive is posted when its coroutine first runs (KvTransport.recv)
            receive = await suspended_task(link.receiver.recv(tag, buffer))
            assert not receive.done()
            await link.receiver.withdraw(tag)
            await asyncio.wait_for(receive, WAIT_S)
            assert bool((buffer == 0xA5).all())

            # a real message of the withdrawn tag, coming late, is not received
            message = torch.ones(4096, dtype=torch.uint8)
            late = asyncio.ensure_future(link.endpoint.send(tag, message))
            await asyncio.wait([late], timeout=LATE_S)
            late.cancel()
            assert bool((buffer == 0xA5).all())

    asyncio.run(body())


def test_withdraw_before_the_receive_makes_it_complete_empty(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            tag = message_tag(new_transfer_secret(), 0)
            other_tag = message_tag(new_transfer_secret(), 0)
            await link.receiver.withdraw(tag)
            buffer = torch.full((4096,), 0x5A, dtype=torch.uint8)
            await asyncio.wait_for(link.receiver.recv(tag, buffer), WAIT_S)
            assert bool((buffer == 0x5A).all())

            # the withdrawal was of that tag only: another receive still gets its message
            message = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
            receive = await suspended_task(link.receiver.recv(other_tag, buffer))  # posted
            await asyncio.wait_for(link.endpoint.send(other_tag, message), WAIT_S)
            await asyncio.wait_for(receive, WAIT_S)
            assert torch.equal(buffer, message)

    asyncio.run(body())
