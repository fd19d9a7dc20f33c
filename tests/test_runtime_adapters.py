"""The coordinator's runtime LoRA changes (``coordinator/runtime_adapters.py``) over its real
registry, the workers' calls answered by a stand-in per worker address: all or none (a
refusal or differing files unload it again where it was newly loaded), the registry's
records updated at once, newcomers given the adapters loaded here, unloads.

On a real etcd (``discovery/etcd_adapter_catalog.py``): the record of the adapters shared by
two coordinators (each its own registry, as two processes have), so one gives newcomers what
the other loaded, after the other is gone, and takes back what it gave once the other
unloaded it; an etcd that does not answer refuses a load or an unload and changes nothing.

Last, the worker's own check of the folder a load names (``--lora-dir``). The calls themselves,
the workers' refusals and the engines' loads run for real in
``tests/test_lora_runtime_served.py``; here the coordinator's bookkeeping is checked on
cases a real cluster makes hard to stage (one worker of three refusing, files differing per
host, a worker joining later).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from splitserve.common.adapter_id import AdapterId, WantedAdapter
from splitserve.common.errors import (
    InvalidRequestError,
    MembershipStoreError,
    ModelNotFoundError,
    WorkerCallError,
)
from splitserve.common.membership import Role
from splitserve.coordinator import runtime_adapters
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry
from splitserve.coordinator.runtime_adapters import RuntimeAdapters
from splitserve.discovery.etcd_adapter_catalog import EtcdAdapterCatalog
from splitserve.discovery.etcd_keys import adapters_prefix
from splitserve.proto.etcd_client import EtcdClient
from splitserve.proto.status import status_of
from splitserve.worker.adapters_servicer import adapter_folder
from tests.etcd import EtcdServer


@dataclass
class _Worker:
    """A worker's adapter calls: what it serves, and how it answers a load."""

    digest: str = "d1"
    """The digest of the files it reads under any path not in ``files``."""
    refusal: Exception | None = None
    served: dict[str, str] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    """path -> the digest of the files it reads there."""

    async def load(
        self,
        name: str,
        path: str,
        timeout_s: float,
        *,
        replace: bool = False,
        check_only: bool = False,
    ) -> tuple[AdapterId, bool]:
        self.calls.append(f"{'check' if check_only else 'load'} {name}")
        if self.refusal is not None:
            raise self.refusal
        digest = self.files.get(path, self.digest)
        if self.served.get(name, digest) != digest and not replace:
            raise InvalidRequestError("other files", "lora_name")
        newly = self.served.get(name) != digest
        if not check_only:
            self.served[name] = digest
        return AdapterId(name, digest), newly

    async def unload(self, name: str, timeout_s: float) -> None:
        self.calls.append(f"unload {name}")
        if self.served.pop(name, None) is None:
            raise ModelNotFoundError(f"no {name}")


class _Channels:
    def __init__(self, workers: dict[str, _Worker]) -> None:
        self.workers = workers

    def adapters(self, address: str) -> _Worker:
        return self.workers[address]


def _record(worker_id: str, role: Role, address: str) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,
        address=address,
        compat_hash="h",
        block_size=16,
        dtype="float32",
        num_blocks=100,
        max_model_len=4096,
    )


def _registry(*addresses: str) -> WorkerRegistry:
    registry = WorkerRegistry()
    for index, address in enumerate(addresses):
        registry.register(_record(f"w{index}", Role.DECODE, address))
    registry.register(_record("w0-prefill", Role.PREFILL, addresses[0]))  # two roles, one process
    return registry


def _cluster(*addresses: str) -> tuple[WorkerRegistry, dict[str, _Worker]]:
    return _registry(*addresses), {address: _Worker() for address in addresses}


def _served(registry: WorkerRegistry) -> dict[str, set[AdapterId]]:
    return {w.worker_id: set(w.adapters) for w in registry.workers(healthy_only=False)}


