"""Values larger than one key of a store holds, kept in parts: a ``ResponseStore`` over one
whose keys take at most ``part_bytes`` each (etcd's request limit: 1.5 MiB by default), so a
long conversation or a streamed background response's record is kept whatever its size.

Layout: a value of at most ``part_bytes`` is kept as it is under its key (what every value
was before, so records already kept read the same). A larger one is cut into parts kept under
``<key>#<generation>#<i>`` (a random generation for each write), and its key holds a *head*:
``HEAD_MARK`` and the JSON of the generation, the number of parts, the value's size and its
SHA-256. Records are JSON and never start with ``HEAD_MARK``'s NUL.

Contract (``common/response_store.py``'s, for any size of value):
- A write puts every part first and the head last: the head is the commit. ``replace``
  compares and swaps the head only, so two writers racing over one key cannot both win, and
  the loser's parts are deleted. The previous generation's parts are deleted after the head
  that replaced it (where this process knows them: the head it read or wrote last).
- ``get`` reads the head, then its parts; a part missing or a value whose SHA-256 is not the
  head's (a writer replaced the head and deleted those parts meanwhile) reads the head again,
  up to ``READ_ATTEMPTS`` times; then the value is gone (None), as an expired one.
- ``replace``'s ``expected`` is a value as ``get`` returned it: for a value kept in parts,
  the head this process read it from is what is compared (read again where it has none).
- Parts live as long as their head: written with the same time to live, just before it.
  Parts no head names (a writer that died between its parts and its head, or a previous
  generation another process wrote) expire with their time to live.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from splitserve.common.response_store import ResponseStore

HEAD_MARK = b"\x00parts\x00"
READ_ATTEMPTS = 4
HEADS_KEPT = 4096
"""Heads of values in parts this process remembers (the most recently read or written): a
replace over one it forgot reads the value again; an overwrite of one it forgot leaves the
old parts to expire."""


@dataclass(frozen=True)
class _Head:
    generation: str
    parts: int
    size: int
    sha256: str

    def to_bytes(self) -> bytes:
        fields = {"g": self.generation, "n": self.parts, "b": self.size, "h": self.sha256}
        return HEAD_MARK + json.dumps(fields).encode()

    @classmethod
    def parse(cls, raw: bytes) -> _Head | None:
        """The head ``raw`` is, or None for a value kept whole."""
        if not raw.startswith(HEAD_MARK):
            return None
        fields = json.loads(raw[len(HEAD_MARK) :])
        return cls(fields["g"], fields["n"], fields["b"], fields["h"])

    def part_keys(self, key: str) -> list[str]:
        return [f"{key}#{self.generation}#{i}" for i in range(self.parts)]


class ChunkedStore:
    """``store`` with values of any size (module docstring); ``part_bytes``: the most one
    of its keys takes."""

    def __init__(self, store: ResponseStore, part_bytes: int) -> None:
        if part_bytes < 1024:
            raise ValueError(f"parts of {part_bytes} bytes: at least 1024")
        self.store = store
        self.part_bytes = part_bytes
        self._seen: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()
        """key -> (the raw head last read or written here, its value's SHA-256), for keys
        kept in parts."""

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        raw = await self._write_parts(key, value, ttl_s)
        try:
            await self.store.put(key, raw, ttl_s)
        except BaseException:
            await self._drop_parts(key, raw)
            raise
        await self._wrote(key, raw)

    async def replace(self, key: str, value: bytes, ttl_s: float, expected: bytes | None) -> bool:
        expected_raw = expected
        if expected is not None and len(expected) > self.part_bytes:
            expected_raw = await self._head_of(key, expected)
            if expected_raw is None:
                return False  # the key holds something else now
        raw = await self._write_parts(key, value, ttl_s)
        try:
            replaced = await self.store.replace(key, raw, ttl_s, expected_raw)
        except BaseException:
            await self._drop_parts(key, raw)
            raise
        if not replaced:
            await self._drop_parts(key, raw)
            return False
        await self._wrote(key, raw, previous=expected_raw)
        return True

    async def get(self, key: str) -> bytes | None:
        for _ in range(READ_ATTEMPTS):
            raw = await self.store.get(key)
            head = None if raw is None else _Head.parse(raw)
            if raw is None or head is None:
                self._seen.pop(key, None)
                return raw
            parts = await asyncio.gather(*(self.store.get(k) for k in head.part_keys(key)))
            if all(part is not None for part in parts):
                value = b"".join(part for part in parts if part is not None)
                digest = hashlib.sha256(value).hexdigest()
                if len(value) == head.size and digest == head.sha256:
                    self._remember(key, raw, digest.encode())
                    return value
        return None

    async def delete(self, key: str) -> bool:
        raw = await self.store.get(key)
        deleted = await self.store.delete(key)
        if raw is not None:
            await self._drop_parts(key, raw)
        self._seen.pop(key, None)
        return deleted

    async def close(self) -> None:
        self._seen.clear()
        await self.store.close()

    async def _write_parts(self, key: str, value: bytes, ttl_s: float) -> bytes:
        """``value`` kept whole (itself), or its parts put and its head (returned)."""
        if len(value) <= self.part_bytes:
            return value
        parts = [value[at : at + self.part_bytes] for at in range(0, len(value), self.part_bytes)]
        digest = hashlib.sha256(value).hexdigest()
        head = _Head(secrets.token_hex(8), len(parts), len(value), digest)
        keys = head.part_keys(key)
        try:
            puts = (self.store.put(k, p, ttl_s) for k, p in zip(keys, parts, strict=True))
            await asyncio.gather(*puts)
        except BaseException:
            await self._drop_parts(key, head.to_bytes())
            raise
        return head.to_bytes()

    async def _wrote(self, key: str, raw: bytes, previous: bytes | None = None) -> None:
        """After ``raw`` became ``key``'s: the parts of the head it replaced go, and a head is
        remembered with the SHA-256 it names."""
        known = self._seen.get(key)
        stale = previous if previous is not None else (known[0] if known else None)
        if stale is not None and stale != raw:
            await self._drop_parts(key, stale)
        head = _Head.parse(raw)
        if head is None:
            self._seen.pop(key, None)
        else:
            self._remember(key, raw, head.sha256.encode())

    def _remember(self, key: str, raw: bytes, digest: bytes) -> None:
        self._seen[key] = (raw, digest)
        self._seen.move_to_end(key)
        while len(self._seen) > HEADS_KEPT:
            self._seen.popitem(last=False)

    async def _head_of(self, key: str, expected: bytes) -> bytes | None:
        """The raw head ``key`` holds where its value is ``expected`` (read here before, or
        read now), else None."""
        digest = hashlib.sha256(expected).hexdigest().encode()
        known = self._seen.get(key)
        if known is not None and known[1] == digest:
            return known[0]
        if await self.get(key) != expected:
            return None
        known = self._seen.get(key)
        return None if known is None else known[0]

    async def _drop_parts(self, key: str, raw: bytes) -> None:
        """Delete the parts ``raw`` names (nothing for a value kept whole); best effort:
        parts left expire with their time to live."""
        head = _Head.parse(raw)
        if head is None:
            return
        await asyncio.gather(
            *(self.store.delete(k) for k in head.part_keys(key)), return_exceptions=True
        )
