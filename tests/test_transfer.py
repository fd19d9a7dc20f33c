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

from splitserve.transfer.buffer_pool import PAGE_BYTES, BufferPool, size_class
from splitserve.transfer.errors import (
    IncompatibleKvLayoutError,
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from splitserve.transfer.inprocess import InProcessTransport
from splitserve.transfer.layer_channel import (
    LayerReceiver,
    LayerSender,
    TransferState,
    ring_size,
)
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


# ----------------------------------------------------------------------------- buffer pool


def test_size_class_rounds_to_pages_then_to_quarter_powers_of_two() -> None:
    page = PAGE_BYTES
    assert [size_class(n) for n in (0, 1, page, page + 1, 4 * page)] == [
        page,
        page,
        page,
        2 * page,
        4 * page,
    ]
    assert size_class(4 * page + 1) == 5 * page  # a quarter of 4 pages
    mib = 1 << 20
    assert size_class(mib + 1) == mib + mib // 4
    assert size_class(3 * mib) == 3 * mib  # 4k-token layers of the default model fit exactly
    assert size_class(3 * mib + 1) == 3 * mib + mib // 2
    for nbytes in [*range(1, 70_000, 997), *(SMOLLM2_BF16.layer_bytes(b) for b in range(1, 300))]:
        capacity = size_class(nbytes)
        assert capacity >= nbytes and capacity % page == 0
        assert capacity <= max(nbytes * 1.25, page) or capacity - nbytes < page


def test_pool_lends_exact_views_and_reuses_released_memory() -> None:
    pool = BufferPool()
    first = pool.acquire(1000)
    assert first.shape == (1000,) and first.dtype == torch.uint8 and first.is_contiguous()
    address = first.data_ptr()
    pool.release(first)
    second = pool.acquire(900)  # same size class: the same memory
    assert second.shape == (900,) and second.data_ptr() == address
    other = pool.acquire(5 * PAGE_BYTES)  # another class: new memory
    assert other.data_ptr() != address
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.leased_buffers, stats.idle_buffers) == (1, 2, 2, 0)
    pool.release(second)
    pool.release(other)
    assert pool.stats().retained_bytes == 6 * PAGE_BYTES


def test_pool_bound_frees_the_least_recently_released() -> None:
    pool = BufferPool(max_retained_bytes=2 * PAGE_BYTES)
    views = [pool.acquire(PAGE_BYTES) for _ in range(3)]
    addresses = [view.data_ptr() for view in views]
    for view in views:
        pool.release(view)
    stats = pool.stats()
    assert (stats.retained_bytes, stats.idle_buffers, stats.freed) == (2 * PAGE_BYTES, 2, 1)
    again = [pool.acquire(PAGE_BYTES) for _ in range(2)]
    assert [view.data_ptr() for view in again] == [addresses[2], addresses[1]]  # newest first
    assert pool.stats().hits == 2


def test_pool_frees_a_buffer_larger_than_its_bound() -> None:
    pool = BufferPool(max_retained_bytes=0)
    pool.release(pool.acquire(10))
    stats = pool.stats()
    assert (stats.retained_bytes, stats.idle_buffers, stats.freed, stats.leased_buffers) == (
        0,
        0,
        1,
        0,
    )


def test_pool_refuses_foreign_and_double_releases() -> None:
    pool = BufferPool()
    view = pool.acquire(64)
    pool.release(view)
    with pytest.raises(ValueError, match="not leased"):
        pool.release(view)
    with pytest.raises(ValueError, match="not leased"):
        pool.release(torch.empty(64, dtype=torch.uint8))


def test_pool_pretouch_lends_usable_buffers() -> None:
    pool = BufferPool(pretouch=True)
    view = pool.acquire(3 * PAGE_BYTES + 5)
    view.fill_(7)
    assert int(view.sum()) == 7 * view.numel()
    pool.release(view)


def test_pool_is_consistent_under_concurrent_threads() -> None:
    pool = BufferPool(max_retained_bytes=8 * PAGE_BYTES)

    def churn(seed: int) -> None:
        for step in range(300):
            view = pool.acquire(((seed + step) % 5 + 1) * PAGE_BYTES)
            view[0] = seed  # a lent buffer belongs to one holder at a time
            assert int(view[0]) == seed
            pool.release(view)

    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        list(executor.map(churn, range(4)))
    stats = pool.stats()
    assert stats.leased_buffers == 0 and stats.retained_bytes <= 8 * PAGE_BYTES
    assert stats.hits + stats.misses == 4 * 300


def test_ring_size_covers_the_receive_window() -> None:
    mib = 1 << 20
    assert ring_size(30, 3 * mib, window_bytes=16 * mib) == 6
    assert ring_size(30, SMOLLM2_BF16.layer_bytes(8), window_bytes=16 * mib) == 30
    assert ring_size(30, 64 * mib, window_bytes=16 * mib) == 2  # never fewer than two
    assert ring_size(1, 64 * mib) == 1 and ring_size(0, mib) == 0


