"""What one engine step produced for one request, and why a request ended (torch-free).

The scheduler emits a ``RequestUpdate`` per request that sampled; the engine streams them to
its callers as ``StepOutput`` (update + logprobs), the decode worker sends them over the wire
(every token once, the first included) and the coordinator folds them into its
``RequestTracker``. Counts are cumulative for the request on that engine (for a resumed
request: since it was resumed there).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

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
    """One request's progress in one step (or in consecutive steps, ``followed_by``)."""

    update: RequestUpdate
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """On the output with a request's first token, when its params asked for
    ``prompt_logprobs``: one record per prompt token after the first, in order (record ``i``
    describes prompt token ``i + 1``); empty on every other output."""

    def followed_by(self, later: StepOutput) -> StepOutput:
        """This output and the same request's next one as one output: both steps' tokens and
        logprobs in order (the prompt's logprobs from the one carrying them), the later one's
        cumulative counts, finish and stop token. What a
        relay that fell behind sends instead of the two (one message for both). Raises
        ``ValueError`` when ``later`` is another request's or this one already finished."""
        if later.update.request_id != self.update.request_id:
            raise ValueError("followed_by: outputs of two requests")
        if self.update.finish_reason is not None:
            raise ValueError("followed_by: nothing follows a finished request's last output")
        tokens = self.update.new_token_ids + later.update.new_token_ids
        update = replace(later.update, new_token_ids=tokens)
        prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        return StepOutput(update, self.logprobs + later.logprobs, prompt_logprobs)
