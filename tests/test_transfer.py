"""KV transfer: layer-wise sender/receiver over the in-process and the UCX transport, straight
into the receiver's KV-cache blocks; the transports' ``withdraw``; the KV layout compatibility
check.

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
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import pytest
import torch

import splitserve.transfer.layer_channel as layer_channel
from splitserve.common.errors import (
    IncompatibleKvLayoutError,
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from splitserve.common.kv_layout import KvLayout
from splitserve.transfer.inprocess import InProcessTransport
from splitserve.transfer.layer_channel import (
    LayerReceiver,
    LayerSender,
    TransferState,
    layer_messages,
)
from splitserve.transfer.plan import TransferPlan, message_tag, new_transfer_secret
from splitserve.transfer.transport import KvEndpoint, KvTransport
from splitserve.worker.kv_io import receive_destinations

pytestmark = pytest.mark.timeout(60)

NUM_LAYERS = 6
CACHE_BLOCKS = 24
"""Blocks of the fake decode-side KV cache; a transfer reserves some of them."""
SCATTERED = [9, 10, 11, 3, 4, 20, 19, 0]
"""A block table in allocation order: sorted it is four runs (0; 3-4; 9-11; 19-20), two of
them reversed or split in the table."""
SMOLLM2_BF16 = KvLayout(
    model="SmolLM2-135M-Instruct",
    dtype="bfloat16",
    block_size=16,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)
"""The default model's KV layout; tests send ``NUM_LAYERS`` layers of it."""
WAIT_S = 10.0
"""Bound on waits that are expected to succeed (a hang turns into a failure, not a stall)."""
LATE_S = 0.3
"""Room for a late message to land, which must not."""

_transfer_ids = itertools.count(1)


@dataclass
class Link:
    """A one-way path: ``endpoint`` sends to ``receiver``."""

    receiver: KvTransport
    endpoint: KvEndpoint


@contextlib.asynccontextmanager
async def open_link(kind: str) -> AsyncIterator[Link]:
    """Transports for ``kind`` on the running loop; closed on exit."""
    transports: list[KvTransport]
    if kind == "ucx":
        from splitserve.transfer.ucx import UcxTransport

        transports = [UcxTransport()]  # one per process: it sends to its own address
    else:
        transports = [InProcessTransport(), InProcessTransport()]
    sender_side, receiver_side = transports[0], transports[-1]
    try:
        endpoint = await sender_side.connect(receiver_side.address)
        yield Link(receiver_side, endpoint)
    finally:
        for transport in transports:
            await transport.close()


def kv_shape(num_blocks: int) -> tuple[int, ...]:
    layout = SMOLLM2_BF16
    return (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)


def random_kv(num_blocks: int) -> torch.Tensor:
    """Random bytes viewed as ``NUM_LAYERS`` layers of bf16 KV:
    ``[layers, 2, blocks, block_size, kv_heads, head_dim]``."""
    raw = torch.randint(
        0, 256, (NUM_LAYERS, SMOLLM2_BF16.layer_bytes(num_blocks)), dtype=torch.uint8
    )
    return raw.view(torch.bfloat16).view(NUM_LAYERS, *kv_shape(num_blocks))


def new_cache() -> torch.Tensor:
    """The decode worker's KV cache, all zero: ``[layers, 2, CACHE_BLOCKS, ...]``."""
    return torch.zeros(NUM_LAYERS, *kv_shape(CACHE_BLOCKS), dtype=torch.bfloat16)


