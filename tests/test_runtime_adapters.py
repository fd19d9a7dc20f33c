"""The coordinator's runtime LoRA changes (``coordinator/runtime_adapters.py``) over its real
registry, the workers' calls answered by a stand-in per worker address: all or none (a
refusal or differing files unload it again where it was newly loaded), the registry's
records updated at once, newcomers given the adapters loaded here, unloads.

Last, the worker's own check of the folder a load names (``--lora-dir``). The calls themselves,
the workers' refusals and the engines' loads run for real in
``tests/test_lora_runtime_served.py``; here the coordinator's bookkeeping is checked on
cases a real cluster makes hard to stage (one worker of three refusing, files differing per
host, a worker joining later).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from splitserve.common.adapter_id import AdapterId
from splitserve.common.errors import InvalidRequestError, ModelNotFoundError, WorkerCallError
from splitserve.common.membership import Role
from splitserve.coordinator import runtime_adapters
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry
from splitserve.coordinator.runtime_adapters import RuntimeAdapters
from splitserve.worker.adapters_servicer import adapter_folder


@dataclass
class _Worker:
    """A worker's adapter calls: what it serves, and how it answers a load."""

    digest: str = "d1"
    refusal: Exception | None = None
    served: dict[str, str] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    async def load(self, name: str, path: str, timeout_s: float) -> tuple[AdapterId, bool]:
        self.calls.append(f"load {name}")
        if self.refusal is not None:
            raise self.refusal
        newly = name not in self.served
        self.served[name] = self.digest
        return AdapterId(name, self.digest), newly

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


def _cluster(*addresses: str) -> tuple[WorkerRegistry, dict[str, _Worker]]:
    registry = WorkerRegistry()
    for index, address in enumerate(addresses):
        registry.register(_record(f"w{index}", Role.DECODE, address))
    registry.register(_record("w0-prefill", Role.PREFILL, addresses[0]))  # two roles, one process
    return registry, {address: _Worker() for address in addresses}


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
        assert not adapters.loaded

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
