"""Layers grouped into fewer messages (``transfer/plan.py``: Groups): the receiver's
destination asks for messages of at least ``min_message_bytes``, its plan says how many layers
each carries, and both sides of the layer channel follow it over both transports.

- ``group_layers`` picks the smallest group that divides the layers and reaches the size.
- Grouped transfers land bit-exact, straight or through the staging ring, in layers / group
  messages, from parts adjacent in one staging buffer (sent as they lie, no copy) or apart
  (joined by a copy), offered in any order, a layer twice.
- A plan whose groups do not divide the layers is refused (``InvalidRequestError`` naming the
  field for a peer's plan); a grouped message of the wrong size fails the transfer naming its
  layers (``test_transfer_messages.py``).
- The group crosses the wire in the reservation and the pull; a peer that predates it (0)
  means one layer a message.
"""

from __future__ import annotations

import argparse
import asyncio

import pytest
import torch

from splitserve.common.errors import InvalidRequestError
from splitserve.proto import convert
from splitserve.transfer import staging
from splitserve.transfer.destination import KvDestination, min_message_bytes
from splitserve.transfer.layer_channel import LayerReceiver, LayerSender, TransferState, _joined
from splitserve.transfer.plan import (
    InvalidTransferPlanError,
    TransferPlan,
    group_layers,
    new_transfer_secret,
)
from splitserve.transfer.reservation import KvReservation
from splitserve.worker.process import add_worker_args, transfer_settings_of
from tests.transfer_support import (
    CACHE_BLOCKS,
    NUM_LAYERS,
    SCATTERED,
    SMOLLM2_BF16,
    WAIT_S,
    _StalledEndpoint,
    _transfer_ids,
    as_bytes,
    assert_zero,
    counting_link,
    new_cache,
    random_kv,
    unreserved,
)

pytestmark = pytest.mark.timeout(60)

EVERY_BLOCK = list(reversed(range(CACHE_BLOCKS)))
"""Every block of the cache: its groups are one region each, received straight."""


def test_the_group_is_the_smallest_divisor_of_the_layers_reaching_the_size() -> None:
    assert group_layers(32, 4 << 20, 16 << 20) == 4  # a 1,024-token Llama-8B prompt on CUDA
    assert group_layers(32, 32 << 20, 16 << 20) == 1  # 8,192 tokens: a layer is enough
    assert group_layers(30, 3, 10) == 5  # 4 does not divide 30
    assert group_layers(30, 1, 1000) == 30  # nothing reaches it: one message
    assert group_layers(7, 100, 0) == 1
    assert group_layers(0, 100, 1000) == 1  # no layer: no message, any group
    assert min_message_bytes(torch.device("meta")) == 0  # another kind: one layer a message


def test_a_destination_asks_for_groups_of_its_layers() -> None:
    layer_bytes = SMOLLM2_BF16.layer_bytes(len(SCATTERED))
    destination = KvDestination(new_cache(), SCATTERED, min_message_bytes=2 * layer_bytes + 1)
    assert destination.plan.layers_per_message == 3  # 3 layers: the smallest divisor past 2
    assert destination.num_messages == NUM_LAYERS // 3
    assert destination.message_bytes == 3 * layer_bytes
    assert destination.whole(0) is None  # others' blocks between: through staging
    every = KvDestination(new_cache(), EVERY_BLOCK, min_message_bytes=1)
    assert every.plan.layers_per_message == 1 and every.whole(1) is not None


@pytest.mark.parametrize("group", [2, 3, 6])
@pytest.mark.parametrize(
    "block_ids", [list(range(8)), SCATTERED, EVERY_BLOCK], ids=["one-run", "4-runs", "straight"]
)
@pytest.mark.parametrize("parts", ["adjacent", "apart"])
def test_grouped_layers_land_bit_exact_in_fewer_messages(
    transport_kind: str, block_ids: list[int], group: int, parts: str
) -> None:
    """``parts`` adjacent: every layer gathered into its row of one staging buffer, as the
    workers do (each group sent as it lies); apart: each layer a tensor of its own (joined by a
    copy). Layers offered out of order, one of them twice."""
    layer_bytes = SMOLLM2_BF16.layer_bytes(len(block_ids))

    async def body() -> None:
        async with counting_link(transport_kind) as (link, endpoint, receiver_side):
            cache = new_cache()
            destination = KvDestination(cache, block_ids, (group - 1) * layer_bytes + 1)
            plan = destination.plan
            assert plan.layers_per_message == group
            transfer_id, secret = next(_transfer_ids), new_transfer_secret()
            receiver = LayerReceiver(link.receiver, transfer_id, secret, destination)
            loop = asyncio.get_running_loop()
            sender = LayerSender(link.endpoint, transfer_id, secret, NUM_LAYERS, plan, loop)
            kv = random_kv(len(block_ids))  # [layers, 2, blocks, ...] in block-table order
            ordered = kv[:, :, list(plan.block_order)].contiguous()  # the staging buffer
            for layer in [5, 2, 0, 4, 4, 1, 3]:
                sender.offer(
                    layer,
                    ordered[layer] if parts == "adjacent" else kv[layer][:, list(plan.block_order)],
                )
            sent = await sender.finish(WAIT_S)
            await receiver.wait(WAIT_S)

            assert torch.equal(as_bytes(cache[:, :, block_ids]), as_bytes(kv))
            assert_zero(cache[:, :, unreserved(block_ids)])
            assert sent == NUM_LAYERS * layer_bytes
            messages = NUM_LAYERS // group
            assert sender.messages_sent == endpoint.sent == messages
            assert receiver.receives_posted == receiver_side.posted == messages
            assert sender.state is receiver.state is TransferState.DONE
            assert receiver.layers_received == NUM_LAYERS and receiver.settled

    asyncio.run(body())


