"""How a role reaches etcd: its ``MembershipSettings`` made into ``EtcdAccess`` (endpoints,
login, TLS), from which each announcer and watcher gets its own ``EtcdClient``.

The password of ``--etcd-user`` never travels on a command line: it is the first line of
``--etcd-password-file`` or, without that flag, ``SPLITSERVE_ETCD_PASSWORD`` from the
environment (``splitserve up``'s children inherit its environment, so it reaches them without
appearing in any process list). TLS files are read here once, so a role refuses unreadable
or non-PEM files when it starts, not at its first call to etcd.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from splitserve.common.env_flags import comma_separated
from splitserve.discovery.flags import PASSWORD_ENV, MembershipSettings
from splitserve.proto.etcd_auth import EtcdLogin
from splitserve.proto.etcd_client import EtcdClient
from splitserve.proto.tls import TlsConfig, TlsFiles


@dataclass(frozen=True)
class EtcdAccess:
    """What an ``EtcdClient`` of this process needs (``repr`` never shows the password)."""

    endpoints: tuple[str, ...]
    login: EtcdLogin | None
    credentials: grpc.ChannelCredentials | None

    def client(self) -> EtcdClient:
        """A new client (channels open on its first call)."""
        return EtcdClient(self.endpoints, credentials=self.credentials, login=self.login)


def etcd_access(
    settings: MembershipSettings, env: Mapping[str, str] = os.environ
) -> EtcdAccess | None:
    """The access ``settings`` describe; None without ``--etcd-endpoints``. ``ValueError``
    naming the flag or variable to fix: a user without a password, a file that cannot be
    read or is not PEM."""
    endpoints = comma_separated(settings.etcd_endpoints or "")
    if not endpoints:
        return None
    return EtcdAccess(tuple(endpoints), _login(settings, env), _credentials(settings))


def _login(settings: MembershipSettings, env: Mapping[str, str]) -> EtcdLogin | None:
    if settings.etcd_user is None:
        return None
    if settings.etcd_password_file is not None:
        try:
            lines = settings.etcd_password_file.read_text().splitlines()
        except OSError as error:
            raise ValueError(f"--etcd-password-file: {error}") from error
        password = lines[0] if lines else ""
        if not password:
            raise ValueError(f"--etcd-password-file {settings.etcd_password_file}: no password")
    else:
        password = env.get(PASSWORD_ENV, "")
        if not password:
            raise ValueError(
                f"--etcd-user {settings.etcd_user} needs its password: set {PASSWORD_ENV} "
                "or --etcd-password-file"
            )
    return EtcdLogin(settings.etcd_user, password)


def _credentials(settings: MembershipSettings) -> grpc.ChannelCredentials | None:
    files = TlsFiles(cert=settings.etcd_cert, key=settings.etcd_key, ca=settings.etcd_ca)
    if files == TlsFiles():
        return None
    try:
        return TlsConfig.load(files).channel_credentials()
    except (OSError, ValueError) as error:
        raise ValueError(f"etcd TLS: {error}") from error
