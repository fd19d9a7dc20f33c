"""Flags that choose the membership backend, for the coordinator and the workers.

``--etcd-endpoints host:port[,host:port...]`` (env ``SPLITSERVE_ETCD_ENDPOINTS``): membership
lives in that etcd cluster, under ``--cluster-name`` (several splitserve clusters may share
one etcd). Without it, workers register with ``--coordinator`` over gRPC, the single-machine
default (``splitserve up``): no etcd to install or run.

An etcd closed to strangers: ``--etcd-user`` logs in as that etcd user, whose password is
never a flag (``discovery/etcd_access.py``: ``SPLITSERVE_ETCD_PASSWORD`` or
``--etcd-password-file``); ``--etcd-ca`` speaks TLS to etcd, and ``--etcd-cert`` with
``--etcd-key`` presents a client certificate (etcd's ``--client-cert-auth``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.env_flags import comma_separated, env_name
from splitserve.common.settings import add_settings_args, setting, settings_of

PASSWORD_ENV = env_name("--etcd-password")
"""The environment variable holding ``--etcd-user``'s password (there is no such flag)."""


@dataclass(frozen=True)
class MembershipSettings:
    """Where membership lives and how to reach it (a settings group: ``common/settings.py``).
    ``__post_init__`` refuses a client certificate without its key (and the reverse) and a
    password file without a user."""

    etcd_endpoints: str | None = setting(
        None, "etcd v3 client endpoints (host:port, comma-separated): membership in etcd"
    )
    cluster_name: str = setting("splitserve", "this cluster's name in etcd's keys")
    etcd_user: str | None = setting(
        None,
        "etcd user to log in as (etcd with auth enabled; its roles need readwrite on "
        f"/splitserve/<cluster-name>/). Its password is never a flag: {PASSWORD_ENV} in the "
        "environment, or --etcd-password-file",
    )
    etcd_password_file: Path | None = setting(
        None, f"file whose first line is --etcd-user's password (wins over {PASSWORD_ENV})"
    )
    etcd_ca: Path | None = setting(
        None, "PEM CA bundle etcd's server certificate must chain to: TLS to etcd"
    )
    etcd_cert: Path | None = setting(
        None,
        "PEM client certificate to present to etcd (mutual TLS, etcd's --client-cert-auth; "
        "with --etcd-key)",
    )
    etcd_key: Path | None = setting(None, "PEM private key of --etcd-cert")

    def __post_init__(self) -> None:
        if (self.etcd_cert is None) != (self.etcd_key is None):
            raise ValueError("--etcd-cert and --etcd-key go together")
        if self.etcd_password_file is not None and self.etcd_user is None:
            raise ValueError("--etcd-password-file needs --etcd-user")

    def for_child(self) -> MembershipSettings:
        """The same settings as a process started elsewhere takes them: the endpoints
        without spaces or empty items, every file as an absolute path."""
        files = ("etcd_password_file", "etcd_ca", "etcd_cert", "etcd_key")
        absolute = {name: getattr(self, name).resolve() for name in files if getattr(self, name)}
        endpoints = ",".join(comma_separated(self.etcd_endpoints or "")) or None
        return dataclasses.replace(self, etcd_endpoints=endpoints, **absolute)


def add_membership_args(
    parser: argparse._ActionsContainer, env: Mapping[str, str] = os.environ
) -> None:
    add_settings_args(parser, MembershipSettings, env)


def membership_settings(args: argparse.Namespace) -> MembershipSettings:
    """The membership flags of a parsed command line (one of the groups above);
    ``ValueError`` for values ``MembershipSettings`` refuses."""
    return settings_of(args, MembershipSettings)
