"""Worker membership on etcd (``discovery/etcd_announcer.py``, ``discovery/etcd_watcher.py``)
against a real etcd server.

A watcher sees an announced worker join and, after ``withdraw()``, leave at once (not after
the TTL); a worker process killed without withdrawing leaves after its TTL; two watchers see
the same changes; an etcd outage longer than the TTL changes nothing (the watcher keeps its
members, the announcer keeps its lease) and the watcher catches up afterwards; an announcer
whose lease is lost, or whose etcd comes back empty, publishes again; values that are not
a worker's info, and other clusters' workers, are not members.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from splitserve.common.kv_layout import KvLayout
from splitserve.common.membership import Role, WorkerInfo
from splitserve.discovery import Joined, Left, MembershipChange
from splitserve.discovery.etcd_announcer import EtcdAnnouncer
from splitserve.discovery.etcd_keys import worker_key, workers_prefix
from splitserve.discovery.etcd_watcher import EtcdMembershipWatcher
from splitserve.proto.etcd_client import EtcdClient, Lease
from tests.etcd import EtcdServer

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
CLUSTER = "test"
TTL_S = 2
"""etcd's smallest lease TTL with its default election timeout."""
CHANGE_TIMEOUT_S = 5.0
LONG_TTL_S = 60
"""Longer than any scenario here may run: a key under it leaves only by revocation."""

