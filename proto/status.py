"""The one place where domain errors become gRPC status codes (and back, for callers).

``status_of(error)`` maps an exception to (code, message, param); servicers use ``abort_with``
for failures before a stream produced anything. The offending field travels in the trailing
metadata key ``splitserve-param`` so that the HTTP gateway can fill OpenAI's ``param``.
"""

from __future__ import annotations

import grpc

from splitserve.common.errors import (
    CapacityError,
    IncompatibleKvLayoutError,
    InvalidRequestError,
    ModelLoadError,
    OverloadedError,
    TransferError,
    WorkerUnavailableError,
)

PARAM_METADATA_KEY = "splitserve-param"
RETRY_AFTER_METADATA_KEY = "retry-after-ms"


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status code, message, offending param or "") for a domain exception."""
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error), error.param or ""
    if isinstance(error, OverloadedError | CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), ""
    if isinstance(error, IncompatibleKvLayoutError | ModelLoadError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(error), ""
    if isinstance(error, TransferError | WorkerUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(error), ""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details() or str(error.code()), ""
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}", ""


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the status of ``error`` (raises, as ``context.abort`` does)."""
    code, message, param = status_of(error)
    metadata: list[tuple[str, str]] = []
    if param:
        metadata.append((PARAM_METADATA_KEY, param))
    if isinstance(error, OverloadedError):
        metadata.append((RETRY_AFTER_METADATA_KEY, str(int(error.retry_after_s * 1000))))
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(code, message)
