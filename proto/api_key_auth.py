"""API keys on the coordinator's public port: one server interceptor and the caller of a call.

``ApiKeyInterceptor`` refuses, with UNAUTHENTICATED, every call whose ``authorization``
metadata names no key of ``ApiKeys`` (``common/api_keys.py``), reflection included; health
checks stay open unless ``protect_health``. With no keys configured it lets everything pass.
``caller_of(context)`` is the caller a servicer scopes the call to (whose requests it may
abort).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2

from splitserve.common.api_keys import ApiKeys, Caller
from splitserve.proto.cluster_auth import AUTH_METADATA_KEY, AdmittingInterceptor, metadata_value

HEALTH_PREFIX = "/" + health_pb2.DESCRIPTOR.services_by_name["Health"].full_name + "/"
REFUSAL = "a valid API key is required (authorization: Bearer <key>)"


class ApiKeyInterceptor(AdmittingInterceptor):
    refusal = REFUSAL

    def __init__(self, keys: ApiKeys, *, protect_health: bool = False) -> None:
        self._keys = keys
        self._protect_health = protect_health

    def admits(self, details: grpc.HandlerCallDetails) -> bool:
        if not self._protect_health and details.method.startswith(HEALTH_PREFIX):
            return True
        authorization = metadata_value(details.invocation_metadata, AUTH_METADATA_KEY)
        return self._keys.caller_of(authorization) is not None


async def caller_of(keys: ApiKeys, context: grpc.aio.ServicerContext) -> Caller:
    """The caller of a call (``ANONYMOUS`` without keys); ends the call UNAUTHENTICATED when
    it names no key (the interceptor refuses those first; this keeps a servicer safe
    without it)."""
    authorization = metadata_value(context.invocation_metadata(), AUTH_METADATA_KEY)
    caller = keys.caller_of(authorization)
    if caller is None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
    assert caller is not None  # abort raises
    return caller
