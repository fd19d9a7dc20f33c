"""The one place where domain errors become gRPC status codes (and back, for callers).

``status_of(error)`` maps an exception to (code, message, param); servicers use ``abort_with``
for failures before a stream produced anything; ``error_from_rpc`` turns a failed worker call
back into a domain error, so the callers of worker clients see domain errors only. The
offending field travels in the trailing metadata key ``splitserve-param`` so that the HTTP
gateway can fill OpenAI's ``param``.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import grpc

from splitserve.common.errors import (
    CapacityError,
    IncompatibleKvLayoutError,
    InvalidRequestError,
    MembershipStoreError,
    ModelLoadError,
    ModelNotFoundError,
    OverloadedError,
    SplitserveError,
    TransferError,
    WorkerCallError,
    WorkerUnavailableError,
)

T = TypeVar("T")

PARAM_METADATA_KEY = "splitserve-param"
RETRY_AFTER_METADATA_KEY = "retry-after-ms"
RETRY_PUSHBACK_METADATA_KEY = "grpc-retry-pushback-ms"
"""gRPC's own retry hint: a retrying client waits exactly this long; negative: do not retry."""


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status code, message, offending param or "") for a domain exception."""
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error), error.param or ""
    if isinstance(error, OverloadedError | CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), ""
    if isinstance(error, ModelNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(error), error.param
    if isinstance(error, IncompatibleKvLayoutError | ModelLoadError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(error), ""
    if isinstance(
        error, TransferError | WorkerUnavailableError | WorkerCallError | MembershipStoreError
    ):
        return grpc.StatusCode.UNAVAILABLE, str(error), ""
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}", ""


def retry_after_ms_of(error: BaseException) -> int | None:
    """An overload refusal's hint to retry after, in milliseconds; None for other errors."""
    return int(error.retry_after_s * 1000) if isinstance(error, OverloadedError) else None


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the status of ``error`` (raises, as ``context.abort`` does).

    An overload refusal carries its hint twice in the trailing metadata: ``retry-after-ms``
    (the gateway's HTTP ``Retry-After``, the client's ``ClientError.retry_after_s``) and
    ``grpc-retry-pushback-ms``, the wait of gRPC's own client retries. The pushback is -1
    (gRPC: do not retry) when the hint outlasts the call's deadline, so that the caller gets
    the refusal and its hint at once rather than DEADLINE_EXCEEDED at the deadline.
    """
    code, message, param = status_of(error)
    metadata: list[tuple[str, str]] = []
    if param:
        metadata.append((PARAM_METADATA_KEY, param))
    if (retry_after_ms := retry_after_ms_of(error)) is not None:
        remaining_s = context.time_remaining()
        outlasts_deadline = remaining_s is not None and retry_after_ms >= remaining_s * 1000
        metadata.append((RETRY_AFTER_METADATA_KEY, str(retry_after_ms)))
        metadata.append(
            (RETRY_PUSHBACK_METADATA_KEY, "-1" if outlasts_deadline else str(retry_after_ms))
        )
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(code, message)


def error_from_rpc(error: grpc.aio.AioRpcError) -> SplitserveError:
    """The domain error a failed internal call stands for.

    INVALID_ARGUMENT / OUT_OF_RANGE: ``InvalidRequestError`` (with the callee's ``param``);
    RESOURCE_EXHAUSTED: ``CapacityError``; FAILED_PRECONDITION: ``IncompatibleKvLayoutError``
    (the only refusal of a loaded worker that is not the request's fault); UNAVAILABLE:
    ``WorkerUnavailableError`` (the worker, or a worker it relayed for, is unreachable);
    anything else (DEADLINE_EXCEEDED, INTERNAL, CANCELLED, ...): ``WorkerCallError``.
    """
    code = error.code()
    details = error.details() or code.name
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        metadata = dict(error.trailing_metadata() or ())
        return InvalidRequestError(details, metadata.get(PARAM_METADATA_KEY) or None)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityError(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return IncompatibleKvLayoutError(details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return WorkerUnavailableError(f"UNAVAILABLE: {details}")
    return WorkerCallError(f"{code.name}: {details}")


async def call_internal(rpc: Awaitable[T]) -> T:
    """Await an internal unary call (a worker's or the membership service's); a failure
    raises its domain error (``error_from_rpc``)."""
    try:
        return await rpc
    except grpc.aio.AioRpcError as error:
        raise error_from_rpc(error) from None
