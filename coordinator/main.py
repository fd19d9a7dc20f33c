"""``splitserve coordinator``: the coordinator process, on two planes.

Public (``--port``): the ``Coordinator`` API (Generate, Abort, GetModelInfo) and health
(SERVING once a decode worker is registered), for clients and the gateway. Internal
(``--internal-port``): ``Membership`` (RegisterWorker, Heartbeat, ListWorkers) and health,
every call refused without the cluster credential. With ``--api-key`` / ``--api-keys-file``
the public port refuses calls without a key (health stays open unless
``--health-needs-key``); with ``--tls-cert``/``--tls-key`` both ports serve TLS, and with
``--tls-ca`` the internal one requires client certificates signed by it (``proto/tls.py``).
Reflection only with ``--grpc-reflection``.
With ``--etcd-endpoints`` it also follows the workers published in etcd
(``membership_follower.py``). Drops workers that stop heartbeating or leave. SIGTERM
drains: health NOT_SERVING, new calls refused, running streams get ``--drain-timeout``
seconds. Prints ``splitserve coordinator internal ready at <host:port>``, then
``splitserve coordinator ready at <host:port>`` once both listen.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry

from splitserve.common.api_keys import ApiKeys, api_keys_or_exit
from splitserve.common.cpu_affinity import pin_or_exit
from splitserve.common.env_flags import built_or_exit, comma_separated
from splitserve.common.errors import ModelLoadError
from splitserve.common.gc_tuning import tune_gc_for_serving
from splitserve.common.loop_lag import LoopLag
from splitserve.common.membership import Role
from splitserve.common.memory_budget import StreamCap, stream_cap
from splitserve.common.metrics import serve_metrics
from splitserve.common.settings import add_settings_args, settings_or_exit
from splitserve.common.tokenizer import Tokenizer
from splitserve.common.tracing import configure_tracing, shutdown_tracing
from splitserve.coordinator import COORDINATOR_METRICS, INTERNAL_READY, PUBLIC_READY
from splitserve.coordinator.dial_check import DialCheck
from splitserve.coordinator.membership_follower import MembershipFollower
from splitserve.coordinator.membership_servicer import MembershipServicer
from splitserve.coordinator.metrics import CoordinatorMetrics, LoopLagCollector
from splitserve.coordinator.service import Coordinator, CoordinatorConfig
from splitserve.coordinator.servicer import CoordinatorServicer
from splitserve.coordinator.settings import CoordinatorSettings
from splitserve.coordinator.tenants import TenantLimits, TenantPolicy
from splitserve.discovery.etcd_access import EtcdAccess, etcd_access
from splitserve.discovery.etcd_adapter_catalog import EtcdAdapterCatalog
from splitserve.discovery.etcd_watcher import EtcdMembershipWatcher
from splitserve.engine.model_spec import model_tokenizer, served_model_name
from splitserve.proto.api_key_auth import ApiKeyInterceptor
from splitserve.proto.cluster_access import ClusterAccess, access_or_exit
from splitserve.proto.server import RoleServer, serve_forever, start_server
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc

logger = logging.getLogger(__name__)
CHANNEL_GRACE_S = 120.0
"""How long a channel to a worker that left stays open (longer than any drain)."""
SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
MEMBERSHIP_SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Membership"].full_name
BYTES_PER_STREAM = 64 * 1024
"""What the in-flight cap reserves per request: the coordinator's resident memory grew by
about 25-30 KB a stream with 300-1,000 open (bench/bench_scale.py, 2026-11-26), so with
room to spare."""
MEMORY_SHARE = 0.25
"""Of the memory available at start, what the coordinator's requests may fill: it shares
its machine (or its container's limit) with the rest of the process and, often, other roles."""
FALLBACK_MAX_INFLIGHT = 1024
"""The cap where the available memory cannot be read."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``CoordinatorSettings`` (``settings.py``: every flag is declared there)."""
    parser = argparse.ArgumentParser(prog="splitserve coordinator", description=__doc__)
    add_settings_args(parser, CoordinatorSettings)
    return parser


def inflight_cap(flag_value: int) -> StreamCap:
    """``--max-inflight``: the flag's value when positive, else what memory allows."""
    if flag_value > 0:
        return StreamCap(flag_value, "--max-inflight")
    return stream_cap(BYTES_PER_STREAM, MEMORY_SHARE, FALLBACK_MAX_INFLIGHT)


def tenant_policy_or_exit(
    parser: argparse.ArgumentParser, settings: CoordinatorSettings
) -> TenantPolicy:
    """The tenants' limits from the flags and the tenants file; a usage error (exit 2)
    naming what is wrong."""
    try:
        default = TenantLimits(
            max_inflight=settings.tenant_max_inflight,
            tokens_per_minute=settings.tenant_tokens_per_minute,
        )
        if settings.tenants_file is None:
            return TenantPolicy(default)
        return TenantPolicy.from_toml(settings.tenants_file, default)
    except (OSError, ValueError) as error:  # tomllib.TOMLDecodeError is a ValueError
        parser.error(f"tenants: {error}")


@dataclass(frozen=True)
class PreparedCoordinator:
    """A coordinator built from its flags, ready to serve (``serve``)."""

    settings: CoordinatorSettings
    coordinator: Coordinator
    access: ClusterAccess
    keys: ApiKeys
    etcd: EtcdAccess | None = None
    """How the coordinator reaches etcd (``--etcd-endpoints``; None: it does not), read
    and checked once in ``prepare``."""


def prepare(
    parser: argparse.ArgumentParser, args: argparse.Namespace, role: str = "coordinator"
) -> PreparedCoordinator:
    """Everything before serving: the settings, the process pinned (before any thread
    starts), the credential, keys and etcd login checked, logging and tracing as ``role``,
    the tokenizer loaded; a usage error (exit 2) for what is wrong."""
    settings = settings_or_exit(parser, args, CoordinatorSettings)
    pin_or_exit(parser, settings.cpu_affinity)
    access = access_or_exit(parser, args)
    keys = api_keys_or_exit(parser, args)
    etcd = built_or_exit(parser, lambda: etcd_access(settings.membership))  # refused first
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    configure_tracing(role, settings.tracing.otlp_traces_endpoint)
    config = _config_of(parser, settings, served_model_name(settings.model))
    catalog = None  # without etcd: the coordinator's memory
    if etcd is not None:  # the model's runtime LoRA adapters, shared by its coordinators
        model = config.checkpoint or config.model_name
        catalog = EtcdAdapterCatalog(etcd.client(), settings.membership.cluster_name, model)
    coordinator = Coordinator(config, _tokenizer_or_exit(parser, settings), access, catalog)
    return PreparedCoordinator(settings, coordinator, access, keys, etcd)


def _tokenizer_or_exit(parser: argparse.ArgumentParser, settings: CoordinatorSettings) -> Tokenizer:
    """The model's tokenizer, with ``--chat-template``'s template where given; a usage error
    (exit 2) for a template file that cannot be read or compiled, or one that does not show
    the tools where ``--tool-call-parser`` says the template shows them."""
    tokenizer = model_tokenizer(settings.model)
    if settings.chat_template is not None:
        try:
            source = settings.chat_template.read_text(encoding="utf-8")
            tokenizer = tokenizer.with_chat_template(source)
        except (OSError, UnicodeDecodeError, ModelLoadError) as error:
            parser.error(f"--chat-template {settings.chat_template}: {error}")
    if settings.tool_call_parser != "json" and "tools" not in tokenizer.chat_template_variables:
        parser.error(
            f"--tool-call-parser {settings.tool_call_parser} needs a chat template that shows "
            "the tools (reads tools); the model's does not: give one with --chat-template"
        )
    return tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    prepared = prepare(parser, parser.parse_args(argv))
    try:
        serve_forever(functools.partial(serve, prepared))
    finally:
        shutdown_tracing()
    return 0


def _config_of(
    parser: argparse.ArgumentParser, settings: CoordinatorSettings, checkpoint: str
) -> CoordinatorConfig:
    """The coordinator's config from its settings, for ``checkpoint``; a usage error (exit
    2) for a tenants file it cannot read."""
    max_inflight = inflight_cap(settings.max_inflight)
    logger.info("at most %s requests in flight", max_inflight.describe())
    names = comma_separated(settings.served_model_name)
    return CoordinatorConfig(
        tenants=tenant_policy_or_exit(parser, settings),
        model_name=names[0] if names else checkpoint,
        model_aliases=tuple(names[1:]),
        checkpoint=checkpoint,
        max_inflight=max_inflight.streams,
        default_max_tokens=settings.default_max_tokens,
        max_tokens_cap=settings.max_tokens_cap,
        multiplexed_decode=settings.relay == "multiplexed",
        lora_admin_tenants=comma_separated(settings.lora_admin_tenants),
        trust_request_chat_template=settings.trust_request_chat_template,
        tool_call_format=settings.tool_call_parser,
        reasoning_format=settings.reasoning_parser,
        routing=settings.routing_config(),
        flow=settings.flow_config(),
        admission=settings.admission_config(),
    )


Serving = Callable[[CoordinatorServicer, str], None]
"""Told the public servicer and its address ("host:port") once both planes serve."""


async def serve(
    prepared: PreparedCoordinator,
    stop: asyncio.Event,
    serving: Serving | None = None,
    before_close: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve both planes until ``stop``, then drain: health NOT_SERVING, new calls refused,
    running streams get ``--drain-timeout`` seconds. ``serving``: told the servicer once the
    planes serve (an in-process gateway's streams go to it); ``before_close``: awaited after
    the gRPC drain, before the workers' channels close (the in-process gateway's own drain,
    whose streams still use them)."""
    settings, coordinator = prepared.settings, prepared.coordinator
    access, keys = prepared.access, prepared.keys
    registry = CollectorRegistry()
    targets = settings.capacity_targets()
    metrics = CoordinatorMetrics(
        registry,
        coordinator.config.model_name,
        coordinator.registry,
        coordinator.admission,
        desired=lambda: coordinator.desired_workers(targets),
    )
    registry.register(LoopLagCollector(LoopLag.start()))  # stall checks leave it out
    dial_check = DialCheck(coordinator.registry, coordinator.channels)
    servicer = CoordinatorServicer(coordinator, metrics, keys, settings.client_stall_timeout)
    planes = await _start_planes(settings, coordinator, servicer, dial_check, access, keys)
    server, internal = planes
    print(f"{INTERNAL_READY} at {settings.host}:{internal.port}", flush=True)
    if settings.metrics_port >= 0:
        port = serve_metrics(registry, settings.host, settings.metrics_port)
        print(f"{COORDINATOR_METRICS} at http://{settings.host}:{port}/metrics", flush=True)
    tune_gc_for_serving()
    print(f"{PUBLIC_READY} at {settings.host}:{server.port}", flush=True)
    if serving is not None:
        serving(servicer, f"{settings.host}:{server.port}")
    await coordinator.runtime_adapters.start()
    watcher = asyncio.create_task(_watch_workers(coordinator, server, stop))
    follower = _membership_follower(prepared.etcd, settings.membership.cluster_name, coordinator)
    following = None if follower is None else asyncio.create_task(follower.run())
    await stop.wait()
    await server.set_serving(False)
    servicer.draining = True
    await server.server.stop(settings.drain_timeout)
    if before_close is not None:
        await before_close()
    await internal.server.stop(1.0)
    for task in (watcher, following):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    await dial_check.close()
    await coordinator.runtime_adapters.close()
    await coordinator.channels.close()


async def _start_planes(
    settings: CoordinatorSettings,
    coordinator: Coordinator,
    servicer: CoordinatorServicer,
    dial_check: DialCheck,
    access: ClusterAccess,
    keys: ApiKeys,
) -> tuple[RoleServer, RoleServer]:
    """The public plane (the ``Coordinator`` API behind the API keys) and the internal one
    (``Membership``, every call with the cluster credential; serving once it is up)."""
    reflection = settings.reflection.grpc_reflection
    membership = MembershipServicer(
        coordinator.registry, coordinator.router.forget, dial_check, coordinator.router.kv_events
    )
    public = await start_server(
        settings.host,
        settings.port,
        _plane(coordinator_pb2_grpc.add_CoordinatorServicer_to_server, servicer, SERVICE_NAME),
        credential=None,
        tls=access.tls,
        with_reflection=reflection,
        interceptors=(ApiKeyInterceptor(keys, protect_health=settings.health_needs_key),),
    )
    internal = await start_server(
        settings.host,
        settings.internal_port,
        _plane(
            coordinator_pb2_grpc.add_MembershipServicer_to_server,
            membership,
            MEMBERSHIP_SERVICE_NAME,
        ),
        credential=access.credential,
        tls=access.tls,
        with_reflection=reflection,
    )
    await internal.set_serving(True)
    return public, internal


def _plane(
    add: Callable[[object, grpc.aio.Server], None], servicer: object, service: str
) -> Callable[[grpc.aio.Server], list[str]]:
    """Registers ``servicer`` (by its generated ``add`` function) as ``service``."""

    def register(server: grpc.aio.Server) -> list[str]:
        add(servicer, server)
        return [service]

    return register


def _membership_follower(
    etcd: EtcdAccess | None, cluster_name: str, coordinator: Coordinator
) -> MembershipFollower | None:
    """With ``--etcd-endpoints`` (``etcd``): the follower of the etcd membership (workers
    may also register over gRPC, as without it)."""
    if etcd is None:
        return None
    watcher = EtcdMembershipWatcher(etcd.client(), cluster_name)
    return MembershipFollower(
        watcher,
        coordinator.registry,
        coordinator.channels,
        coordinator.router.forget,
        coordinator.router.kv_events,
    )


async def _watch_workers(coordinator: Coordinator, server, stop: asyncio.Event) -> None:  # noqa: ANN001
    """Expire silent workers, keep health in step with having a decode worker, and close
    channels to addresses no worker has had for ``CHANNEL_GRACE_S``."""
    serving = False
    while not stop.is_set():
        listed = {w.address for w in coordinator.registry.workers(healthy_only=False)}
        await coordinator.channels.retain(listed, CHANNEL_GRACE_S, time.monotonic())
        for record in coordinator.registry.expire():
            # Not routed to any more; its open streams end by themselves if it is really gone
            # (gRPC keepalive), and a worker that was only busy registers again.
            logger.warning("worker %s (%s) stopped heartbeating", record.worker_id, record.address)
            coordinator.router.forget(record.worker_id)
        ready = bool(coordinator.registry.workers(Role.DECODE))
        if ready != serving:
            await server.set_serving(ready)
            serving = ready
        await asyncio.sleep(0.25)


if __name__ == "__main__":
    sys.exit(main())
