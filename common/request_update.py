"""What one engine step produced for one request, and why a request ended (torch-free).

The scheduler emits a ``RequestUpdate`` per request that sampled; the engine streams them to
its callers as ``StepOutput`` (update + logprobs), the decode worker sends them over the wire
(every token once, the first included) and the coordinator folds them into its
``RequestTracker``. Counts are cumulative for the request on that engine (for a resumed
request: since it was resumed there).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from splitserve.common.logprobs import TokenLogprob


class FinishReason(enum.Enum):
    """Why generation ended, as reported to clients (OpenAI ``finish_reason``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class RequestUpdate:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    stop_token_id: int | None = None


@dataclass(frozen=True)
class StepOutput:
    """One request's progress in one step."""

    update: RequestUpdate
    logprobs: tuple[TokenLogprob, ...] = ()
