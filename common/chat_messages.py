"""A chat's messages, tool calls and their ids included, and what the chat template sees of
them (torch-free).

``ChatMessage`` and ``ToolCall`` are the typed messages every entry point carries (the Python
client's, the wire's, the coordinator's; ``client/types.py`` exports them).
``template_messages`` is the one place they become the template's input.

Contract of ``template_messages`` (every message becomes a ``{"role", "content"}`` dict):
- a message's ``tool_call_id`` is its dict's ``tool_call_id`` and an assistant message's
  calls its ``tool_calls``, ``[{"id", "type": "function", "function": {"name",
  "arguments"}}]`` with the arguments decoded from their JSON text (as HF templates expect
  them), so a template that uses them renders them its own way;
- a template that never names ``tool_calls`` sees an assistant message's calls as its
  content, in splitserve's tool-call format (``client/tools.py``), with their ids:
  ``{"tool_calls": [{"id": ..., "name": ..., "arguments": {...}}]}``;
- a template that never names ``tool_call_id`` sees a tool message that has one as the
  content ``{"tool_call_id": ..., "content": <its text>}``: the prompt says which call each
  result answers either way;
- a call whose arguments are not JSON raises ``InvalidRequestError`` (param ``messages``).
Plain ``{"role": ..., "content": ...}`` mappings (the offline API's) pass as they are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve.common.errors import InvalidRequestError


@dataclass(frozen=True)
class ToolCall:
    """One tool call: one a chat answer makes (``client/tools.py``), or one of an assistant
    message in a chat's history."""

    name: str
    arguments: str
    """The arguments as a JSON text (OpenAI's ``function.arguments``)."""
    id: str = ""
    """The call's id (OpenAI's ``call_...``); "" where none was given."""


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn; the clients also accept plain ``{"role": ..., "content": ...}`` dicts."""

    role: str
    content: str
    tool_call_id: str = ""
    """A tool message's: the id of the call it answers ("": none)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant message's: the calls it made."""


TemplateMessage = dict[str, object]
"""One message as the chat template reads it (a Jinja context value, not a payload)."""


def template_messages(
    messages: Sequence[ChatMessage | Mapping[str, str]], template: str | None
) -> list[TemplateMessage]:
    """``messages`` as the chat template whose source is ``template`` sees them (module
    docstring)."""
    renders_calls = _names(template, "tool_calls")
    renders_ids = _names(template, "tool_call_id")
    return [
        _template_message(message, renders_calls, renders_ids)
        if isinstance(message, ChatMessage)
        else dict(message)
        for message in messages
    ]


def _names(template: str | None, field: str) -> bool:
    return template is not None and re.search(rf"\b{field}\b", template) is not None


def _template_message(
    message: ChatMessage, renders_calls: bool, renders_ids: bool
) -> TemplateMessage:
    content = message.content
    if message.tool_calls and not renders_calls:
        content = json.dumps({"tool_calls": [_written_call(call) for call in message.tool_calls]})
    elif message.tool_call_id and message.role == "tool" and not renders_ids:
        content = json.dumps(
            {"tool_call_id": message.tool_call_id, "content": content}, ensure_ascii=False
        )
    shown: TemplateMessage = {"role": message.role, "content": content}
    if message.tool_call_id:
        shown["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        shown["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    return shown


def _written_call(call: ToolCall) -> dict[str, object]:
    """A history call in splitserve's tool-call format (its id first, when it has one)."""
    written: dict[str, object] = {"id": call.id} if call.id else {}
    written.update(name=call.name, arguments=_arguments(call))
    return written


def _arguments(call: ToolCall) -> object:
    try:
        return json.loads(call.arguments) if call.arguments.strip() else {}
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        raise InvalidRequestError(
            f"tool call {call.id or call.name!r}: its arguments must be JSON", "messages"
        ) from None