@pytest.mark.parametrize("indexed", [False, True], ids=["per-run", "indexed"])
def test_a_scattered_group_lands_in_its_layers_blocks_and_nowhere_else(indexed: bool) -> None:
    """Both ways ``scatter`` copies a group of 3 layers (per run; one ``index_copy_``, what
    CUDA uses, run here on the CPU)."""
    layer_bytes = SMOLLM2_BF16.layer_bytes(len(SCATTERED))
    cache = new_cache()
    destination = KvDestination(cache, SCATTERED, 3 * layer_bytes, indexed=indexed)
    kv = random_kv(len(SCATTERED))  # [layers, 2, blocks, ...] in block-table order
    order = list(destination.plan.block_order)
    destination.scatter(1, as_bytes(kv[3:6][:, :, order].contiguous()).view(-1))
    assert torch.equal(as_bytes(cache[3:, :, SCATTERED]), as_bytes(kv[3:]))
    assert_zero(cache[:3])
    assert_zero(cache[:, :, unreserved(SCATTERED)])


def test_adjacent_parts_are_sent_as_they_lie_and_others_joined() -> None:
    buffer = torch.arange(24, dtype=torch.uint8).view(3, 8)  # three layers' parts
    joined = _joined([buffer[0], buffer[1], buffer[2]])
    assert joined.data_ptr() == buffer.data_ptr() and torch.equal(joined, buffer.view(-1))
    apart = [buffer[0], buffer[2]]  # a gap between them
    joined = _joined(apart)
    assert joined.data_ptr() != buffer.data_ptr() and torch.equal(joined, torch.cat(apart))
    other = torch.arange(8, dtype=torch.uint8)  # another storage
    assert torch.equal(_joined([buffer[2], other]), torch.cat([buffer[2], other]))


def test_groups_that_do_not_divide_the_layers_are_refused() -> None:
    plan = TransferPlan.for_destination([3, 4], layers_per_message=4)

    async def body() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(InvalidTransferPlanError, match="4 layers a message do not divide 6"):
            LayerSender(_StalledEndpoint(), 1, new_transfer_secret(), NUM_LAYERS, plan, loop)
        sender = LayerSender(_StalledEndpoint(), 1, new_transfer_secret(), 8, plan, loop)
        with pytest.raises(ValueError, match="layer 8 of a transfer of 8 layers"):
            sender.offer(8, random_kv(2)[0])

    asyncio.run(body())
    with pytest.raises(InvalidRequestError, match="do not divide") as caught:
        plan.check_groups(NUM_LAYERS, "target")
    assert caught.value.param == "target"
    plan.check_groups(8, "target")  # divides: nothing raised
    with pytest.raises(InvalidTransferPlanError, match="positive"):
        TransferPlan((0,), (1,), layers_per_message=0)


def test_the_group_crosses_the_wire_and_a_peer_without_it_means_one_layer() -> None:
    plan = TransferPlan.for_destination([9, 3, 4], layers_per_message=3)
    reservation = KvReservation(7, "decode:1", 40, "hash", plan, new_transfer_secret())
    message = convert.reservation_to_proto(reservation)
    assert message.layers_per_message == 3
    assert convert.reservation_from_proto(message) == reservation
    message.ClearField("layers_per_message")  # what a decode worker before groups sends
    assert convert.reservation_from_proto(message).plan.layers_per_message == 1


def test_a_ring_of_groups_wraps_around(
    transport_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three messages of two layers through a ring of two slots: the third group lands in the
    first slot once the first group was copied out."""
    monkeypatch.setattr(staging, "EAGER_BYTES", 1 << 62)
    monkeypatch.setattr(
        "splitserve.transfer.layer_channel.ring_depth", lambda count, size, on_gpu=False: 2
    )
    layer_bytes = SMOLLM2_BF16.layer_bytes(len(SCATTERED))

    async def body() -> None:
        async with counting_link(transport_kind) as (link, _, receiver_side):
            cache = new_cache()
            destination = KvDestination(cache, SCATTERED, 2 * layer_bytes)
            transfer_id, secret = next(_transfer_ids), new_transfer_secret()
            receiver = LayerReceiver(link.receiver, transfer_id, secret, destination)
            plan = destination.plan
            loop = asyncio.get_running_loop()
            sender = LayerSender(link.endpoint, transfer_id, secret, NUM_LAYERS, plan, loop)
            kv = random_kv(len(SCATTERED))
            ordered = kv[:, :, list(plan.block_order)].contiguous()
            for layer in range(NUM_LAYERS):
                sender.offer(layer, ordered[layer])
            await sender.finish(WAIT_S)
            await receiver.wait(WAIT_S)
            assert torch.equal(as_bytes(cache[:, :, SCATTERED]), as_bytes(kv))
            assert receiver_side.most_at_once <= 2 and receiver_side.posted == 3

    asyncio.run(body())


def test_an_operator_sets_the_message_size_on_the_worker_command_line() -> None:
    """``--kv-message-bytes``: the size a worker's receivers group layers to (0: one layer a
    message), the device's default without it; a negative one is refused at start."""
    parser = argparse.ArgumentParser()
    add_worker_args(parser, env={})
    default = transfer_settings_of(parser.parse_args([]))
    assert default.min_message_bytes is None
    assert min_message_bytes(torch.device("cpu"), default.min_message_bytes) == 1 << 20
    off = transfer_settings_of(parser.parse_args(["--kv-message-bytes=0"]))
    assert min_message_bytes(torch.device("cuda"), off.min_message_bytes) == 0
    with pytest.raises(ValueError, match="--kv-message-bytes must be >= 0, not -1"):
        transfer_settings_of(parser.parse_args(["--kv-message-bytes=-1"]))
