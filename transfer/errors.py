"""Transfer failures; each leaves both sides able to release the request's blocks."""

from __future__ import annotations

from splitserve.engine.errors import SplitserveError


class TransferError(SplitserveError):
    """A KV transfer failed (peer gone, transport error)."""


class TransferTimeoutError(TransferError):
    """A KV transfer made no progress within its deadline (e.g. the peer died)."""


class TransferAbortedError(TransferError):
    """The transfer was aborted locally (the request was cancelled)."""


class IncompatibleKvLayoutError(TransferError):
    """Two workers' KV caches differ (model, dtype, block size or layout): no transfer."""
