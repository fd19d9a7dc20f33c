"""gRPC ``WorkerAdapters`` service, on every worker whatever its role: LoRA adapters loaded
and unloaded while the worker serves (the coordinator's ``LoadLoraAdapter`` and
``UnloadLoraAdapter`` reach every worker of its model with these calls).

Contract:
- Only a worker started with ``--lora-dir`` loads or unloads adapters at runtime, loading
  only from folders
  under it (a relative ``path`` is taken under it; an absolute one, links resolved,
  must lie within it): a caller holding the cluster credential still reads no other file of the
  host. Without it every call is FAILED_PRECONDITION, naming the flag.
- A load reads the folder off the engine thread and serves it between two steps
  (``AsyncEngine.load_adapter``): INVALID_ARGUMENT (param ``lora_path``) for an adapter that
  cannot be served as trained, (``lora_name``) for a name served here with other files.
- ``replace`` serves the files in place of other files served under the name (requests
  running finish with the old ones). ``check_only`` reads and checks them and answers as the
  load would, serving nothing, and keeps what it read (``StagedAdapters``, one per name, for
  ``STAGED_TTL_S``) for the load of the same name and path that follows: the coordinator's
  in-place load checks on every worker first, then serves on all, and each serves exactly
  the files it checked.
- An unload (NOT_FOUND where the name is not served) refuses new requests of the adapter at
  once; those running finish with it (``EngineCore.unserve_adapter``).
- The worker's load reports carry its adapters from then on (``LoadReport.adapters``), so
  every coordinator following it learns the change.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from splitserve.common.adapter_id import AdapterId, check_adapter_name
from splitserve.common.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.lora import LoraAdapter
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
from splitserve.proto.status import abort_with
from splitserve.worker.servicer_base import WorkerServicerBase

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerAdapters"].full_name
STAGED_TTL_S = 300.0
"""How long a checked adapter (``check_only``) is kept for the load that follows."""


@dataclass(frozen=True)
class _Staged:
    folder: Path
    adapter: LoraAdapter | AdapterId
    at: float


class StagedAdapters:
    """Adapters read and checked for a load that follows (``check_only``): at most one per
    name, each kept ``STAGED_TTL_S``; a load of the same name and folder takes it."""

    def __init__(self) -> None:
        self._staged: dict[str, _Staged] = {}

    def keep(self, name: str, folder: Path, adapter: LoraAdapter | AdapterId) -> None:
        now = time.monotonic()
        self._staged = {n: s for n, s in self._staged.items() if now - s.at < STAGED_TTL_S}
        self._staged[name] = _Staged(folder, adapter, now)

    def take(self, name: str, folder: Path) -> LoraAdapter | AdapterId | None:
        """What was kept for ``name`` from ``folder`` (and is no older than the TTL), once."""
        staged = self._staged.pop(name, None)
        if staged is None or staged.folder != folder:
            return None
        return staged.adapter if time.monotonic() - staged.at < STAGED_TTL_S else None


def adapter_folder(lora_dir: Path, path: str) -> Path:
    """The folder ``path`` names under ``lora_dir`` (relative: under it; absolute: it must
    lie within it once links are resolved); ``InvalidRequestError`` (param ``lora_path``)
    for a path outside it or empty."""
    if not path:
        raise InvalidRequestError("lora_path is required", "lora_path")
    root = lora_dir.resolve()
    try:
        folder = (root / path).resolve()
    except (OSError, ValueError) as error:  # a NUL byte, a link loop
        raise InvalidRequestError(f"lora_path {path!r}: {error}", "lora_path") from None
    if folder != root and root not in folder.parents:
        raise InvalidRequestError(
            f"lora_path {path!r} lies outside the workers' --lora-dir {str(root)!r}: runtime "
            "loads read adapters only from folders under it",
            "lora_path",
        )
    return folder


class AdaptersServicer(WorkerServicerBase[AsyncEngine], worker_pb2_grpc.WorkerAdaptersServicer):
    """Bound to the worker's engine once it is up; ``lora_dir``: the worker's ``--lora-dir``
    (None: runtime loads refused)."""

    def __init__(self, lora_dir: Path | None) -> None:
        super().__init__()
        self._lora_dir = lora_dir
        self._staged = StagedAdapters()

    def add_to(self, server: grpc.aio.Server) -> str:
        """Register on ``server``; the service's full name (for health and reflection)."""
        worker_pb2_grpc.add_WorkerAdaptersServicer_to_server(self, server)
        return SERVICE_NAME

    async def LoadAdapter(
        self, request: worker_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadAdapterResponse:
        engine = await self._runtime_changes(context)
        assert self._lora_dir is not None
        name, replace = request.name, request.replace
        try:
            check_adapter_name(name)
            folder = adapter_folder(self._lora_dir, request.path)
            adapter = None if request.check_only else self._staged.take(name, folder)
            if adapter is None:
                adapter = await engine.read_adapter(name, folder)
            newly = await engine.serve_adapter(
                name, adapter, replace=replace, check_only=request.check_only
            )
        except ModelLoadError as error:
            await abort_with(context, InvalidRequestError(str(error), "lora_path"))
        except InvalidRequestError as error:
            await abort_with(context, error)
        if request.check_only:
            self._staged.keep(name, folder, adapter)
        elif newly:
            logger.info("LoRA adapter %r loaded from %s", name, folder)
        loaded = AdapterId(name, adapter.digest)
        return worker_pb2.LoadAdapterResponse(
            adapter=convert.adapters_to_proto([loaded])[0], newly_loaded=newly
        )

    async def UnloadAdapter(
        self, request: worker_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.UnloadAdapterResponse:
        engine = await self._runtime_changes(context)
        try:
            await engine.unload_adapter(request.name)
        except ModelNotFoundError as error:
            await abort_with(context, error)
        return worker_pb2.UnloadAdapterResponse()

    async def _runtime_changes(self, context: grpc.aio.ServicerContext) -> AsyncEngine:
        """The engine, where this worker's adapters may change at runtime (``--lora-dir``);
        the call ends FAILED_PRECONDITION otherwise."""
        engine = await self.ready(context)
        if self._lora_dir is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker's LoRA adapters do not change at runtime: start it with --lora-dir",
            )
        return engine
