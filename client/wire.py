"""Client values <-> coordinator proto messages: the only module of the client that reads or
builds ``coordinator_pb2`` messages (torch-free)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

import grpc

from splitserve.client.errors import ClientError
from splitserve.client.types import (
    ChatMessage,
    ChatTemplate,
    Chunk,
    Finish,
    LatencyTargets,
    ModelInfo,
    PromptToken,
    Sampling,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2

MessageLike = ChatMessage | Mapping[str, str]
"""A chat turn: a ``ChatMessage`` (tool call ids and calls included) or a
``{"role": ..., "content": ...}`` dict."""

COORDINATOR_SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
"""The full service name, as the coordinator reports it in ``grpc.health.v1``."""


def new_request_id() -> str:
    return uuid.uuid4().hex


def generate_request(
    prompt: str | None,
    messages: Sequence[MessageLike] | None,
    token_ids: Sequence[int] | None,
    sampling: Sampling | None,
    request_id: str | None,
    priority: int = 0,
    targets: LatencyTargets | None = None,
    traceparent: str = "",
    session_id: str = "",
    model: str = "",
    add_special_tokens: bool | None = None,
    chat_template: ChatTemplate | None = None,
    truncate_prompt_tokens: int | None = None,
) -> coordinator_pb2.GenerateRequest:
    """The request for exactly one of ``prompt``, ``messages`` or ``token_ids``
    (``request_id``: None or "" for a fresh one, ``new_request_id``; ``priority``: admission
    order among waiting requests, higher first; ``targets``: the request's own latency
    targets, None for the coordinator's; ``traceparent``: a W3C trace context whose trace
    the request's spans join; ``session_id``: its session's, whose requests every coordinator
    sends to the same decode worker while that one has room; ``model``: the model asked for,
    "" for the coordinator's; ``add_special_tokens``: whether the prompt's text gets the
    tokenizer's special tokens, None for the default: yes for text, no for a chat;
    ``chat_template``: how ``messages`` are rendered, None for the template's defaults;
    ``truncate_prompt_tokens``: keep only the prompt's last N tokens, -1 as many as the
    context takes, None all).

    Raises ``ValueError`` unless exactly one is given, ``TypeError`` for a malformed message and
    ``ClientError`` (INVALID_ARGUMENT) for sampling values the wire cannot carry.
    """
    candidates = (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
    given = [name for name, value in candidates if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, messages, token_ids (got {given or 'none'})")
    request = coordinator_pb2.GenerateRequest(
        request_id=request_id or new_request_id(),
        priority=priority,
        traceparent=traceparent,
        session_id=session_id,
        model=model,
        add_special_tokens=add_special_tokens,
        truncate_prompt_tokens=truncate_prompt_tokens,
    )
    if sampling is not None:
        request.sampling.CopyFrom(sampling.to_proto())
    if targets is not None:
        request.latency_targets.CopyFrom(targets.to_proto())
    if chat_template is not None and messages is None:
        raise ValueError("chat_template applies to messages only")
    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        request.chat.CopyFrom(_chat(messages, chat_template))
    else:
        assert token_ids is not None
        request.token_ids.CopyFrom(common_pb2.TokenIds(ids=list(token_ids)))
    return request


def continuation(
    request: coordinator_pb2.GenerateRequest, streamed_token_ids: Sequence[int]
) -> coordinator_pb2.GenerateRequest:
    """``request`` again, to go on after ``streamed_token_ids`` (the completion tokens the
    client already has): the coordinator generates only what follows them (when a stream
    goes on: ``continuation.StreamContinuation``)."""
    again = coordinator_pb2.GenerateRequest()
    again.CopyFrom(request)
    again.continue_after.CopyFrom(common_pb2.TokenIds(ids=list(streamed_token_ids)))
    return again


def _message(message: MessageLike) -> coordinator_pb2.ChatMessage:
    if isinstance(message, ChatMessage):
        return convert.chat_message_to_proto(message)
    try:
        role, content = message["role"], message.get("content")
    except (KeyError, TypeError, AttributeError) as error:
        raise TypeError(f"a chat message needs a role and content, got {message!r}") from error
    if not isinstance(role, str) or not isinstance(content, str | None):
        raise TypeError(f"chat message role and content must be strings, got {message!r}")
    return coordinator_pb2.ChatMessage(role=role, content=content or "")


def stream_item(response: coordinator_pb2.GenerateResponse, request_id: str) -> Chunk | Finish:
    """A ``Chunk`` or ``Finish`` of one streamed response; raises ``ClientError`` for an
    in-stream error message (and for a response with no payload, which a server never sends).
    """
    request_id = response.request_id or request_id
    kind = response.WhichOneof("payload")
    if kind == "chunk":
        chunk = response.chunk
        return Chunk(
            request_id=request_id,
            text=chunk.text,
            token_ids=tuple(chunk.token_ids),
            logprobs=tuple(_logprob(lp) for lp in chunk.logprobs),
            usage=usage(response.usage),
            prompt_logprobs=tuple(_logprob(lp) for lp in chunk.prompt_logprobs),
            prompt_first_token=(
                PromptToken(chunk.prompt_first_token.token_id, chunk.prompt_first_token.text)
                if chunk.HasField("prompt_first_token")
                else None
            ),
        )
    if kind == "completion":
        completion = response.completion
        return Finish(
            request_id=request_id,
            finish_reason=finish_reason(completion.finish_reason),
            stop_reason=_stop_reason(completion),
            usage=usage(response.usage),
        )
    if kind == "error":
        raise ClientError.from_message(response.error, request_id)
    raise ClientError(grpc.StatusCode.INTERNAL, "response without payload", request_id=request_id)


def finish_reason(value: int) -> str:
    """``FINISH_REASON_STOP`` -> "stop", "length", "abort" (and "unspecified")."""
    return common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _stop_reason(completion: coordinator_pb2.Completion) -> str | int | None:
    kind = completion.WhichOneof("stop_reason")
    if kind == "stop_string":
        return completion.stop_string
    if kind == "stop_token_id":
        return completion.stop_token_id
    return None


def usage(message: common_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=message.prompt_tokens,
        completion_tokens=message.completion_tokens,
        cached_tokens=message.cached_tokens,
    )


def _logprob(message: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=message.token_id,
        logprob=message.logprob,
        rank=message.rank,
        text=message.text,
        top=tuple(TopLogprob(t.token_id, t.logprob, t.text) for t in message.top),
    )


def tokenize_request(
    prompt: str | None,
    messages: Sequence[MessageLike] | None,
    add_special_tokens: bool | None = None,
    chat_template: ChatTemplate | None = None,
) -> coordinator_pb2.TokenizeRequest:
    """The request for exactly one of ``prompt`` or ``messages`` (``ValueError`` else);
    ``add_special_tokens`` and ``chat_template`` as ``generate_request``'s."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt, messages")
    if chat_template is not None and messages is None:
        raise ValueError("chat_template applies to messages only")
    request = coordinator_pb2.TokenizeRequest(add_special_tokens=add_special_tokens)
    if prompt is not None:
        request.text = prompt
    else:
        assert messages is not None
        request.chat.CopyFrom(_chat(messages, chat_template))
    return request


def _chat(
    messages: Sequence[MessageLike], template: ChatTemplate | None
) -> coordinator_pb2.ChatPrompt:
    converted = [_message(m) for m in messages]
    if template is None:
        return coordinator_pb2.ChatPrompt(messages=converted)
    return template.to_proto(converted)


def model_info(message: coordinator_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model=message.model,
        max_model_len=message.max_model_len,
        vocab_size=message.vocab_size,
        eos_token_ids=tuple(message.eos_token_ids),
        dtype=message.dtype,
        aliases=tuple(message.aliases),
        checkpoint=message.checkpoint,
        adapters=tuple(message.adapters),
        tool_call_format=message.tool_call_format or "json",
        reasoning_format=message.reasoning_format,
    )
