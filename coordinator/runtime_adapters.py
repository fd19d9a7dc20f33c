"""LoRA adapters loaded and unloaded across a coordinator's workers while they serve (the
gateway's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, the ``Coordinator``
service's ``LoadLoraAdapter`` and ``UnloadLoraAdapter``).

Contract:
- ``load`` asks every registered worker of the model (each process once, whatever its
  roles) to serve the adapter (``worker/adapters_servicer.py``). All or none: where one
  worker refuses or fails, or the workers read files of different digests under the path,
  the workers that newly loaded it unload it again and the caller gets the first worker's
  error, naming that worker. A prompt of an adapter may be computed on one worker and
  decoded on another, so a request of it must find the same files on both.
- Without ``replace``, a name recorded (below) from another path is refused (INVALID_ARGUMENT
  ``lora_name``), as a worker refuses a name it serves with other files.
- ``replace`` (vLLM's ``load_inplace``) serves the files in place of other files served
  under the name, in two phases (``_load_in_place``): every worker reads and checks them
  (``check_only``; a refusal or differing files change nothing anywhere), the adapter is
  recorded, then every worker serves them to the requests that come next (those running
  finish with the old files).
- On success the registry's records list the adapter at once (a request right after the
  answer is routed to it); the workers' load reports carry it from then on for every other
  coordinator following them.
- On success it is recorded in the model's ``AdapterCatalog`` (``discovery/adapter_catalog.py``:
  with ``--etcd-endpoints`` a key in etcd that every coordinator of the model reads, else
  this coordinator's memory); where it cannot be recorded (etcd unreachable) the load is
  undone like a refusal (``MembershipStoreError``: UNAVAILABLE).
- Every adapter recorded there is loaded onto the routable workers that lack it (``_reconcile``,
  once a second from ``start``: a worker that joined later or came back; one that refused is
  asked again after ``RECONCILE_RETRY_S``), and in place onto those serving other files under
  its name (checked there first), by every coordinator of the model that reads the
  record: on etcd an adapter outlives the coordinator that loaded it and is given to the
  newcomers of a fleet that scales out whichever coordinators run. A newcomer that reads
  other files under the path (another digest) is made to unload them again. An adapter this
  coordinator gave a newcomer and that is no longer recorded when it looks next (another
  coordinator unloaded it meanwhile) it unloads there again (``_withdraw_unwanted``).
  Adapters every worker must always serve belong in the workers' ``--lora-modules``.
- ``unload`` removes the record first (no coordinator gives it out again; etcd unreachable:
  UNAVAILABLE, nothing changed), then asks every worker serving the name to stop (requests of
  it already running finish there); ``ModelNotFoundError`` where it was neither recorded nor
  served.
- One change at a time per coordinator (a lock): a load and an unload of one name through
  one coordinator never interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NoReturn

from splitserve.common.adapter_id import AdapterId, WantedAdapter, check_adapter_name
from splitserve.common.errors import (
    InvalidRequestError,
    MembershipStoreError,
    ModelLoadError,
    ModelNotFoundError,
    SplitserveError,
    WorkerCallError,
    WorkerUnavailableError,
)
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry
from splitserve.discovery.adapter_catalog import AdapterCatalog, LocalAdapterCatalog
from splitserve.proto.worker_clients import WorkerChannels

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0
"""Deadline of one worker's load: reading, checking and banking the adapter's factors."""
UNLOAD_TIMEOUT_S = 10.0
RECONCILE_INTERVAL_S = 1.0
"""How often the workers are checked for recorded adapters that they lack."""
RECONCILE_RETRY_S = 30.0
"""After a worker refused or failed to load an adapter on its own: when it is asked again."""


@dataclass(frozen=True)
class AdapterLoaded:
    """The answer to a load: the adapter (its files' digest) and the workers serving it."""

    adapter: AdapterId
    workers: int


class RuntimeAdapters:
    """LoRA adapters loaded at runtime onto the model's workers: the changes asked of this
    coordinator, and the record of them every coordinator of the model follows (module
    docstring)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        channels: WorkerChannels,
        catalog: AdapterCatalog | None = None,
    ) -> None:
        self._registry = registry
        self._channels = channels
        self.catalog: AdapterCatalog = LocalAdapterCatalog() if catalog is None else catalog
        """The adapters every worker of the model is to serve (module docstring)."""
        self._lock = asyncio.Lock()
        self._reconciling: asyncio.Task[None] | None = None
        self._refused_at: dict[tuple[str, str], float] = {}
        """(worker address, adapter name) -> when that worker last refused it on its own."""
        self._given: dict[tuple[str, str], str] = {}
        """(worker address, adapter name) -> the digest ``_reconcile`` loaded there."""

    async def start(self) -> None:
        """Follow the catalog and give its adapters to the workers that lack them."""
        await self.catalog.start()
        self._keep_reconciling()

    def _keep_reconciling(self) -> None:
        if self._reconciling is None or self._reconciling.done():
            self._reconciling = asyncio.create_task(self._reconcile(), name="lora-reconcile")

    async def load(self, name: str, path: str, *, replace: bool = False) -> AdapterLoaded:
        """Serve the adapter in ``path`` (as each worker's ``--lora-dir`` resolves it) as
        ``name`` on every worker of the model, or on none (module docstring); ``replace``:
        in place of other files served under ``name`` (``_load_in_place``)."""
        check_adapter_name(name)
        if not path:
            raise InvalidRequestError("lora_path is required", "lora_path")
        async with self._lock:
            addresses = _addresses(self._registry.workers(healthy_only=False))
            if not addresses:
                raise WorkerUnavailableError("no worker is registered to load the adapter on")
            if replace:
                return await self._load_in_place(name, path, addresses)
            recorded = self.catalog.wanted().get(name)
            if recorded is not None and recorded.path != path:
                raise InvalidRequestError(
                    f"LoRA adapter {name!r} is loaded from other files ({recorded.path!r}): "
                    "unload it first, or load these in place (load_inplace)",
                    "lora_name",
                )
            loaded, failures = await self._call_load(addresses, name, path)
            digests = {adapter.digest for adapter, _ in loaded.values()}
            if failures or len(digests) > 1:
                newly = [address for address, (_, fresh) in loaded.items() if fresh]
                await asyncio.gather(*(self._unload_at(address, name) for address in newly))
                _raise_refusal(failures, digests, path)
            adapter = next(iter(loaded.values()))[0]
            try:
                await self.catalog.put(WantedAdapter(adapter, path))
            except MembershipStoreError as error:
                newly = [address for address, (_, fresh) in loaded.items() if fresh]
                await asyncio.gather(*(self._unload_at(address, name) for address in newly))
                raise MembershipStoreError(
                    f"LoRA adapter {name!r} not loaded: it could not be recorded for the other "
                    f"coordinators ({error})"
                ) from error
            self._record(name, adapter, set(loaded))
            logger.info("LoRA adapter %r loaded from %s on %d workers", name, path, len(loaded))
            self._keep_reconciling()
            return AdapterLoaded(adapter, len(loaded))

    async def _load_in_place(self, name: str, path: str, addresses: list[str]) -> AdapterLoaded:
        """Two phases: every worker reads and checks the files (``check_only``; a refusal or
        differing files change nothing anywhere), the adapter is recorded, then every worker
        serves them under ``name`` in place of what it served (requests running there finish
        with the old files). A worker that fails the second phase (gone since the first)
        keeps what it had until it answers again: the record gives it the new files then
        (``_load_missing``); the caller gets UNAVAILABLE naming it."""
        checked, failures = await self._call_load(
            addresses, name, path, replace=True, check_only=True
        )
        digests = {adapter.digest for adapter, _ in checked.values()}
        if failures or len(digests) > 1:
            _raise_refusal(failures, digests, path)
        adapter = next(iter(checked.values()))[0]
        try:
            await self.catalog.put(WantedAdapter(adapter, path))
        except MembershipStoreError as error:
            raise MembershipStoreError(
                f"LoRA adapter {name!r} not replaced: it could not be recorded for the other "
                f"coordinators ({error})"
            ) from error
        served, failures = await self._call_load(addresses, name, path, replace=True)
        self._record(name, adapter, {a for a, (got, _) in served.items() if got == adapter})
        stray = [(a, got) for a, (got, _) in served.items() if got != adapter]
        if failures or stray:
            address, error = failures[0] if failures else (stray[0][0], f"read {stray[0][1]}")
            raise WorkerCallError(
                f"worker at {address}: {error}; the other workers serve the files checked "
                f"(digest {adapter.digest}) and it is given them once it answers again"
            )
        logger.info("LoRA adapter %r replaced from %s on %d workers", name, path, len(served))
        self._keep_reconciling()
        return AdapterLoaded(adapter, len(served))

    async def _call_load(
        self,
        addresses: list[str],
        name: str,
        path: str,
        *,
        replace: bool = False,
        check_only: bool = False,
    ) -> tuple[dict[str, tuple[AdapterId, bool]], list[tuple[str, BaseException]]]:
        """Load (``check_only``: check) at every address at once: each worker's (id, newly)
        answer, and the failures in address order."""
        results = await asyncio.gather(
            *(
                self._channels.adapters(a).load(
                    name, path, LOAD_TIMEOUT_S, replace=replace, check_only=check_only
                )
                for a in addresses
            ),
            return_exceptions=True,
        )
        loaded: dict[str, tuple[AdapterId, bool]] = {}
        failures: list[tuple[str, BaseException]] = []
        for address, result in zip(addresses, results, strict=True):
            if isinstance(result, BaseException):
                failures.append((address, result))
            else:
                loaded[address] = result
        return loaded, failures

    async def unload(self, name: str) -> int:
        """Stop serving ``name`` on every worker serving it; how many did. Requests of it
        running there finish with it."""
        async with self._lock:
            recorded = await self.catalog.remove(name)
            self._given = {key: digest for key, digest in self._given.items() if key[1] != name}
            holders = _addresses(
                w
                for w in self._registry.workers(healthy_only=False)
                if any(adapter.name == name for adapter in w.adapters)
            )
            if not holders:
                if recorded:
                    return 0
                raise ModelNotFoundError(f"no worker serves a LoRA adapter named {name!r}")
            results = await asyncio.gather(
                *(self._channels.adapters(a).unload(name, UNLOAD_TIMEOUT_S) for a in holders),
                return_exceptions=True,
            )
            gone = {
                address
                for address, result in zip(holders, results, strict=True)
                if result is None or isinstance(result, ModelNotFoundError)
            }
            self._record(name, None, gone)
            for address, result in zip(holders, results, strict=True):
                if address not in gone and isinstance(result, BaseException):
                    raise _at_worker(address, result)
            logger.info("LoRA adapter %r unloaded from %d workers", name, len(gone))
            return len(gone)

    async def close(self) -> None:
        """Stop loading adapters onto newcomers and following the catalog."""
        if self._reconciling is not None:
            self._reconciling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconciling
        await self.catalog.close()

    def _record(self, name: str, adapter: AdapterId | None, addresses: set[str]) -> None:
        """The workers at ``addresses`` serve ``adapter`` under ``name`` now, in place of what
        they served under it (None: nothing)."""
        for record in self._registry.workers(healthy_only=False):
            if record.address in addresses:
                kept = {a for a in record.adapters if a.name != name}
                record.adapters = frozenset(kept if adapter is None else {*kept, adapter})

    async def _unload_at(self, address: str, name: str) -> None:
        """Undo a load at one worker (best effort: logged when it fails)."""
        try:
            await self._channels.adapters(address).unload(name, UNLOAD_TIMEOUT_S)
        except SplitserveError as error:
            logger.warning("worker at %s kept LoRA adapter %r: %s", address, name, error)

    async def _reconcile(self) -> None:
        """Until closed: load each recorded adapter onto the routable workers that lack it,
        and take back what was given out here and is no longer recorded."""
        while True:
            await asyncio.sleep(RECONCILE_INTERVAL_S)
            try:
                async with self._lock:
                    wanted = self.catalog.wanted()
                    await self._withdraw_unwanted(wanted)
                    await self._load_missing(wanted)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the reconciling for good
                logger.exception("giving LoRA adapters to newcomers failed; going on")

    async def _withdraw_unwanted(self, wanted: dict[str, WantedAdapter]) -> None:
        """Forget what was given to workers that no longer serve it; unload what was given
        and is no longer recorded."""
        records = {record.address: record for record in self._registry.workers(healthy_only=False)}
        withdrawn: list[tuple[str, str]] = []
        for (address, name), digest in list(self._given.items()):
            record = records.get(address)
            recorded = wanted.get(name)
            if record is not None and AdapterId(name, digest) in record.adapters:
                if recorded is not None:
                    continue  # still wanted (other files recorded: _load_missing replaces)
                logger.info(
                    "LoRA adapter %r is no longer wanted: unloading it at %s", name, address
                )
                self._record(name, None, {address})
                withdrawn.append((address, name))
            del self._given[(address, name)]  # withdrawn, or it left, or its adapter went
        await asyncio.gather(*(self._unload_at(address, name) for address, name in withdrawn))

    async def _load_missing(self, wanted: dict[str, WantedAdapter]) -> None:
        now = time.monotonic()
        done: set[tuple[str, str]] = set()
        for record in self._registry.workers():
            served = {adapter.name: adapter.digest for adapter in record.adapters}
            for name, recorded in wanted.items():
                key = (record.address, name)
                if served.get(name) == recorded.adapter.digest or key in done:
                    continue
                if now - self._refused_at.get(key, -RECONCILE_RETRY_S) < RECONCILE_RETRY_S:
                    continue
                done.add(key)
                await self._give(record, recorded, now, replace=name in served)

    async def _give(
        self, record: WorkerRecord, wanted: WantedAdapter, now: float, *, replace: bool
    ) -> None:
        """Load ``wanted`` onto the worker of ``record`` (``replace``: in place of the other
        files it serves under the name, checked there first); where it refuses, or reads
        other files (undone there, or with ``replace`` never served), it is not asked again
        within ``RECONCILE_RETRY_S``."""
        name, address = wanted.adapter.name, record.address
        client = self._channels.adapters(address)
        try:
            if replace:
                checked, _ = await client.load(
                    name, wanted.path, LOAD_TIMEOUT_S, replace=True, check_only=True
                )
                if checked.digest != wanted.adapter.digest:
                    self._refuse_other_files(address, wanted, checked.digest, now)
                    return
            adapter, fresh = await client.load(name, wanted.path, LOAD_TIMEOUT_S, replace=replace)
        except SplitserveError as error:
            self._refused_at[(address, name)] = now
            logger.warning("worker at %s did not load LoRA adapter %r: %s", address, name, error)
            return
        if adapter.digest != wanted.adapter.digest:
            self._refuse_other_files(address, wanted, adapter.digest, now)
            if fresh and not replace:
                await self._unload_at(address, name)
            return
        self._record(name, adapter, {address})
        if fresh:
            self._given[(address, name)] = adapter.digest
            verb = "replaced on" if replace else "loaded on newcomer"
            logger.info("LoRA adapter %r %s %s", name, verb, record.worker_id)

    def _refuse_other_files(
        self, address: str, wanted: WantedAdapter, digest: str, now: float
    ) -> None:
        self._refused_at[(address, wanted.adapter.name)] = now
        logger.warning(
            "worker at %s read other files for LoRA adapter %r under %s (digest %s, the "
            "others' %s): not serving them there",
            address,
            wanted.adapter.name,
            wanted.path,
            digest,
            wanted.adapter.digest,
        )


def _addresses(records: Iterable[WorkerRecord]) -> list[str]:
    """The distinct worker processes' addresses among ``records`` (a worker of two roles
    registers twice at one address), sorted."""
    return sorted({record.address for record in records})


def _raise_refusal(
    failures: list[tuple[str, BaseException]], digests: set[str], path: str
) -> NoReturn:
    """The answer to a load the workers did not all take: the first failure, naming its
    worker, else the workers' differing files."""
    if failures:
        raise _at_worker(*failures[0])
    raise InvalidRequestError(
        f"the workers read different files under {path!r} (digests "
        f"{', '.join(sorted(digests))}): give every worker the same adapter there",
        "lora_path",
    )


def _at_worker(address: str, error: BaseException) -> SplitserveError:
    """``error`` of the worker at ``address`` as the caller's error, naming the worker."""
    prefix = f"worker at {address}: "
    if isinstance(error, InvalidRequestError):
        return InvalidRequestError(prefix + error.message, error.param)
    if isinstance(error, ModelNotFoundError | ModelLoadError | WorkerUnavailableError):
        return type(error)(prefix + str(error))
    if isinstance(error, SplitserveError):
        return WorkerCallError(prefix + str(error))
    raise error
