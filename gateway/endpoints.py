"""The generation routes as data: what differs between ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``POST /v1/responses``, so that one handler
(``gateway/app.py:_generate``) serves all three.

An ``Endpoint`` says how a request body becomes the client's prompt and sampling
(``gateway/sampling.py``: everything asked is honoured or refused with a 400 naming the field)
and which response shape answers it (``gateway/responses.py``). Everything else (model check,
request id, latency targets, priority, streaming, errors, disconnects) is the handler's, the
same for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel

from splitserve.client import Sampling
from splitserve.gateway.reply import DATA_FRAMING, TYPED_FRAMING, SseFraming
from splitserve.gateway.responses import (
    ChatBuilder,
    CompletionBuilder,
    Extras,
    PromptShown,
    ResponseBuilder,
)
from splitserve.gateway.responses_events import ResponsesBuilder
from splitserve.gateway.responses_input import (
    responses_prompts,
    responses_sampling,
    responses_tools,
)
from splitserve.gateway.responses_schemas import ResponseObject, ResponsesRequest
from splitserve.gateway.sampling import (
    PromptArgs,
    chat_echo,
    chat_prompts,
    chat_sampling,
    completion_prompts,
    completion_sampling,
    request_tools,
    wants_echo_logprobs,
)
from splitserve.gateway.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    _SamplingFields,
)

Body = TypeVar("Body", bound=_SamplingFields)
"""An endpoint's request body (both share the sampling, streaming and placement fields)."""


@dataclass(frozen=True)
class Endpoint(Generic[Body]):
    """What one generation route does its own way. ``prompts`` then ``sampling`` read the
    body, each raising ``ApiError`` (400, naming the field) for what cannot be served."""

    path: str
    response_model: type[BaseModel]
    """The whole response's schema (OpenAPI)."""
    description: str
    """What a 200 answers (OpenAPI)."""
    id_prefix: str
    """The response's id is ``{id_prefix}-{request id}`` (OpenAI's ``cmpl-`` / ``chatcmpl-``)."""
    prompts: Callable[[Body], list[PromptArgs]]
    """The request's prompts (several only for completions' list of prompts)."""
    sampling: Callable[[Body], Sampling]
    builder: Callable[[str, str, Body, int, PromptShown], ResponseBuilder]
    """(response id, model, body, choice index, what it shows of its prompt) -> that choice's
    response builder (``gateway/choices.py`` keeps one per choice)."""
    framing: SseFraming = DATA_FRAMING
    """How its stream writes events (``gateway/reply.py``)."""
    usage_chunks: bool = True
    """Whether ``stream_options`` asks for usage chunks (chat's and completions' shape)."""


def _extras(body: CompletionRequest | ChatCompletionRequest, prompt: PromptShown) -> Extras:
    return Extras(body.prompt_logprobs is not None, prompt.token_ids)


def _completion_builder(
    response_id: str, model: str, body: CompletionRequest, index: int, prompt: PromptShown
) -> ResponseBuilder:
    echo_top = body.logprobs if wants_echo_logprobs(body) else None
    want_logprobs = body.logprobs is not None
    return CompletionBuilder(
        response_id, model, want_logprobs, index, prompt.echo_text, echo_top,
        _extras(body, prompt),
    )  # fmt: skip


def _chat_builder(
    response_id: str, model: str, body: ChatCompletionRequest, index: int, prompt: PromptShown
) -> ResponseBuilder:
    return ChatBuilder(
        response_id, model, bool(body.logprobs), index, request_tools(body),
        _extras(body, prompt), chat_echo(body), body._reasoning_format,
        body.include_reasoning is not False,
    )  # fmt: skip


COMPLETIONS = Endpoint[CompletionRequest](
    "/v1/completions",
    CompletionResponse,
    "A completion, or with `stream` an SSE stream of `data: <CompletionResponse chunk>` events "
    "ending in `data: [DONE]`.",
    "cmpl",
    completion_prompts,
    completion_sampling,
    _completion_builder,
)
"""``POST /v1/completions``: text or token ids, ``text_completion`` objects (16 tokens unless
``max_tokens`` says otherwise, as in vLLM)."""
CHAT = Endpoint[ChatCompletionRequest](
    "/v1/chat/completions",
    ChatCompletionResponse,
    "A chat completion, or with `stream` an SSE stream of `data: <ChatCompletionChunk>` "
    "events ending in `data: [DONE]`.",
    "chatcmpl",
    chat_prompts,
    chat_sampling,
    _chat_builder,
)
"""``POST /v1/chat/completions``: messages, ``chat.completion`` objects (without
``max_tokens`` up to the coordinator's ``--default-max-tokens``)."""


def _responses_builder(
    response_id: str, model: str, body: ResponsesRequest, index: int, prompt: PromptShown
) -> ResponseBuilder:
    return ResponsesBuilder(response_id, model, body, responses_tools(body))


RESPONSES = Endpoint[ResponsesRequest](
    "/v1/responses",
    ResponseObject,
    "A response, or with `stream` an SSE stream of typed events (`event: response.created`, "
    "..., `response.output_text.delta`, ..., `response.completed`), each `data:` an object "
    "with its `type` and `sequence_number`.",
    "resp",
    responses_prompts,
    responses_sampling,
    _responses_builder,
    TYPED_FRAMING,
    usage_chunks=False,
)
"""``POST /v1/responses``: OpenAI's Responses API as the chat completion it amounts to
(``gateway/responses_input.py``), answered as a ``response`` object or its events
(``gateway/responses_events.py``)."""
