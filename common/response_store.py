"""Where the Responses API's stored responses live: a key -> bytes store whose values expire.

Contract of every ``ResponseStore``:
- ``put(key, value, ttl_s)`` keeps ``value`` under ``key`` (replacing any) for at least
  ``ttl_s`` seconds, unless a later ``delete`` or, for ``MemoryResponseStore`` only, its byte
  budget (oldest first) drops it sooner; ``StoreFailed`` where the backend refused it;
- ``get(key)`` is the value while kept, else None (never an expired value);
- ``delete(key)`` drops it; whether it was kept;
- ``replace(key, value, ttl_s, expected)`` is ``put`` made only if ``key`` holds ``expected``
  now (None: holds nothing), atomically (against every process sharing the store); whether
  it was made. A read-modify-write that retries on False loses no concurrent write.
Keys are the gateway's response ids (``resp-...``); values the serialized records of
``gateway/stored_responses.py``, which are opaque here.

Backends (the gateway's ``--response-store``): ``memory`` (this process only: the default for a
single gateway), ``sqlite:PATH`` (one file every gateway process of a machine shares:
``splitserve up --gateways N``), ``etcd`` (every gateway of a cluster:
``discovery/etcd_response_store.py``), ``none``. Here, below every role, so that the etcd
backend (``discovery/``) and the gateway share the contract.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol


class StoreFailed(Exception):
    """The backend did not keep, read or delete a value (unreachable, too large, ...)."""


class ResponseStore(Protocol):
    async def put(self, key: str, value: bytes, ttl_s: float) -> None: ...

    async def get(self, key: str) -> bytes | None: ...

    async def delete(self, key: str) -> bool: ...

    async def replace(
        self, key: str, value: bytes, ttl_s: float, expected: bytes | None
    ) -> bool: ...

    async def close(self) -> None: ...


class MemoryResponseStore:
    """This process's memory, at most ``max_bytes`` of values: a put past that drops the
    least recently put or read values first (a value larger than the budget is refused)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._values: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        """key -> (expiry on the monotonic clock, value), least recently used first."""
        self.bytes = 0
        """The values' total size."""

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        if len(value) > self.max_bytes:
            raise StoreFailed(
                f"the response's record ({len(value)} bytes) is over the store's budget "
                f"({self.max_bytes} bytes: --response-store-bytes)"
            )
        self._drop(key)
        self._values[key] = (time.monotonic() + ttl_s, value)
        self.bytes += len(value)
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._values)))

    async def get(self, key: str) -> bytes | None:
        kept = self._values.get(key)
        if kept is None:
            return None
        if kept[0] <= time.monotonic():
            self._drop(key)
            return None
        self._values.move_to_end(key)
        return kept[1]

    async def delete(self, key: str) -> bool:
        kept = self._values.get(key)
        self._drop(key)
        return kept is not None and kept[0] > time.monotonic()

    async def replace(self, key: str, value: bytes, ttl_s: float, expected: bytes | None) -> bool:
        # no await between the read and the put: nothing else runs in between
        if await self.get(key) != expected:
            return False
        await self.put(key, value, ttl_s)
        return True

    async def close(self) -> None:
        self._values.clear()
        self.bytes = 0

    def _drop(self, key: str) -> None:
        kept = self._values.pop(key, None)
        if kept is not None:
            self.bytes -= len(kept[1])


_SCHEMA = "CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, expires REAL, value BLOB)"
_PURGE_EVERY = 256
"""Puts between two deletions of the expired rows."""


class SqliteResponseStore:
    """One SQLite file (WAL, so readers do not wait on a writer) that several processes of one
    machine share; expiry by the wall clock, which they share. Each call runs one short
    statement on a worker thread, never on the event loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._connection = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
        with self._lock, self._connection:
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute(_SCHEMA)
        self._puts = 0

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        self._puts += 1
        purge = self._puts % _PURGE_EVERY == 0
        await asyncio.to_thread(self._put, key, value, time.time() + ttl_s, purge)

    async def get(self, key: str) -> bytes | None:
        return await asyncio.to_thread(self._get, key, time.time())

    async def delete(self, key: str) -> bool:
        return await asyncio.to_thread(self._delete, key, time.time())

    async def replace(self, key: str, value: bytes, ttl_s: float, expected: bytes | None) -> bool:
        expires = time.time() + ttl_s
        return await asyncio.to_thread(self._replace, key, value, expires, expected)

    async def close(self) -> None:
        with self._lock:
            self._connection.close()

    def _put(self, key: str, value: bytes, expires: float, purge: bool) -> None:
        try:
            with self._lock, self._connection:
                self._connection.execute(
                    "INSERT OR REPLACE INTO responses VALUES (?, ?, ?)", (key, expires, value)
                )
                if purge:
                    self._connection.execute(
                        "DELETE FROM responses WHERE expires <= ?", (time.time(),)
                    )
        except sqlite3.Error as error:
            raise StoreFailed(f"{self.path}: {error}") from error

    def _replace(self, key: str, value: bytes, expires: float, expected: bytes | None) -> bool:
        """In one write transaction (``BEGIN IMMEDIATE``: other processes' writes wait)."""
        connection = self._connection
        try:
            with self._lock:
                connection.execute("BEGIN IMMEDIATE")
                try:
                    row = connection.execute(
                        "SELECT value FROM responses WHERE key = ? AND expires > ?",
                        (key, time.time()),
                    ).fetchone()
                    if (None if row is None else bytes(row[0])) != expected:
                        connection.rollback()
                        return False
                    connection.execute(
                        "INSERT OR REPLACE INTO responses VALUES (?, ?, ?)", (key, expires, value)
                    )
                    connection.commit()
                    return True
                except BaseException:
                    connection.rollback()
                    raise
        except sqlite3.Error as error:
            raise StoreFailed(f"{self.path}: {error}") from error

    def _get(self, key: str, now: float) -> bytes | None:
        try:
            with self._lock:
                row = self._connection.execute(
                    "SELECT value FROM responses WHERE key = ? AND expires > ?", (key, now)
                ).fetchone()
        except sqlite3.Error as error:
            raise StoreFailed(f"{self.path}: {error}") from error
        return None if row is None else bytes(row[0])

    def _delete(self, key: str, now: float) -> bool:
        try:
            with self._lock, self._connection:
                kept = self._connection.execute(
                    "DELETE FROM responses WHERE key = ? AND expires > ?", (key, now)
                ).rowcount
                self._connection.execute("DELETE FROM responses WHERE key = ?", (key,))
        except sqlite3.Error as error:
            raise StoreFailed(f"{self.path}: {error}") from error
        return kept > 0