def test_a_load_reaches_every_worker_process_once_and_is_routable_at_once() -> None:
    async def run() -> None:
        registry, workers = _cluster("a:1", "b:1")
        adapters = RuntimeAdapters(registry, _Channels(workers))  # type: ignore[arg-type]
        loaded = await adapters.load("tuned", "every")
        assert loaded.adapter == AdapterId("tuned", "d1") and loaded.workers == 2
        assert [w.calls for w in workers.values()] == [["load tuned"], ["load tuned"]]
        assert all(ids == {loaded.adapter} for ids in _served(registry).values())
        assert await adapters.unload("tuned") == 2
        assert all(not ids for ids in _served(registry).values())
        with pytest.raises(ModelNotFoundError):
            await adapters.unload("tuned")
        await adapters.close()

    asyncio.run(run())


def test_one_refusal_unloads_it_again_where_it_was_newly_loaded() -> None:
    async def run() -> None:
        registry, workers = _cluster("a:1", "b:1", "c:1")
        workers["b:1"].served["tuned"] = "d1"  # b had it already: it keeps it
        workers["c:1"].refusal = InvalidRequestError("no such folder", "lora_path")
        adapters = RuntimeAdapters(registry, _Channels(workers))  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="worker at c:1: no such folder") as error:
            await adapters.load("tuned", "missing")
        assert error.value.param == "lora_path"
        assert workers["a:1"].calls == ["load tuned", "unload tuned"]
        assert workers["b:1"].calls == ["load tuned"] and workers["b:1"].served == {"tuned": "d1"}
        assert not adapters.catalog.wanted()

        workers["c:1"].refusal = WorkerCallError("DEADLINE_EXCEEDED")
        with pytest.raises(WorkerCallError, match="worker at c:1"):
            await adapters.load("tuned", "every")

    asyncio.run(run())


def test_workers_reading_different_files_serve_none_of_them() -> None:
    async def run() -> None:
        registry, workers = _cluster("a:1", "b:1")
        workers["b:1"].digest = "d2"
        adapters = RuntimeAdapters(registry, _Channels(workers))  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="different files") as error:
            await adapters.load("tuned", "every")
        assert error.value.param == "lora_path"
        assert all(not w.served for w in workers.values())
        assert all(not ids for ids in _served(registry).values())

    asyncio.run(run())


def test_a_worker_joining_later_is_given_the_adapters_loaded_here(monkeypatch) -> None:
    monkeypatch.setattr(runtime_adapters, "RECONCILE_INTERVAL_S", 0.01)

    async def run() -> None:
        registry, workers = _cluster("a:1")
        adapters = RuntimeAdapters(registry, _Channels(workers))  # type: ignore[arg-type]
        await adapters.load("tuned", "every")
        workers["n:1"] = _Worker()
        registry.register(_record("newcomer", Role.DECODE, "n:1"))
        workers["r:1"] = _Worker(refusal=InvalidRequestError("no --lora-dir"))
        registry.register(_record("refuser", Role.DECODE, "r:1"))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if registry.get("newcomer").adapters:  # type: ignore[union-attr]
                break
        assert registry.get("newcomer").adapters == {AdapterId("tuned", "d1")}  # type: ignore[union-attr]
        assert workers["n:1"].served == {"tuned": "d1"}
        await asyncio.sleep(0.1)
        assert workers["r:1"].calls == ["load tuned"]  # asked once, not again within the retry
        await adapters.unload("tuned")
        await asyncio.sleep(0.05)
        assert workers["n:1"].calls == ["load tuned", "unload tuned"]  # not loaded back
        await adapters.close()

    asyncio.run(run())


