"""The life of a worker process, for either role.

``run_worker`` starts the gRPC server first (internal plane: every call, health included,
must carry the cluster credential; health NOT_SERVING, so orchestrators holding the
credential can probe it while the model loads), loads the engine off the event loop, creates
the UCX transport on the loop, warms the engine up with a short request, flips health to
SERVING, prints ``splitserve <role> ready at <address>``, registers with the coordinator's
internal port and heartbeats until SIGINT/SIGTERM. Then it drains: health NOT_SERVING, no
more heartbeats, ``LeaveCluster`` (the coordinator routes nothing new here), running requests
(``WorkerServicerBase.in_flight``) get ``--drain-timeout`` seconds to finish while the server
still answers their calls (a pushed prompt's ``CompleteKv``, an ``Abort``); what is left is
then cancelled, which the coordinator hands over (a decode stream resumes on another decode
worker, a prefill is retried elsewhere); then the engine stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
import torch
from prometheus_client import CollectorRegistry

from splitserve.common.busy_flag import BusyFlag, BusyFlagReader
from splitserve.common.errors import MembershipStoreError
from splitserve.common.gc_tuning import tune_gc_for_serving
from splitserve.common.kv_events import KvEventLog
from splitserve.common.kv_layout import KvLayout
from splitserve.common.kv_push_cost import KvPushCosts
from splitserve.common.load import EngineLoad, LoadReport
from splitserve.common.membership import Role, WorkerInfo, hosted_worker_ids, member_id
from splitserve.common.metrics import serve_metrics
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tracing import configure_tracing, shutdown_tracing
from splitserve.discovery.etcd_access import etcd_access
from splitserve.discovery.etcd_announcer import EtcdAnnouncer
from splitserve.discovery.flags import membership_settings
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.cli_args import engine_config_from_args
from splitserve.engine.config import EngineConfig
from splitserve.engine.device import dtype_refusal
from splitserve.engine.model_spec import served_model_name
from splitserve.engine.step_threads import BorrowedCores, StepThreads
from splitserve.proto.cluster_access import ClusterAccess, access_or_exit
from splitserve.proto.server import RoleServer, serve_forever, start_server
from splitserve.transfer.paced import PacedTransport
from splitserve.transfer.transport import KvTransport
from splitserve.transfer.ucx import UcxTransport
from splitserve.worker.adapters_servicer import AdaptersServicer
from splitserve.worker.identity import WorkerIdentity
from splitserve.worker.metrics import TransferMetrics, install_engine_metrics
from splitserve.worker.monitor_servicer import MonitorServicer
from splitserve.worker.process import (
    add_worker_args,
    advertised_address,
    apply_cpu_affinity,
    borrowed_cpus,
    coordinator_addresses,
    transfer_settings_of,
    ucx_settings_of,
    worker_id_of,
)
from splitserve.worker.registration import CoordinatorLink
from splitserve.worker.servicer_base import WorkerServicerBase
from splitserve.worker.sim_startup import wait_out_startup
from splitserve.worker.stall_watch import StallWatch
from splitserve.worker.transfer_settings import TransferSettings

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 1.0
"""After the drain: how long calls still running get before they are cancelled."""


class WorkerDomain(Protocol):
    """A role's domain object over the process's engine; ``close`` leaves the engine, which
    ``run_worker`` created, running (it shuts it down after every domain closed)."""

    layout: KvLayout
    transfer_metrics: TransferMetrics
    pulls_cached_kv_min_blocks: int
    """What its membership record says of pulling cached KV (``WorkerInfo``): 0 unless the
    domain is a prefill worker that pulls."""

    def kv_push_costs(self) -> KvPushCosts:
        """What it learned of its KV pushes (``common/kv_push_cost.py``), for the load
        reports; empty unless the domain is a prefill worker."""
        ...

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
    make_domain: Callable[
        [AsyncEngine, KvTransport, WorkerIdentity, TransferSettings], WorkerDomain
    ]
    """(the process's engine, transport, identity, KV transfer settings) -> the domain
    object."""


def engine_config_for(args: argparse.Namespace, roles: Sequence[WorkerRole]) -> EngineConfig:
    """The engine configuration of a worker serving ``roles``: its flags', with
    ``RunnerConfig.decodes`` off where no role decodes (a prefill-only worker)."""
    config = engine_config_from_args(args)
    decodes = any(role.role is Role.DECODE for role in roles)
    return dataclasses.replace(config, runner=dataclasses.replace(config.runner, decodes=decodes))


def step_threads_of(args: argparse.Namespace) -> StepThreads | None:
    """The engine's per-step thread sizing from the lending flags (after
    ``apply_cpu_affinity``); None when it neither lends (``--busy-file``) nor borrows
    (``--borrow-cores``). Opens (a lender: creates) the busy files: OSError where it cannot."""
    borrowed = borrowed_cpus(args)
    if not args.busy_file and not borrowed:
        return None
    own_threads = args.threads or torch.get_num_threads()
    lends = BusyFlag(Path(args.busy_file)) if args.busy_file else None
    borrows = None
    if borrowed:
        borrows = BorrowedCores(frozenset(borrowed), BusyFlagReader(Path(args.borrow_while_idle)))
    return StepThreads(own_threads, lends, borrows)


def role_worker_id(base_id: str, role: WorkerRole, roles: Sequence[WorkerRole]) -> str:
    """The id a role registers under (``common/membership.py:member_id``)."""
    return member_id(base_id, role.name, len(roles))


async def run_worker(
    args: argparse.Namespace,
    roles: Sequence[WorkerRole],
    access: ClusterAccess,
    stop: asyncio.Event,
    step_threads: StepThreads | None = None,
    transport: UcxTransport | None = None,
) -> None:
    """One worker serving ``roles`` (one, or prefill and decode together) on one engine: each
    role has its servicer on the one gRPC server, its domain object over the shared
    ``AsyncEngine`` and its own membership record (``role_worker_id``); load reports, health,
    stall watch and draining are the worker's. ``step_threads``: the engine's core lending
    (``step_threads_of``), if any. ``transport``: the process's UCX transport when several
    workers share the process (``run_hosted_workers``, which closes it); by default the
    worker makes its own and closes it when it stops."""
    servicers = [role.make_servicer() for role in roles]
    monitor = MonitorServicer()
    adapters = AdaptersServicer(Path(args.lora_dir) if args.lora_dir else None)
    label = "+".join(role.name for role in roles)
    server = await _start_server(args, roles, servicers, (monitor, adapters), access)
    base_id, address = worker_id_of(args, _kind(roles)), advertised_address(args, server.port)
    identities = [
        WorkerIdentity(role_worker_id(base_id, role, roles), address, access) for role in roles
    ]
    engine = await AsyncEngine.start(engine_config_for(args, roles), step_threads=step_threads)
    owns_transport = transport is None
    if transport is None:
        transport = UcxTransport(ucx_settings_of(args))
    link = engine.facts.kv_link  # a simulated engine's: its KV takes the real model's time
    kv_transport = transport if link is None else PacedTransport(transport, link)
    domains = [
        role.make_domain(engine, kv_transport, identity, transfer_settings_of(args))
        for role, identity in zip(roles, identities, strict=True)
    ]
    await _warm_up(engine)
    await wait_out_startup(args)  # a simulated worker serves when the real one would
    model_name = served_model_name(args.model)  # announced, and a metric label
    if args.metrics_port >= 0:
        _serve_worker_metrics(args, engine, domains, model_name, label)
    for servicer, domain in zip(servicers, domains, strict=True):
        servicer.bind(domain)
    adapters.bind(engine)
    report, kv_events, watching = await _start_serving(args, engine, domains, server, monitor, stop)
    print(f"splitserve {label} ready at {address}", flush=True)
    infos = _records(roles, identities, domains, address, engine, model_name)
    membership = _Membership.join(args, infos, report, access, kv_events, stop)
    await stop.wait()
    await watching
    await server.set_serving(False)
    await membership.leave()
    await _drain(servicers, args.drain_timeout, label, base_id)
    await server.server.stop(SHUTDOWN_GRACE_S)
    for domain in domains:
        await domain.close()
    engine.shutdown()
    if owns_transport:
        await transport.close()


def _records(
    roles: Sequence[WorkerRole],
    identities: Sequence[WorkerIdentity],
    domains: Sequence[WorkerDomain],
    address: str,
    engine: AsyncEngine,
    model_name: str,
) -> list[WorkerInfo]:
    """Each role's membership record: its id, the worker's ``address``, its domain's KV
    layout and pull setting, the engine's pool, context window and LoRA adapters, the model's
    name."""
    return [
        WorkerInfo(
            worker_id=identity.worker_id,
            role=role.role,
            address=address,
            layout=domain.layout,
            num_blocks=engine.facts.num_blocks,
            max_model_len=engine.facts.max_model_len,
            model=model_name,
            pulls_cached_kv_min_blocks=domain.pulls_cached_kv_min_blocks,
            adapters=engine.served_adapters,
        )
        for role, identity, domain in zip(roles, identities, domains, strict=True)
    ]


async def _start_server(
    args: argparse.Namespace,
    roles: Sequence[WorkerRole],
    servicers: Sequence[WorkerServicerBase],
    process_servicers: Sequence[MonitorServicer | AdaptersServicer],
    access: ClusterAccess,
) -> RoleServer:
    """The worker's gRPC server, listening (health NOT_SERVING): each role's servicer (not
    yet bound to its domain) and the process's own (its load monitor and its adapters),
    every call checked for the cluster credential."""

    def register(server: grpc.aio.Server) -> list[str]:
        for role, servicer in zip(roles, servicers, strict=True):
            role.add_servicer(servicer, server)
        return [
            *(role.service_name for role in roles),
            *(servicer.add_to(server) for servicer in process_servicers),
        ]

    return await start_server(
        args.host,
        args.port,
        register,
        credential=access.credential,
        tls=access.tls,
        with_reflection=args.grpc_reflection,
    )


def _serve_worker_metrics(
    args: argparse.Namespace,
    engine: AsyncEngine,
    domains: Sequence[WorkerDomain],
    model_name: str,
    label: str,
) -> None:
    """Export the engine's figures and the domains' KV transfer figures on
    ``--metrics-port`` (printing where)."""
    registry = CollectorRegistry()
    install_engine_metrics(registry, engine, model_name, label)
    transfer_metrics = TransferMetrics(registry, model_name, label)
    for domain in domains:
        domain.transfer_metrics = transfer_metrics
    port = serve_metrics(registry, args.host, args.metrics_port)
    print(f"{label} metrics at http://{args.host}:{port}/metrics", flush=True)


def reported_load(load: EngineLoad, domains: Sequence[WorkerDomain]) -> EngineLoad:
    """The engine's ``load`` with what the worker's prefill domain (at most one) learned of
    its KV pushes, where it pushed any."""
    for domain in domains:
        push = domain.kv_push_costs()
        if push.overall.pushes:
            return dataclasses.replace(load, kv_push=push)
    return load


async def _start_serving(
    args: argparse.Namespace,
    engine: AsyncEngine,
    domains: Sequence[WorkerDomain],
    server: RoleServer,
    monitor: MonitorServicer,
    stop: asyncio.Event,
) -> tuple[Callable[[], Awaitable[LoadReport]], KvEventLog, asyncio.Task[None]]:
    """Bind the monitor to the worker's load reports (the engine's load with what its
    prefill domain learned of its KV pushes, and the stall watch's readiness) and KV events,
    turn health SERVING, start the stall watch (until ``stop``) and tune the GC for serving.
    Returns the report function, the KV event log (the membership records carry both) and
    the stall watch's task."""
    stall_watch = StallWatch(engine.step_running_s, args.stall_timeout)

    async def report() -> LoadReport:
        return LoadReport(
            reported_load(engine.latest_load, domains),
            stall_watch.ready(),
            adapters=engine.served_adapters,
        )

    kv_events = KvEventLog()  # every coordinator's heartbeats or load stream carry its changes
    await engine.record_kv_events(kv_events)
    monitor.kv_events = kv_events
    monitor.bind(report)
    await server.set_serving(True)
    watching = asyncio.create_task(stall_watch.watch(server.set_serving, stop))
    tune_gc_for_serving()
    return report, kv_events, watching


