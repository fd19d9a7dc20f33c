"""The asyncio etcd v3 client (``proto/etcd_client.py``) against a real etcd server.

Keys, prefixes and deletes; leases that expire unless kept alive and that revocation ends at
once; a prefix watch that delivers every change once, in order, across an etcd restart, and
that falls back to a full read when etcd compacted its position away; bounded failures when
etcd is down; fail-over to a second endpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import pytest

from splitserve.proto.etcd_client import (
    DeleteEvent,
    EtcdClient,
    EtcdUnavailable,
    LeaseNotFound,
    PutEvent,
    ResetEvent,
    WatchEvent,
    prefix_end,
)
from tests.etcd import EtcdServer, free_port

T = TypeVar("T")
SHORT_TTL_S = 2
"""etcd's smallest lease TTL with its default election timeout."""


def run(scenario: Coroutine[Any, Any, T], timeout_s: float = 20.0) -> T:
    return asyncio.run(asyncio.wait_for(scenario, timeout_s))


async def _next(events: AsyncIterator[WatchEvent], timeout_s: float = 5.0) -> WatchEvent:
    return await asyncio.wait_for(anext(events), timeout_s)


def test_prefix_end_covers_exactly_the_prefix() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


@pytest.mark.timeout(30)
def test_put_get_prefix_and_delete(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        async with EtcdClient([etcd.endpoint]) as client:
            first = await client.put(b"/p/b", b"2")
            await client.put(b"/p/a", b"1")
            await client.put(b"/q/c", b"outside")
            items, revision = await client.get_prefix(b"/p/")
            assert [(kv.key, kv.value) for kv in items] == [(b"/p/a", b"1"), (b"/p/b", b"2")]
            assert revision == first + 2 and items[1].mod_revision == first
            assert await client.delete(b"/p/a")
            assert not await client.delete(b"/p/a")
            assert await client.get(b"/p/a") is None
            got = await client.get(b"/p/b")
            assert got is not None and got.value == b"2" and got.lease == 0

    run(scenario())


@pytest.mark.timeout(30)
def test_a_lease_kept_alive_outlives_its_ttl_and_an_unkept_one_expires(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        async with EtcdClient([etcd.endpoint]) as client:
            kept = await client.grant_lease(SHORT_TTL_S)
            unkept = await client.grant_lease(SHORT_TTL_S)
            assert kept.ttl_s == SHORT_TTL_S
            await client.put(b"/l/kept", b"k", kept)
            await client.put(b"/l/unkept", b"u", unkept)
            keeper = asyncio.create_task(client.keep_alive(kept))
            start = time.monotonic()
            while await client.get(b"/l/unkept") is not None:
                await asyncio.sleep(0.1)
            expired_after_s = time.monotonic() - start
            assert SHORT_TTL_S - 0.5 < expired_after_s < SHORT_TTL_S + 5.0
            await asyncio.sleep(1.0)  # past a full TTL: only the keep-alives hold it
            kept_kv = await client.get(b"/l/kept")
            assert kept_kv is not None and kept_kv.lease == kept.id
            assert not keeper.done()
            keeper.cancel()

    run(scenario())


@pytest.mark.timeout(30)
def test_revoke_deletes_at_once_and_keep_alive_reports_the_loss(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        async with EtcdClient([etcd.endpoint]) as client:
            lease = await client.grant_lease(3)
            await client.put(b"/r/k", b"v", lease)
            keeper = asyncio.create_task(client.keep_alive(lease))
            await asyncio.sleep(0.2)
            await client.revoke(lease)
            assert await client.get(b"/r/k") is None
            await asyncio.wait_for(keeper, 3.0)  # returns: etcd says the lease is gone
            with pytest.raises(LeaseNotFound):
                await client.revoke(lease)
            with pytest.raises(LeaseNotFound):
                await client.put(b"/r/k", b"v", lease)

    run(scenario())


@pytest.mark.timeout(30)
def test_watch_delivers_every_change_under_the_prefix_in_order(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        async with EtcdClient([etcd.endpoint]) as client:
            _, revision = await client.get_prefix(b"/w/")
            await client.put(b"/w/a", b"1")  # before the watch starts: replayed from history
            events = client.watch_prefix(b"/w/", revision + 1)
            await client.put(b"/elsewhere", b"x")
            await client.put(b"/w/a", b"2")
            await client.delete(b"/w/a")
            got = [await _next(events) for _ in range(3)]
            assert got == [
                PutEvent(b"/w/a", b"1", revision + 1),
                PutEvent(b"/w/a", b"2", revision + 3),
                DeleteEvent(b"/w/a", revision + 4),
            ]
            await events.aclose()

    run(scenario())


@pytest.mark.timeout(40)
def test_watch_resumes_after_an_etcd_restart_without_repeating(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        async with EtcdClient([etcd.endpoint], timeout_s=1.0) as client:
            _, revision = await client.get_prefix(b"/w/")
            events = client.watch_prefix(b"/w/", revision + 1)
            await client.put(b"/w/a", b"before")
            assert await _next(events) == PutEvent(b"/w/a", b"before", revision + 1)
            pending = asyncio.ensure_future(_next(events, timeout_s=30.0))
            await asyncio.to_thread(etcd.stop)
            with pytest.raises(EtcdUnavailable):
                await client.get_prefix(b"/w/")
            await asyncio.sleep(1.0)
            assert not pending.done()  # the outage itself is no event
            await asyncio.to_thread(etcd.start)
            await client.put(b"/w/b", b"after")
            assert await pending == PutEvent(b"/w/b", b"after", revision + 2)
            await events.aclose()

    run(scenario(), timeout_s=35.0)


@pytest.mark.timeout(30)
def test_watch_from_a_compacted_revision_resets_with_a_full_read(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        async with EtcdClient([etcd.endpoint]) as client:
            first = await client.put(b"/c/a", b"1")
            await client.put(b"/c/a", b"2")
            latest = await client.put(b"/c/b", b"3")
            await asyncio.to_thread(etcd.compact, latest)
            events = client.watch_prefix(b"/c/", first)
            reset = await _next(events)
            assert isinstance(reset, ResetEvent) and reset.revision == latest
            assert [(kv.key, kv.value) for kv in reset.items] == [(b"/c/a", b"2"), (b"/c/b", b"3")]
            await client.put(b"/c/b", b"4")  # the watch goes on after the read
            assert await _next(events) == PutEvent(b"/c/b", b"4", latest + 1)
            await events.aclose()

    run(scenario())


@pytest.mark.timeout(30)
def test_calls_fail_over_to_the_next_endpoint_and_fail_bounded_without_any(
    etcd: EtcdServer,
) -> None:
    dead = f"127.0.0.1:{free_port()}"

    async def scenario() -> None:
        async with EtcdClient([dead, etcd.endpoint], timeout_s=1.0) as client:
            await client.put(b"/f/k", b"v")
            got = await client.get(b"/f/k")
            assert got is not None and got.value == b"v"
        async with EtcdClient([dead], timeout_s=1.0) as client:
            start = time.monotonic()
            with pytest.raises(EtcdUnavailable):
                await client.get(b"/f/k")
            assert time.monotonic() - start < 3.0

    run(scenario())
