"""Domain errors of splitserve.

Every error a user can cause or meet derives from ``SplitserveError``; this module is the one
place they are defined (engine, transfer, workers and coordinator alike). ``proto/status.py``
maps them to gRPC status codes and the gateway to HTTP statuses, each in one place; the engine
never raises bare ``ValueError`` for user input.
"""

from __future__ import annotations


class SplitserveError(Exception):
    """Base class of every splitserve domain error."""


class InvalidRequestError(SplitserveError, ValueError):
    """The request itself is wrong (maps to INVALID_ARGUMENT / HTTP 400).

    ``param`` names the offending field (OpenAI's ``error.param``) when there is one.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """Prompt (plus requested output) does not fit the model's context window."""


class ModelNotFoundError(SplitserveError):
    """The request asks for a model this server does not serve (maps to NOT_FOUND / HTTP 404
    naming ``model``)."""

    param = "model"


class ModelLoadError(SplitserveError):
    """A model path is missing, unsupported or its files are corrupt."""


class CapacityError(SplitserveError):
    """The worker cannot take the request now (maps to RESOURCE_EXHAUSTED / HTTP 429)."""


class EngineStoppedError(SplitserveError):
    """The engine was shut down; the request did not complete."""


class WorkerUnavailableError(SplitserveError):
    """No worker can take the request now (none registered, all failed), or a worker could
    not be reached (its call ended UNAVAILABLE)."""


class WorkerCallError(SplitserveError):
    """A worker call failed for a reason that is neither the request's nor the worker being
    unreachable (deadline exceeded, internal error, cancelled by the worker)."""


class OverloadedError(SplitserveError):
    """Admission refused: too many requests in flight. ``retry_after_s`` hints when to retry;
    ``refuses_all_s`` > 0: any request arriving within that many seconds would be refused the
    same way, whatever it asks (a full admission queue), so a caller may refuse those itself."""

    def __init__(
        self, message: str, retry_after_s: float = 1.0, refuses_all_s: float = 0.0
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.refuses_all_s = refuses_all_s


# ---- KV transfer failures; each leaves both sides able to release the request's blocks ----


class MembershipStoreError(SplitserveError):
    """The membership store (etcd) refused a call or did not answer."""


class TransferError(SplitserveError):
    """A KV transfer failed (peer gone, transport error)."""


class TransferTimeoutError(TransferError):
    """A KV transfer made no progress within its deadline (e.g. the peer died)."""


class TransferAbortedError(TransferError):
    """The transfer was aborted locally (the request was cancelled)."""


class IncompatibleKvLayoutError(TransferError):
    """Two workers' KV caches differ (model, dtype, block size or layout): no transfer."""