@dataclass
class _Membership:
    """The worker's records in the cluster: a heartbeating link per coordinator and record
    (``CoordinatorLink``), and with etcd an announcer per record."""

    links: list[tuple[CoordinatorLink, asyncio.Task[None]]]
    announcers: list[tuple[EtcdAnnouncer, asyncio.Task[None]]]

    @classmethod
    def join(
        cls,
        args: argparse.Namespace,
        infos: Sequence[WorkerInfo],
        report: Callable[[], Awaitable[LoadReport]],
        access: ClusterAccess,
        kv_events: KvEventLog,
        stop: asyncio.Event,
    ) -> _Membership:
        """Register ``infos`` with every ``--coordinator`` and, with etcd, announce them
        there (each in a task of its own, retried until it lands)."""
        links = []
        for coordinator in coordinator_addresses(args.coordinator or ""):
            for info in infos:
                link = CoordinatorLink(coordinator, info, report, access, kv_events)
                links.append((link, asyncio.create_task(link.run(stop))))
        announcers = []
        etcd = etcd_access(membership_settings(args))
        if etcd is not None:
            for info in infos:
                announcer = EtcdAnnouncer(etcd.client(), args.cluster_name)
                announcers.append((announcer, asyncio.create_task(_announce(announcer, info))))
        return cls(links, announcers)

    async def leave(self) -> None:
        """No more heartbeats or announcing, then every record leaves at once: each
        coordinator drops it (``LeaveCluster``), and etcd's leases are revoked."""
        for _, link_task in self.links:
            link_task.cancel()  # no heartbeat may re-register it
            with contextlib.suppress(BaseException):
                await link_task
        await asyncio.gather(*(link.leave() for link, _ in self.links))
        for _, announcing in self.announcers:
            announcing.cancel()
            with contextlib.suppress(BaseException):
                await announcing
        # every coordinator drops each record at once
        await asyncio.gather(*(announcer.withdraw() for announcer, _ in self.announcers))