# ----------------------------------------------------------------------------- receive buffers


def make_pooled_receiver(
    link: Link, pool: BufferPool, num_blocks: int, scatter: RecordingScatter
) -> tuple[LayerSender, LayerReceiver]:
    """Like ``make_pair``, with a ring of two buffers from ``pool``."""
    transfer_id = next(_transfer_ids)
    receiver = LayerReceiver(
        link.receiver,
        transfer_id,
        NUM_LAYERS,
        SMOLLM2_BF16.layer_bytes(num_blocks),
        scatter,
        link.executor,
        num_buffers=2,
        pool=pool,
    )
    sender = LayerSender(link.endpoint, transfer_id, NUM_LAYERS, asyncio.get_running_loop())
    return sender, receiver


class RecordingPool(BufferPool):
    """A pool that records the address of every buffer it lends."""

    def __init__(self) -> None:
        super().__init__()
        self.lent: list[int] = []

    def acquire(self, nbytes: int) -> torch.Tensor:
        view = super().acquire(nbytes)
        self.lent.append(view.data_ptr())
        return view


class AddressScatter(RecordingScatter):
    """Also records the address of each buffer a layer was scattered from."""

    def __init__(self, destination: torch.Tensor) -> None:
        super().__init__(destination)
        self.addresses: set[int] = set()

    def __call__(self, layer: int, data: torch.Tensor) -> None:
        self.addresses.add(data.data_ptr())
        super().__call__(layer, data)


def test_receiver_returns_its_buffers_after_done_and_the_next_reuses_them(
    transport_kind: str,
) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            pool = BufferPool()
            kv = random_kv(num_blocks=4)
            rounds = []
            for _ in range(2):
                scatter = AddressScatter(torch.zeros_like(kv))
                sender, receiver = make_pooled_receiver(link, pool, 4, scatter)
                assert pool.stats().leased_buffers == 2
                await asyncio.to_thread(offer_from_thread, sender, kv, range(NUM_LAYERS))
                await sender.finish(WAIT_S)
                await receiver.wait(WAIT_S)
                assert torch.equal(as_bytes(scatter.destination), as_bytes(kv))
                stats = pool.stats()
                assert (stats.leased_buffers, stats.idle_buffers) == (0, 2)
                rounds.append(scatter.addresses)
            assert len(rounds[0]) == 2 and rounds[1] == rounds[0]
            assert (pool.stats().misses, pool.stats().hits) == (2, 2)

    asyncio.run(body())


@pytest.mark.parametrize("ending", ["abort", "timeout"])
def test_buffer_of_a_pending_receive_is_reused_only_after_it_lands(
    transport_kind: str, ending: str
) -> None:
    async def body() -> None:
        async with open_link(transport_kind) as link:
            pool = RecordingPool()
            kv = random_kv(num_blocks=2)
            scatter = RecordingScatter(torch.zeros_like(kv))
            _, receiver = make_pooled_receiver(link, pool, 2, scatter)
            ring = set(pool.lent)
            await asyncio.sleep(0.05)  # the receives of layers 0 and 1 are posted
            if ending == "abort":
                await receiver.abort()
            else:
                with pytest.raises(TransferTimeoutError):
                    await receiver.wait(0.2)
            assert pool.stats().leased_buffers == 2  # a late message may still land there
            other = pool.acquire(SMOLLM2_BF16.layer_bytes(2))
            assert other.data_ptr() not in ring
            pool.release(other)

            for layer in range(2):  # the late messages land in the ring buffers
                tag = layer_tag(receiver.transfer_id, layer)
                await link.endpoint.send(tag, as_bytes(kv[layer]))
            async with asyncio.timeout(WAIT_S):
                while pool.stats().leased_buffers:
                    await asyncio.sleep(0.01)
            assert pool.stats().idle_buffers == 3
            again = [pool.acquire(SMOLLM2_BF16.layer_bytes(2)) for _ in range(3)]
            assert ring <= {view.data_ptr() for view in again}
            assert scatter.layers == []  # landed after the end: never scattered

    asyncio.run(body())


def test_buffer_of_a_receive_cancelled_under_the_receiver_is_never_reused() -> None:
    pool = BufferPool()

    async def body() -> None:
        transport = InProcessTransport()
        executor = concurrent.futures.ThreadPoolExecutor(1)
        scatter = RecordingScatter(torch.zeros_like(random_kv(1)))
        LayerReceiver(transport, next(_transfer_ids), NUM_LAYERS, 64, scatter, executor, 2, pool)
        await asyncio.sleep(0.05)
        executor.shutdown()
        # asyncio.run now cancels the receiver's task and its posted receives

    asyncio.run(body())
    assert pool.stats().leased_buffers == 2 and pool.stats().idle_buffers == 0
