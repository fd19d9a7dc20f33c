"""What a process needs on the internal plane: the cluster credential and its TLS material.

``ClusterAccess`` bundles the credential every internal call carries (``cluster_auth.py``)
with the process's ``TlsConfig`` (``tls.py``; None: plaintext), and opens the channels of
internal calls. Every role's main builds one from its flags with ``access_or_exit``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from splitserve.common.settings import add_settings_args, default_group
from splitserve.proto.cluster_auth import ClusterAuthSettings, ClusterCredential, credential_or_exit
from splitserve.proto.server import open_channel
from splitserve.proto.tls import TlsConfig, TlsSettings, tls_or_exit


@dataclass(frozen=True)
class ClusterAccess:
    credential: ClusterCredential
    tls: TlsConfig | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that carries the credential."""
        return self.credential.metadata

    def channel(self, address: str) -> grpc.aio.Channel:
        """A channel to an internal server at ``address`` (TLS when this process has it)."""
        return open_channel(address, self.tls)


@dataclass(frozen=True)
class ClusterAccessSettings:
    """The cluster credential and the TLS files of a role's internal calls (a settings
    group: ``common/settings.py``)."""

    auth: ClusterAuthSettings = default_group(ClusterAuthSettings)
    tls: TlsSettings = default_group(TlsSettings)


def add_cluster_access_args(
    parser: argparse._ActionsContainer, env: Mapping[str, str] = os.environ
) -> None:
    """The cluster credential's flags and the TLS flags."""
    add_settings_args(parser, ClusterAccessSettings, env)


def access_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ClusterAccess:
    """The flags' ``ClusterAccess``, or the parser's usage error (exit status 2): a role never
    starts without the credential, nor with unreadable TLS files."""
    return ClusterAccess(credential_or_exit(parser, args), tls_or_exit(parser, args))
