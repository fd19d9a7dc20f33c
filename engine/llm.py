"""Offline Python API: generate for a list of prompts or chats, or stream tokens as they come.

    llm = LLM()                                    # the default model, bf16 where native
    [out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    for chunk in llm.stream(["Tell me a story"], SamplingParams(max_tokens=64)):
        print(chunk.text, end="", flush=True)

All prompts of a call are validated before any is queued, so a bad one (empty, too long,
invalid parameters) raises ``InvalidRequestError`` and nothing else is lost. Every call leaves
the engine idle with all KV blocks free, also when a stream is closed early.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence

from splitserve.common.chat_messages import ChatMessage, template_messages
from splitserve.common.errors import InvalidRequestError
from splitserve.common.output_processor import CompletionOutput, RequestTracker, StreamChunk
from splitserve.common.prompt import ChatMessages, TextOrTokens, encode_prompt
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.engine_core import EngineCore

Prompt = TextOrTokens


class LLM:
    """One in-process engine driven synchronously by the caller's thread."""

    def __init__(
        self,
        model: str = "default",
        *,
        config: EngineConfig | None = None,
        checkpoint: LoadedCheckpoint | None = None,
    ) -> None:
        self.engine = EngineCore(config or EngineConfig(model=ModelConfig(model=model)), checkpoint)
        self._ids = itertools.count()
        self._active = False
        """True while a generate/stream call drives the engine (one at a time)."""

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion as one concurrent batch; results in prompt order."""
        trackers = self._submit(_as_prompt_list(prompts), params)
        for _ in self._run(trackers):
            pass
        return [tracker.result() for tracker in trackers]

    def chat(
        self,
        conversations: ChatMessages | Sequence[ChatMessages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Apply the model's chat template (with the assistant prompt) and generate."""
        return self.generate(self.render_chats(conversations), params)

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamChunk]:
        """Yield each request's new tokens and text as the engine produces them."""
        trackers = self._submit(_as_prompt_list(prompts), params)
        yield from self._run(trackers)

    def render_chats(self, conversations: ChatMessages | Sequence[ChatMessages]) -> list[str]:
        """Prompt texts for one conversation or a list of them (chat template applied)."""
        if not conversations:
            raise InvalidRequestError("messages must not be empty", "messages")
        if isinstance(conversations[0], Mapping | ChatMessage):
            conversations = [conversations]  # type: ignore[list-item]
        template = self.tokenizer.chat_template
        return [
            self.tokenizer.apply_chat_template(template_messages(c, template))  # type: ignore[arg-type]
            for c in conversations
        ]

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (text is tokenized with the model's special tokens)."""
        return encode_prompt(self.tokenizer, prompt)

    # ---- internals -------------------------------------------------------------------------

    def _submit(
        self,
        prompts: list[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestTracker]:
        params_list = _as_params_list(params, len(prompts))
        if self._active:
            raise InvalidRequestError(
                "another generate/stream call of this LLM is still running; finish or close it"
            )
        encoded = [self.encode_prompt(prompt) for prompt in prompts]
        for token_ids, sampling in zip(encoded, params_list, strict=True):
            self.engine.validate_request(token_ids, sampling)
        trackers = []
        for token_ids, sampling in zip(encoded, params_list, strict=True):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, token_ids, sampling)
            trackers.append(RequestTracker(request_id, token_ids, sampling, self.tokenizer))
        return trackers

    def _run(self, trackers: list[RequestTracker]) -> Iterator[StreamChunk]:
        by_id = {tracker.request_id: tracker for tracker in trackers}
        self._active = True
        try:
            while any(not tracker.finished for tracker in trackers):
                for step_output in self.engine.step():
                    tracker = by_id[step_output.update.request_id]
                    chunk = tracker.process(
                        step_output.update, step_output.logprobs, step_output.prompt_logprobs
                    )
                    if chunk.finish_reason is not None and step_output.update.finish_reason is None:
                        self.engine.finish_request(tracker.request_id)  # stop string matched
                    yield chunk
        finally:
            self._active = False
            for tracker in trackers:
                if not tracker.finished:
                    self.engine.abort_request(tracker.request_id)
                    tracker.abort()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single prompt given as token ids
    return list(prompts)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
