"""gRPC server plumbing shared by every role: options, health, reflection, uvloop, shutdown.

Every role's process calls ``serve_forever(build)``: it installs uvloop, creates the
``grpc.aio`` server with raised message limits and, on the internal plane, the cluster
credential check (``cluster_auth``), registers ``grpc.health.v1`` (all services NOT_SERVING
until the role calls ``set_serving``) and reflection when asked, binds the port, starts, then
runs the role's ``build`` coroutine and waits until SIGINT/SIGTERM, when it stops accepting
calls, lets running ones finish for a grace period and runs the role's cleanup.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from splitserve.common.orphan import stop_when_orphaned
from splitserve.common.settings import add_settings_args, setting
from splitserve.proto.cluster_auth import ClusterAuthInterceptor, ClusterCredential
from splitserve.proto.tls import TlsConfig

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
"""Message size limit: long prompts' token ids and KV metadata exceed gRPC's 4 MiB default."""

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
MAX_PENDING_CALLS = 1 << 16
"""Calls gRPC's core may hold before the Python server takes them. Its defaults (a soft limit
of 1,000 with random early drops above it, all dropped past 3,000) cancel a crowd's calls
before they reach admission: 2,000 streams arriving at once lost 25-214 of theirs (CANCELLED,
no refusal, no log line). Admission (``coordinator/admission.py``) is what refuses a crowd,
with a retry hint. Still finite: calls wait here before any credential or API key is checked,
so a stranger's flood may hold at most this many (a few KB each)."""
SERVER_OPTIONS = (
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
)


def open_channel(address: str, tls: TlsConfig | None) -> grpc.aio.Channel:
    """A channel to another role with the shared options: TLS (``tls.py``) when ``tls`` is
    given, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)


class RoleServer:
    """A started gRPC server and its health state."""

    def __init__(self, server: grpc.aio.Server, health: HealthServicer, port: int) -> None:
        self.server = server
        self.health = health
        self.port = port
        self.service_names: tuple[str, ...] = ()

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)


async def start_server(
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], Sequence[str]],
    *,
    credential: ClusterCredential | None,
    tls: TlsConfig | None,
    with_reflection: bool = False,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> RoleServer:
    """Create, register (``register`` adds servicers, returns full service names), bind, start.

    ``credential``: an internal-plane server, every call of which (health and reflection
    included) must carry it (``cluster_auth``); None only for the coordinator's public port.
    ``tls``: serve TLS when it holds a certificate (``tls.py``); on the internal plane with a
    CA, callers must present a certificate it signed (mutual TLS). ``interceptors`` run after
    the credential check (the public port's API keys).
    ``with_reflection``: serve gRPC reflection (off by default: it lists every method).
    """
    checks = () if credential is None else (ClusterAuthInterceptor(credential),)
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=(*checks, *interceptors))
    names = tuple(register(server))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if with_reflection:
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection((*names, health_name, reflection.SERVICE_NAME), server)
    if tls is not None and tls.can_serve:
        secure = tls.server_credentials(require_client_cert=credential is not None)
        bound = server.add_secure_port(f"{host}:{port}", secure)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    role_server = RoleServer(server, health, bound)
    role_server.service_names = names
    await role_server.set_serving(False)
    return role_server


def serve_forever(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop_event)`` on uvloop; SIGINT/SIGTERM set ``stop_event``, as does the
    death of the ``splitserve up`` that started this process (``common/orphan.py``)."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        stop_when_orphaned()
        await main(stop)

    uvloop.run(runner())


async def wait_for_health(
    address: str,
    timeout_s: float,
    service: str = "",
    credential: ClusterCredential | None = None,
    tls: TlsConfig | None = None,
) -> None:
    """Poll ``grpc.health.v1`` at ``address`` until SERVING; ``TimeoutError`` after timeout.
    ``credential``: for a server of the internal plane; ``tls``: for a server speaking TLS."""
    metadata = None if credential is None else credential.metadata
    async with open_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    reply = await stub.Check(
                        health_pb2.HealthCheckRequest(service=service),
                        timeout=1,
                        metadata=metadata,
                    )
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.1)


@dataclass(frozen=True)
class ReflectionSettings:
    """A settings group (``common/settings.py``)."""

    grpc_reflection: bool = setting(False, "serve gRPC reflection (it lists every method)")


def add_reflection_flag(
    parser: argparse._ActionsContainer, env: Mapping[str, str] = os.environ
) -> None:
    """``--grpc-reflection``: serve gRPC reflection (off by default; it lists every method)."""
    add_settings_args(parser, ReflectionSettings, env)
