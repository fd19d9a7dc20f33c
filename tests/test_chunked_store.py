"""Values kept in parts (``common/chunked_store.py``): the store contract for values of any
size, no part left behind by an overwrite, a delete or a lost race, a value whose parts are
gone read as gone, and on a real etcd a value over its request limit kept whole (a gateway on
etcd keeping a conversation past that limit: ``tests/test_conversations.py``)."""

from __future__ import annotations

import asyncio
import os

import pytest

from splitserve.common.chunked_store import HEAD_MARK, ChunkedStore
from splitserve.common.response_store import MemoryResponseStore, StoreFailed
from splitserve.discovery.etcd_response_store import EtcdResponseStore
from splitserve.proto.etcd_client import EtcdClient
from tests.etcd import EtcdServer
from tests.test_stored_responses import _contract, _replaces_lose_no_write

PART = 1024


def _keys(memory: MemoryResponseStore) -> set[str]:
    return set(memory._values)


def test_the_contract_holds_for_small_values_and_large_ones() -> None:
    async def run() -> None:
        memory = MemoryResponseStore(1 << 30)
        store = ChunkedStore(memory, PART)
        await _contract(store)
        big, bigger = os.urandom(5 * PART + 7), os.urandom(9 * PART)
        await store.put("k", big, 60)
        assert await store.get("k") == big
        assert memory._values["k"][1].startswith(HEAD_MARK)
        assert len(_keys(memory) - {"resp-b"}) == 1 + 6  # the head and its 6 parts
        await store.put("k", bigger, 60)  # the first value's parts go
        assert await store.get("k") == bigger and len(_keys(memory) - {"resp-b"}) == 1 + 9
        assert await store.replace("k", big, 60, big) is False  # not what it holds
        assert await store.replace("k", big, 60, bigger) is True
        assert await store.get("k") == big and len(_keys(memory) - {"resp-b"}) == 1 + 6
        await store.put("k", b"small", 60)  # kept whole again, its parts gone
        assert await store.get("k") == b"small" and _keys(memory) == {"k", "resp-b"}
        await store.put("k", big, 60)
        assert await store.delete("k") is True and _keys(memory) == {"resp-b"}

    asyncio.run(run())


def test_gateways_growing_one_value_past_a_part_lose_no_write_and_leave_no_part() -> None:
    """Two handles (two gateways' stores over one backend) adding to one value at once, read
    then ``replace`` retried until it holds, the value growing to many parts: every addition
    is kept, and only the last head's parts remain (the losers' were deleted)."""

    async def run() -> None:
        memory = MemoryResponseStore(1 << 30)
        first, second = ChunkedStore(memory, PART), ChunkedStore(memory, PART)
        await first.put("counted", b"", 60)

        async def add(store: ChunkedStore, mark: bytes) -> None:
            while True:
                seen = await store.get("counted")
                assert seen is not None
                if await store.replace("counted", seen + mark * 700, 60, seen):
                    return

        marks = [bytes([ord("a") + i]) for i in range(12)]
        await asyncio.gather(*(add((first, second)[i % 2], m) for i, m in enumerate(marks)))
        value = await second.get("counted")
        assert value is not None and sorted(set(value)) == sorted(b"".join(marks))
        assert len(value) == 12 * 700
        assert len(_keys(memory)) == 1 + -(-len(value) // PART)  # the head and its parts
        fresh = MemoryResponseStore(1 << 30)  # small values too
        await _replaces_lose_no_write(ChunkedStore(fresh, PART), ChunkedStore(fresh, PART))

    asyncio.run(run())


def test_a_value_whose_parts_are_gone_reads_as_gone() -> None:
    async def run() -> None:
        memory = MemoryResponseStore(1 << 30)
        store = ChunkedStore(memory, PART)
        await store.put("k", os.urandom(3 * PART), 60)
        part = next(key for key in _keys(memory) if key.startswith("k#"))
        await memory.delete(part)
        assert await store.get("k") is None
        await memory.put(part, b"x" * PART, 60)  # a part of other bytes: the SHA-256 says so
        assert await store.get("k") is None

    asyncio.run(run())


def test_etcd_keeps_a_value_over_its_request_limit_in_parts(etcd: EtcdServer) -> None:
    """Etcd refuses a 3 MiB value (its 1.5 MiB request limit); in parts it is kept, read back
    by another handle of the cluster, replaced and deleted."""

    async def run() -> None:
        raw = EtcdResponseStore(EtcdClient((etcd.endpoint,)), "blue")
        big, other = os.urandom(3 << 20), os.urandom(2 << 20)
        with pytest.raises(StoreFailed):
            await raw.put("resp-big", big, 60)
        store = ChunkedStore(raw, 1 << 20)
        reader = ChunkedStore(EtcdResponseStore(EtcdClient((etcd.endpoint,)), "blue"), 1 << 20)
        await store.put("resp-big", big, 60)
        assert await reader.get("resp-big") == big
        assert await reader.replace("resp-big", other, 60, big) is True
        assert await store.replace("resp-big", big, 60, big) is False  # it holds other now
        assert await store.get("resp-big") == other
        assert await store.delete("resp-big") is True
        assert await reader.get("resp-big") is None
        left, _ = await raw.client.get_prefix(b"/splitserve/blue/responses/resp-big")
        assert left == [], left  # no part left behind
        for each in (store, reader):
            await each.close()

    asyncio.run(run())
