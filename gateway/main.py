"""``splitserve gateway``: the OpenAI-compatible HTTP server (uvicorn, uvloop, httptools).

Talks to the coordinators of each model at ``--coordinator`` (once per model); prints
``splitserve gateway ready at http(s)://<host>:<port>`` once listening. SIGINT / SIGTERM drain
it (uvicorn's graceful shutdown: no new connections, open streams get ``--drain-timeout``
seconds to finish; those still open then are cancelled, which aborts their requests), then it
exits 0, as every role does after a drain.

TLS (``proto/tls.py``'s flags): ``--tls-cert``/``--tls-key`` serve HTTPS; ``--tls-ca`` (or
the system's roots) verifies the coordinator, which is then dialled over TLS. API keys:
``--api-key`` / ``--api-keys-file`` (``common/api_keys.py``); ``/health`` and ``/metrics``
stay open unless ``--health-needs-key``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import uvicorn
import uvloop

from splitserve.common.api_keys import add_api_key_args, add_health_needs_key_flag, api_keys_or_exit
from splitserve.common.cpu_affinity import pin_or_exit
from splitserve.common.env_flags import add_env_flag, comma_separated, env_default, env_name, truthy
from splitserve.common.gc_tuning import tune_gc_for_serving
from splitserve.common.orphan import stop_when_orphaned
from splitserve.common.tracing import add_tracing_args, configure_tracing, shutdown_tracing
from splitserve.gateway.app import GatewayConfig, create_app
from splitserve.gateway.body_limit import DEFAULT_MAX_BODY_BYTES
from splitserve.gateway.disconnect import CLIENT_STALL_TIMEOUT_S
from splitserve.gateway.listeners import shared_port_listeners
from splitserve.proto.streams_server import RELAYS
from splitserve.proto.tls import add_tls_args, tls_or_exit

DEFAULT_COORDINATOR = "127.0.0.1:50051"
LISTEN_BACKLOG = 65535
"""Connections the kernel holds for the gateway before it accepts them; Linux caps it at
``net.core.somaxconn``. Past it, a crowd's connections are dropped by the kernel, and some
clients see their connection reset with no response (10,000 streams sent at once against a
cap of 4,096: 371 resets in one run)."""
SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def warn_if_backlog_capped(path: Path = SOMAXCONN) -> int | None:
    """Log a warning when the kernel caps the listen backlog below ``LISTEN_BACKLOG``; the
    cap, or None where it cannot be read."""
    try:
        cap = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    if cap < LISTEN_BACKLOG:
        logging.getLogger("splitserve.gateway").warning(
            "net.core.somaxconn is %d: past that many connections arriving at once the kernel "
            "drops some (clients see resets); raise it (sysctl -w net.core.somaxconn=%d) "
            "for crowds",
            cap,
            LISTEN_BACKLOG,
        )
    return cap


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve gateway", description=__doc__)

    def flag(name: str, default: object, convert: type, help_text: str) -> None:
        add_env_flag(parser, name, default, convert, help_text)

    flag("--host", "127.0.0.1", str, "address the HTTP server binds")
    flag("--port", 8000, int, "HTTP port; 0 picks a free one")
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        default=env_default("--reuse-port", False, truthy, os.environ),
        help="share --port with other gateway processes (SO_REUSEPORT: the kernel spreads "
        "connections over them); this one's own /metrics is then also on a port of its own, "
        "printed at start (env SPLITSERVE_REUSE_PORT)",
    )
    parser.add_argument(
        "--coordinator",
        action="append",
        default=None,
        help="a model's coordinators: a gRPC address; several as ip:port,ip:port (or a DNS "
        "name resolving to several, dns:///name:port): calls are balanced over them and a "
        "stream whose coordinator dies continues through another. Repeat the flag once per "
        "model: each request goes to the coordinators of the model it names "
        f"(env {env_name('--coordinator')}, models separated by ';'; default "
        f"{DEFAULT_COORDINATOR})",
    )
    flag(
        "--served-model-name",
        "",
        str,
        "comma-separated model names clients may use, with a single --coordinator only "
        "(default: the names the coordinators serve under, their --served-model-name)",
    )
    flag("--request-timeout", 3600.0, float, "deadline of each request's gRPC call, seconds")
    flag("--log-level", "warning", str, "uvicorn log level (info logs every request)")
    flag("--drain-timeout", 30.0, float, "on SIGTERM, seconds open streams may take to finish")
    flag("--max-body-bytes", DEFAULT_MAX_BODY_BYTES, int, "larger request bodies get 413")
    parser.add_argument(
        "--relay",
        choices=RELAYS,
        default=env_default("--relay", "multiplexed", str, os.environ),
        help="how streams reach the coordinator: 'multiplexed' (many streams' tokens per "
        "gRPC message on shared GenerateStreams calls) or 'per-stream' (a Generate call "
        "each) (env SPLITSERVE_RELAY)",
    )
    flag(
        "--client-stall-timeout",
        CLIENT_STALL_TIMEOUT_S,
        float,
        "an SSE client that reads nothing this many seconds loses its stream (and request)",
    )
    flag("--cpu-affinity", None, str, "pin the process to these cores, e.g. '0' or '0-3'")
    add_tls_args(parser)
    add_api_key_args(parser)
    add_health_needs_key_flag(parser, "/health and /metrics")
    add_tracing_args(parser)
    return parser


def coordinator_targets(
    flags: Sequence[str] | None, env: Mapping[str, str] = os.environ
) -> tuple[str, ...]:
    """One coordinator target per model: the ``--coordinator`` flags given, else
    ``SPLITSERVE_COORDINATOR`` split at ';', else the default address."""
    if flags:
        given = list(flags)
    else:
        given = env.get(env_name("--coordinator"), DEFAULT_COORDINATOR).split(";")
    return tuple(target.strip() for target in given if target.strip()) or (DEFAULT_COORDINATOR,)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    pin_or_exit(parser, args.cpu_affinity)  # before any thread starts
    tls = tls_or_exit(parser, args)
    keys = api_keys_or_exit(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    warn_if_backlog_capped()
    configure_tracing("gateway", args.otlp_traces_endpoint)
    names = tuple(comma_separated(args.served_model_name))
    targets = coordinator_targets(args.coordinator)
    if names and len(targets) > 1:
        parser.error(
            "--served-model-name needs a single --coordinator: in front of several models, "
            "names are the coordinators' (their --served-model-name)"
        )
    config = GatewayConfig(
        coordinators=targets,
        served_model_names=names,
        request_timeout_s=args.request_timeout,
        api_keys=keys,
        health_needs_key=args.health_needs_key,
        coordinator_credentials=None if tls is None else tls.channel_credentials(),
        max_body_bytes=args.max_body_bytes,
        relay=args.relay,
        client_stall_timeout_s=args.client_stall_timeout,
    )
    serves_tls = tls is not None and tls.can_serve
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=args.host,
            port=args.port,
            loop="uvloop",
            http="httptools",
            log_level=args.log_level,
            timeout_graceful_shutdown=args.drain_timeout,
            backlog=LISTEN_BACKLOG,
            ssl_certfile=tls.files.cert if serves_tls else None,
            ssl_keyfile=tls.files.key if serves_tls else None,
        )
    )

    listeners = None
    if args.reuse_port:
        try:
            listeners = shared_port_listeners(args.host, args.port, LISTEN_BACKLOG)
        except OSError as error:
            parser.exit(1, f"splitserve gateway: cannot listen on port {args.port}: {error}\n")

    async def serve() -> None:
        sockets = None if listeners is None else listeners.sockets
        task = asyncio.create_task(server.serve(sockets=sockets))
        while not server.started:
            if task.done():
                await task  # startup failed (port taken): raises or returns
                return
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        scheme = "https" if serves_tls else "http"
        if listeners is not None:  # before the ready line, which launchers wait for
            own = f"{scheme}://{args.host}:{listeners.instance_port}"
            print(f"splitserve gateway instance at {own}", flush=True)
        tune_gc_for_serving()
        print(f"splitserve gateway ready at {scheme}://{args.host}:{port}", flush=True)
        await task

    # uvicorn drains on SIGINT / SIGTERM and then raises the signal again under the handlers
    # it found installed: with these, a drained gateway returns (status 0) instead of dying of it.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _after_drain)
    stop_when_orphaned()  # up died: SIGTERM ourselves, which uvicorn drains on
    try:
        uvloop.run(serve())
    finally:
        shutdown_tracing()
    return 0 if server.started else 1


def _after_drain(signum: int, frame: object) -> None:
    """The handler uvicorn's re-raised stop signal meets once the drain is over: nothing
    is left to do."""


if __name__ == "__main__":
    sys.exit(main())
