"""``splitserve probe``: one ``grpc.health.v1`` check, for an orchestrator's exec probe.

    splitserve probe --address 127.0.0.1:50060          # exit 0 when SERVING, else 1
    python -m splitserve.launch.probe --address ...     # the same without loading torch

Kubernetes' native ``grpc`` probe sends no metadata, so it cannot reach the internal plane
(the workers' port, the coordinator's ``--internal-port``), which refuses every call without
the cluster credential, health checks included (``proto/cluster_auth.py``). This command
sends it: it reads the credential as the roles do (``SPLITSERVE_CLUSTER_TOKEN``,
``--cluster-token-file``, ``--cluster-token``) and the TLS flags (``proto/tls.py``), and
makes one check with a short deadline. Without a credential it checks unauthenticated (the
coordinator's public port).

Exit status: 0 when the service is SERVING; with ``--alive``, 0 on any health answer
(SERVING or NOT_SERVING: the server is up and answering, as while a worker loads its model
or drains, which a liveness probe must not punish); 1 otherwise (refused, unreachable, no
answer within ``--timeout``); 2 for flags it cannot use. It prints one line saying what it
saw, which Kubernetes keeps in the probe's event. ``python -m`` skips ``splitserve``'s
command table, whose module also holds offline generation, so a probe every few seconds
costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.env_flags import built_or_exit
from splitserve.proto.cluster_auth import (
    ClusterCredential,
    add_cluster_auth_args,
    credential_from_args,
)
from splitserve.proto.tls import TlsConfig, add_tls_args, tls_or_exit

SERVING = "SERVING"
ANSWERS = frozenset(health_pb2.HealthCheckResponse.ServingStatus.keys())
"""What a health server answers: SERVING, NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN."""


def check_health(
    address: str,
    *,
    service: str = "",
    credential: ClusterCredential | None = None,
    tls: TlsConfig | None = None,
    server_name: str | None = None,
    timeout_s: float = 3.0,
) -> str:
    """One health check of ``service`` at ``address``: the status the server answered
    (``ANSWERS``), or the name of the gRPC error code the call ended with (UNAUTHENTICATED,
    UNAVAILABLE, DEADLINE_EXCEEDED, NOT_FOUND for an unknown service)."""
    options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
    if tls is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=options)
    metadata = None if credential is None else credential.metadata
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, metadata=metadata
            )
        except grpc.RpcError as error:
            return error.code().name  # type: ignore[attr-defined]  # a call's error is a Call
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def build_parser(env: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve probe", description=__doc__.split("\n\n", 1)[0]
    )
    parser.add_argument("--address", required=True, help="host:port of the gRPC server")
    parser.add_argument(
        "--service", default="", help="service name to check (default '': the whole server)"
    )
    parser.add_argument(
        "--alive",
        action="store_true",
        help="succeed on any health answer, NOT_SERVING included (liveness)",
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="deadline of the check, s")
    parser.add_argument(
        "--tls-server-name",
        default=None,
        help="name the server's certificate must carry, when --address's host is not in it "
        "(a probe dialling 127.0.0.1)",
    )
    add_cluster_auth_args(parser, env)
    add_tls_args(parser, env)
    return parser


def _credential(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> ClusterCredential | None:
    """The flags' credential; None when none is given (a public port); a usage error when one
    is given but unusable (too short, unreadable file)."""
    if args.cluster_token is None and args.cluster_token_file is None:
        return None
    return built_or_exit(parser, lambda: credential_from_args(args))


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] = os.environ) -> int:
    parser = build_parser(env)
    args = parser.parse_args(argv)
    credential = _credential(parser, args)
    tls = tls_or_exit(parser, args)
    status = check_health(
        args.address,
        service=args.service,
        credential=credential,
        tls=tls,
        server_name=args.tls_server_name,
        timeout_s=args.timeout,
    )
    healthy = status == SERVING or (args.alive and status in ANSWERS)
    print(f"{args.address} {args.service or '(server)'}: {status}", flush=True)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
