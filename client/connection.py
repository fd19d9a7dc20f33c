"""How a client reaches the coordinator: its channel (plaintext or TLS) and its API key.

``credentials``: ``grpc.ssl_channel_credentials(root_certificates=<CA PEM>)`` (add a client
certificate if the port wants one) for a coordinator serving TLS; None: plaintext.
``api_key``: sent with every call as ``authorization: Bearer <key>``, as the OpenAI SDK sends
its key; the coordinator scopes what the call may touch to that key (``abort`` ends only
requests started with the same key).
"""

from __future__ import annotations

import grpc

from splitserve.client.errors import RetryPolicy
from splitserve.client.retry import channel_options

Metadata = tuple[tuple[str, str], ...]


def call_metadata(api_key: str | None) -> Metadata | None:
    """The metadata every call carries: the API key, when there is one."""
    return None if api_key is None else (("authorization", f"Bearer {api_key}"),)


def aio_channel(
    target: str, credentials: grpc.ChannelCredentials | None, retry: RetryPolicy
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` that retries by ``retry``."""
    options = channel_options(retry)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def sync_channel(
    target: str, credentials: grpc.ChannelCredentials | None, retry: RetryPolicy
) -> grpc.Channel:
    """A blocking channel to ``target`` that retries by ``retry``."""
    options = channel_options(retry)
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)
