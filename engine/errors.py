"""Domain errors of splitserve.

Every error a user can cause or meet derives from ``SplitserveError``. Servicers and the HTTP
gateway map these classes to gRPC status codes / HTTP statuses in exactly one place each; the
engine never raises bare ``ValueError`` for user input.
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


class ModelLoadError(SplitserveError):
    """A model path is missing, unsupported or its files are corrupt."""


class CapacityError(SplitserveError):
    """The worker cannot take the request now (maps to RESOURCE_EXHAUSTED / HTTP 429)."""
