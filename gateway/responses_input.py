"""A Responses API request (``POST /v1/responses``) as the chat completion it amounts to, so
that the chat path's prompt, sampling, tools and structured outputs serve it unchanged
(``gateway/sampling.py``).

Contract of ``as_chat``:
- ``instructions`` becomes a system message before the input; a ``previous_response_id``'s
  conversation (its stored input and output items: ``gateway/stored_responses.py``, read
  onto the body as ``_previous`` before) or a ``conversation``'s items
  (``gateway/conversations.py``, read as ``_conversation``) come next; ``input`` text is one
  user message; a list of items becomes messages in order: a message item (``role`` user, system,
  developer or assistant; ``content`` text or ``input_text`` / ``output_text`` parts) as that
  message, consecutive ``function_call`` items as one assistant message's tool calls, a
  ``function_call_output`` item as the tool message answering its ``call_id``;
- function ``tools`` and ``tool_choice`` in the Responses shape (name at the top level) become
  chat's (under ``function``); ``text.format`` becomes ``response_format``;
  ``max_output_tokens`` is ``max_tokens`` (400 when both are sent and differ);
- every other sampling field is the chat body's as sent; ``include``'s
  ``message.output_text.logprobs`` is chat's ``logprobs`` (``top_logprobs`` alternatives);
  ``reasoning.effort`` chat's ``reasoning_effort`` (low, medium, high);
- anything it cannot serve is a 400 naming the field or item (``input.2.content.0``): other
  item or part types (images, files, reasoning, references to stored items), other tool types,
  and the declared fields that ask for stored state or features splitserve lacks
  (any other ``include``, reasoning ``summary`` and other efforts,
  ``truncation: auto``, ``top_logprobs`` without the logprobs ``include``,
  ``max_tool_calls``, ``prompt``).
"""

from __future__ import annotations

from typing import Any

from splitserve.client import Sampling
from splitserve.client.tools import ToolPlan
from splitserve.gateway.errors import invalid
from splitserve.gateway.metadata import checked_metadata
from splitserve.gateway.responses_schemas import ResponsesRequest
from splitserve.gateway.sampling import PromptArgs, chat_prompts, chat_sampling, request_tools
from splitserve.gateway.schemas import (
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    MessageToolCall,
    _SamplingFields,
)
from splitserve.gateway.stored_responses import conversation

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_EFFORTS = ("low", "medium", "high")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The one ``include`` served: each output token's logprob (and ``top_logprobs`` others)."""
_SHARED_FIELDS = frozenset(_SamplingFields.model_fields) - {"n", "best_of", "stream_options"}
"""The sampling fields a Responses body passes on to the chat body as they are."""


def responses_prompts(body: ResponsesRequest) -> list[PromptArgs]:
    return chat_prompts(as_chat(body))


def responses_sampling(body: ResponsesRequest) -> Sampling:
    return chat_sampling(as_chat(body))


def responses_tools(body: ResponsesRequest) -> ToolPlan | None:
    return request_tools(as_chat(body))


def as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion ``body`` amounts to (module docstring), made once per request and
    kept on it; ``ApiError`` 400 for what cannot be served."""
    if body._chat is None:
        body._chat = _chat_of(body)
    return body._chat


def _chat_of(body: ResponsesRequest) -> ChatCompletionRequest:
    _refuse_unserved(body)
    checked_metadata(body.metadata)  # kept with the response (400 past OpenAI's bounds)
    messages = [] if body.instructions is None else [_message("system", body.instructions)]
    if body._previous is not None:
        _add_messages(messages, conversation(body._previous), "previous_response_id")
    if body._conversation is not None:
        _add_messages(messages, body._conversation.context(), "conversation")
    _add_messages(messages, body.input, "input")
    if not messages:
        raise invalid("input must hold at least one message", "input")
    if body.max_tokens and body.max_output_tokens and body.max_tokens != body.max_output_tokens:
        raise invalid("max_tokens and max_output_tokens differ; send one", "max_output_tokens")
    fields = {name: getattr(body, name) for name in _SHARED_FIELDS}
    fields["max_tokens"] = body.max_output_tokens or body.max_tokens
    if wants_logprobs(body):
        fields["logprobs"], fields["top_logprobs"] = True, body.top_logprobs or 0
    response_format = _response_format(body.text)
    if response_format is not None:
        if body.response_format is not None:
            raise invalid("send the structured output once, as text.format", "response_format")
        fields["response_format"] = response_format
    chat = ChatCompletionRequest.model_construct(
        **fields,
        messages=messages,
        tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        reasoning_effort=_effort(body.reasoning),
    )
    chat._tool_format = body._tool_format
    chat._reasoning_format = body._reasoning_format
    return chat


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the output text's logprobs are asked for (``include``)."""
    return LOGPROBS_INCLUDE in (body.include or ())


