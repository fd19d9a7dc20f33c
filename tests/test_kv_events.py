"""KV events (issue 33): a worker's prefix-cache changes reach every coordinator and make its
view of where KV lives exact.

- ``BlockPool`` tells its listener of every hash entering and leaving its prefix index;
- ``KvEventLog`` gives each reader the changes after its cursor (each hash's last), a reset
  (the whole cached set) to a reader without a cursor or behind what it keeps, and replaying
  from an older cursor gives the newest state;
- a load stream (workers followed through etcd) carries them too, a reset first;
- the router reads a worker's cached prefix from its events once it has them: a second
  coordinator that never routed a conversation sends its next turn to the worker holding
  it, and an evicted prefix attracts nothing;
- end to end (slow): two coordinators, two decode workers (simulated engines); the first
  turns of four conversations through coordinator 0 spread over both workers, the second
  turns through coordinator 1 each reserve every full block their worker holds from its
  cache (the decode workers' ``kv_reused_blocks_total``). Without events coordinator 1 would
  send them by load alone (it never saw the first turns); before the block pool preferred
  uncached free blocks for reservations, the later turns' blocks were evicted by the earlier
  turns' reservations (the events said so; 12 of 24 blocks were reused).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from splitserve.client import AsyncClient, Chunk, Sampling
from splitserve.common.blocks import hash_block, prompt_block_hashes
from splitserve.common.kv_events import KvEventLog
from splitserve.common.load import EngineLoad, LoadReport
from splitserve.common.membership import Role
from splitserve.coordinator.router import KnownPrefix
from splitserve.engine.block_pool import BlockPool
from splitserve.proto.cluster_auth import ClusterCredential
from splitserve.proto.server import start_server
from splitserve.proto.worker_clients import WorkerMonitorClient
from splitserve.worker.monitor_servicer import MonitorServicer
from tests.cluster import cluster, metric_total
from tests.etcd import free_port
from tests.request_records import record
from tests.test_router import _router, _worker

H = [hash_block(None, [i]) for i in range(8)]
REUSED = "splitserve_kv_reused_blocks_total"
"""KV blocks a decode worker reserved from its prefix cache for pushed prompts (not sent)."""


def test_the_block_pool_tells_its_listener_of_every_cached_hash_and_eviction() -> None:
    pool = BlockPool(2)
    changes: list[tuple[bytes, bool]] = []
    pool.cache_listener = lambda block_hash, stored: changes.append((block_hash, stored))
    a, b = pool.allocate(2)
    pool.register(a, H[0])
    pool.register(b, H[0])  # the same content again: stays uncached, no event
    pool.register(b, H[1])
    pool.free([a, b])
    assert changes == [(H[0], True), (H[1], True)]
    assert sorted(pool.cached_hashes()) == sorted(H[:2])
    pool.allocate(1)  # reuses the least recently freed block: its hash leaves the index
    assert changes[2:] == [(H[0], False)]


def test_each_reader_gets_what_changed_after_its_cursor_or_a_reset() -> None:
    log = KvEventLog(capacity=4)
    first = log.since(None)
    assert first.reset and first.stored == () and first.seq == 0
    log.record(H[0], True)
    log.record(H[1], True)
    log.record(H[0], False)  # stored then evicted: its last change wins
    batch = log.since(first.seq)
    assert not batch.reset and batch.seq == 3
    assert batch.stored == (H[1],) and batch.evicted == (H[0],)
    assert log.since(batch.seq) == type(batch)(3, False)  # nothing new
    log.record(H[2], True)
    log.record(H[3], True)  # 5 changes, 4 kept: the cursor 0 fell behind
    behind = log.since(0)
    assert behind.reset and set(behind.stored) == {H[1], H[2], H[3]}
    assert log.since(99).reset  # a cursor from another log (the worker restarted)
    # replaying from an older cursor onto a newer state gives the newest state
    state = {H[1]}
    replay = log.since(2)
    state = (state - set(replay.evicted)) | set(replay.stored)
    assert state == set(log.since(None).stored)


def test_a_coordinator_sends_a_turn_where_events_say_its_prefix_is() -> None:
    """Coordinator 2 never routed the conversation: without events both idle workers look
    alike to it (the first wins); with them, the turn goes where its blocks are, until they
    are evicted."""
    a, b = _worker("a", Role.DECODE), _worker("b", Role.DECODE)
    router = _router(a, b)
    prompt = list(range(100))
    hashes = prompt_block_hashes(prompt, 16)
    assert router.route(record(prompt, 16)).decode.worker_id == "a"  # no knowledge: a tie
    router = _router(a, b)
    log = KvEventLog()
    for block_hash in hashes:
        log.record(block_hash, True)
    router.kv_events("b", log.since(None))
    assert router.route(record(prompt, 16)).decode.worker_id == "b"
    cursor = log.since(None).seq
    for block_hash in hashes:
        log.record(block_hash, False)
    router.kv_events("b", log.since(cursor))
    assert router.decode_cached_blocks(b, hashes) == 0
    router.forget("b")
    assert router.decode_cached_blocks(b, hashes) == 0


def test_a_load_stream_carries_the_cache_then_its_changes_and_starts_over() -> None:
    """Workers followed through etcd: their ``WatchLoad`` stream (a real gRPC server) carries
    the whole cached set first, then each message's changes; a new stream starts over."""
    credential = ClusterCredential.generate()
    log = KvEventLog()
    log.record(H[0], True)
    monitor = MonitorServicer()
    monitor.kv_events = log

    async def load() -> LoadReport:
        return LoadReport(EngineLoad(num_total_blocks=64), ready=True)

    monitor.bind(load)

    async def body() -> None:
        server = await start_server(
            "127.0.0.1", 0, lambda s: [monitor.add_to(s)], credential=credential, tls=None
        )
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                client = WorkerMonitorClient(channel, credential)
                stream = client.watch_load(0.05)
                first = (await anext(stream)).kv_events
                assert first is not None and first.reset and first.stored == (H[0],)
                log.record(H[1], True)
                log.record(H[0], False)
                seen = KnownPrefix()
                seen.apply(first)
                while seen.overlap_blocks([H[1]]) == 0:
                    events = (await anext(stream)).kv_events
                    assert events is not None and not events.reset
                    seen.apply(events)
                assert seen.overlap_blocks([H[0]]) == 0
                await stream.aclose()
                again = (await anext(client.watch_load(0.05))).kv_events
                assert again is not None and again.reset and again.stored == (H[1],)
        finally:
            await server.server.stop(None)

    asyncio.run(body())


