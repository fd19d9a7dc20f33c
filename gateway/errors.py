"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

``ApiError`` is what handlers raise; ``from_client_error`` maps a coordinator status to the
HTTP status a user of the OpenAI API expects (INVALID_ARGUMENT and FAILED_PRECONDITION -> 400,
UNAUTHENTICATED -> 401, PERMISSION_DENIED -> 403, NOT_FOUND -> 404, RESOURCE_EXHAUSTED -> 429
with ``Retry-After`` (but 413 for gRPC's message size limit), UNAVAILABLE -> 503,
DEADLINE_EXCEEDED -> 504, anything else 500).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from splitserve.client import ClientError


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unauthorized(message: str) -> ApiError:
    """401 in OpenAI's shape, asking for a bearer token."""
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


@contextlib.contextmanager
def client_errors_as_api_errors() -> Iterator[None]:
    """Around a client call whose failure is the HTTP answer: its ``ClientError`` raised as
    the ``ApiError`` ``from_client_error`` makes of it."""
    try:
        yield
    except ClientError as error:
        raise from_client_error(error) from error


def from_client_error(error: ClientError) -> ApiError:
    code, message, param = error.code, error.message, error.param
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, message, param=param)
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return unauthorized(message)
    if code is grpc.StatusCode.NOT_FOUND:
        return ApiError(404, message, param=param, code="not_found")
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return ApiError(403, message, type="permission_error", code="permission_denied")
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return ApiError(400, message, param=param, code="failed_precondition")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in message:
        # gRPC's message size limit, not overload: retrying can never succeed
        return ApiError(413, message, code="request_too_large")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_after = max(1, math.ceil(error.retry_after_s or 1.0))
        return ApiError(
            429,
            message,
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after)},
        )
    if code is grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, message, type="service_unavailable", code="unavailable")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, message, type="timeout", code="deadline_exceeded")
    if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED):
        return ApiError(503, message, type="service_unavailable", code=code.name.lower())
    return ApiError(500, message, type="server_error", code=code.name.lower())


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def from_http_exception(error: StarletteHTTPException) -> ApiError:
    """Starlette's own errors (no route, wrong method, a body that cannot be parsed or is too
    large) in OpenAI's shape, with their status; their headers (``Allow``) kept."""
    status = error.status_code
    return ApiError(
        status,
        str(error.detail),
        type="invalid_request_error" if status < 500 else "server_error",
        code=_HTTP_CODES.get(status, "invalid_body" if status == 400 else None),
        headers=dict(error.headers or {}),
    )


def from_validation_error(error: RequestValidationError) -> ApiError:
    """A 400 naming the first offending field (``messages.0.role``) or the malformed JSON."""
    first = error.errors()[0] if error.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('msg', '')}", code="invalid_json")
    # pydantic names the union member a value failed against ("str", "list[str]"): drop those
    location = [
        part
        for part in location
        if part not in ("str", "int", "bool", "float") and not part.startswith(("list[", "dict["))
    ]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
    return ApiError(400, message, param=param)
