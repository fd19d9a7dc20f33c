"""The shape of a KV transfer's bytes: a block table cut into runs (``TransferPlan``), a layer
sent as one message (``layer_message``) and landed in the reserved blocks (``KvDestination``:
straight into a destination that is one region, else scattered out of staging run by run); the
transports' answer to a message of another size than its receive, the size check by canary
(``LayerCanaries``) and a sender whose plan cuts other sizes; the KV layout compatibility
check and a layer's size.

The transport tests run for both backends, UCX inside this one process (see
``test_transfer.py``); the fake cache and the link: ``transfer_support.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from splitserve.common.errors import IncompatibleKvLayoutError, TransferError
from splitserve.common.kv_layout import KvLayout
from splitserve.transfer.canary import CANARY_BYTES, LayerCanaries
from splitserve.transfer.destination import KvDestination
from splitserve.transfer.layer_channel import (
    LayerReceiver,
    LayerSender,
    TransferState,
    layer_message,
)
from splitserve.transfer.plan import TransferPlan, message_tag, new_transfer_secret
from tests.transfer_support import (
    CACHE_BLOCKS,
    NUM_LAYERS,
    SCATTERED,
    SMOLLM2_BF16,
    WAIT_S,
    Link,
    _StalledEndpoint,
    _transfer_ids,
    as_bytes,
    assert_zero,
    let_late_sends_run,
    new_cache,
    open_link,
    random_kv,
    unreserved,
)

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- plans


def test_scattered_table_is_cut_into_runs() -> None:
    plan = TransferPlan.for_destination(SCATTERED)
    assert plan.run_lengths == (1, 2, 3, 2)
    assert [SCATTERED[position] for position in plan.block_order] == sorted(SCATTERED)


# ----------------------------------------------------------------------------- messages


def test_a_layer_is_one_message_k_then_v_without_a_copy() -> None:
    plan = TransferPlan.for_destination(SCATTERED)  # four runs: still one message
    layer = random_kv(len(SCATTERED))[0]  # [2, blocks, ...] in plan order
    message = layer_message(plan, layer)
    assert message.dtype == torch.uint8 and message.is_contiguous()
    assert message.numel() == SMOLLM2_BF16.layer_bytes(len(SCATTERED))
    half = message.numel() // 2
    assert torch.equal(message[:half], as_bytes(layer[0]))  # K of every block, then V
    assert torch.equal(message[half:], as_bytes(layer[1]))
    assert message.data_ptr() == layer.data_ptr()


def test_offering_a_layer_of_the_wrong_block_count_is_refused() -> None:
    async def body() -> None:
        plan = TransferPlan.for_destination(SCATTERED)
        loop = asyncio.get_running_loop()
        sender = LayerSender(_StalledEndpoint(), 1, new_transfer_secret(), NUM_LAYERS, plan, loop)
        with pytest.raises(ValueError, match=r"expected \[2, 8, \.\.\.\] KV"):
            sender.offer(0, random_kv(7)[0])
        with pytest.raises(ValueError, match="expected"):
            layer_message(plan, random_kv(9)[0])
        with pytest.raises(ValueError, match="expected"):
            layer_message(plan, random_kv(8)[0, 0])  # K only
        with pytest.raises(ValueError, match="expected"):
            layer_message(plan, torch.zeros(8, dtype=torch.uint8))
        await asyncio.sleep(0)
        assert sender.state is TransferState.PENDING and sender.bytes_sent == 0
        assert sender.messages_sent == 0

    asyncio.run(body())


# ----------------------------------------------------------------------------- destinations


def test_a_destination_of_some_blocks_is_not_one_region() -> None:
    destination = KvDestination(new_cache(), SCATTERED)
    assert destination.plan == TransferPlan.for_destination(SCATTERED)
    assert destination.num_layers == NUM_LAYERS
    assert destination.message_bytes == SMOLLM2_BF16.layer_bytes(len(SCATTERED))
    assert destination.whole(0) is None  # others' blocks lie between: through staging
    assert KvDestination(new_cache(), range(CACHE_BLOCKS - 1)).whole(0) is None  # one short


def test_a_destination_of_every_block_is_received_straight() -> None:
    """All of the cache's blocks, in any table order: the layer's K and V are one region in
    the message's order, so the receive lands in the cache itself."""
    cache = new_cache()
    table = list(reversed(range(CACHE_BLOCKS)))
    destination = KvDestination(cache, table)
    for layer in range(NUM_LAYERS):
        whole = destination.whole(layer)
        assert whole is not None and whole.dtype == torch.uint8 and whole.is_contiguous()
        assert whole.data_ptr() == cache[layer].data_ptr()
        assert whole.numel() == destination.message_bytes


