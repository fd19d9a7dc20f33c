"""The runtime LoRA adapters of a model in etcd (``discovery/adapter_catalog.py``'s contract):
a key per adapter under ``etcd_keys.adapters_prefix(cluster, model)``, its value the
serialized ``WantedAdapter``, with no lease (an adapter outlives every coordinator).

``start`` reads the prefix and watches it from the revision after that read, in a task that
retries until etcd answers and starts over after a watch that ended on an error, so a
coordinator started before etcd, or one that lost its login, catches up by itself. Its own
``put`` and ``remove`` change ``wanted()`` at once, before their watch events arrive; every
change is applied only when newer (by store revision) than what is known of that name, so a
late event never undoes a newer change. A value that is not a valid ``WantedAdapter`` for its
key is logged and treated as absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from splitserve.common.adapter_id import WantedAdapter
from splitserve.common.errors import InvalidRequestError
from splitserve.discovery.etcd_keys import adapter_key, adapter_name_of, adapters_prefix
from splitserve.proto import convert
from splitserve.proto.etcd_client import (
    DeleteEvent,
    EtcdClient,
    KeyValue,
    PutEvent,
    ResetEvent,
    WatchEvent,
)

logger = logging.getLogger(__name__)

RETRY_MIN_S = 0.5
RETRY_MAX_S = 10.0


class EtcdAdapterCatalog:
    """``AdapterCatalog`` on etcd for the runtime adapters of ``model`` in ``cluster``;
    ``client`` is its own (``close`` closes it)."""

    def __init__(self, client: EtcdClient, cluster: str, model: str) -> None:
        self._client = client
        self._cluster = cluster
        self._model = model
        self._prefix = adapters_prefix(cluster, model)
        self._wanted: dict[str, WantedAdapter] = {}
        self._revisions: dict[str, int] = {}
        """name -> the store revision of the newest change known of it (kept after a
        removal, so an older put arriving late is not taken for a new one)."""
        self._task: asyncio.Task[None] | None = None
        self.read = asyncio.Event()
        """Set once the prefix has been read (``wanted()`` is the store's from then on)."""

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name="etcd-adapter-catalog")

    def wanted(self) -> dict[str, WantedAdapter]:
        return dict(self._wanted)

    async def put(self, wanted: WantedAdapter) -> None:
        name = wanted.adapter.name
        value = convert.wanted_adapter_to_bytes(wanted)
        revision = await self._client.put(adapter_key(self._cluster, self._model, name), value)
        self._apply(name, wanted, revision)

    async def remove(self, name: str) -> bool:
        revision = await self._client.delete(adapter_key(self._cluster, self._model, name))
        if revision:
            self._apply(name, None, revision)
        return bool(revision)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._client.close()

    async def _follow(self) -> None:
        """Read, then watch; after any failure wait (capped backoff) and start over."""
        backoff_s = RETRY_MIN_S
        while True:
            try:
                items, revision = await self._client.get_prefix(self._prefix)
                self._replace(items, revision)
                self.read.set()
                backoff_s = RETRY_MIN_S
                async for event in self._client.watch_prefix(self._prefix, revision + 1):
                    self._on(event)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # etcd unreachable or refusing: retried, never fatal
                logger.warning("following the LoRA adapters in etcd failed (%s); retrying", error)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, RETRY_MAX_S)

    def _on(self, event: WatchEvent) -> None:
        if isinstance(event, ResetEvent):
            self._replace(event.items, event.revision)
            return
        name = adapter_name_of(self._prefix, event.key)
        if isinstance(event, PutEvent):
            self._apply(name, self._decode(name, event.value), event.revision)
        elif isinstance(event, DeleteEvent):
            self._apply(name, None, event.revision)
        else:
            raise TypeError(f"unknown watch event {event!r}")

    def _apply(self, name: str, wanted: WantedAdapter | None, revision: int) -> None:
        """``name`` holds ``wanted`` (None: nothing) as of ``revision``, unless a newer change
        of it is known."""
        if revision < self._revisions.get(name, 0):
            return
        self._revisions[name] = revision
        if wanted is None:
            self._wanted.pop(name, None)
        else:
            self._wanted[name] = wanted

    def _replace(self, items: Iterable[KeyValue], revision: int) -> None:
        """The whole prefix as of ``revision``: names absent from it are gone (unless changed
        here later than that)."""
        present = {}
        for item in items:
            name = adapter_name_of(self._prefix, item.key)
            present[name] = (self._decode(name, item.value), item.mod_revision)
        for name in set(self._wanted) - set(present):
            self._apply(name, None, revision)
        for name, (wanted, mod_revision) in present.items():
            self._apply(name, wanted, mod_revision)

    def _decode(self, name: str, value: bytes) -> WantedAdapter | None:
        try:
            wanted = convert.wanted_adapter_from_bytes(value)
        except InvalidRequestError as error:
            logger.warning("ignoring the etcd LoRA adapter key %r: %s", name, error)
            return None
        if wanted.adapter.name != name:
            logger.warning("ignoring the etcd LoRA adapter key %r: it holds %r", name, wanted)
            return None
        return wanted