def _refuse_unserved(body: ResponsesRequest) -> None:
    refusals: list[tuple[str, bool, str]] = [
        (
            "include",
            any(name != LOGPROBS_INCLUDE for name in body.include or ()),
            f"of include, only {LOGPROBS_INCLUDE!r} is supported",
        ),
        (
            "reasoning",
            any(
                value is not None
                for key, value in (body.reasoning or {}).items()
                if key != "effort"
            ),
            "of reasoning, only effort is served (summaries are not)",
        ),
        (
            "truncation",
            body.truncation not in (None, "disabled"),
            "only truncation: disabled is supported (a prompt too long is refused)",
        ),
        (
            "top_logprobs",
            body.top_logprobs is not None and not wants_logprobs(body),
            f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]",
        ),
        ("max_tool_calls", body.max_tool_calls is not None, "max_tool_calls is not supported"),
        ("prompt", body.prompt is not None, "stored prompts are not supported"),
        (
            "prompt_logprobs",
            body.prompt_logprobs is not None,
            "a response has no place for prompt_logprobs: send them to chat completions",
        ),
        (
            "return_token_ids",
            bool(body.return_token_ids),
            "a response has no place for token ids: send return_token_ids to chat completions",
        ),
    ]
    for field, asked, reason in refusals:
        if asked:
            raise invalid(f"{reason} ({field})", field)


def _message(role: str, content: str) -> ChatMessage:
    return ChatMessage(role=role, content=content)  # type: ignore[arg-type]


def _effort(reasoning: dict[str, Any] | None) -> str | None:
    """``reasoning.effort`` as chat's ``reasoning_effort``; 400 naming it for another."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise invalid(f"reasoning.effort must be one of {', '.join(_EFFORTS)}", "reasoning.effort")
    return effort


def check_items(items: list[dict[str, Any]], field: str) -> None:
    """400 naming the item (``{field}.{index}...``) for an item a response's input could not
    take (a conversation's items are checked so when they are added)."""
    _add_messages([], items, field)


def _add_messages(
    messages: list[ChatMessage], given: str | list[dict[str, Any]], field: str
) -> None:
    """Append ``given``'s messages (a text, or items) to ``messages``; errors name items
    as ``{field}.{index}``."""
    if isinstance(given, str):
        messages.append(_message("user", given))
        return
    for index, item in enumerate(given):
        where = f"{field}.{index}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message_item(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = _text_of(item.get("output"), f"{where}.output")
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=call_id))
        else:
            raise invalid(f"input items of type {kind!r} are not supported", f"{where}.type")


def _message_item(item: dict[str, Any], where: str) -> ChatMessage:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise invalid(
            f"a message's role must be one of {', '.join(_MESSAGE_ROLES)}", f"{where}.role"
        )
    return _message(role, _text_of(item.get("content"), f"{where}.content"))


def _text_of(content: Any, where: str) -> str:
    """Text, or text parts joined; 400 naming the part for any other."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("content must be text or a list of text parts", where)
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise invalid("only text content parts are supported", f"{where}.{index}")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid("a text part needs its text", f"{where}.{index}.text")
        texts.append(text)
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise invalid(f"{key} must be a non-empty string", f"{where}.{key}")
    return value


def _function_call(item: dict[str, Any], where: str) -> MessageToolCall:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise invalid("arguments must be the call's JSON text", f"{where}.arguments")
    return MessageToolCall(
        id=_string(item, "call_id", where),
        function=CalledFunction(name=_string(item, "name", where), arguments=arguments),
    )


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' function tools in chat's shape; 400 naming any other tool."""
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise invalid(
                f"only function tools are supported, not {tool.get('type')!r}",
                f"tools.{index}.type",
            )
        function = {key: value for key, value in tool.items() if key != "type"}
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise invalid(
            "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if not text:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise invalid("only verbosity: medium is supported", "text.verbosity")
    if unknown := sorted(set(text) - {"format", "verbosity"}):
        raise invalid(f"text.{unknown[0]} is not supported", f"text.{unknown[0]}")
    form = text.get("format")
    if form is None:
        return None
    if not isinstance(form, dict):
        raise invalid("text.format must be an object", "text.format")
    kind = form.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = form.get("schema")
        if not isinstance(schema, dict):
            raise invalid("a json_schema format needs its schema, an object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": form.get("name"), "schema": schema}}
    raise invalid(f"unknown text.format type {kind!r}", "text.format.type")
