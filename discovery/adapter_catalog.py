"""The LoRA adapters loaded at runtime that every worker of a model is to serve: the
coordinators' shared record of them, behind one small interface.

``coordinator/runtime_adapters.py`` writes an adapter here once every worker has loaded it
and removes it before unloading it, and gives each adapter recorded here to the workers that
lack it (a worker that joined later or came back). Backends:

- ``LocalAdapterCatalog``: the coordinator's memory. What it loaded is given to newcomers
  while it runs; another coordinator of the same workers, or this one after a restart, knows
  nothing of it (the single-machine default, without etcd).
- ``EtcdAdapterCatalog`` (``etcd_adapter_catalog.py``, with ``--etcd-endpoints``): a key per
  adapter in etcd, read and watched by every coordinator of the model, so an adapter loaded
  through one coordinator is given to newcomers by all of them and outlives the coordinator
  that loaded it.

Contract every backend keeps: after ``put`` returns, ``wanted()`` lists the adapter here at
once, and every other coordinator's catalog soon after (none while the store is unreachable);
after ``remove`` returns, none lists it. A ``put`` or ``remove`` that cannot be recorded
raises ``MembershipStoreError`` and changes nothing. ``wanted()`` is empty until ``start()``
has read the store; a store unreachable then is retried in the background.
"""

from __future__ import annotations

from typing import Protocol

from splitserve.common.adapter_id import WantedAdapter


class AdapterCatalog(Protocol):
    """The runtime LoRA adapters of one model that its workers are to serve."""

    async def start(self) -> None:
        """Begin following the record (returns at once; never raises)."""
        ...

    def wanted(self) -> dict[str, WantedAdapter]:
        """The adapters recorded, by name (a copy)."""
        ...

    async def put(self, wanted: WantedAdapter) -> None:
        """Record ``wanted`` (replacing what its name held)."""
        ...

    async def remove(self, name: str) -> bool:
        """Forget ``name``; whether it was recorded."""
        ...

    async def close(self) -> None:
        """Stop following; idempotent."""
        ...


class LocalAdapterCatalog:
    """``AdapterCatalog`` in this process's memory (module docstring)."""

    def __init__(self) -> None:
        self._wanted: dict[str, WantedAdapter] = {}

    async def start(self) -> None:
        pass

    def wanted(self) -> dict[str, WantedAdapter]:
        return dict(self._wanted)

    async def put(self, wanted: WantedAdapter) -> None:
        self._wanted[wanted.adapter.name] = wanted

    async def remove(self, name: str) -> bool:
        return self._wanted.pop(name, None) is not None

    async def close(self) -> None:
        pass
