"""TLS for every gRPC server and channel of a cluster: ``--tls-cert``, ``--tls-key``, ``--tls-ca``.

One ``TlsConfig`` per process, from its flags (or their ``SPLITSERVE_TLS_*`` twins):

- ``cert`` + ``key`` (PEM): the process's own certificate chain and private key. A server
  needs both; a channel presents them as its client certificate when the server asks.
- ``ca`` (PEM): the roots this process trusts for its peers. On a channel it verifies the
  server (absent: the system's roots); on an internal-plane server it turns on mutual TLS:
  every caller must present a certificate signed by it, besides the cluster credential.

Without any of the three flags a process speaks plaintext (``TlsConfig`` is None). Every
peer address a process dials must be named in the certificate of the process it reaches
(``--advertise-host`` for workers): gRPC checks the name, IP addresses included.
The coordinator's public port never requires a client certificate (clients authenticate
with API keys), but it serves TLS whenever the coordinator has a certificate.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from splitserve.common.env_flags import built_or_exit
from splitserve.common.settings import add_settings_args, setting


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the PEM files one process uses (the flags, before reading)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None


@dataclass(frozen=True)
class TlsConfig:
    """One process's TLS material, read from its files (``repr`` never shows the key)."""

    files: TlsFiles
    cert_pem: bytes | None
    key_pem: bytes | None
    ca_pem: bytes | None

    def __repr__(self) -> str:
        return f"TlsConfig({self.files!r})"

    @classmethod
    def load(cls, files: TlsFiles) -> TlsConfig:
        """Read the files; ``ValueError`` when only one of cert and key is given or a file is
        not PEM (``OSError`` when it cannot be read)."""
        if (files.cert is None) != (files.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        pems = [None if path is None else path.read_bytes() for path in (files.cert, files.key)]
        ca_pem = None if files.ca is None else files.ca.read_bytes()
        for path, pem in zip((files.cert, files.key, files.ca), (*pems, ca_pem), strict=True):
            if pem is not None and b"-----BEGIN " not in pem:
                raise ValueError(f"{path} is not a PEM file")
        return cls(files, pems[0], pems[1], ca_pem)

    @property
    def can_serve(self) -> bool:
        return self.cert_pem is not None

    def server_credentials(self, *, require_client_cert: bool) -> grpc.ServerCredentials:
        """Credentials of a server with this certificate; ``require_client_cert`` (and a CA):
        callers must present a certificate the CA signed (mutual TLS)."""
        if self.cert_pem is None or self.key_pem is None:
            raise ValueError("serving TLS needs --tls-cert and --tls-key")
        mutual = require_client_cert and self.ca_pem is not None
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.ca_pem,
            require_client_auth=mutual,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a channel: verify the server against the CA (the system's roots
        without one); present this process's certificate when it has one."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=self.key_pem,
            certificate_chain=self.cert_pem,
        )


@dataclass(frozen=True)
class TlsSettings:
    """The TLS files a process serves and checks peers with (a settings group:
    ``common/settings.py``)."""

    tls_cert: Path | None = setting(None, "PEM certificate chain this process serves")
    tls_key: Path | None = setting(None, "PEM private key of --tls-cert")
    tls_ca: Path | None = setting(
        None, "PEM CA bundle that peers' certificates must chain to (mutual TLS between roles)"
    )


def add_tls_args(parser: argparse._ActionsContainer, env: Mapping[str, str] = os.environ) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca`` (and ``SPLITSERVE_TLS_*`` twins)."""
    add_settings_args(parser, TlsSettings, env)


def files_of(args: argparse.Namespace) -> TlsFiles:
    return TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)


def tls_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TlsConfig | None:
    """The flags' ``TlsConfig`` (None without any), or the parser's usage error (exit status
    2) naming what is wrong with the files."""
    files = files_of(args)
    if files == TlsFiles():
        return None
    return built_or_exit(parser, lambda: TlsConfig.load(files))


def tls_env(files: TlsFiles) -> dict[str, str]:
    """The environment that hands ``files`` to a child process (``splitserve up``)."""
    named = {"SPLITSERVE_TLS_CERT": files.cert, "SPLITSERVE_TLS_KEY": files.key}
    named["SPLITSERVE_TLS_CA"] = files.ca
    return {name: str(path.resolve()) for name, path in named.items() if path is not None}
