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
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from splitserve.common.api_keys import add_api_key_args, add_health_needs_key_flag, api_keys_or_exit
from splitserve.common.cpu_affinity import pin_or_exit
from splitserve.common.env_flags import add_env_flag, comma_separated, env_default, truthy
from splitserve.common.gc_tuning import tune_gc_for_serving
from splitserve.common.loop_lag import LoopLag
from splitserve.common.membership import Role
from splitserve.common.memory_budget import StreamCap, stream_cap
from splitserve.common.metrics import serve_metrics
from splitserve.common.model_files import load_tokenizer, model_name_of, resolve_model_path
from splitserve.common.tracing import add_tracing_args, configure_tracing, shutdown_tracing
from splitserve.coordinator import INTERNAL_READY, PUBLIC_READY
from splitserve.coordinator.admission import AdmissionConfig
from splitserve.coordinator.attempt import AttemptTimeouts
from splitserve.coordinator.dial_check import DialCheck
from splitserve.coordinator.flow import FlowConfig
from splitserve.coordinator.membership_follower import MembershipFollower
from splitserve.coordinator.membership_servicer import MembershipServicer
from splitserve.coordinator.metrics import CoordinatorMetrics, LoopLagCollector
from splitserve.coordinator.placement import PlacementMode, Slo
from splitserve.coordinator.router import DEFAULT_SLO, RoutingConfig
from splitserve.coordinator.service import Coordinator, CoordinatorConfig
from splitserve.coordinator.servicer import SEND_TIMEOUT_S, CoordinatorServicer
from splitserve.coordinator.tenants import TenantLimits, TenantPolicy
from splitserve.discovery.etcd_watcher import EtcdMembershipWatcher
from splitserve.discovery.flags import add_membership_args, etcd_endpoints
from splitserve.proto.api_key_auth import ApiKeyInterceptor
from splitserve.proto.cluster_access import access_or_exit, add_cluster_access_args
from splitserve.proto.etcd_client import EtcdClient
from splitserve.proto.server import add_reflection_flag, serve_forever, start_server
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.streams_server import RELAYS

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
    parser = argparse.ArgumentParser(prog="splitserve coordinator", description=__doc__)

    def flag(name: str, default: object, convert: type, help_text: str) -> None:
        add_env_flag(parser, name, default, convert, help_text)

    flag("--host", "127.0.0.1", str, "address the gRPC server binds")
    flag("--port", 50051, int, "public gRPC port (clients, gateway); 0 picks a free one")
    flag(
        "--internal-port",
        50052,
        int,
        "internal gRPC port (worker membership; cluster credential required); 0: any free",
    )
    flag(
        "--model",
        "default",
        str,
        "model whose tokenizer and chat template to use; only workers announcing the same "
        "checkpoint are routed to (a coordinator serves one model)",
    )
    flag(
        "--served-model-name",
        "",
        str,
        "comma-separated names requests may ask for the model by, the first reported "
        "(default: the checkpoint's name: a GGUF file's stem or an HF folder's name)",
    )
    flag("--cpu-affinity", None, str, "pin the process to these cores, e.g. '0' or '0-3'")
    flag(
        "--max-inflight",
        0,
        int,
        "requests admitted at once (then RESOURCE_EXHAUSTED); 0: as many as a quarter of the "
        "memory available at start holds (common/memory_budget.py), printed at start",
    )
    flag(
        "--local-prefill-max-tokens",
        0,
        int,
        "prompts of at most this many tokens are prefilled on the decode worker",
    )
    flag(
        "--placement",
        PlacementMode.RULE.value,
        str,
        "where prompts are computed: rule (a prefill worker unless short, the default), "
        "adaptive (per request from the workers' learned step times and the latency targets), "
        "remote or local (always, where possible)",
    )
    flag("--ttft-slo-ms", DEFAULT_SLO.ttft_s * 1000, float, "TTFT target adaptive placement uses")
    flag("--tpot-slo-ms", DEFAULT_SLO.tpot_s * 1000, float, "TPOT target adaptive placement uses")
    flag(
        "--ttft-at-risk",
        RoutingConfig.ttft_at_risk,
        float,
        "adaptive placement computes a prompt on its decode worker only when the prefill "
        "side's predicted TTFT is above this fraction of the target (0: whenever that is "
        "faster and the decode batch keeps its TPOT target)",
    )
    flag(
        "--kv-share",
        AdmissionConfig.kv_share,
        float,
        "share of the decode workers' KV this coordinator admits requests against "
        "(prompt + max_tokens each); 1/N when N coordinators share the workers",
    )
    flag(
        "--max-queued",
        AdmissionConfig.max_queued_requests,
        int,
        "requests that may wait for KV (then RESOURCE_EXHAUSTED)",
    )
    flag(
        "--max-queued-prompt-tokens",
        AdmissionConfig.max_queued_prompt_tokens,
        int,
        "prompt tokens that may wait for KV (then RESOURCE_EXHAUSTED)",
    )
    flag(
        "--max-queue-wait",
        AdmissionConfig.max_queue_wait_s,
        float,
        "seconds a request may wait for KV; one predicted to wait longer is refused at once",
    )
    flag(
        "--default-max-tokens",
        CoordinatorConfig.default_max_tokens,
        int,
        "output tokens of a request without max_tokens (0: up to the context); admission "
        "reserves KV for them",
    )
    flag("--max-tokens-cap", 0, int, "the most max_tokens a request may ask for (0: no cap)")
    flag(
        "--prefill-backlog",
        AdmissionConfig.prefill_backlog_s,
        float,
        "seconds of the workers' measured prefill rate that may be admitted and not yet "
        "computed; more wait in the coordinator's fair queue, not in the workers' FIFO queues",
    )
    parser.add_argument(
        "--admit-within-tpot",
        action="store_true",
        default=env_default("--admit-within-tpot", False, truthy, os.environ),
        help="admit only as many requests as the decode workers' learned step times decode "
        "within --tpot-slo-ms; the rest wait or get 429 (env SPLITSERVE_ADMIT_WITHIN_TPOT=1)",
    )
    parser.add_argument(
        "--late-waiters-yield",
        action=argparse.BooleanOptionalAction,
        default=env_default("--late-waiters-yield", True, truthy, os.environ),
        help="a request waiting for admission that can no longer have its first token within "
        "its TTFT target lets those of its priority that still can go first (default on; env "
        "SPLITSERVE_LATE_WAITERS_YIELD=0 turns it off)",
    )
    flag(
        "--tenant-max-inflight",
        0,
        int,
        "requests each tenant (API key's tenant) may have admitted or waiting; 0: no limit",
    )
    flag(
        "--tenant-tokens-per-minute",
        0,
        int,
        "tokens (prompt + max_tokens) each tenant may start per minute; 0: no limit",
    )
    flag(
        "--tenants-file",
        None,
        Path,
        "TOML file of per-tenant limits, weights and highest priorities "
        "(coordinator/tenants.py), over the two flags above",
    )
    flag(
        "--client-stall-timeout",
        SEND_TIMEOUT_S,
        float,
        "seconds a stream may wait for a client that reads nothing; then its request is "
        "aborted and its KV freed",
    )
    parser.add_argument(
        "--relay",
        choices=RELAYS,
        default=env_default("--relay", "multiplexed", str, os.environ),
        help="how decode streams reach this coordinator: 'multiplexed' (many requests' "
        "tokens per gRPC message, on one GenerateStreams call per decode worker) or "
        "'per-stream' (a Generate call each) (env SPLITSERVE_RELAY)",
    )
    flag("--prefill-timeout", 300.0, float, "seconds a prefill (compute + KV push) may take")
    flag(
        "--stall-factor",
        AttemptTimeouts.stall_factor,
        float,
        "a decoding stream silent for this many times its worker's expected step time (from "
        "the worker's reported step-cost model and load) is stalled: counted, logged and "
        "resumed on another decode worker; 0: no watch",
    )
    flag(
        "--stall-floor-s",
        AttemptTimeouts.stall_floor_s,
        float,
        "... but never before this many seconds of silence",
    )
    flag("--metrics-port", 0, int, "Prometheus /metrics port (0: any free port, -1: off)")
    flag(
        "--drain-timeout",
        30.0,
        float,
        "on SIGTERM, seconds running streams may take to finish (new calls are refused)",
    )
    add_reflection_flag(parser)
    add_cluster_access_args(parser)
    add_api_key_args(parser)
    add_health_needs_key_flag(parser, "gRPC health checks on the public port")
    add_membership_args(parser)
    add_tracing_args(parser)
    return parser


