"""Refusals at the gateway's door: an ASGI middleware that answers a generation request with
429 before its body is parsed, validated or sent, while the coordinator it would go to has said
that it refuses every new request for now.

A coordinator whose admission queue is full by its request count refuses whatever arrives, and
says so for a moment (``StreamEnd.refuses_all_ms``); the gateway's stream multiplexer then
refuses the streams it would start on that coordinator's calls itself
(``client/stream_mux.py``). This middleware asks the multiplexer first
(``Gateway.edge_refusal``): where every call the caller's key would use refuses now, the
request is answered here, at a fraction of what parsing and validating it costs (a crowd's
refusals are the gateway's work). Otherwise it passes on untouched.

Contract:
- Only ``POST`` to ``paths`` (the generation routes), only behind the API-key check (an
  unknown key still gets 401), and only where the gateway serves one model route (several
  routes need the body's ``model`` to choose one; their requests take the usual way).
- The answer is the multiplexer's refusal as the usual path would answer it
  (``gateway/errors.py:from_client_error``: 429, ``Retry-After`` what is left of the
  coordinator's hint, OpenAI's error body); the request body is read (and dropped) first, so
  the connection stays usable. A body the usual path would refuse as invalid gets the 429
  instead, as OpenAI's rate limits come before validation.
- Its responses are counted under their route's path (``scope["route"]``, which the
  router would have set).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.gateway.errors import ApiError

EdgeRefusal = Callable[[Scope, str | None], ApiError | None]
"""The refusal for a request of ``scope`` with this ``Authorization`` header value, or None."""


@dataclass(frozen=True)
class _RouteName:
    """What ``scope["route"]`` offers the request counter: the path."""

    path: str


class RefuseAtTheDoor:
    def __init__(self, app: ASGIApp, paths: frozenset[str], refusal: EdgeRefusal) -> None:
        self.app = app
        self._paths = paths
        self._refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self._paths:
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope, Headers(scope=scope).get("authorization"))
        if error is None:
            await self.app(scope, receive, send)
            return
        while (await receive()).get("more_body", False):
            pass
        scope["route"] = _RouteName(scope["path"])
        await error.response()(scope, receive, send)
