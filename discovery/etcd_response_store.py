"""Stored Responses API responses in etcd, shared by every gateway of a cluster (the gateway's
``--response-store etcd``), under ``discovery/etcd_keys.py:response_key``.

Expiry is etcd's: each value lives under a lease granted for ``ttl_s`` plus
``LEASE_REUSE_S``, and a lease takes the puts of its first ``LEASE_REUSE_S`` seconds (one
lease a minute however many responses, not one each), so a value lives between ``ttl_s`` and
``ttl_s + LEASE_REUSE_S`` seconds, never refreshed. A value over etcd's request limit
(``--max-request-bytes``, 1.5 MiB by default) or an unreachable etcd is ``StoreFailed``: the
gateway keeps its values through ``common/chunked_store.py``, in parts of ``PART_BYTES``.
Contract: ``common/response_store.py``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from splitserve.common.response_store import StoreFailed
from splitserve.discovery.etcd_keys import response_key
from splitserve.proto.etcd_client import EtcdClient, EtcdError, Lease, LeaseNotFound

T = TypeVar("T")

LEASE_REUSE_S = 60.0
"""How long one lease takes new values."""
PART_BYTES = 1 << 20
"""The most one key takes from ``common/chunked_store.py``, which keeps larger values in
parts: under etcd's default request limit (1.5 MiB) with room for the key and the request."""


class EtcdResponseStore:
    def __init__(self, client: EtcdClient, cluster: str) -> None:
        self.client = client
        self.cluster = cluster
        self._lease: Lease | None = None
        self._lease_since = 0.0
        """When ``_lease`` was granted (monotonic)."""
        self._granting = asyncio.Lock()

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        etcd_key = response_key(self.cluster, key)
        await self._leased(ttl_s, lambda lease: self.client.put(etcd_key, value, lease))

    async def replace(self, key: str, value: bytes, ttl_s: float, expected: bytes | None) -> bool:
        etcd_key = response_key(self.cluster, key)
        return await self._leased(
            ttl_s, lambda lease: self.client.put_if(etcd_key, value, expected, lease)
        )

    async def _leased(self, ttl_s: float, write: Callable[[Lease], Awaitable[T]]) -> T:
        """``write`` under the current lease (once more under a new one where the lease is
        gone); ``StoreFailed`` for etcd's errors."""
        try:
            lease = await self._current_lease(ttl_s)
            try:
                return await write(lease)
            except LeaseNotFound:  # revoked or expired under us: once more on a new one
                self._lease = None
                return await write(await self._current_lease(ttl_s))
        except EtcdError as error:
            raise StoreFailed(f"etcd: {error}") from error

    async def get(self, key: str) -> bytes | None:
        try:
            kept = await self.client.get(response_key(self.cluster, key))
        except EtcdError as error:
            raise StoreFailed(f"etcd: {error}") from error
        return None if kept is None else kept.value

    async def delete(self, key: str) -> bool:
        try:
            return bool(await self.client.delete(response_key(self.cluster, key)))
        except EtcdError as error:
            raise StoreFailed(f"etcd: {error}") from error

    async def close(self) -> None:
        await self.client.close()

    async def _current_lease(self, ttl_s: float) -> Lease:
        """The lease new values go under: the current one while it is young enough that
        every value it holds lives at least ``ttl_s``, else a new one."""
        async with self._granting:
            age = time.monotonic() - self._lease_since
            if self._lease is None or age >= LEASE_REUSE_S:
                self._lease_since = time.monotonic()
                self._lease = await self.client.grant_lease(math.ceil(ttl_s + LEASE_REUSE_S))
            return self._lease