_DYING_WORKER = """
import asyncio, sys
from splitserve.discovery.etcd_announcer import EtcdAnnouncer
from splitserve.proto.etcd_client import EtcdClient
from tests.test_discovery_etcd import CLUSTER, TTL_S, worker

async def main():
    announcer = EtcdAnnouncer(EtcdClient([sys.argv[1]]), CLUSTER, ttl_s=TTL_S)
    await announcer.announce(worker(sys.argv[2]))
    print("announced", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""
"""A worker process that announces itself and keeps its lease alive until it is killed."""


def worker(worker_id: str) -> WorkerInfo:
    layout = KvLayout(
        model="m", dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8
    )
    return WorkerInfo(
        worker_id=worker_id,
        role=Role.DECODE,
        address=f"127.0.0.1:{5000 + len(worker_id)}",
        layout=layout,
        num_blocks=64,
        max_model_len=512,
    )


def run(scenario: Coroutine[Any, Any, T], timeout_s: float = 25.0) -> T:
    return asyncio.run(asyncio.wait_for(scenario, timeout_s))


async def _next(
    changes: AsyncIterator[MembershipChange], timeout_s: float = CHANGE_TIMEOUT_S
) -> MembershipChange:
    return await asyncio.wait_for(anext(changes), timeout_s)


async def _started_watcher(endpoint: str, cluster: str = CLUSTER) -> EtcdMembershipWatcher:
    watcher = EtcdMembershipWatcher(EtcdClient([endpoint], timeout_s=1.0), cluster)
    await watcher.start()
    return watcher


@pytest.mark.timeout(30)
def test_a_watcher_sees_a_worker_join_and_leave_at_once_on_withdraw(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        watcher = await _started_watcher(etcd.endpoint)
        assert watcher.snapshot() == {}
        changes = watcher.changes()
        client = EtcdClient([etcd.endpoint])
        # A TTL longer than the whole scenario may run: only a revocation removes the key.
        announcer = EtcdAnnouncer(client, CLUSTER, ttl_s=LONG_TTL_S)
        await announcer.announce(worker("w1"))
        assert await _next(changes) == Joined(worker("w1"))
        assert watcher.snapshot() == {"w1": worker("w1")}
        late = await _started_watcher(etcd.endpoint)  # a watcher started later reads it
        assert late.snapshot() == {"w1": worker("w1")}
        await announcer.withdraw()
        assert await client.get(worker_key(CLUSTER, "w1")) is None  # gone when it returns
        assert await _next(changes) == Left("w1")
        assert watcher.snapshot() == {}
        await announcer.withdraw()  # idempotent
        await watcher.close()
        assert [change async for change in changes] == []  # the iterator ends on close
        await late.close()

    run(scenario())


@pytest.mark.timeout(30)
def test_two_watchers_see_the_same_changes(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        watchers = [await _started_watcher(etcd.endpoint) for _ in range(2)]
        streams = [watcher.changes() for watcher in watchers]
        client = EtcdClient([etcd.endpoint])
        first, second = EtcdAnnouncer(client, CLUSTER), EtcdAnnouncer(client, CLUSTER)
        await first.announce(worker("a"))
        await second.announce(worker("b"))
        await first.withdraw()
        expected = [Joined(worker("a")), Joined(worker("b")), Left("a")]
        for stream in streams:
            assert [await _next(stream) for _ in expected] == expected
        assert [w.snapshot() for w in watchers] == [{"b": worker("b")}] * 2
        await second.withdraw()
        for watcher in watchers:
            await watcher.close()

    run(scenario())


@pytest.mark.timeout(30)
def test_a_worker_killed_without_withdrawing_leaves_after_its_ttl(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        watcher = await _started_watcher(etcd.endpoint)
        changes = watcher.changes()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _DYING_WORKER,
            etcd.endpoint,
            "doomed",
            cwd=ROOT,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            assert process.stdout is not None
            line = await asyncio.wait_for(process.stdout.readline(), 15.0)
            assert line.strip() == b"announced"
            assert await _next(changes) == Joined(worker("doomed"))
            await asyncio.sleep(TTL_S + 0.5)  # kept alive past its TTL while it lives
            assert watcher.snapshot() == {"doomed": worker("doomed")}
            process.send_signal(signal.SIGKILL)
            start = time.monotonic()
            assert await _next(changes, timeout_s=TTL_S + 3.0) == Left("doomed")
            assert time.monotonic() - start > TTL_S - 1.0  # the lease's expiry, not sooner
        finally:
            if process.returncode is None:
                process.kill()
            await process.wait()
        await watcher.close()

    run(scenario())


@pytest.mark.slow  # etcd back empty, below, restarts it too
@pytest.mark.timeout(40)
def test_an_etcd_outage_changes_no_membership_and_the_watcher_catches_up(
    etcd: EtcdServer,
) -> None:
    async def scenario() -> None:
        watcher = await _started_watcher(etcd.endpoint)
        changes = watcher.changes()
        stays = EtcdAnnouncer(EtcdClient([etcd.endpoint], timeout_s=1.0), CLUSTER, ttl_s=TTL_S)
        await stays.announce(worker("stays"))
        assert await _next(changes) == Joined(worker("stays"))

        await asyncio.to_thread(etcd.stop)
        pending = asyncio.ensure_future(_next(changes, timeout_s=30.0))
        await asyncio.sleep(TTL_S + 1.0)  # longer than the lease's TTL
        assert not pending.done(), "an etcd outage produced a membership change"
        assert watcher.snapshot() == {"stays": worker("stays")}
        await asyncio.to_thread(etcd.start)

        joins = EtcdAnnouncer(EtcdClient([etcd.endpoint]), CLUSTER, ttl_s=TTL_S)
        await joins.announce(worker("joins"))
        assert await pending == Joined(worker("joins"))  # caught up; no Left("stays") first
        await asyncio.sleep(TTL_S + 1.5)  # the lease etcd restored is kept alive again
        later = asyncio.ensure_future(_next(changes, timeout_s=30.0))
        await asyncio.sleep(0.2)
        assert not later.done()
        later.cancel()
        assert watcher.snapshot() == {"stays": worker("stays"), "joins": worker("joins")}
        for announcer in (stays, joins):
            await announcer.withdraw()
        await watcher.close()

    run(scenario(), timeout_s=35.0)


@pytest.mark.timeout(30)
def test_an_announcer_publishes_again_when_its_lease_is_lost(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        client = EtcdClient([etcd.endpoint])
        watcher = await _started_watcher(etcd.endpoint)
        changes = watcher.changes()
        announcer = EtcdAnnouncer(client, CLUSTER, ttl_s=3)
        await announcer.announce(worker("w"))
        assert await _next(changes) == Joined(worker("w"))
        published = await client.get(worker_key(CLUSTER, "w"))
        assert published is not None
        await client.revoke(Lease(id=published.lease, ttl_s=3))  # as if it had expired
        assert await _next(changes) == Left("w")
        assert await _next(changes) == Joined(worker("w"))  # at its next keep-alive
        again = await client.get(worker_key(CLUSTER, "w"))
        assert again is not None and again.lease not in (0, published.lease)
        await announcer.withdraw()
        assert await _next(changes) == Left("w")
        await watcher.close()

    run(scenario())


@pytest.mark.timeout(40)
def test_etcd_back_empty_gets_the_worker_again_and_the_watcher_resyncs(
    etcd: EtcdServer,
) -> None:
    async def scenario() -> None:
        client = EtcdClient([etcd.endpoint], timeout_s=1.0)
        watcher = await _started_watcher(etcd.endpoint)
        announcer = EtcdAnnouncer(client, CLUSTER, ttl_s=TTL_S)
        await announcer.announce(worker("w"))
        for _ in range(5):  # the watcher's position moves past a fresh store's revision
            await client.put(workers_prefix(CLUSTER) + b"noise", b"not a worker")
        await asyncio.to_thread(etcd.stop)
        await asyncio.to_thread(etcd.wipe)
        await asyncio.to_thread(etcd.start)
        deadline = time.monotonic() + 10.0
        while await client.get(worker_key(CLUSTER, "w")) is None:
            assert time.monotonic() < deadline, "the announcer did not publish again"
            await asyncio.sleep(0.1)
        joins = EtcdAnnouncer(client, CLUSTER, ttl_s=TTL_S)
        await joins.announce(worker("joins"))
        expected = {"w": worker("w"), "joins": worker("joins")}
        while watcher.snapshot() != expected:
            assert time.monotonic() < deadline, f"watcher stuck at {watcher.snapshot()}"
            await asyncio.sleep(0.1)
        for each in (announcer, joins):
            await each.withdraw()
        await watcher.close()

    run(scenario())


@pytest.mark.timeout(30)
def test_invalid_values_and_other_clusters_are_not_members(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        client = EtcdClient([etcd.endpoint])
        await client.put(worker_key(CLUSTER, "garbage"), b"\xff\x00 not a proto")
        other = EtcdAnnouncer(client, "other")
        await other.announce(worker("elsewhere"))
        watcher = await _started_watcher(etcd.endpoint)
        changes = watcher.changes()
        assert watcher.snapshot() == {}
        await client.put(worker_key(CLUSTER, "impostor"), b"")  # parses, but has no id
        ours = EtcdAnnouncer(client, CLUSTER)
        await ours.announce(worker("ours"))
        assert await _next(changes) == Joined(worker("ours"))  # nothing before it
        assert watcher.snapshot() == {"ours": worker("ours")}
        with pytest.raises(ValueError):
            workers_prefix("a/b")
        for announcer in (other, ours):
            await announcer.withdraw()
        await watcher.close()

    run(scenario())
