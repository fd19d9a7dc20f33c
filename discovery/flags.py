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
from dataclasses import dataclass

from splitserve.common.env_flags import comma_separated
from splitserve.common.settings import add_settings_args, setting


@dataclass(frozen=True)
class MembershipSettings:
    """Where membership lives (a settings group: ``common/settings.py``)."""

    etcd_endpoints: str | None = setting(
        None, "etcd v3 client endpoints (host:port, comma-separated): membership in etcd"
    )
    cluster_name: str = setting("splitserve", "this cluster's name in etcd's keys")


def add_membership_args(
    parser: argparse._ActionsContainer, env: Mapping[str, str] = os.environ
) -> None:
    add_settings_args(parser, MembershipSettings, env)


def etcd_endpoints(args: argparse.Namespace) -> list[str]:
    """The endpoints of ``--etcd-endpoints``; empty without it."""
    return comma_separated(args.etcd_endpoints or "")
