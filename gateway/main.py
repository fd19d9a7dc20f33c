"""``splitserve gateway``: the OpenAI-compatible HTTP server (uvicorn, uvloop, httptools).

Talks to the coordinators of each model at ``--coordinator`` (once per model); prints
``splitserve gateway ready at http(s)://<host>:<port>`` once listening. SIGINT / SIGTERM drain
it (uvicorn's graceful shutdown: no new connections, open streams get ``--drain-timeout``
seconds to finish; those still open then are cancelled, which aborts their requests), then it
exits 0, as every role does after a drain.

TLS (``proto/tls.py``'s flags): ``--tls-cert``/``--tls-key`` serve HTTPS; ``--tls-ca`` (or
the system's roots) verifies the coordinator, which is then dialled over TLS. API keys:
``--api-key`` / ``--api-keys-file`` (``common/api_keys.py``); ``/health`` and ``/metrics``
stay open unless ``--health-needs-key``. Stored responses: ``--response-store``
(``response_store_of``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sqlite3
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import uvicorn
import uvloop
from fastapi import FastAPI

from splitserve.client.stream_mux import OpenStreams
from splitserve.common.api_keys import ApiKeys, api_keys_or_exit
from splitserve.common.chunked_store import ChunkedStore
from splitserve.common.cpu_affinity import pin_or_exit
from splitserve.common.env_flags import built_or_exit, comma_separated, env_name
from splitserve.common.gc_tuning import tune_gc_for_serving
from splitserve.common.orphan import stop_when_orphaned
from splitserve.common.response_store import (
    MemoryResponseStore,
    ResponseStore,
    SqliteResponseStore,
)
from splitserve.common.settings import add_settings_args, settings_or_exit
from splitserve.common.tracing import configure_tracing, shutdown_tracing
from splitserve.discovery.etcd_access import etcd_access
from splitserve.discovery.etcd_response_store import PART_BYTES as ETCD_PART_BYTES
from splitserve.discovery.etcd_response_store import EtcdResponseStore
from splitserve.gateway import GATEWAY_READY
from splitserve.gateway.app import GatewayConfig, create_app
from splitserve.gateway.disconnect import exposing_raw_send
from splitserve.gateway.listeners import Listeners, shared_port_listeners
from splitserve.gateway.settings import DEFAULT_COORDINATOR, GatewaySettings
from splitserve.proto.tls import TlsConfig, tls_or_exit

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
    """The parser of ``GatewaySettings`` (``settings.py``: every flag is declared there)."""
    parser = argparse.ArgumentParser(prog="splitserve gateway", description=__doc__)
    add_settings_args(parser, GatewaySettings)
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
    settings = settings_or_exit(parser, args, GatewaySettings)
    pin_or_exit(parser, settings.cpu_affinity)  # before any thread starts
    tls = tls_or_exit(parser, args)
    keys = api_keys_or_exit(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    warn_if_backlog_capped()
    configure_tracing("gateway", settings.tracing.otlp_traces_endpoint)
    app = create_app(config_of(parser, settings, keys, tls))
    server = http_server(settings, app, tls)
    listeners = None
    if settings.reuse_port:
        try:
            listeners = shared_port_listeners(settings.host, settings.port, LISTEN_BACKLOG)
        except OSError as error:
            parser.exit(1, f"splitserve gateway: cannot listen on port {settings.port}: {error}\n")
    # uvicorn drains on SIGINT / SIGTERM and then raises the signal again under the handlers
    # it found installed: with these, a drained gateway returns (status 0) instead of dying of it.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _after_drain)
    stop_when_orphaned()  # up died: SIGTERM ourselves, which uvicorn drains on
    try:
        uvloop.run(serve_http(server, app, settings, listeners, serves_tls(tls)))
    finally:
        shutdown_tracing()
    return 0 if server.started else 1


def serves_tls(tls: TlsConfig | None) -> bool:
    return tls is not None and tls.can_serve


def config_of(
    parser: argparse.ArgumentParser,
    settings: GatewaySettings,
    keys: ApiKeys,
    tls: TlsConfig | None,
    local_streams: OpenStreams | None = None,
) -> GatewayConfig:
    """The app's config from the settings; a usage error (exit 2) for model names in front
    of several models. ``local_streams``: the coordinator runs in this process
    (``GatewayConfig.local_streams``)."""
    names = tuple(comma_separated(settings.served_model_name))
    targets = coordinator_targets(settings.coordinator)
    if names and len(targets) > 1:
        parser.error(
            "--served-model-name needs a single --coordinator: in front of several models, "
            "names are the coordinators' (their --served-model-name)"
        )
    return GatewayConfig(
        coordinators=targets,
        served_model_names=names,
        request_timeout_s=settings.request_timeout,
        api_keys=keys,
        health_needs_key=settings.health_needs_key,
        coordinator_credentials=None if tls is None else tls.channel_credentials(),
        max_body_bytes=settings.max_body_bytes,
        relay=settings.relay,
        client_stall_timeout_s=settings.client_stall_timeout,
        local_streams=local_streams,
        response_store=response_store_of(parser, settings),
        response_ttl_s=settings.responses.response_store_ttl,
        drain_timeout_s=settings.drain_timeout,
    )


def response_store_of(
    parser: argparse.ArgumentParser, settings: GatewaySettings
) -> ResponseStore | None:
    """The store ``--response-store`` names (None: ``none``); a usage error (exit 2) for
    another value, ``etcd`` without ``--etcd-endpoints`` or a SQLite file that cannot be
    opened."""
    chosen = settings.responses
    kind, _, path = chosen.response_store.partition(":")
    if chosen.response_store_ttl <= 0:
        parser.error("--response-store-ttl must be positive")
    if kind == "memory" and not path:
        return MemoryResponseStore(chosen.response_store_bytes)
    if kind == "none" and not path:
        return None
    if kind == "sqlite" and path:
        try:
            return SqliteResponseStore(Path(path))
        except sqlite3.Error as error:
            parser.error(f"--response-store {chosen.response_store}: {error}")
    if kind == "etcd" and not path:
        access = built_or_exit(parser, lambda: etcd_access(settings.etcd))
        if access is None:
            parser.error("--response-store etcd needs --etcd-endpoints")
        etcd_store = EtcdResponseStore(access.client(), settings.etcd.cluster_name)
        return ChunkedStore(etcd_store, ETCD_PART_BYTES)
    parser.error(
        f"--response-store must be memory, sqlite:PATH, etcd or none, not {chosen.response_store!r}"
    )


def http_server(settings: GatewaySettings, app: FastAPI, tls: TlsConfig | None) -> uvicorn.Server:
    """The uvicorn server of ``app`` (``gateway/app.py:create_app``'s; HTTPS where the TLS
    files can serve)."""
    https = serves_tls(tls)
    return uvicorn.Server(
        uvicorn.Config(
            exposing_raw_send(app),
            host=settings.host,
            port=settings.port,
            loop="uvloop",
            http="httptools",
            log_level=settings.log_level,
            timeout_graceful_shutdown=settings.drain_timeout,
            backlog=LISTEN_BACKLOG,
            ssl_certfile=tls.files.cert if tls is not None and https else None,
            ssl_keyfile=tls.files.key if tls is not None and https else None,
        )
    )


async def serve_http(
    server: uvicorn.Server,
    app: FastAPI,
    settings: GatewaySettings,
    listeners: Listeners | None,
    https: bool,
) -> None:
    """Serve until uvicorn's drain ends; print the ready line once listening (and, on a
    shared port, this instance's own address before it). Once told to stop, the app's
    background responses get the same ``--drain-timeout`` as its open streams, from then."""
    sockets = None if listeners is None else listeners.sockets
    task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:
        if task.done():
            await task  # startup failed (port taken): raises or returns
            return
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    scheme = "https" if https else "http"
    if listeners is not None:  # before the ready line, which launchers wait for
        own = f"{scheme}://{settings.host}:{listeners.instance_port}"
        print(f"splitserve gateway instance at {own}", flush=True)
    tune_gc_for_serving()
    print(f"{GATEWAY_READY} at {scheme}://{settings.host}:{port}", flush=True)
    stopping = asyncio.create_task(_drain_background(server, app, settings.drain_timeout))
    try:
        await task
    finally:
        stopping.cancel()


async def _drain_background(server: uvicorn.Server, app: FastAPI, timeout_s: float) -> None:
    """Once ``server`` is told to stop: ``app``'s background responses end within
    ``timeout_s`` (``gateway/background.py:BackgroundRuns.drain``), beside uvicorn's drain."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    await app.state.gateway.background.drain(timeout_s)


def _after_drain(signum: int, frame: object) -> None:
    """The handler uvicorn's re-raised stop signal meets once the drain is over: nothing
    is left to do."""


if __name__ == "__main__":
    sys.exit(main())