def inflight_cap(flag_value: int) -> StreamCap:
    """``--max-inflight``: the flag's value when positive, else what memory allows."""
    if flag_value > 0:
        return StreamCap(flag_value, "--max-inflight")
    return stream_cap(BYTES_PER_STREAM, MEMORY_SHARE, FALLBACK_MAX_INFLIGHT)


def placement_mode_or_exit(parser: argparse.ArgumentParser, value: str) -> PlacementMode:
    """The ``--placement`` mode; exits with a usage error naming the choices."""
    try:
        return PlacementMode(value)
    except ValueError:
        choices = ", ".join(mode.value for mode in PlacementMode)
        parser.error(f"--placement must be one of {choices}, not {value!r}")


def tenant_policy_or_exit(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> TenantPolicy:
    """The tenants' limits from the flags and the tenants file; a usage error (exit 2)
    naming what is wrong."""
    try:
        default = TenantLimits(
            max_inflight=args.tenant_max_inflight, tokens_per_minute=args.tenant_tokens_per_minute
        )
        if args.tenants_file is None:
            return TenantPolicy(default)
        return TenantPolicy.from_toml(args.tenants_file, default)
    except (OSError, ValueError) as error:  # tomllib.TOMLDecodeError is a ValueError
        parser.error(f"tenants: {error}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    pin_or_exit(parser, args.cpu_affinity)  # before any thread starts
    access = access_or_exit(parser, args)
    keys = api_keys_or_exit(parser, args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s"
    )
    configure_tracing("coordinator", args.otlp_traces_endpoint)
    model_path = resolve_model_path(args.model)
    slo = Slo(ttft_s=args.ttft_slo_ms / 1000, tpot_s=args.tpot_slo_ms / 1000)
    if not 0 < args.kv_share <= 1:
        parser.error(f"--kv-share must be in (0, 1], not {args.kv_share}")
    if not 0 <= args.ttft_at_risk <= 1:
        parser.error(f"--ttft-at-risk must be in [0, 1], not {args.ttft_at_risk}")
    max_inflight = inflight_cap(args.max_inflight)
    logger.info("at most %s requests in flight", max_inflight.describe())
    checkpoint = model_name_of(model_path)
    names = comma_separated(args.served_model_name)
    config = CoordinatorConfig(
        tenants=tenant_policy_or_exit(parser, args),
        model_name=names[0] if names else checkpoint,
        model_aliases=tuple(names[1:]),
        checkpoint=checkpoint,
        max_inflight=max_inflight.streams,
        default_max_tokens=args.default_max_tokens,
        max_tokens_cap=args.max_tokens_cap,
        multiplexed_decode=args.relay == "multiplexed",
        routing=RoutingConfig(
            local_prefill_max_tokens=args.local_prefill_max_tokens,
            mode=placement_mode_or_exit(parser, args.placement),
            slo=slo,
            ttft_at_risk=args.ttft_at_risk,
        ),
        flow=FlowConfig(
            timeouts=AttemptTimeouts(
                prefill_s=args.prefill_timeout,
                stall_factor=args.stall_factor,
                stall_floor_s=args.stall_floor_s,
            )
        ),
        admission=AdmissionConfig(
            kv_share=args.kv_share,
            max_queued_requests=args.max_queued,
            max_queued_prompt_tokens=args.max_queued_prompt_tokens,
            max_queue_wait_s=args.max_queue_wait,
            prefill_backlog_s=args.prefill_backlog,
            within_tpot=args.admit_within_tpot,
            late_waiters_yield=args.late_waiters_yield,
            prior_tpot_s=slo.tpot_s,
            prior_ttft_s=slo.ttft_s,
        ),
    )
    coordinator = Coordinator(config, load_tokenizer(model_path), access)
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry, config.model_name, coordinator.registry, coordinator.admission
    )

    async def run(stop: asyncio.Event) -> None:
        registry.register(LoopLagCollector(LoopLag.start()))  # stall checks leave it out
        dial_check = DialCheck(coordinator.registry, coordinator.channels)
        servicer = CoordinatorServicer(coordinator, metrics, keys, args.client_stall_timeout)
        server = await start_server(
            args.host,
            args.port,
            lambda s: (
                coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
                [SERVICE_NAME],
            )[1],
            credential=None,
            tls=access.tls,
            with_reflection=args.grpc_reflection,
            interceptors=(ApiKeyInterceptor(keys, protect_health=args.health_needs_key),),
        )
        internal = await start_server(
            args.host,
            args.internal_port,
            lambda s: (
                coordinator_pb2_grpc.add_MembershipServicer_to_server(
                    MembershipServicer(
                        coordinator.registry,
                        coordinator.router.forget,
                        dial_check,
                        coordinator.router.kv_events,
                    ),
                    s,
                ),
                [MEMBERSHIP_SERVICE_NAME],
            )[1],
            credential=access.credential,
            tls=access.tls,
            with_reflection=args.grpc_reflection,
        )
        await internal.set_serving(True)
        print(f"{INTERNAL_READY} at {args.host}:{internal.port}", flush=True)
        if args.metrics_port >= 0:
            port = serve_metrics(registry, args.host, args.metrics_port)
            print(f"coordinator metrics at http://{args.host}:{port}/metrics", flush=True)
        tune_gc_for_serving()
        print(f"{PUBLIC_READY} at {args.host}:{server.port}", flush=True)
        watcher = asyncio.create_task(_watch_workers(coordinator, server, stop))
        follower = _membership_follower(args, coordinator)
        following = None if follower is None else asyncio.create_task(follower.run())
        await stop.wait()
        await server.set_serving(False)
        servicer.draining = True
        await server.server.stop(args.drain_timeout)
        await internal.server.stop(1.0)
        for task in (watcher, following):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await dial_check.close()
        await coordinator.channels.close()

    try:
        serve_forever(run)
    finally:
        shutdown_tracing()
    return 0


def _membership_follower(
    args: argparse.Namespace, coordinator: Coordinator
) -> MembershipFollower | None:
    """With ``--etcd-endpoints``: the follower of the etcd membership (workers may also
    register over gRPC, as without it)."""
    endpoints = etcd_endpoints(args)
    if not endpoints:
        return None
    watcher = EtcdMembershipWatcher(EtcdClient(endpoints), args.cluster_name)
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