@pytest.mark.parametrize("block_ids", [[5], list(range(3, 11)), SCATTERED])
def test_scatter_lands_a_layer_in_its_blocks_and_nowhere_else(block_ids: list[int]) -> None:
    cache = new_cache()
    destination = KvDestination(cache, block_ids)
    kv = random_kv(len(block_ids))  # [layers, 2, blocks, ...] in block-table order
    order = list(destination.plan.block_order)
    for layer in (4, 1):
        destination.scatter(layer, layer_message(destination.plan, kv[layer][:, order]))
    landed = cache[:, :, block_ids]
    assert torch.equal(as_bytes(landed[[1, 4]]), as_bytes(kv[[1, 4]]))
    assert_zero(landed[[0, 2, 3, 5]])
    assert_zero(cache[:, :, unreserved(block_ids)])


def test_a_destination_is_refused_for_a_cache_it_does_not_fit() -> None:
    cache = new_cache()
    with pytest.raises(ValueError, match="contiguous"):
        KvDestination(cache.transpose(0, 1), SCATTERED)
    with pytest.raises(ValueError, match="out of range"):
        KvDestination(cache, [3, CACHE_BLOCKS])
    with pytest.raises(ValueError, match="repeat"):
        KvDestination(cache, [3, 4, 3])


# ----------------------------------------------------------------------------- sizes


SIZE_ERRORS = {
    "shorter": (56, "has 56 bytes, receive buffer 64"),
    "one-byte-shorter": (63, "has 63 bytes, receive buffer 64"),
    "empty": (0, "has 0 bytes, receive buffer 64"),
    "longer": (65, r"65 bytes, receive buffer 64|\(64 bytes\) failed: Message truncated"),
}
"""Message sizes sent to a 64-byte receive, and the error each raises in the in-process
transport. UCX reports only a longer message ("Message truncated"): it completes a receive
with a shorter one, which the layer channel's canary then finds (``ucx.py``, Sizes)."""
COMPLETED_BY_UCX = {"shorter", "one-byte-shorter", "empty"}


@pytest.mark.parametrize("receive_first", [True, False])
@pytest.mark.parametrize("mismatch", list(SIZE_ERRORS))
def test_a_message_of_another_size_than_the_receive(
    transport_kind: str, mismatch: str, receive_first: bool
) -> None:
    size, error = SIZE_ERRORS[mismatch]

    async def body() -> None:
        async with open_link(transport_kind) as link:
            tag = message_tag(new_transfer_secret(), 0)
            buffer = torch.full((64,), 7, dtype=torch.uint8)
            message = torch.zeros(size, dtype=torch.uint8)
            if receive_first:
                receive = asyncio.ensure_future(link.receiver.recv(tag, buffer))
                await asyncio.sleep(0.01)
                await asyncio.wait_for(link.endpoint.send(tag, message), WAIT_S)
            else:
                await asyncio.wait_for(link.endpoint.send(tag, message), WAIT_S)
                receive = asyncio.ensure_future(link.receiver.recv(tag, buffer))
            if transport_kind == "ucx" and mismatch in COMPLETED_BY_UCX:
                await asyncio.wait_for(receive, WAIT_S)  # the contract: the caller checks
                assert not buffer[:size].any() and bool((buffer[size:] == 7).all())
                return
            with pytest.raises(TransferError, match=error):
                await asyncio.wait_for(receive, WAIT_S)

    asyncio.run(body())