async def _drain(
    servicers: Sequence[WorkerServicerBase], timeout_s: float, label: str, base_id: str
) -> None:
    """Give the calls that carry work ``timeout_s`` to end (logged as worker ``label``
    ``base_id`` drains); whatever still runs after it is the server's stop to cancel."""
    running = sum(servicer.in_flight.count for servicer in servicers)
    logger.info("%s %s draining: %d running", label, base_id, running)
    drained = await asyncio.gather(
        *(servicer.in_flight.wait_idle(timeout_s) for servicer in servicers)
    )
    if all(drained):
        logger.info("%s %s drained", label, base_id)
    else:
        logger.warning(
            "%s %s: %d requests still running after %.0f s; handing them over",
            label,
            base_id,
            sum(servicer.in_flight.count for servicer in servicers),
            timeout_s,
        )


async def run_hosted_workers(
    args: argparse.Namespace,
    roles: Sequence[WorkerRole],
    access: ClusterAccess,
    stop: asyncio.Event,
) -> None:
    """``--host-workers`` simulated workers in this one process (``hosted_args``: each its
    own gRPC port, metrics port and membership records, ``<worker id>-<i>``), all on one
    event loop and one UCX transport, each with its own engine and engine thread; they stop
    and drain together. Only simulated engines: real ones would share the cores and memory
    (``worker_main`` refuses that)."""
    transport = UcxTransport(ucx_settings_of(args))
    base_id = worker_id_of(args, _kind(roles))
    hosted = [
        hosted_args(args, worker_id, index)
        for index, worker_id in enumerate(hosted_worker_ids(base_id, args.host_workers))
    ]
    try:
        await asyncio.gather(
            *(run_worker(one, roles, access, stop, None, transport) for one in hosted)
        )
    finally:
        await transport.close()