def test_a_load_in_place_checks_every_worker_before_any_serves_the_new_files(
    monkeypatch,
) -> None:
    monkeypatch.setattr(runtime_adapters, "RECONCILE_INTERVAL_S", 0.01)

    async def run() -> None:
        registry, workers = _cluster("a:1", "b:1", "c:1")
        for worker in workers.values():
            worker.files["v2"] = "d2"
        adapters = RuntimeAdapters(registry, _Channels(workers))  # type: ignore[arg-type]
        await adapters.load("tuned", "v1")
        with pytest.raises(InvalidRequestError, match="other files") as refused:
            await adapters.load("tuned", "v2")  # without load_inplace: the record refuses
        assert refused.value.param == "lora_name"

        workers["c:1"].files["v2"] = "d3"  # c reads other files under v2: nobody changes
        with pytest.raises(InvalidRequestError, match="different files"):
            await adapters.load("tuned", "v2", replace=True)
        workers["c:1"].files["v2"] = "d2"
        workers["b:1"].refusal = InvalidRequestError("no such folder", "lora_path")
        with pytest.raises(InvalidRequestError, match="worker at b:1"):
            await adapters.load("tuned", "v2", replace=True)
        assert all(w.served == {"tuned": "d1"} for w in workers.values())
        assert adapters.catalog.wanted()["tuned"].adapter.digest == "d1"
        assert workers["a:1"].calls == ["load tuned", "check tuned", "check tuned"]

        workers["b:1"].refusal = None
        loaded = await adapters.load("tuned", "v2", replace=True)
        assert loaded.adapter == AdapterId("tuned", "d2") and loaded.workers == 3
        assert all(w.served == {"tuned": "d2"} for w in workers.values())
        assert all(ids == {loaded.adapter} for ids in _served(registry).values())
        assert adapters.catalog.wanted()["tuned"].path == "v2"

        # a worker that came back serving the old files is given the new ones in place
        workers["n:1"] = _Worker(served={"tuned": "d1"}, files={"v2": "d2"})
        registry.register(_record("late", Role.DECODE, "n:1"))
        registry.get("late").adapters = frozenset({AdapterId("tuned", "d1")})  # type: ignore[union-attr]
        await _until(lambda: workers["n:1"].served == {"tuned": "d2"}, "the in-place reload")
        assert workers["n:1"].calls == ["check tuned", "load tuned"]
        await _until(lambda: _adapters_of(registry, "late") == {loaded.adapter}, "its record")
        await adapters.close()

    asyncio.run(run())


def test_a_worker_reads_adapters_only_under_its_lora_dir(tmp_path) -> None:
    root = tmp_path / "adapters"
    (root / "tuned").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (root / "escape").symlink_to(tmp_path / "secret")
    assert adapter_folder(root, "tuned") == (root / "tuned").resolve()
    assert adapter_folder(root, str(root / "tuned")) == (root / "tuned").resolve()
    for outside in ("../secret", str(tmp_path / "secret"), "escape", "/etc", "a\x00b", ""):
        with pytest.raises(InvalidRequestError) as refused:
            adapter_folder(root, outside)
        assert refused.value.param == "lora_path", outside


MODEL = "org/base-model"
"""A model name holding a "/", as checkpoints' names do (percent-encoded in the keys)."""


def _catalog(etcd: EtcdServer, model: str = MODEL) -> EtcdAdapterCatalog:
    return EtcdAdapterCatalog(EtcdClient([etcd.endpoint], timeout_s=1.0), "test", model)


