"""Turns per-step token updates into text deltas and finished completions.

Torch-free and transport-agnostic: the offline ``LLM`` API uses it in-process and the
coordinator uses it for streams it detokenizes. One ``RequestTracker`` per request holds the
incremental detokenizer (stop strings included) and accumulates tokens, text and logprobs.
When a stop string matches, ``process`` reports ``FinishReason.STOP`` and the caller must
finish the request in the engine (``EngineCore.finish_request``) so its blocks are freed.

Stop tokens (EOS or ``stop_token_ids``) are kept in ``token_ids`` but never rendered as text.
Stop strings, like stop tokens, are ignored until ``min_tokens`` tokens were generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.common.detokenizer import IncrementalDetokenizer, TokenDecoder
from splitserve.common.logprobs import TokenLogprob
from splitserve.common.request_update import FinishReason, RequestUpdate
from splitserve.common.sampling_params import SamplingParams


@dataclass(frozen=True)
class StreamChunk:
    """New output of one request: what a streaming client receives."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text: str
    """Text delta, safe to display (no broken UTF-8, no partial stop string)."""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request, if any."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """On the chunk of the first token, when asked: the prompt's (``StepOutput``)."""


@dataclass(frozen=True)
class CompletionOutput:
    """A finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """When asked: one record per prompt token after the first (``StepOutput``)."""


class RequestTracker:
    """Accumulates one request's output; see the module docstring for the contract."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        decoder: TokenDecoder,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.detokenizer = IncrementalDetokenizer(
            decoder,
            prompt_token_ids,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
        )
        self.min_tokens = params.min_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(
        self,
        update: RequestUpdate,
        logprobs: Sequence[TokenLogprob] = (),
        prompt_logprobs: Sequence[TokenLogprob] = (),
    ) -> StreamChunk:
        """Fold one engine update in; a stop-string match finishes the request here.
        ``prompt_logprobs`` are kept from the first update carrying them, and passed on in
        its chunk only (a request resumed elsewhere computes none again)."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id} already finished")
        new_prompt_logprobs: tuple[TokenLogprob, ...] = ()
        if prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = new_prompt_logprobs = tuple(prompt_logprobs)
        self.num_cached_tokens = update.num_cached_tokens
        new_ids = update.new_token_ids
        renderable = new_ids
        if update.stop_token_id is not None and new_ids and new_ids[-1] == update.stop_token_id:
            renderable = new_ids[:-1]
            self.stop_reason = update.stop_token_id
        self.token_ids.extend(new_ids)
        self.logprobs.extend(logprobs)
        # Like stop tokens, stop strings only count once min_tokens have been generated.
        check_stops = len(self.token_ids) >= self.min_tokens
        delta = self.detokenizer.add_tokens(renderable, check_stops)
        text = delta.text
        finish_reason = update.finish_reason
        if delta.stop_string is not None:
            finish_reason = FinishReason.STOP
            self.stop_reason = delta.stop_string
        elif finish_reason is not None:
            text += self.detokenizer.finish()
        self.finish_reason = finish_reason
        return StreamChunk(
            self.request_id,
            tuple(new_ids),
            text,
            tuple(logprobs),
            finish_reason,
            self.stop_reason,
            new_prompt_logprobs,
        )

    def abort(self) -> StreamChunk:
        """Finish as aborted (client cancel, shutdown); no further text is emitted."""
        self.finish_reason = FinishReason.ABORT
        return StreamChunk(self.request_id, (), "", (), FinishReason.ABORT)

    def result(self) -> CompletionOutput:
        """The finished completion; only valid once ``finished``."""
        if self.finish_reason is None:
            raise RuntimeError(f"request {self.request_id} has not finished")
        return CompletionOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids),
            text=self.detokenizer.text,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs),
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=list(self.prompt_logprobs),
        )
