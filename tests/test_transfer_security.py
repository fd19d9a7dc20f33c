"""KV transfers nobody can forge: a message aimed at reserved blocks with a guessed tag never
lands there, a layer's message shorter than planned fails the transfer naming the layer, and
the transfer still completes bit for bit with the real sender's KV. Both transports (UCX in this one
process, see ``test_transfer.py``), a float32 KV cache compared byte for byte.

The secret crosses the wire intact, only at its size, and never shows in a repr; the
coordinator relays a reservation unread, and a forged plan is refused where it is used. The tag
function itself (same secret and index, same tag; other secrets, other tags) is tested in
``test_transfer_plan.py``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from splitserve.common.errors import InvalidRequestError, TransferError
from splitserve.proto import convert
from splitserve.proto.worker_clients import RelayedReservation
from splitserve.transfer.destination import KvDestination
from splitserve.transfer.layer_channel import LayerReceiver, LayerSender, TransferState
from splitserve.transfer.plan import TransferPlan, message_tag, new_transfer_secret
from splitserve.transfer.reservation import KvReservation
from tests.transfer_support import WAIT_S, Link, let_late_sends_run, open_link

pytestmark = pytest.mark.timeout(60)

NUM_LAYERS = 3
CACHE_BLOCKS = 16
BLOCK_SHAPE = (4, 2, 8)
"""block_size, kv_heads, head_dim: small, so every message goes eagerly (no rendezvous)."""
RESERVED = [9, 10, 2, 3, 4, 13]
"""Three runs (2-4; 9-10; 13): still one message per layer."""
OLD_MESSAGE_BITS = 20
"""The old tag packing this guards against: ``transfer_id << 20 | message index``."""


@dataclass
class Reservation:
    """A receiver posted into ``RESERVED`` blocks of a zero float32 ``cache``."""

    cache: torch.Tensor
    """``[layers, 2, CACHE_BLOCKS, *BLOCK_SHAPE]`` float32, zero outside what lands."""
    plan: TransferPlan
    transfer_id: int
    secret: bytes
    receiver: LayerReceiver

    @property
    def num_messages(self) -> int:
        return NUM_LAYERS  # one per layer

    def message_bytes(self) -> list[int]:
        """Planned size of each message, by index (the layer): K and V of every block."""
        block_size, kv_heads, head_dim = BLOCK_SHAPE
        block_bytes = block_size * kv_heads * head_dim * 4  # float32
        return [2 * self.plan.num_blocks * block_bytes] * NUM_LAYERS

    def sender(self, link: Link) -> LayerSender:
        """The legitimate prefill side's sender of this transfer."""
        loop = asyncio.get_running_loop()
        return LayerSender(
            link.endpoint, self.transfer_id, self.secret, NUM_LAYERS, self.plan, loop
        )


def reserve(link: Link) -> Reservation:
    cache = torch.zeros(NUM_LAYERS, 2, CACHE_BLOCKS, *BLOCK_SHAPE, dtype=torch.float32)
    destination = KvDestination(cache, RESERVED)
    transfer_id = secrets.randbelow((1 << (64 - OLD_MESSAGE_BITS)) - 2) + 1
    secret = new_transfer_secret()
    receiver = LayerReceiver(link.receiver, transfer_id, secret, destination)
    return Reservation(cache, destination.plan, transfer_id, secret, receiver)


def real_kv() -> torch.Tensor:
    """The prompt's KV, ``[layers, 2, len(RESERVED), *BLOCK_SHAPE]`` in block-table order."""
    return torch.randn(NUM_LAYERS, 2, len(RESERVED), *BLOCK_SHAPE, dtype=torch.float32)


async def push(link: Link, reservation: Reservation, kv: torch.Tensor) -> None:
    """The legitimate prefill side: every layer, gathered in plan order, sent under the
    reservation's secret."""
    sender = reservation.sender(link)
    order = list(reservation.plan.block_order)
    for layer in range(NUM_LAYERS):
        sender.offer(layer, kv[layer][:, order])
    await sender.finish(WAIT_S)


def old_style_tags(transfer_id: int, num_messages: int) -> list[int]:
    """Tags an attacker who knows (or guesses near) the transfer id would try: the old packing
    for that id and its neighbours, and the bare message indices (transfer id 0)."""
    ids = [transfer_id - 1, transfer_id, transfer_id + 1, 0]
    return [(tid << OLD_MESSAGE_BITS) | index for tid in ids for index in range(num_messages)]


