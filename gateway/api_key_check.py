"""API keys on the HTTP side: an ASGI middleware that answers 401 before any route runs.

With keys configured (``common/api_keys.py``), every request must carry ``Authorization:
Bearer <key>`` naming one of them (the OpenAI SDK sends its ``api_key`` that way); a missing
or unknown key gets 401 with the OpenAI error body (``code: invalid_api_key``) and
``WWW-Authenticate: Bearer``. ``/health`` and ``/metrics`` stay open for probes and scrapers
unless ``health_needs_key``. The key itself travels on to the coordinator with the request
(``Gateway.client_for``), which scopes the request to it. A refused request's body is never
read: its connection closes after the 401 (``Connection: close``).
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.common.api_keys import ApiKeys
from splitserve.gateway.errors import unauthorized

OPEN_PATHS = frozenset({"/health", "/metrics"})


class RequireApiKey:
    def __init__(self, app: ASGIApp, keys: ApiKeys, health_needs_key: bool = False) -> None:
        self.app = app
        self._keys = keys
        self._open = frozenset() if health_needs_key else OPEN_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._keys.required or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        authorization = Headers(scope=scope).get("authorization")
        if self._keys.caller_of(authorization) is not None:
            await self.app(scope, receive, send)
            return
        message = (
            "Incorrect API key provided."
            if authorization
            else "You didn't provide an API key: send it as 'Authorization: Bearer <key>'."
        )
        response = unauthorized(message).response()
        # the body is not read for a stranger: the connection closes after the answer, so no
        # unread body is taken for a next request, nor holds a drain for --drain-timeout
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value (None without one)."""
    if authorization is None:
        return None
    scheme, _, key = authorization.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None
