"""A bound on request bodies: an ASGI middleware that answers 413 (OpenAI's error shape)
to a body over ``max_bytes``, before the app reads any of it when ``Content-Length`` says so,
or as soon as a chunked body passes the bound (the app then sees ``BodyTooLarge``, an HTTP
413 the app's error handlers turn into the same body). Nothing over the bound is buffered.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.gateway.defaults import DEFAULT_MAX_BODY_BYTES
from splitserve.gateway.errors import from_http_exception


class BodyTooLarge(HTTPException):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body is larger than {max_bytes} bytes")


class LimitBody:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            error = from_http_exception(BodyTooLarge(self.max_bytes))
            await error.response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)
