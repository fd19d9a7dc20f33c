"""How a client reaches the coordinator: its channel (plaintext or TLS) and its API key.

``target``: "host:port", or several coordinators as "ip:port,ip:port" (calls are balanced over
those that answer; a stream whose coordinator dies continues through another), or any gRPC
target such as "dns:///coordinators.example:50051" (a name resolving to several).

``credentials``: ``grpc.ssl_channel_credentials(root_certificates=<CA PEM>)`` (add a client
certificate if the port wants one) for a coordinator serving TLS; None: plaintext.
``api_key``: sent with every call as ``authorization: Bearer <key>``, as the OpenAI SDK sends
its key; the coordinator scopes what the call may touch to that key (``abort`` ends only
requests started with the same key).
"""

from __future__ import annotations

import ipaddress

import grpc

from splitserve.client.errors import RetryPolicy
from splitserve.client.retry import channel_options

Metadata = tuple[tuple[str, str], ...]


def call_metadata(api_key: str | None) -> Metadata | None:
    """The metadata every call carries: the API key, when there is one."""
    return None if api_key is None else (("authorization", f"Bearer {api_key}"),)


def channel_target(target: str) -> str:
    """The gRPC target of ``target``: a comma-separated list of IP:port becomes gRPC's
    ``ipv4:``/``ipv6:`` list; ``ValueError`` for a list with host names (use a DNS name that
    resolves to several)."""
    if "," not in target or ":///" in target or target.startswith(("ipv4:", "ipv6:")):
        return target
    addresses = [address.strip() for address in target.split(",") if address.strip()]
    hosts = [address.rsplit(":", 1)[0] for address in addresses]
    if all(host.startswith("[") for host in hosts):
        return "ipv6:" + ",".join(addresses)
    try:
        for host in hosts:
            ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(
            f"several coordinators must be given as IP:port ({target!r}); "
            "for host names use one DNS name that resolves to all of them (dns:///name:port)"
        ) from None
    return "ipv4:" + ",".join(addresses)


def _several(target: str) -> bool:
    """Whether ``target`` may name several coordinators (a list, or a DNS name)."""
    return "," in target or target.startswith("dns:")


def aio_channel(
    target: str, credentials: grpc.ChannelCredentials | None, retry: RetryPolicy
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` that retries by ``retry``."""
    several = _several(target)
    options = channel_options(retry, health_checked=several)
    target = channel_target(target)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def sync_channel(
    target: str, credentials: grpc.ChannelCredentials | None, retry: RetryPolicy
) -> grpc.Channel:
    """A blocking channel to ``target`` that retries by ``retry``."""
    several = _several(target)
    options = channel_options(retry, health_checked=several)
    target = channel_target(target)
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)