def _kind(roles: Sequence[WorkerRole]) -> str:
    """What a worker's default id starts with: its one role's name, else "worker"."""
    return roles[0].name if len(roles) == 1 else "worker"


def hosted_args(args: argparse.Namespace, worker_id: str, index: int) -> argparse.Namespace:
    """The flags of hosted worker ``index``: its id (``hosted_worker_ids``), and ``--port`` /
    ``--metrics-port`` ``index`` above the given ones (any free ones for 0; no metrics for a
    negative one)."""
    hosted = argparse.Namespace(**vars(args))
    hosted.worker_id = worker_id
    hosted.port = args.port + index if args.port else 0
    if args.metrics_port > 0:
        hosted.metrics_port = args.metrics_port + index
    return hosted


def worker_main(
    roles: Sequence[WorkerRole],
    argv: Sequence[str] | None,
    description: str,
    command: str | None = None,
) -> int:
    """Entry point of a worker process: flags, logging, CPU pinning, then ``run_worker``.
    ``command``: the ``splitserve`` command when it is not the one role's name (``worker``,
    whose ``--roles`` its caller has read; it is listed in ``--help`` here)."""
    label = "+".join(role.name for role in roles)
    parser = argparse.ArgumentParser(
        prog=f"splitserve {command or roles[0].name}", description=description
    )
    if command is not None:
        parser.add_argument("--roles", help="roles this worker serves: prefill,decode (default)")
    add_worker_args(parser)
    args = parser.parse_args(argv)
    access = access_or_exit(parser, args)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {label} %(levelname)s %(message)s")
    try:
        apply_cpu_affinity(args)
        step_threads = step_threads_of(args)  # a lender says busy from here until it idles
    except (ValueError, OSError) as error:  # a malformed list, cores it lacks, a busy file
        parser.error(f"cores: {error}")
    configure_tracing(label, args.otlp_traces_endpoint)  # its export thread on our cores

    try:
        transfer_settings_of(args)  # refused here, not after the engine loaded
        etcd_access(membership_settings(args))  # the etcd login and TLS files too
    except ValueError as error:
        parser.error(str(error))
    refusal = dtype_refusal(args.dtype, args.device, computes=args.engine != "sim")
    if refusal is not None:  # refused at start, not by oneDNN at the first linear
        parser.error(refusal)
    if args.host_workers < 1:
        parser.error("--host-workers must be at least 1")
    if args.host_workers > 1 and args.engine != "sim":
        parser.error("--host-workers above 1 needs --engine sim (one real engine per process)")
    if args.host_workers > 1 and step_threads is not None:
        parser.error("--host-workers above 1 takes no core lending flags")

    async def run(stop: asyncio.Event) -> None:
        if args.host_workers > 1:
            await run_hosted_workers(args, roles, access, stop)
        else:
            await run_worker(args, roles, access, stop, step_threads)

    try:
        serve_forever(run)
    finally:
        shutdown_tracing()
    return 0


async def _announce(announcer: EtcdAnnouncer, info: WorkerInfo) -> None:
    """Publish ``info`` in etcd, retrying until etcd takes it (it may start after us)."""
    backoff_s = 0.2
    while True:
        try:
            await announcer.announce(info)
            logger.info("announced in etcd")
            return
        except MembershipStoreError as error:
            logger.warning("announcing in etcd failed (%s); retrying", error)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 5.0)


async def _warm_up(engine: AsyncEngine) -> None:
    """One short request through the whole path (first-call costs: packing, allocations)."""
    vocab = engine.facts.vocab_size
    prompt = [i % vocab for i in range(1, 40)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate("warmup", prompt, params):
        pass
