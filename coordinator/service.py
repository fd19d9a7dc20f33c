"""The coordinator's domain: admission, tokenization, the worker registry and request flows.

``Coordinator.generate`` validates and tokenizes a request (text, chat messages rendered with
the model's template, or token ids), admits it (at most ``max_inflight`` requests; beyond that
``OverloadedError`` with a retry hint) and runs its ``RequestFlow``. ``abort`` cancels a
running flow by id, which ends its worker calls and frees its blocks; only the caller (API
key) that started a request may abort it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from splitserve.common.api_keys import ANONYMOUS, Caller
from splitserve.common.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    OverloadedError,
    WorkerUnavailableError,
)
from splitserve.common.membership import Role
from splitserve.common.output_processor import StreamChunk
from splitserve.common.prompt import Prompt, check_in_vocab, encode_prompt, min_prompt_tokens
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tokenizer import Tokenizer
from splitserve.coordinator.flow import FlowConfig, RequestFlow
from splitserve.coordinator.registry import WorkerRegistry
from splitserve.coordinator.router import Router, RoutingConfig
from splitserve.proto.cluster_access import ClusterAccess
from splitserve.proto.worker_clients import WorkerChannels


@dataclass(frozen=True)
class CoordinatorConfig:
    model_name: str
    max_inflight: int = 1024
    """Requests admitted at once; more get RESOURCE_EXHAUSTED with a retry hint."""
    routing: RoutingConfig = RoutingConfig()
    flow: FlowConfig = FlowConfig()


@dataclass(frozen=True)
class _Running:
    flow: RequestFlow
    caller: Caller
    """Who started it: the only one who may abort it."""


class Coordinator:
    def __init__(
        self, config: CoordinatorConfig, tokenizer: Tokenizer, access: ClusterAccess
    ) -> None:
        """``access``: how the coordinator's calls to workers reach them (credential, TLS)."""
        self.config = config
        self.tokenizer = tokenizer
        self.registry = WorkerRegistry()
        self.router = Router(self.registry, config.routing)
        self.channels = WorkerChannels(access)
        self._running: dict[str, _Running] = {}
        self.flow_observer: Callable[[RequestFlow], None] | None = None
        """Called with each flow when it ends (metrics); must not raise."""

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt; raises ``InvalidRequestError`` for empty or malformed input."""
        return encode_prompt(self.tokenizer, prompt)

    @property
    def max_model_len(self) -> int:
        lengths = [w.max_model_len for w in self.registry.workers(Role.DECODE)]
        return max(lengths, default=0)

    @property
    def fill_limit(self) -> int:
        """Tokens (prompt + output) every decode worker can hold: its context window capped by
        its KV capacity; what a request without ``max_tokens`` may grow to."""
        limits = [
            min(w.max_model_len, w.num_blocks * w.block_size)
            for w in self.registry.workers(Role.DECODE)
        ]
        return min(limits, default=0)

    @property
    def ready(self) -> bool:
        return bool(self.registry.workers(Role.DECODE))

    def _check_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if limit and num_prompt_tokens + params.max_tokens > limit:
            raise ContextLengthExceededError(
                f"this model's context is {limit} tokens; the prompt has {num_prompt_tokens} "
                f"and max_tokens is {params.max_tokens}",
                "max_tokens" if num_prompt_tokens < limit else "prompt",
            )

    def _check_length_before_tokenizing(
        self, prompt: Prompt, params: SamplingParams, fill_context: bool
    ) -> None:
        """Refuse a prompt whose lower bound on tokens (``min_prompt_tokens``, no tokenizing)
        already leaves no room in the context: a huge prompt costs nothing."""
        limit = self.max_model_len
        at_least = min_prompt_tokens(self.tokenizer, prompt)
        wanted = 1 if fill_context else params.max_tokens
        if limit and at_least + wanted > limit:
            raise ContextLengthExceededError(
                f"this model's context is {limit} tokens; the prompt has at least {at_least}",
                "prompt",
            )

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        fill_context: bool = False,
        caller: Caller = ANONYMOUS,
        continue_after: Sequence[int] = (),
    ) -> AsyncIterator[tuple[RequestFlow, StreamChunk]]:
        """Stream a request's chunks (with its flow, for usage figures).

        ``fill_context``: the caller set no ``max_tokens``; generate up to ``fill_limit``.
        ``caller``: who asks; the only one ``abort`` lets end the request.
        ``continue_after``: completion tokens another coordinator already streamed to the
        client (``RequestFlow.replay``); the stream carries only what follows them, unless
        they already finish the request (then one final chunk without text).
        Every flow, also one that fails, is passed to ``flow_observer`` when it ends.
        """
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._running:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
        self._check_length_before_tokenizing(prompt, params, fill_context)
        # tokenizing (and chat templating) a long prompt takes a while: not on the event loop
        prompt_ids = await asyncio.to_thread(self.encode, prompt)
        if not self.ready:
            raise WorkerUnavailableError("no decode worker is registered yet")
        if fill_context and self.fill_limit > len(prompt_ids):
            params = dataclasses.replace(params, max_tokens=self.fill_limit - len(prompt_ids))
        self._check_length(len(prompt_ids), params)
        if len(self._running) >= self.config.max_inflight:
            raise OverloadedError(
                f"{len(self._running)} requests in flight (limit {self.config.max_inflight})"
            )
        flow = RequestFlow(
            request_id,
            prompt_ids,
            params,
            self.tokenizer,
            self.router,
            self.channels,
            self.config.flow,
        )
        self._running[request_id] = _Running(flow, caller)
        try:
            if continue_after:
                replayed = self._replay(flow, continue_after)
                if replayed is not None:
                    yield flow, replayed
            async with contextlib.aclosing(flow.run()) as chunks:
                async for chunk in chunks:
                    yield flow, chunk
        finally:
            self._running.pop(request_id, None)
            if self.flow_observer is not None:
                self.flow_observer(flow)

    def _replay(self, flow: RequestFlow, token_ids: Sequence[int]) -> StreamChunk | None:
        """Replay tokens another coordinator streamed; the finishing chunk (without the text
        the client has) when they end the request, else None."""
        check_in_vocab(token_ids, self.tokenizer.vocab_size, "token ids", "continue_after")
        chunk = flow.replay(list(token_ids))
        if chunk.finish_reason is None:
            return None
        return dataclasses.replace(chunk, new_token_ids=(), text="", logprobs=())

    def abort(self, request_id: str, caller: Caller = ANONYMOUS) -> bool:
        """Cancel a running request that ``caller`` started (its stream ends); False when no
        such request runs, or another caller's does (which is not told apart: that one keeps
        running)."""
        running = self._running.get(request_id)
        if running is None or running.caller.key_digest != caller.key_digest:
            return False
        running.flow.abort()
        return True