async def forge(link: Link, tags: Sequence[int], sizes: Sequence[int]) -> None:
    """Send a poison message (float32 1e30 everywhere) of each planned size to each tag, as
    anyone who can reach the decode worker's transport could."""
    poison = [torch.full((size // 4,), 1e30).view(torch.uint8) for size in sizes]
    sends = [link.endpoint.send(tag, poison[index % len(poison)]) for index, tag in enumerate(tags)]
    await asyncio.wait_for(asyncio.gather(*sends), WAIT_S)  # eager: complete unreceived


def assert_nothing_landed(reservation: Reservation) -> None:
    """The cache is still all zero (the receives and their canaries are in the receiver's
    staging, never in the cache)."""
    assert not reservation.cache.view(torch.uint8).any()


def assert_landed_exactly(reservation: Reservation, kv: torch.Tensor) -> None:
    """The reserved blocks hold ``kv`` byte for byte; every other block is still zero."""
    landed = reservation.cache[:, :, RESERVED]
    assert torch.equal(landed.contiguous().view(torch.uint8), kv.contiguous().view(torch.uint8))
    others = [block for block in range(CACHE_BLOCKS) if block not in RESERVED]
    assert not reservation.cache[:, :, others].view(torch.uint8).any()


def test_messages_with_guessed_tags_never_land_and_the_real_kv_does(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            reservation = reserve(link)
            sizes = reservation.message_bytes()
            tags = old_style_tags(reservation.transfer_id, reservation.num_messages)
            tags += [message_tag(new_transfer_secret(), index) for index in range(len(sizes))]
            await forge(link, tags, sizes)
            await asyncio.sleep(0.05)  # room for a forged message to land, which must not
            assert_nothing_landed(reservation)

            kv = real_kv()
            await push(link, reservation, kv)
            await reservation.receiver.wait(WAIT_S)
            assert reservation.receiver.state is TransferState.DONE
            assert_landed_exactly(reservation, kv)

    asyncio.run(body())


@pytest.mark.parametrize("layer", [0, 1])
def test_a_message_shorter_than_planned_fails_the_transfer(transport_kind: str, layer: int) -> None:
    """The holder of the secret sends layer ``layer``'s message two floats short (after a
    full layer 0 for layer 1): the transfer fails naming that layer, never completing as if
    its blocks were filled. (Two floats: the receiver's canary sees a message at least 8 bytes
    short, see ``canary.py``; the in-process transport any shortfall.)"""

    async def body() -> None:
        async with open_link(transport_kind) as link:
            reservation = reserve(link)
            sizes = reservation.message_bytes()
            if layer == 1:
                full = torch.ones(sizes[0] // 4, dtype=torch.float32).view(torch.uint8)
                await link.endpoint.send(message_tag(reservation.secret, 0), full)
                # landed and counted before the short one is sent: a failure ends the wait for
                # a message still being copied (the receiver fails fast), so over UCX the
                # short one could otherwise win the race (seen once in a full suite run)
                async with asyncio.timeout(WAIT_S):
                    while reservation.receiver.layers_received < 1:
                        await asyncio.sleep(0.001)
            short = torch.ones(sizes[layer] // 4 - 2, dtype=torch.float32).view(torch.uint8)
            tag = message_tag(reservation.secret, layer)
            sending = asyncio.ensure_future(link.endpoint.send(tag, short))
            expected = rf"layer {layer}: .*has (at most )?{short.numel()} bytes"
            with pytest.raises(TransferError, match=expected):
                await reservation.receiver.wait(WAIT_S)
            assert reservation.receiver.state is TransferState.FAILED
            assert reservation.receiver.settled  # the other receives were withdrawn
            assert reservation.receiver.layers_received == layer  # never the short one
            await asyncio.wait_for(sending, WAIT_S)
            others = [block for block in range(CACHE_BLOCKS) if block not in RESERVED]
            assert not reservation.cache[:, :, others].view(torch.uint8).any()

            # the real sender, too late: the transfer stays failed, nothing more lands
            before = reservation.cache.clone()
            late = reservation.sender(link)
            kv = real_kv()
            for late_layer in range(NUM_LAYERS):
                late.offer(late_layer, kv[late_layer][:, list(reservation.plan.block_order)])
            await let_late_sends_run(late)
            assert torch.equal(reservation.cache.view(torch.uint8), before.view(torch.uint8))
            assert reservation.receiver.state is TransferState.FAILED

    asyncio.run(body())


# ----------------------------------------------------------------------------- the secret


def sample_reservation() -> KvReservation:
    plan = TransferPlan.for_destination(RESERVED)
    return KvReservation(2**63 + 5, "decode:1", 21, "hash", plan, new_transfer_secret())


def test_the_secret_crosses_the_wire_intact() -> None:
    reservation = sample_reservation()
    message = convert.reservation_to_proto(reservation)
    assert message.transfer_secret == reservation.transfer_secret
    assert convert.reservation_from_proto(message) == reservation


@pytest.mark.parametrize("size", [0, 8, 15, 17, 32])
def test_a_reservation_with_a_secret_of_another_size_is_refused(size: int) -> None:
    message = convert.reservation_to_proto(sample_reservation())
    message.transfer_secret = bytes(size)
    with pytest.raises(InvalidRequestError, match="secret") as caught:
        convert.reservation_from_proto(message)
    assert caught.value.param == "target"


def test_the_secret_is_never_in_a_reservations_repr() -> None:
    reservation = sample_reservation()
    assert reservation.transfer_secret.hex() not in repr(reservation)
    assert repr(reservation.transfer_secret) not in repr(reservation)


def test_the_coordinator_relays_a_reservation_unread_and_the_prefill_side_checks_it() -> None:
    """The coordinator passes the decode worker's message on as it came; a forged plan is
    refused where the plan is used (the prefill worker's conversion), and the relay's repr
    hides the secret like the reservation's."""
    reservation = sample_reservation()
    relayed = RelayedReservation(convert.reservation_to_proto(reservation))
    assert convert.reservation_from_proto(relayed.message) == reservation
    assert reservation.transfer_secret.hex() not in repr(relayed)
    assert repr(reservation.transfer_secret) not in repr(relayed)
    forged = convert.reservation_to_proto(reservation)
    forged.block_order[0] = forged.block_order[1]  # not a permutation of the blocks
    relayed = RelayedReservation(forged)  # nothing read on the way
    with pytest.raises(InvalidRequestError, match="transfer plan") as caught:
        convert.reservation_from_proto(relayed.message)
    assert caught.value.param == "target"