async def _until(predicate, what: str, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _adapters_of(registry: WorkerRegistry, worker_id: str) -> frozenset[AdapterId]:
    record = registry.get(worker_id)
    assert record is not None
    return record.adapters


@pytest.mark.timeout(60)
def test_the_etcd_record_is_read_by_every_coordinator_and_outlives_its_writer(
    etcd: EtcdServer,
) -> None:
    tuned = WantedAdapter(AdapterId("tuned/v1", "d1"), "tuned")

    async def run() -> None:
        writer, reader = _catalog(etcd), _catalog(etcd)
        other_model = _catalog(etcd, "other")
        for catalog in (writer, reader, other_model):
            await catalog.start()
            await asyncio.wait_for(catalog.read.wait(), 10)
        await writer.put(tuned)
        assert writer.wanted() == {"tuned/v1": tuned}  # at once where it was written
        await _until(lambda: reader.wanted() == {"tuned/v1": tuned}, "the other coordinator")
        await writer.close()
        later = _catalog(etcd)  # a coordinator started after the writer is gone reads it
        await later.start()
        await asyncio.wait_for(later.read.wait(), 10)
        assert later.wanted() == {"tuned/v1": tuned}
        assert other_model.wanted() == {}  # another model's adapters are not this one's
        async with EtcdClient([etcd.endpoint]) as client:  # a value that is no adapter
            await client.put(adapters_prefix("test", MODEL) + b"junk", b"\xff not a message")
        assert await later.remove("tuned/v1")
        assert not await later.remove("tuned/v1")
        assert later.wanted() == {}
        await _until(lambda: reader.wanted() == {}, "the removal at the other coordinator")
        for catalog in (reader, other_model, later):
            await catalog.close()

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_another_coordinator_gives_newcomers_what_one_loaded_and_takes_it_back(
    etcd: EtcdServer, monkeypatch
) -> None:
    monkeypatch.setattr(runtime_adapters, "RECONCILE_INTERVAL_S", 0.01)
    workers = {"a:1": _Worker(), "b:1": _Worker()}
    channels = _Channels(workers)

    async def run() -> None:
        first = RuntimeAdapters(_registry("a:1"), channels, _catalog(etcd))  # type: ignore[arg-type]
        second_registry = _registry("a:1")
        second = RuntimeAdapters(second_registry, channels, _catalog(etcd))  # type: ignore[arg-type]
        for adapters in (first, second):
            await adapters.start()
        await first.load("tuned", "every")
        await first.close()  # the coordinator that loaded it is gone

        second_registry.register(_record("newcomer", Role.DECODE, "b:1"))
        await _until(lambda: _adapters_of(second_registry, "newcomer"), "the newcomer's load")
        assert _adapters_of(second_registry, "newcomer") == {AdapterId("tuned", "d1")}
        assert workers["b:1"].served == {"tuned": "d1"}

        workers["c:1"] = _Worker(digest="d2")  # other files under the path
        second_registry.register(_record("stranger", Role.DECODE, "c:1"))
        await _until(lambda: len(workers["c:1"].calls) == 2, "the stranger's load and unload")
        assert workers["c:1"].calls == ["load tuned", "unload tuned"]
        assert not _adapters_of(second_registry, "stranger")  # requests of it go elsewhere

        # A third coordinator unloads it while the second has just given it to b:1
        # (the third's registry has not heard of b:1 yet): the second takes it back there.
        third_registry = _registry("a:1")
        for record in third_registry.workers():  # as a:1's load reports told it
            record.adapters = frozenset({AdapterId("tuned", "d1")})
        third = RuntimeAdapters(third_registry, channels, _catalog(etcd))  # type: ignore[arg-type]
        await third.start()
        assert await third.unload("tuned") == 1
        assert workers["a:1"].served == {}
        await _until(lambda: not workers["b:1"].served, "the newcomer's unload")
        assert workers["b:1"].calls == ["load tuned", "unload tuned"]
        assert not _adapters_of(second_registry, "newcomer")
        await asyncio.sleep(0.1)
        assert workers["a:1"].calls == ["load tuned", "load tuned", "unload tuned"]  # not back
        for adapters in (second, third):
            await adapters.close()

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_an_etcd_that_does_not_answer_refuses_a_load_and_an_unload(etcd: EtcdServer) -> None:
    registry, workers = _cluster("a:1", "b:1")

    async def run() -> None:
        adapters = RuntimeAdapters(registry, _Channels(workers), _catalog(etcd))  # type: ignore[arg-type]
        await adapters.start()
        await adapters.load("tuned", "every")
        etcd.stop()
        try:
            with pytest.raises(MembershipStoreError, match="could not be recorded"):
                await adapters.load("other", "every")
            assert all(w.served == {"tuned": "d1"} for w in workers.values())  # undone
            with pytest.raises(MembershipStoreError):
                await adapters.unload("tuned")
            assert all(w.served == {"tuned": "d1"} for w in workers.values())  # unchanged
        finally:
            etcd.start()
        assert await adapters.unload("tuned") == 2
        await adapters.close()

    asyncio.run(run())
    assert status_of(MembershipStoreError("etcd down"))[0] == grpc.StatusCode.UNAVAILABLE
