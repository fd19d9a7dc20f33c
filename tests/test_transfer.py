"""KV transfer: layer-wise sender/receiver over the in-process and the UCX transport, the tag
packing, and the KV layout compatibility check.

Every transport test runs for both backends. UCX runs inside this one process: the transport
sends to its own worker address. ``ucxx`` allows one application context per process, so the
``transport_kind`` fixture resets it after each UCX test; every test body runs in its own
``asyncio.run`` and creates its transport on that loop. No test may hang: each carries a
timeout, and every wait in the code under test is bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

from splitserve.transfer.errors import (
    IncompatibleKvLayoutError,
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from splitserve.transfer.inprocess import InProcessTransport
from splitserve.transfer.layer_channel import LayerReceiver, LayerSender, TransferState
from splitserve.transfer.layout import KvLayout
from splitserve.transfer.transport import (
    LAYER_BITS,
    MAX_TRANSFER_ID,
    KvEndpoint,
    KvTransport,
    layer_tag,
)

pytestmark = pytest.mark.timeout(60)

NUM_LAYERS = 6
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

_transfer_ids = itertools.count(1)


@pytest.fixture(params=["inprocess", "ucx"])
def transport_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The backend under test; after a UCX test the process-wide ucxx context is reset."""
    kind: str = request.param
    if kind == "ucx":
        ucxx = pytest.importorskip("ucxx")
        yield kind
        ucxx.reset()
    else:
        yield kind


@dataclass
class Link:
    """A one-way path: ``endpoint`` sends to ``receiver``; ``executor`` runs scatters."""

    receiver: KvTransport
    endpoint: KvEndpoint
    executor: concurrent.futures.Executor


@contextlib.asynccontextmanager
async def open_link(kind: str) -> AsyncIterator[Link]:
    """Transports for ``kind`` on the running loop; closed (and the executor shut) on exit."""
    transports: list[KvTransport]
    if kind == "ucx":
        from splitserve.transfer.ucx import UcxTransport

        transports = [UcxTransport()]  # one per process: it sends to its own address
    else:
        transports = [InProcessTransport(), InProcessTransport()]
    sender_side, receiver_side = transports[0], transports[-1]
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scatter")
    try:
        endpoint = await sender_side.connect(receiver_side.address)
        yield Link(receiver_side, endpoint, executor)
    finally:
        executor.shutdown(wait=True)
        for transport in transports:
            await transport.close()


def random_kv(num_blocks: int) -> torch.Tensor:
    """Random bytes viewed as ``NUM_LAYERS`` layers of bf16 KV:
    ``[layers, 2, blocks, block_size, kv_heads, head_dim]``."""
    layout = SMOLLM2_BF16
    raw = torch.randint(0, 256, (NUM_LAYERS, layout.layer_bytes(num_blocks)), dtype=torch.uint8)
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return raw.view(torch.bfloat16).view(NUM_LAYERS, *shape)


