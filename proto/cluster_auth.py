"""The cluster credential: what every call on the internal plane carries, and its one check.

All processes of a cluster share one secret token: ``--cluster-token``, ``--cluster-token-file``
or ``SPLITSERVE_CLUSTER_TOKEN`` (``splitserve up`` makes a fresh one per run and hands it to
its children through the environment, never on a command line). Internal calls send it as
gRPC metadata ``authorization: Bearer <token>`` (the typed clients in ``worker_clients.py`` and
``membership_client.py`` add it to every call); every internal server checks it once per call
in ``ClusterAuthInterceptor``, with a constant-time comparison, and refuses a call without it
or with another token with UNAUTHENTICATED: health checks and reflection included, and from
localhost too. The coordinator's public port does not take this interceptor (it answers
clients, who never hold the cluster token).
"""

from __future__ import annotations

import argparse
import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from splitserve.common.env_flags import built_or_exit
from splitserve.common.settings import add_settings_args, setting

AUTH_METADATA_KEY = "authorization"
TOKEN_ENV = "SPLITSERVE_CLUSTER_TOKEN"
MIN_TOKEN_CHARS = 16
REFUSAL = "this is an internal port of a splitserve cluster: the cluster credential is required"


@dataclass(frozen=True)
class ClusterCredential:
    """The shared secret of one cluster (``repr`` never shows it)."""

    token: str

    def __post_init__(self) -> None:
        if len(self.token) < MIN_TOKEN_CHARS or any(c.isspace() for c in self.token):
            raise ValueError(
                f"the cluster token must be at least {MIN_TOKEN_CHARS} characters without spaces"
            )

    def __repr__(self) -> str:
        return "ClusterCredential(<secret>)"

    @classmethod
    def generate(cls) -> ClusterCredential:
        """A fresh random token (256 bits from the OS's CSPRNG)."""
        return cls(secrets.token_urlsafe(32))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that carries the credential."""
        return ((AUTH_METADATA_KEY, f"Bearer {self.token}"),)

    def admits(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """True when ``metadata`` carries this credential (constant-time comparison)."""
        received = metadata_value(metadata, AUTH_METADATA_KEY)
        expected = f"Bearer {self.token}"
        return received is not None and hmac.compare_digest(received.encode(), expected.encode())


class AdmittingInterceptor(grpc.aio.ServerInterceptor):
    """A server interceptor that lets a call reach its servicer only when ``admits`` says so
    and ends it UNAUTHENTICATED with ``refusal`` otherwise (unknown methods pass through, to
    get gRPC's own UNIMPLEMENTED)."""

    refusal = "unauthenticated"

    def admits(self, details: grpc.HandlerCallDetails) -> bool:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or self.admits(handler_call_details):
            return handler
        return refusing(handler, self.refusal)


class ClusterAuthInterceptor(AdmittingInterceptor):
    """Refuses every call that does not carry the cluster credential (UNAUTHENTICATED)."""

    refusal = REFUSAL

    def __init__(self, credential: ClusterCredential) -> None:
        self._credential = credential

    def admits(self, details: grpc.HandlerCallDetails) -> bool:
        return self._credential.admits(details.invocation_metadata)


def refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED with
    ``message`` (the servicer never runs)."""

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def metadata_value(metadata: Sequence[tuple[str, str | bytes]] | None, key: str) -> str | None:
    """The first value of ``key`` in call metadata, as text; None when absent."""
    for name, value in metadata or ():
        if name == key:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


@dataclass(frozen=True)
class ClusterAuthSettings:
    """Where the cluster credential comes from (a settings group: ``common/settings.py``)."""

    cluster_token_file: Path | None = setting(
        None,
        "file holding the cluster token (one line); prefer it or the env to --cluster-token, "
        "which other users of this machine can read in the process list",
    )
    cluster_token: str | None = setting(None, "the cluster's shared secret")


def add_cluster_auth_args(
    parser: argparse._ActionsContainer, env: Mapping[str, str] = os.environ
) -> None:
    """``--cluster-token`` / ``--cluster-token-file`` (and ``SPLITSERVE_*`` twins)."""
    add_settings_args(parser, ClusterAuthSettings, env)


def credential_from_args(args: argparse.Namespace) -> ClusterCredential:
    """The credential the flags (or environment) name; ``ValueError`` with what to do when
    none is given or it is too short."""
    token = args.cluster_token
    if args.cluster_token_file is not None:
        token = Path(args.cluster_token_file).read_text().strip()
    if not token:
        raise ValueError(
            f"no cluster credential: set {TOKEN_ENV}, --cluster-token-file or --cluster-token "
            "(the same secret on every process of the cluster; `splitserve up` makes one)"
        )
    return ClusterCredential(token)


def credential_or_exit(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> ClusterCredential:
    """``credential_from_args``, or the parser's usage error (exit status 2) saying what to set
    when there is none or its file cannot be read: a role never starts without it."""
    return built_or_exit(parser, lambda: credential_from_args(args))
