"""The scheduling side (block pool, KV manager, scheduler, requests, detokenization, the
coordinator's registry and router) is torch-free."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE_MODULES = (
    "splitserve.engine.block_pool",
    "splitserve.engine.kv_cache_manager",
    "splitserve.engine.scheduler",
    "splitserve.engine.request",
    "splitserve.engine.sampling_params",
    "splitserve.engine.config",
    "splitserve.engine.output_processor",
    "splitserve.transfer.layout",
    "splitserve.coordinator.registry",
    "splitserve.coordinator.router",
    "splitserve.client",
    "splitserve.client.types",
    "splitserve.client.errors",
    "splitserve.client.retry",
    "splitserve.client.wire",
    "splitserve.client.async_client",
    "splitserve.client.sync_client",
)


def test_scheduling_modules_do_not_import_torch() -> None:
    imports = "; ".join(f"import {name}" for name in TORCH_FREE_MODULES)
    check = f"{imports}; import sys; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", check], check=True)
