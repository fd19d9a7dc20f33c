"""What a failed call looks like to a client: ``ClientError``; when to try again: ``RetryPolicy``.

One exception type for every failure the coordinator reports, whether as a call status (before
anything was streamed) or as an in-stream ``Error`` message (after tokens were streamed). Its
``param`` is the offending request field (trailing metadata ``splitserve-param`` or
``Error.param``), its ``retry_after_s`` the server's hint for overload refusals (trailing
metadata ``retry-after-ms``). ``RetryPolicy`` is data only: gRPC applies it (see
``splitserve.client.retry``). Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import grpc

from splitserve.proto.splitserve.v1 import common_pb2
from splitserve.proto.status import PARAM_METADATA_KEY, RETRY_AFTER_METADATA_KEY

_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class _FailedCall(Protocol):
    """What both ``grpc.aio.AioRpcError`` and a failed sync call offer."""

    def code(self) -> grpc.StatusCode: ...
    def details(self) -> str | None: ...
    def trailing_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...


class ClientError(Exception):
    """A call failed: the gRPC status ``code``, a human ``message`` and, where known, the
    offending request field ``param`` (OpenAI's ``error.param``), the server's retry hint
    ``retry_after_s`` and the ``request_id`` of the stream it ended.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.request_id = request_id

    def __str__(self) -> str:
        text = f"{self.code.name}: {self.message}"
        return f"{text} (param: {self.param})" if self.param else text

    @classmethod
    def from_call(cls, call: _FailedCall, request_id: str | None = None) -> ClientError:
        """The error of a call that ended with a non-OK status (sync or ``grpc.aio``)."""
        metadata = _metadata_dict(call.trailing_metadata())
        code = call.code()
        return cls(
            code,
            call.details() or code.name,
            param=metadata.get(PARAM_METADATA_KEY) or None,
            retry_after_s=_retry_after_s(metadata.get(RETRY_AFTER_METADATA_KEY)),
            request_id=request_id,
        )

    @classmethod
    def from_message(cls, error: common_pb2.Error, request_id: str | None = None) -> ClientError:
        """The error of an in-stream ``Error`` message (its ``code`` is a status number)."""
        code = _CODES_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
        return cls(
            code, error.message or code.name, param=error.param or None, request_id=request_id
        )


def _metadata_dict(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    result: dict[str, str] = {}
    for key, value in metadata or ():
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        result[key.lower()] = text
    return result


def _retry_after_s(value: str | None) -> float | None:
    """``retry-after-ms`` in seconds; None when absent or malformed."""
    if value is None:
        return None
    try:
        milliseconds = float(value)
    except ValueError:
        return None
    return max(0.0, milliseconds / 1000.0)


MAX_ATTEMPTS = 5
"""gRPC's cap on ``retryPolicy.maxAttempts``: it silently clamps larger values to 5, so a
``RetryPolicy`` refuses them instead of promising attempts that would never be made."""


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed call is tried again; gRPC does the retrying (``splitserve.client.retry``
    turns this policy into the channel's service-config ``retryPolicy``).

    Only failures that are safe to repeat are retried: UNAVAILABLE, and RESOURCE_EXHAUSTED when
    ``retry_overloaded``, and for streams only before the first response (so never once a chunk
    was delivered). The wait before attempt ``n + 1`` is
    ``min(max_backoff_s, initial_backoff_s * multiplier**(n - 1))`` scaled by gRPC's random
    factor in ``[0.8, 1.2]``, or exactly the server's hint (``grpc-retry-pushback-ms``, sent with
    ``retry-after-ms``) for RESOURCE_EXHAUSTED when it sent one.

    Invariant: ``1 <= max_attempts <= MAX_ATTEMPTS``; backoff times are >= 0 (gRPC needs
    > 0, so a 0 becomes gRPC's 1 ms resolution); ``multiplier >= 1``.
    """

    max_attempts: int = 4
    """Attempts in all, the first included (1: never retry; at most ``MAX_ATTEMPTS``)."""
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    retry_overloaded: bool = True
    """Retry RESOURCE_EXHAUSTED (admission refused) as well as UNAVAILABLE."""
    jitter: float = 0.1
    """Not honoured any more, kept so that existing callers construct (validated as before).

    It scaled each backoff by a random factor in ``[1 - jitter, 1 + jitter]``; gRPC's retries
    have no setting for it and always scale by a factor in ``[0.8, 1.2]`` (grpcio's C-core,
    measured; the mean wait is the backoff, as before), i.e. as if ``jitter`` were 0.2.
    """

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= MAX_ATTEMPTS:
            raise ValueError(
                f"max_attempts must be in [1, {MAX_ATTEMPTS}] (gRPC's retry limit),"
                f" got {self.max_attempts}"
            )
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must be >= 0")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    @classmethod
    def never(cls) -> RetryPolicy:
        """No retries at all."""
        return cls(max_attempts=1)


DEFAULT_RETRY = RetryPolicy()
"""The clients' default policy: up to 4 attempts, waits of up to 0.1 s doubling up to 2 s."""