@pytest.mark.parametrize("message_bytes", [0, 4, 64])
def test_a_canary_finds_a_message_at_least_its_size_short(message_bytes: int) -> None:
    """Armed, the tail of a buffer holds the canary; a full message overwrites it, one that
    stops ``CANARY_BYTES`` or more short leaves it; 1 to 7 bytes short passes (the limit). A
    buffer under 8 bytes is checked whole; an empty one has nothing to check."""
    layers = 5
    canaries = LayerCanaries(layers, message_bytes, torch.device("cpu"))
    assert canaries.size == min(CANARY_BYTES, message_bytes)
    buffer = torch.zeros(message_bytes, dtype=torch.uint8)
    cases = {  # layer: bytes the message fills from the start of the buffer
        0: message_bytes,
        1: 0,
        2: max(0, message_bytes - CANARY_BYTES),
        3: max(0, message_bytes - 1),
        4: message_bytes,
    }
    for layer, filled in cases.items():
        canaries.arm(layer, buffer)
        buffer[:filled] = torch.arange(1, filled + 1, dtype=torch.uint8)  # the message lands
        canaries.read(layer, buffer)
        found_short = canaries.short(layer)
        if message_bytes == 0:
            assert not found_short  # nothing to check
        elif filled == message_bytes:
            assert not found_short
        elif filled <= message_bytes - canaries.size:
            assert found_short, f"layer {layer}: {filled} of {message_bytes} bytes"
        else:
            assert not found_short  # 1 to 7 bytes short: the documented limit


def test_canaries_are_fresh_for_each_transfer_and_layer() -> None:
    first = LayerCanaries(4, 64, torch.device("cpu"))
    second = LayerCanaries(4, 64, torch.device("cpu"))
    buffer = torch.zeros(64, dtype=torch.uint8)
    tails = []
    for canaries in (first, second):
        for layer in range(4):
            canaries.arm(layer, buffer)
            tails.append(buffer[-CANARY_BYTES:].numpy().tobytes())
    assert len(set(tails)) == len(tails)


async def receive_with_mismatched_sender(
    link: Link, cache: torch.Tensor, block_ids: list[int], sender_blocks: int, group: int = 1
) -> tuple[LayerSender, LayerReceiver]:
    """A receiver into ``block_ids``, ``group`` layers a message, and a sender of the same
    transfer whose plan has ``sender_blocks`` blocks (messages of another size); the first
    group's layers offered."""
    layer_bytes = SMOLLM2_BF16.layer_bytes(len(block_ids))
    destination = KvDestination(cache, block_ids, (group - 1) * layer_bytes + 1)
    assert destination.plan.layers_per_message == group
    transfer_id, secret = next(_transfer_ids), new_transfer_secret()
    receiver = LayerReceiver(link.receiver, transfer_id, secret, destination)
    other = TransferPlan.for_destination(range(sender_blocks), group)
    loop = asyncio.get_running_loop()
    sender = LayerSender(link.endpoint, transfer_id, secret, NUM_LAYERS, other, loop)
    kv = random_kv(sender_blocks)
    for layer in range(group):
        sender.offer(layer, kv[layer])
    return sender, receiver


@pytest.mark.parametrize(("group", "named"), [(1, "layer 0"), (2, "layers 0-1")])
@pytest.mark.parametrize(
    ("block_ids", "sender_blocks"), [([6, 7], 1), ([6], 2)], ids=["shorter", "longer"]
)
def test_a_size_mismatch_fails_the_layer_receiver_naming_the_layer(
    transport_kind: str, block_ids: list[int], sender_blocks: int, group: int, named: str
) -> None:
    """A sender whose plan has another block count: the first message (of one layer, or a
    group of two) fails the transfer, shorter (the canary, or the in-process transport) or
    longer (the transport), naming its layers. Nothing lands outside the reserved blocks."""

    async def body() -> None:
        async with open_link(transport_kind) as link:
            cache = new_cache()
            sender, receiver = await receive_with_mismatched_sender(
                link, cache, block_ids, sender_blocks, group
            )
            with pytest.raises(TransferError, match=rf"{named}: .*") as failed:
                await receiver.wait(WAIT_S)
            assert "receive buffer" in str(failed.value) or "truncated" in str(failed.value)
            assert receiver.state is TransferState.FAILED and receiver.settled
            assert receiver.layers_received == 0
            assert_zero(cache[:, :, unreserved(block_ids)])
            assert_zero(cache[group:])  # no later message was scattered
            await let_late_sends_run(sender)

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
