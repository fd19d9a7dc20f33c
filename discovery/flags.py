"""Flags that choose the membership backend, for the coordinator and the workers.

``--etcd-endpoints host:port[,host:port...]`` (env ``SPLITSERVE_ETCD_ENDPOINTS``): membership
lives in that etcd cluster, under ``--cluster-name`` (several splitserve clusters may share
one etcd). Without it, workers register with ``--coordinator`` over gRPC, the single-machine
default (``splitserve up``): no etcd to install or run.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from splitserve.common.env_flags import add_env_flag, comma_separated


def add_membership_args(
    parser: argparse._ActionsContainer, env: Mapping[str, str] = os.environ
) -> None:
    add_env_flag(
        parser,
        "--etcd-endpoints",
        None,
        str,
        "etcd v3 client endpoints (host:port, comma-separated): membership in etcd",
        env,
    )
    add_env_flag(
        parser, "--cluster-name", "splitserve", str, "this cluster's name in etcd's keys", env
    )


def etcd_endpoints(args: argparse.Namespace) -> list[str]:
    """The endpoints of ``--etcd-endpoints``; empty without it."""
    return comma_separated(args.etcd_endpoints or "")
