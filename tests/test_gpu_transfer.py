"""The layer channel on a CUDA GPU: one message per layer, or per group of 3 layers sent from
one staging buffer as it lies, into a KV cache in device memory, through the staging ring
(copies out of it queued on the transfer stream, one ``index_copy_`` of a group over several
runs, canaries armed and read back by queued copies, one fence a message), over the
in-process transport (its receives complete once the copy ran, as UCX's do) and over UCX
inside this process.

Marked ``gpu``: deselected by default and skipped without CUDA; run it on a GPU machine with
``pytest --noconftest -m gpu tests/test_gpu_transfer.py`` (no conftest fixtures are used).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from splitserve.common.errors import TransferError
from splitserve.transfer.destination import KvDestination
from splitserve.transfer.layer_channel import LayerReceiver, LayerSender, TransferState
from splitserve.transfer.plan import message_tag, new_transfer_secret
from tests import transfer_support as support
from tests.transfer_support import NUM_LAYERS, SCATTERED, WAIT_S, Link, assert_zero

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]

CUDA = torch.device("cuda")


@pytest.fixture(params=["inprocess", "ucx"])
def kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The transport; UCX's process-wide context is reset after its test."""
    if request.param == "ucx":
        ucxx = pytest.importorskip("ucxx")
        torch.empty(1, device=CUDA)  # a current CUDA context before UCX's worker is made
        yield "ucx"
        ucxx.reset()
    else:
        yield "inprocess"


@dataclass
class _Reserved:
    """A receiver posted into ``block_ids`` of a zero cache in device memory."""

    cache: torch.Tensor
    destination: KvDestination
    secret: bytes
    receiver: LayerReceiver

    def sender(self, link: Link) -> LayerSender:
        loop = asyncio.get_running_loop()
        plan = self.destination.plan
        return LayerSender(link.endpoint, 1, self.secret, NUM_LAYERS, plan, loop)


def reserve(
    link: Link, block_ids: list[int], group: int = 1, cache: torch.Tensor | None = None
) -> _Reserved:
    """Posts a receiver into ``block_ids`` of ``cache`` (a new zero cache on the device when
    None: its host-to-device copy synchronizes, so a caller checking for syncs passes one)."""
    cache = support.new_cache().to(CUDA) if cache is None else cache
    layer_bytes = support.SMOLLM2_BF16.layer_bytes(len(block_ids))
    destination = KvDestination(cache, block_ids, (group - 1) * layer_bytes + 1)
    assert destination.plan.layers_per_message == group
    secret = new_transfer_secret()
    receiver = LayerReceiver(link.receiver, 1, secret, destination)
    return _Reserved(cache, destination, secret, receiver)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_ids", [list(range(3, 11)), SCATTERED], ids=["1-run", "4-runs"])
def test_layers_land_bit_exact_in_device_memory(
    kind: str, block_ids: list[int], group: int
) -> None:
    async def body() -> None:
        async with support.open_link(kind) as link:
            reserved = reserve(link, block_ids, group)
            sender = reserved.sender(link)
            kv = support.random_kv(len(block_ids)).to(CUDA)
            order = torch.tensor(reserved.destination.plan.block_order, device=CUDA)
            staging = kv.index_select(2, order)  # queued: sends wait; the layers adjacent
            for layer in range(NUM_LAYERS):
                sender.offer(layer, staging[layer])
            await sender.finish(WAIT_S)
            await reserved.receiver.wait(WAIT_S)
            assert reserved.receiver.state is TransferState.DONE and reserved.receiver.settled
            assert sender.messages_sent == NUM_LAYERS // group
            landed = reserved.cache[:, :, block_ids].cpu()
            assert torch.equal(support.as_bytes(landed), support.as_bytes(kv.cpu()))
            assert_zero(reserved.cache[:, :, support.unreserved(block_ids)].cpu())

    asyncio.run(body())


def test_a_receiver_is_posted_without_waiting_for_the_device(kind: str) -> None:
    """A decode worker posts a receiver on its event loop for every reservation: its
    destination (the scatter's index), canaries and ring are made under CUDA's sync debug mode
    set to fail, so none of it waits for the engine's queued steps; the transfer then lands."""

    async def body() -> None:
        async with support.open_link(kind) as link:
            cache = support.new_cache().to(CUDA)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                reserved = reserve(link, SCATTERED, group=3, cache=cache)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            sender = reserved.sender(link)
            kv = support.random_kv(len(SCATTERED)).to(CUDA)
            order = torch.tensor(reserved.destination.plan.block_order, device=CUDA)
            staging = kv.index_select(2, order)
            for layer in range(NUM_LAYERS):
                sender.offer(layer, staging[layer])
            await sender.finish(WAIT_S)
            await reserved.receiver.wait(WAIT_S)
            landed = reserved.cache[:, :, SCATTERED].cpu()
            assert torch.equal(support.as_bytes(landed), support.as_bytes(kv.cpu()))

    asyncio.run(body())


def test_a_short_layer_fails_the_transfer_naming_it(kind: str) -> None:
    async def body() -> None:
        async with support.open_link(kind) as link:
            reserved = reserve(link, SCATTERED)
            full = torch.ones(reserved.destination.message_bytes, dtype=torch.uint8, device=CUDA)
            await link.endpoint.send(message_tag(reserved.secret, 0), full)
            await link.endpoint.send(message_tag(reserved.secret, 1), full[:-16])
            with pytest.raises(TransferError, match=r"layer 1: .*has (at most )?\d+ bytes"):
                await reserved.receiver.wait(WAIT_S)
            assert reserved.receiver.state is TransferState.FAILED and reserved.receiver.settled
            assert reserved.receiver.layers_received in (0, 1)  # layer 0 may count first
            assert_zero(reserved.cache[2:].cpu())

    asyncio.run(body())


def test_an_aborted_transfer_writes_nothing_more(kind: str) -> None:
    async def body() -> None:
        async with support.open_link(kind) as link:
            reserved = reserve(link, SCATTERED)
            await reserved.receiver.abort()
            assert reserved.receiver.state is TransferState.ABORTED and reserved.receiver.settled
            sender = reserved.sender(link)
            kv = support.random_kv(len(SCATTERED)).to(CUDA)
            for layer in range(NUM_LAYERS):
                sender.offer(layer, kv[layer])
            await support.let_late_sends_run(sender)
            torch.cuda.synchronize()
            assert_zero(reserved.cache.cpu())

    asyncio.run(body())