def as_bytes(kv: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view, so that comparisons are bitwise (random bf16 bytes include NaNs)."""
    return kv.reshape(-1).view(torch.uint8)


class RecordingScatter:
    """A scatter that copies each landed layer into ``destination`` (as the decode worker
    writes into its reserved blocks) and records calls; optionally slow, to race with abort."""

    def __init__(self, destination: torch.Tensor, delay_s: float = 0.0) -> None:
        self.destination = destination
        self.delay_s = delay_s
        self.layers: list[int] = []
        self.running = 0
        self.started = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, layer: int, data: torch.Tensor) -> None:
        with self._lock:
            self.running += 1
            self.layers.append(layer)
        self.started.set()
        try:
            time.sleep(self.delay_s)
            as_bytes(self.destination[layer]).copy_(data)
        finally:
            with self._lock:
                self.running -= 1


def make_pair(
    link: Link, num_blocks: int, scatter: RecordingScatter
) -> tuple[LayerSender, LayerReceiver]:
    """A receiver posted before its sender, as the decode worker reserves before the push."""
    transfer_id = next(_transfer_ids)
    layer_nbytes = SMOLLM2_BF16.layer_bytes(num_blocks)
    receiver = LayerReceiver(
        link.receiver, transfer_id, NUM_LAYERS, layer_nbytes, scatter, link.executor
    )
    sender = LayerSender(link.endpoint, transfer_id, NUM_LAYERS, asyncio.get_running_loop())
    return sender, receiver


def offer_from_thread(sender: LayerSender, kv: torch.Tensor, order: Sequence[int]) -> None:
    """Offer ``kv[layer]`` for each layer of ``order`` from another thread (the engine's)."""

    def engine_thread() -> None:
        for layer in order:
            time.sleep(0.001)  # the engine computes the next layer
            sender.offer(layer, kv[layer])

    thread = threading.Thread(target=engine_thread, name="engine")
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive()


@pytest.mark.parametrize("num_blocks", [1, 64])
def test_layers_offered_from_engine_thread_arrive_bit_exact(
    transport_kind: str, num_blocks: int
) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            kv = random_kv(num_blocks)
            scatter = RecordingScatter(torch.zeros_like(kv))
            sender, receiver = make_pair(link, num_blocks, scatter)
            await asyncio.to_thread(offer_from_thread, sender, kv, range(NUM_LAYERS))
            sent = await sender.finish(WAIT_S)
            await receiver.wait(WAIT_S)

            assert torch.equal(as_bytes(scatter.destination), as_bytes(kv))
            assert sent == NUM_LAYERS * SMOLLM2_BF16.layer_bytes(num_blocks) == kv.numel() * 2
            assert scatter.layers == list(range(NUM_LAYERS))
            assert sender.state is receiver.state is TransferState.DONE
            assert receiver.layers_received == NUM_LAYERS

    asyncio.run(body())


def test_layers_offered_out_of_order_and_twice_arrive_bit_exact(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            kv = random_kv(num_blocks=8)
            scatter = RecordingScatter(torch.zeros_like(kv))
            sender, receiver = make_pair(link, 8, scatter)
            order = [5, 2, 0, 4, 4, 1, 3, 0]  # a repeated offer of a layer is ignored
            await asyncio.to_thread(offer_from_thread, sender, kv, order)
            sent = await sender.finish(WAIT_S)
            await receiver.wait(WAIT_S)

            assert torch.equal(as_bytes(scatter.destination), as_bytes(kv))
            assert sent == NUM_LAYERS * SMOLLM2_BF16.layer_bytes(8)
            assert scatter.layers == list(range(NUM_LAYERS))  # scattered in layer order
            assert sender.state is receiver.state is TransferState.DONE

    asyncio.run(body())


def test_receiver_without_sender_times_out_and_fails(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            scatter = RecordingScatter(torch.zeros_like(random_kv(2)))
            _, receiver = make_pair(link, 2, scatter)
            started = time.monotonic()
            with pytest.raises(TransferTimeoutError, match="0/6 layers"):
                await receiver.wait(0.3)
            assert time.monotonic() - started < 5.0
            assert receiver.state is TransferState.FAILED
            assert scatter.layers == [] and scatter.running == 0

    asyncio.run(body())


def test_sender_finish_times_out_when_layers_are_missing(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            kv = random_kv(num_blocks=4)
            scatter = RecordingScatter(torch.zeros_like(kv))
            sender, receiver = make_pair(link, 4, scatter)
            await asyncio.to_thread(offer_from_thread, sender, kv, [0, 1, 2])
            with pytest.raises(TransferTimeoutError, match="3/6 layers offered"):
                await sender.finish(0.3)
            assert sender.state is TransferState.FAILED
            sender.offer(3, kv[3])  # too late: a terminal transfer sends nothing more
            with pytest.raises(TransferTimeoutError, match="3/6 layers arrived"):
                await receiver.wait(0.3)
            assert receiver.state is TransferState.FAILED
            assert torch.equal(as_bytes(scatter.destination[:3]), as_bytes(kv[:3]))

    asyncio.run(body())


def test_receiver_abort_stops_wait_and_scatter(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            kv = random_kv(num_blocks=4)
            scatter = RecordingScatter(torch.zeros_like(kv), delay_s=0.1)
            sender, receiver = make_pair(link, 4, scatter)
            pending_wait = asyncio.ensure_future(receiver.wait(WAIT_S))
            await asyncio.to_thread(offer_from_thread, sender, kv, range(NUM_LAYERS))
            assert await asyncio.to_thread(scatter.started.wait, WAIT_S)

            await receiver.abort()
            assert scatter.running == 0  # the scatter in flight has returned
            scattered = len(scatter.layers)
            with pytest.raises(TransferAbortedError):
                await pending_wait
            with pytest.raises(TransferAbortedError):
                await receiver.wait(WAIT_S)
            await asyncio.sleep(0.3)  # room for a late scatter, which must not come
            assert len(scatter.layers) == scattered < NUM_LAYERS and scatter.running == 0
            assert receiver.state is TransferState.ABORTED
            sender.abort()

    asyncio.run(body())


def test_receiver_abort_before_any_layer(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            scatter = RecordingScatter(torch.zeros_like(random_kv(2)))
            _, receiver = make_pair(link, 2, scatter)
            pending_wait = asyncio.ensure_future(receiver.wait(WAIT_S))
            await asyncio.sleep(0.05)
            await receiver.abort()
            with pytest.raises(TransferAbortedError):
                await pending_wait
            assert receiver.state is TransferState.ABORTED and scatter.layers == []

    asyncio.run(body())


def test_sender_abort_before_all_layers_fails_finish(transport_kind: str) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            kv = random_kv(num_blocks=4)
            sender, receiver = make_pair(link, 4, RecordingScatter(torch.zeros_like(kv)))
            await asyncio.to_thread(offer_from_thread, sender, kv, [0, 1])
            pending_finish = asyncio.ensure_future(sender.finish(WAIT_S))
            await asyncio.sleep(0.05)
            sender.abort()
            with pytest.raises(TransferAbortedError):
                await pending_finish
            with pytest.raises(TransferAbortedError):
                await sender.finish(WAIT_S)
            assert sender.state is TransferState.ABORTED
            await receiver.abort()

    asyncio.run(body())


class _StalledEndpoint(KvEndpoint):
    """An endpoint whose sends never complete (a peer that stopped reading)."""

    async def send(self, tag: int, buffer: torch.Tensor) -> None:
        await asyncio.Event().wait()


def test_sender_abort_with_sends_in_flight_fails_finish() -> None:
    async def body() -> None:
        sender = LayerSender(_StalledEndpoint(), 1, NUM_LAYERS, asyncio.get_running_loop())
        for layer in range(NUM_LAYERS):
            sender.offer(layer, torch.zeros(16, dtype=torch.uint8))
        pending_finish = asyncio.ensure_future(sender.finish(WAIT_S))
        await asyncio.sleep(0.05)
        assert sender.state is TransferState.ACTIVE and not pending_finish.done()
        sender.abort()
        with pytest.raises(TransferAbortedError):
            await pending_finish
        assert sender.state is TransferState.ABORTED

    asyncio.run(body())


@pytest.mark.parametrize("receive_first", [True, False])
def test_inprocess_size_mismatch_is_a_transfer_error(receive_first: bool) -> None:
    async def body() -> None:
        async with open_link("inprocess") as link:
            tag = layer_tag(next(_transfer_ids), 0)
            buffer = torch.empty(64, dtype=torch.uint8)
            message = torch.zeros(65, dtype=torch.uint8)
            if receive_first:
                receive = asyncio.ensure_future(link.receiver.recv(tag, buffer))
                await asyncio.sleep(0)
                await link.endpoint.send(tag, message)
            else:
                await link.endpoint.send(tag, message)
                receive = asyncio.ensure_future(link.receiver.recv(tag, buffer))
            with pytest.raises(TransferError, match="65 bytes, receive buffer 64"):
                await receive

    asyncio.run(body())


def test_inprocess_size_mismatch_fails_the_layer_receiver() -> None:
    async def body() -> None:
        async with open_link("inprocess") as link:
            kv = random_kv(num_blocks=2)
            scatter = RecordingScatter(torch.zeros_like(kv))
            sender, receiver = make_pair(link, 2, scatter)
            sender.offer(0, kv[0, :, :1])  # one block where the receiver reserved two
            with pytest.raises(TransferError):
                await receiver.wait(WAIT_S)
            assert receiver.state is TransferState.FAILED and scatter.layers == []
            sender.abort()

    asyncio.run(body())


def test_layer_tag_packs_transfer_and_layer() -> None:
    assert layer_tag(0, 0) == 0
    assert layer_tag(1, 2) == (1 << LAYER_BITS) | 2
    assert layer_tag(MAX_TRANSFER_ID, (1 << LAYER_BITS) - 1) == (1 << 64) - 1
    tags = {layer_tag(transfer, layer) for transfer in range(4) for layer in range(40)}
    assert len(tags) == 4 * 40


@pytest.mark.parametrize(
    ("transfer_id", "layer"),
    [(-1, 0), (MAX_TRANSFER_ID + 1, 0), (0, -1), (0, 1 << LAYER_BITS)],
)
def test_layer_tag_rejects_out_of_range(transfer_id: int, layer: int) -> None:
    with pytest.raises(ValueError, match="tag out of range"):
        layer_tag(transfer_id, layer)


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