async def _turn(address: str, token_ids: list[int]) -> list[int]:
    sampling = Sampling(max_tokens=20, temperature=0.0, ignore_eos=True)
    out: list[int] = []
    async with AsyncClient(address) as client:
        async for item in client.stream(token_ids=token_ids, sampling=sampling):
            if isinstance(item, Chunk):
                out += item.token_ids
    return out


@pytest.mark.slow  # a cluster of two coordinators and three workers
@pytest.mark.timeout(300)
def test_a_second_coordinator_routes_next_turns_by_the_workers_events() -> None:
    base = free_port()  # coordinators at base, base + 1; workers after them (up's rule)
    decode_metrics = [f"http://127.0.0.1:{base + i}/metrics" for i in (3, 4)]
    flags = ("--coordinators=2", f"--metrics-port-base={base}")
    with cluster(1, 2, "--engine=sim", up_flags=flags) as both:
        first, second = both.split(",")
        firsts = [[1000 + 7 * c + i for i in range(90)] for c in range(4)]

        async def first_turns() -> list[list[int]]:  # at once: spread over both workers
            return list(await asyncio.gather(*(_turn(first, t) for t in firsts)))

        outputs = asyncio.run(first_turns())
        time.sleep(1.5)  # a few heartbeats: coordinator 1 hears of the cached blocks
        before = [metric_total(url, REUSED) for url in decode_metrics]
        for turn, output in zip(firsts, outputs, strict=True):
            asyncio.run(_turn(second, turn + output + [5, 6, 7]))
        after = [metric_total(url, REUSED) for url in decode_metrics]
    # every next turn found every full block of its last turn (prompt and reply but the
    # reply's last token, whose KV was never computed) where coordinator 1 sent it
    held = sum(
        (len(turn) + len(output) - 1) // 16 for turn, output in zip(firsts, outputs, strict=True)
    )
    assert sum(after) - sum(before) == held
    assert all(b > a for a, b in zip(before, after, strict=True))  # both workers held turns