def as_bytes(kv: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view, so that comparisons are bitwise (random bf16 bytes include NaNs)."""
    return kv.reshape(-1).view(torch.uint8)


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert torch.equal(as_bytes(actual), as_bytes(expected))


def assert_zero(kv: torch.Tensor) -> None:
    assert not as_bytes(kv).any()


def unreserved(block_ids: Sequence[int]) -> list[int]:
    return [block for block in range(CACHE_BLOCKS) if block not in set(block_ids)]


@dataclass
class Transfer:
    """One request's transfer into ``block_ids`` of ``cache``; ``kv`` is the prompt's KV in
    block-table order (what must arrive)."""

    block_ids: list[int]
    cache: torch.Tensor
    kv: torch.Tensor
    plan: TransferPlan
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
    plan, destinations = receive_destinations(cache, block_ids)
    transfer_id, secret = next(_transfer_ids), new_transfer_secret()
    receiver = LayerReceiver(link.receiver, transfer_id, secret, plan, destinations)
    loop = asyncio.get_running_loop()
    sender = LayerSender(link.endpoint, transfer_id, secret, NUM_LAYERS, plan, loop)
    kv = random_kv(len(block_ids))
    return Transfer(block_ids, cache, kv, plan, sender, receiver)


def offer_from_thread(transfer: Transfer, order: Sequence[int]) -> None:
    """Offer each layer of ``order`` from another thread (the engine's), its blocks gathered
    in the plan's order as ``kv_io.gather_layer`` does."""
    ordered = list(transfer.plan.block_order)

    def engine_thread() -> None:
        for layer in order:
            time.sleep(0.001)  # the engine computes the next layer
            transfer.sender.offer(layer, transfer.kv[layer][:, ordered])

    thread = threading.Thread(target=engine_thread, name="engine")
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive()


async def offer(transfer: Transfer, order: Sequence[int]) -> None:
    await asyncio.to_thread(offer_from_thread, transfer, order)


async def until(condition: object, timeout_s: float = WAIT_S) -> None:
    """Poll ``condition()`` on the loop until it holds (bounded)."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def let_late_sends_run(sender: LayerSender) -> None:
    """Give a sender's messages (to withdrawn tags) time to arrive, then stop it. Its sends
    may never complete (UCX rendezvous with no receive), so this never waits on them."""
    finish = asyncio.ensure_future(sender.finish(LATE_S))
    await asyncio.wait([finish], timeout=LATE_S + 1.0)
    sender.abort()
    with contextlib.suppress(TransferError):
        await finish


# ----------------------------------------------------------------------------- arrival


@pytest.mark.parametrize(
    "block_ids",
    [[5], list(range(8)), SCATTERED],
    ids=["one-block", "contiguous", "scattered"],
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


def test_scattered_table_is_cut_into_runs() -> None:
    plan = TransferPlan.for_destination(SCATTERED)
    assert plan.run_lengths == (1, 2, 3, 2)
    assert [SCATTERED[position] for position in plan.block_order] == sorted(SCATTERED)


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
            assert first.plan.messages_per_layer == second.plan.messages_per_layer  # same tags
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
            await until(lambda: receiver.layers_received == 3)

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


def test_receiver_abort_before_any_layer(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            transfer = make_transfer(link, SCATTERED)
            receiver = transfer.receiver
            pending_wait = asyncio.ensure_future(receiver.wait(WAIT_S))
            await asyncio.sleep(0.05)
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
            pending_finish = asyncio.ensure_future(sender.finish(WAIT_S))
            await asyncio.sleep(0.05)
            sender.abort()
            with pytest.raises(TransferAbortedError):
                await pending_finish
            with pytest.raises(TransferAbortedError):
                await sender.finish(WAIT_S)
            assert sender.state is TransferState.ABORTED
            await transfer.receiver.abort()
            assert transfer.receiver.settled

    asyncio.run(body())


class _StalledEndpoint(KvEndpoint):
    """An endpoint whose sends never complete (a peer that stopped reading)."""

    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        await asyncio.Event().wait()


def test_sender_abort_with_sends_in_flight_fails_finish() -> None:
    async def body() -> None:
        plan = TransferPlan.for_destination([4, 2])  # two runs: four messages per layer
        loop = asyncio.get_running_loop()
        sender = LayerSender(_StalledEndpoint(), 1, new_transfer_secret(), NUM_LAYERS, plan, loop)
        for layer in range(NUM_LAYERS):
            sender.offer(layer, torch.zeros(2, 2, 16, dtype=torch.uint8))
        pending_finish = asyncio.ensure_future(sender.finish(WAIT_S))
        await asyncio.sleep(0.05)
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
    message matched a receive but its data never came."""

    name = "stuck"

    def __init__(self) -> None:
        self.withdrawn: list[int] = []

    @property
    def address(self) -> bytes:
        return b"stuck"

    async def connect(self, address: bytes) -> KvEndpoint:
        return _StalledEndpoint()

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        await asyncio.Event().wait()

    async def withdraw(self, tag: int) -> None:
        self.withdrawn.append(tag)


class _LateTransport(_StuckTransport):
    """Receives that complete only when ``release`` is set: data still in flight at the
    settle deadline, landing later."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def recv(self, tag: int, buffer: torch.Tensor) -> None:
        await self.release.wait()


def test_receives_in_flight_past_the_deadline_settle_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(layer_channel, "SETTLE_TIMEOUT_S", 0.2)

    async def body() -> None:
        transport = _LateTransport()
        plan, destinations = receive_destinations(new_cache(), SCATTERED)
        receiver = LayerReceiver(
            transport, next(_transfer_ids), new_transfer_secret(), plan, destinations
        )
        await asyncio.sleep(0.02)
        await asyncio.gather(receiver.abort(), receiver.abort())  # concurrent stops share one
        assert not receiver.settled
        assert len(transport.withdrawn) == len(set(transport.withdrawn))  # withdrawn once each
        settling = asyncio.ensure_future(receiver.until_settled())
        await asyncio.sleep(0.05)
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
        transport = _StuckTransport()
        plan, destinations = receive_destinations(new_cache(), SCATTERED)
        secret = new_transfer_secret()
        receiver = LayerReceiver(transport, next(_transfer_ids), secret, plan, destinations)
        await asyncio.sleep(0.02)
        started = time.monotonic()
        await receiver.abort()
        assert time.monotonic() - started < 2.0  # bounded by SETTLE_TIMEOUT_S
        assert receiver.state is TransferState.ABORTED
        assert not receiver.settled  # the owner must quarantine the blocks
        expected = {
            message_tag(secret, index) for index in range(NUM_LAYERS * plan.messages_per_layer)
        }
        assert set(transport.withdrawn) == expected  # every receive was withdrawn
        assert "must not be reused until they settle" in caplog.text
        # asyncio.run cancels the stuck receives

    asyncio.run(body())


def test_withdraw_completes_a_posted_receive_without_writing(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            tag = message_tag(new_transfer_secret(), 3)
            buffer = torch.full((4096,), 0xA5, dtype=torch.uint8)
            receive = asyncio.ensure_future(link.receiver.recv(tag, buffer))
            await asyncio.sleep(0.05)  # posted
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
            receive = asyncio.ensure_future(link.receiver.recv(other_tag, buffer))
            await asyncio.sleep(0.01)
            await asyncio.wait_for(link.endpoint.send(other_tag, message), WAIT_S)
            await asyncio.wait_for(receive, WAIT_S)
            assert torch.equal(buffer, message)

    asyncio.run(body())


# ----------------------------------------------------------------------------- messages


SIZE_ERRORS = {
    "shorter": (56, "has (at most )?56 bytes, receive buffer 64"),
    "one-byte-shorter": (63, "has 63 bytes, receive buffer 64"),
    "empty": (0, "has (0|at most 56) bytes, receive buffer 64"),
    "longer": (65, r"65 bytes, receive buffer 64|\(64 bytes\) failed: Message truncated"),
}
"""Message sizes sent to a 64-byte receive, and the error each must raise (UCX itself reports
only a longer message: "Message truncated"; the UCX transport finds a shorter one by the canary
in the buffer's last 8 bytes, which bounds its size: "at most 56")."""
MISSED_BY_UCX = {"one-byte-shorter"}
"""Mismatches UCX's canary cannot see (``ucx.py``, Sizes: a message 1 to 7 bytes short): the
UCX receive completes, the in-process one fails."""


@pytest.mark.parametrize("receive_first", [True, False])
@pytest.mark.parametrize("mismatch", list(SIZE_ERRORS))
def test_a_message_of_another_size_than_the_receive_is_a_transfer_error(
    transport_kind: str, mismatch: str, receive_first: bool
) -> None:
    size, error = SIZE_ERRORS[mismatch]

    async def body() -> None:
        async with open_link(transport_kind) as link:
            tag = message_tag(new_transfer_secret(), 0)
            buffer = torch.empty(64, dtype=torch.uint8)
            message = torch.zeros(size, dtype=torch.uint8)
            if receive_first:
                receive = asyncio.ensure_future(link.receiver.recv(tag, buffer))
                await asyncio.sleep(0.01)
                await asyncio.wait_for(link.endpoint.send(tag, message), WAIT_S)
            else:
                await asyncio.wait_for(link.endpoint.send(tag, message), WAIT_S)
                receive = asyncio.ensure_future(link.receiver.recv(tag, buffer))
            if transport_kind == "ucx" and mismatch in MISSED_BY_UCX:
                await asyncio.wait_for(receive, WAIT_S)  # the documented limit, pinned
                assert not buffer[:size].any()
                return
            with pytest.raises(TransferError, match=error):
                await asyncio.wait_for(receive, WAIT_S)

    asyncio.run(body())


@pytest.mark.parametrize("buffer_bytes", [0, 4])
def test_a_receive_buffer_under_8_bytes_is_checked_whole(
    transport_kind: str, buffer_bytes: int
) -> None:
    """A buffer too small for an 8-byte canary: the message of its size lands, an empty one
    into a non-empty buffer is an error (UCX: the canary covers the whole buffer)."""

    async def body() -> None:
        async with open_link(transport_kind) as link:
            secret = new_transfer_secret()
            buffer = torch.zeros(buffer_bytes, dtype=torch.uint8)
            message = torch.arange(1, buffer_bytes + 1, dtype=torch.uint8)
            receive = asyncio.ensure_future(link.receiver.recv(message_tag(secret, 0), buffer))
            await asyncio.sleep(0.01)
            await asyncio.wait_for(link.endpoint.send(message_tag(secret, 0), message), WAIT_S)
            await asyncio.wait_for(receive, WAIT_S)
            assert torch.equal(buffer, message)
            if buffer_bytes == 0:
                return
            empty = torch.empty(0, dtype=torch.uint8)
            receive = asyncio.ensure_future(link.receiver.recv(message_tag(secret, 1), buffer))
            await asyncio.sleep(0.01)
            await asyncio.wait_for(link.endpoint.send(message_tag(secret, 1), empty), WAIT_S)
            error = f"has (0|at most 0) bytes, receive buffer {buffer_bytes}"
            with pytest.raises(TransferError, match=error):
                await asyncio.wait_for(receive, WAIT_S)

    asyncio.run(body())


async def receive_with_mismatched_sender(
    link: Link, cache: torch.Tensor, block_ids: list[int], sender_blocks: int
) -> tuple[LayerSender, LayerReceiver]:
    """A receiver into ``block_ids`` and a sender of the same transfer whose plan is one run of
    ``sender_blocks`` blocks (as many messages per layer, of another size); layer 0 offered."""
    plan, destinations = receive_destinations(cache, block_ids)
    assert plan.num_runs == 1
    transfer_id, secret = next(_transfer_ids), new_transfer_secret()
    receiver = LayerReceiver(link.receiver, transfer_id, secret, plan, destinations)
    other = TransferPlan.for_destination(range(sender_blocks))
    loop = asyncio.get_running_loop()
    sender = LayerSender(link.endpoint, transfer_id, secret, NUM_LAYERS, other, loop)
    sender.offer(0, random_kv(sender_blocks)[0])
    return sender, receiver


@pytest.mark.parametrize(
    ("block_ids", "sender_blocks"), [([6, 7], 1), ([6], 2)], ids=["shorter", "longer"]
)
def test_a_size_mismatch_fails_the_layer_receiver_naming_the_message(
    transport_kind: str, block_ids: list[int], sender_blocks: int
) -> None:
    """A sender whose plan cuts other message sizes: the first message of layer 0 fails the
    transfer. UCX may have written the start of a shorter message into the reserved blocks
    (the in-process transport refuses it whole); nothing lands outside them."""

    async def body() -> None:
        async with open_link(transport_kind) as link:
            cache = new_cache()
            sender, receiver = await receive_with_mismatched_sender(
                link, cache, block_ids, sender_blocks
            )
            with pytest.raises(TransferError, match=r"message 0 \(layer 0\): .*") as failed:
                await receiver.wait(WAIT_S)
            assert "receive buffer" in str(failed.value) or "truncated" in str(failed.value)
            assert receiver.state is TransferState.FAILED and receiver.settled
            assert receiver.layers_received == 0
            assert_zero(cache[:, :, unreserved(block_ids)])
            if transport_kind == "inprocess":
                assert_zero(cache)
            await let_late_sends_run(sender)

    asyncio.run(body())


def test_offering_a_layer_of_the_wrong_block_count_is_refused() -> None:
    async def body() -> None:
        plan = TransferPlan.for_destination(SCATTERED)
        loop = asyncio.get_running_loop()
        sender = LayerSender(_StalledEndpoint(), 1, new_transfer_secret(), NUM_LAYERS, plan, loop)
        with pytest.raises(ValueError, match=r"expected \[2, 8, \.\.\.\] KV"):
            sender.offer(0, random_kv(7)[0])
        with pytest.raises(ValueError, match="expected"):
            layer_messages(plan, random_kv(9)[0])
        with pytest.raises(ValueError, match="expected"):
            layer_messages(plan, random_kv(8)[0, 0])  # K only
        with pytest.raises(ValueError, match="expected"):
            layer_messages(plan, torch.zeros(8, dtype=torch.uint8))
        await asyncio.sleep(0)
        assert sender.state is TransferState.PENDING and sender.bytes_sent == 0

    asyncio.run(body())


def test_layer_messages_are_k_runs_then_v_runs_without_copies() -> None:
    plan = TransferPlan.for_destination(SCATTERED)  # runs of 1, 2, 3, 2 blocks
    layer = random_kv(len(SCATTERED))[0]
    messages = layer_messages(plan, layer)
    assert len(messages) == plan.messages_per_layer == 8
    block = SMOLLM2_BF16.layer_bytes(1) // 2  # K (or V) of one block
    assert [message.numel() for message in messages] == [block * n for n in (1, 2, 3, 2)] * 2
    offsets = plan.run_offsets()
    for half in range(2):
        for run, (offset, length) in enumerate(zip(offsets, plan.run_lengths, strict=True)):
            message = messages[half * plan.num_runs + run]
            assert message.dtype == torch.uint8 and message.is_contiguous()
            assert torch.equal(message, as_bytes(layer[half, offset : offset + length]))
            assert message.untyped_storage().data_ptr() == layer.untyped_storage().data_ptr()


def test_receive_destinations_are_views_of_the_reserved_runs() -> None:
    cache = new_cache()
    plan, destinations = receive_destinations(cache, SCATTERED)
    assert plan == TransferPlan.for_destination(SCATTERED)
    assert len(destinations) == NUM_LAYERS
    block = SMOLLM2_BF16.layer_bytes(1) // 2
    first_blocks = [0, 3, 9, 19]  # sorted runs: 0; 3-4; 9-11; 19-20
    for layer, buffers in enumerate(destinations):
        assert len(buffers) == plan.messages_per_layer
        for index, buffer in enumerate(buffers):
            half, run = divmod(index, plan.num_runs)
            expected = cache[layer, half, first_blocks[run]]
            assert buffer.dtype == torch.uint8 and buffer.is_contiguous()
            assert buffer.numel() == block * plan.run_lengths[run]
            assert buffer.data_ptr() == expected.data_ptr()  # no staging: the cache itself
    with pytest.raises(ValueError, match="contiguous"):
        receive_destinations(cache.transpose(0, 1), SCATTERED)


def test_receiver_rejects_destinations_that_do_not_match_the_plan() -> None:
    async def body() -> None:
        transport = InProcessTransport()
        try:
            plan, destinations = receive_destinations(new_cache(), SCATTERED)
            short = [list(buffers) for buffers in destinations]
            short[2] = short[2][:-1]
            with pytest.raises(ValueError, match="layer 2 has 7 destinations, the plan 8"):
                LayerReceiver(transport, next(_transfer_ids), new_transfer_secret(), plan, short)
            other_plan = TransferPlan.for_destination(range(8))  # one run: two messages
            with pytest.raises(ValueError, match="the plan 2 messages"):
                LayerReceiver(
                    transport, next(_transfer_ids), new_transfer_secret(), other_plan, destinations
                )
        finally:
            await transport.close()

    asyncio.run(body())


# ----------------------------------------------------------------------------- layout


def test_equal_layouts_are_compatible() -> None:
    twin = KvLayout("SmolLM2-135M-Instruct", "bfloat16", 16, 30, 3, 64)
    assert twin == SMOLLM2_BF16 and twin is not SMOLLM2_BF16
    assert twin.compat_hash == SMOLLM2_BF16.compat_hash
    SMOLLM2_BF16.check_compatible(twin)


@pytest.mark.parametrize(
    ("field", "value", "local", "peer"),
    [
        ("block_size", 32, "16", "32"),
        ("dtype", "float16", "'bfloat16'", "'float16'"),
    ],
)
def test_different_layout_is_incompatible(field: str, value: object, local: str, peer: str) -> None:
    other = dataclasses.replace(SMOLLM2_BF16, **{field: value})
    assert other.compat_hash != SMOLLM2_BF16.compat_hash
    with pytest.raises(IncompatibleKvLayoutError) as caught:
        SMOLLM2_BF16.check_compatible(other)
    message = str(caught.value)
    assert f"{field}: local={local} peer={peer}" in message
    assert not any(f"{name}:" in message for name in ("model", "num_layers", "head_dim"))


def test_layer_bytes() -> None:
    # K and V x blocks x block_size x kv_heads x head_dim x element size
    assert SMOLLM2_BF16.layer_bytes(1) == 2 * 16 * 3 * 64 * 2 == 12288
    assert SMOLLM2_BF16.layer_bytes(8) == 8 * 12288
    fp32 = dataclasses.replace(SMOLLM2_BF16, dtype="float32")
    assert fp32.layer_bytes(8) == 2 * SMOLLM2_BF16.layer_bytes(8)
    assert SMOLLM2_BF16.layer_bytes(0) == 0
