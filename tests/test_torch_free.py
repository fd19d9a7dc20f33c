"""What runs without torch: the shared core (``splitserve.common``), the scheduling side
(block pool, KV manager, scheduler, requests), the coordinator's registry and router, worker
discovery with its etcd client, and the whole coordinator, gateway and client processes.

Each check imports in a fresh interpreter and reads ``sys.modules``, so a torch import hidden
behind any chain of imports fails it."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE_MODULES = (
    "splitserve.common.blocks",
    "splitserve.common.detokenizer",
    "splitserve.common.env_flags",
    "splitserve.common.errors",
    "splitserve.common.gguf_file",
    "splitserve.common.kv_layout",
    "splitserve.common.load",
    "splitserve.common.logprobs",
    "splitserve.common.membership",
    "splitserve.common.metrics",
    "splitserve.common.model_files",
    "splitserve.common.output_processor",
    "splitserve.common.prompt",
    "splitserve.common.request_update",
    "splitserve.common.sampling_params",
    "splitserve.common.tokenizer",
    "splitserve.engine.block_pool",
    "splitserve.engine.kv_cache_manager",
    "splitserve.engine.scheduler",
    "splitserve.engine.request",
    "splitserve.engine.config",
    "splitserve.engine.model_spec",  # the coordinator names a model through it
    "splitserve.engine.random_shapes",
    "splitserve.launch.cli",  # the `splitserve` command table; torch only for generate / chat
    "splitserve.transfer.plan",
    "splitserve.coordinator.registry",
    "splitserve.coordinator.router",
    "splitserve.discovery",
    "splitserve.discovery.etcd_announcer",
    "splitserve.discovery.etcd_watcher",
    "splitserve.discovery.etcd_server",
    "splitserve.proto.etcd_client",
    "splitserve.client",
    "splitserve.client.types",
    "splitserve.client.errors",
    "splitserve.client.retry",
    "splitserve.client.wire",
    "splitserve.client.async_client",
    "splitserve.client.sync_client",
)

ROLE_ENTRY_MODULES = (
    "splitserve.coordinator.main",
    "splitserve.launch.up",
    "splitserve.gateway.main",
    "splitserve.launch.probe",
    "splitserve.launch.top",
    "splitserve.engine.sim_profile",
    "splitserve.common.cpu_info",
    "splitserve.client",
)
"""The processes that never run a model: what ``python -m`` / ``import`` loads for each."""


def _imports_torch(modules: tuple[str, ...]) -> bool:
    imports = "; ".join(f"import {name}" for name in modules)
    check = f"{imports}; import sys; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", check], check=True, capture_output=True, text=True
    )
    return result.stdout.strip() == "True"


def test_scheduling_and_shared_modules_do_not_import_torch() -> None:
    assert not _imports_torch(TORCH_FREE_MODULES)


@pytest.mark.parametrize("entry", ROLE_ENTRY_MODULES)
def test_role_entry_module_does_not_import_torch(entry: str) -> None:
    assert not _imports_torch((entry,)), f"{entry} imports torch"


def test_the_check_sees_torch_when_it_is_imported() -> None:
    """The check itself can fail: a worker's entry module does load torch."""
    assert _imports_torch(("splitserve.decode.main",))
