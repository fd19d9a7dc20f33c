"""The life of a worker process, for either role.

``run_worker`` starts the gRPC server first (internal plane: every call, health included,
must carry the cluster credential; health NOT_SERVING, so orchestrators holding the
credential can probe it while the model loads), loads the engine off the event loop, creates
the UCX transport on the loop, warms the engine up with a short request, flips health to
SERVING, prints ``splitserve <role> ready at <address>``, registers with the coordinator's
internal port and heartbeats until SIGINT/SIGTERM; then it reports NOT_SERVING, lets running
calls finish for a grace period and stops the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from prometheus_client import CollectorRegistry

from splitserve.common.load import EngineLoad
from splitserve.common.membership import Role, WorkerInfo
from splitserve.common.metrics import serve_metrics
from splitserve.common.model_files import model_name_of, resolve_model_path
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.cli_args import engine_config_from_args
from splitserve.engine.engine_core import EngineCore
from splitserve.proto.cluster_access import ClusterAccess, access_or_exit
from splitserve.proto.server import serve_forever, start_server
from splitserve.transfer.layout import KvLayout
from splitserve.transfer.transport import KvTransport
from splitserve.transfer.ucx import UcxTransport
from splitserve.worker.identity import WorkerIdentity
from splitserve.worker.metrics import TransferMetrics, install_engine_metrics
from splitserve.worker.process import (
    add_worker_args,
    advertised_address,
    apply_cpu_affinity,
    ucx_settings_of,
    worker_id_of,
)
from splitserve.worker.registration import CoordinatorLink
from splitserve.worker.servicer_base import WorkerServicerBase

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0


class WorkerDomain(Protocol):
    engine: AsyncEngine
    layout: KvLayout
    transfer_metrics: TransferMetrics

    async def load(self) -> EngineLoad: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class WorkerRole:
    """What differs between the prefill and the decode worker process."""

    name: str
    role: Role
    service_name: str
    make_servicer: Callable[[], WorkerServicerBase]
    """The servicer, not yet bound to a domain."""
    add_servicer: Callable[[WorkerServicerBase, grpc.aio.Server], None]
    make_domain: Callable[[EngineCore, KvTransport, WorkerIdentity, float], WorkerDomain]
    """(engine core, transport, identity, transfer timeout) -> the domain object."""


async def run_worker(
    args: argparse.Namespace,
    role: WorkerRole,
    access: ClusterAccess,
    stop: asyncio.Event,
) -> None:
    servicer = role.make_servicer()

    def register(server: grpc.aio.Server) -> list[str]:
        role.add_servicer(servicer, server)
        return [role.service_name]

    server = await start_server(
        args.host,
        args.port,
        register,
        credential=access.credential,
        tls=access.tls,
        with_reflection=args.grpc_reflection,
    )
    identity = WorkerIdentity(
        worker_id_of(args, role.name), advertised_address(args, server.port), access
    )
    worker_id, address = identity.worker_id, identity.address
    core = await asyncio.to_thread(EngineCore, engine_config_from_args(args))
    transport = UcxTransport(ucx_settings_of(args))
    domain = role.make_domain(core, transport, identity, args.transfer_timeout)
    await _warm_up(domain.engine)
    if args.metrics_port >= 0:
        registry = CollectorRegistry()
        model_name = model_name_of(resolve_model_path(args.model))
        install_engine_metrics(registry, domain.engine, model_name, role.name)
        domain.transfer_metrics = TransferMetrics(registry, model_name, role.name)
        port = serve_metrics(registry, args.host, args.metrics_port)
        print(f"{role.name} metrics at http://{args.host}:{port}/metrics", flush=True)
    servicer.bind(domain)
    await server.set_serving(True)
    print(f"splitserve {role.name} ready at {address}", flush=True)

    link_task = None
    if args.coordinator:
        info = WorkerInfo(
            worker_id=worker_id,
            role=role.role,
            address=address,
            layout=domain.layout,
            num_blocks=core.num_blocks,
            max_model_len=core.max_model_len,
        )
        link = CoordinatorLink(args.coordinator, info, domain.load, access)
        link_task = asyncio.create_task(link.run(stop))
    await stop.wait()
    logger.info("%s %s stopping", role.name, worker_id)
    await server.set_serving(False)
    await server.server.stop(SHUTDOWN_GRACE_S)
    if link_task is not None:
        link_task.cancel()
        with contextlib.suppress(BaseException):
            await link_task
    await domain.close()
    await transport.close()


def worker_main(role: WorkerRole, argv: Sequence[str] | None, description: str) -> int:
    """Entry point of a worker process: flags, logging, CPU pinning, then ``run_worker``."""
    parser = argparse.ArgumentParser(prog=f"splitserve {role.name}", description=description)
    add_worker_args(parser)
    args = parser.parse_args(argv)
    access = access_or_exit(parser, args)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {role.name} %(levelname)s %(message)s"
    )
    apply_cpu_affinity(args)

    async def run(stop: asyncio.Event) -> None:
        await run_worker(args, role, access, stop)

    serve_forever(run)
    return 0


async def _warm_up(engine: AsyncEngine) -> None:
    """One short request through the whole path (first-call costs: packing, allocations)."""
    vocab = engine.core.model_config.vocab_size
    prompt = [i % vocab for i in range(1, 40)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate("warmup", prompt, params):
        pass
