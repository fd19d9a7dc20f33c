"""Tool calling: in a documented JSON format (``json``, the default: the default model's chat
template has none), or in the model's own format where its chat template shows the tools
(``hermes``: ``client/hermes_tools.py``), as the coordinator's ``--tool-call-parser`` says
(``TOOL_FORMATS``; the gateway and the Python client read it from ``ModelInfo``).

With ``json``, the request's tools are described to the model in a system message
(``ToolPlan.system_text``: ``TOOLS_PREAMBLE``, then each tool's name, description and
JSON-schema parameters); the model
calls tools by answering with exactly one JSON object::

    {"tool_calls": [{"name": "<tool name>", "arguments": {<the tool's parameters>}}]}

Contract, by ``tool_choice``:
- ``"none"``: the tools are not shown; the answer is content.
- ``"auto"`` (the default with tools): the answer is not constrained; one that parses as the
  format above with known tool names is returned as ``tool_calls`` (finish reason
  ``tool_calls``), anything else as content.
- ``"required"`` or ``{"type": "function", "function": {"name": N}}``: the answer is
  constrained by a JSON schema (``ToolPlan.grammar``: the format above, names limited to the
  tools, or to N, each tool's arguments by its own parameters schema), so a call is
  guaranteed; one call only with a named choice or ``parallel_tool_calls: false``.
- A call's ``arguments`` are the JSON text the model wrote for them (``{}`` when it wrote
  none): what a stream sends in pieces as it is written (``client/tool_call_scanner.py``)
  is, joined, exactly what the whole answer carries.
- History: an assistant message's calls (with their ids) and a tool message's
  ``tool_call_id`` travel as ``ChatMessage`` fields; the coordinator shows them to the chat
  template, and to one that does not render them itself in this format, ids included
  (``common/chat_messages.py``).
With ``llama3_json`` (Llama 3.1, 3.2, 3.3), the tools are given to the chat template as its
``tools`` variable; an answer that is call objects alone (``{"name": ..., "parameters":
{...}}``, several joined by ``;``) is its calls, anything else content; a forced choice is a
JSON schema of one call, or of calls joined by ``; ``.
With ``mistral`` (Mistral's instruct models, v3 tokenizers and later: Mistral 7B v0.3, Nemo,
Small, Large), the tools go to the chat template as with ``llama3_json``; an answer that is a
JSON array of call objects (``[{"name": ..., "arguments": {...}}, ...]``, after an optional
``[TOOL_CALLS]``) is its calls, anything else content; a forced choice is a JSON schema of
such an array (of one call with a named choice or ``parallel_tool_calls: false``).
With ``pythonic`` (Llama 3.2, Llama 4), the tools go to the chat template as with
``llama3_json``; an answer that is a Python list of calls with literal keyword arguments
(``[add(a=1, b=2), now()]``, between optional ``<|python_start|>`` and ``<|python_end|>``) is
its calls, each call's arguments the JSON object of its keywords, anything else content; a
forced choice is a Lark grammar of such a list (``client/pythonic_tools.py``).
With ``qwen3_coder`` (Qwen3-Coder), the tools go to the chat template, the answer may hold text
before its ``<tool_call>`` blocks of ``<function=NAME>`` and ``<parameter=KEY>`` elements (its
content, as ``hermes``), each value read by its parameter's schema type into the call's JSON
arguments; a forced choice is a structural tag of such blocks (``client/xml_tools.py``).
With ``hermes``, the tools are given to the chat template as its ``tools`` variable (OpenAI's
function tools as the request sent them; ``ToolPlan.template_kwargs``), the answer may hold text
before its calls (its content), a forced choice is a structural tag of the blocks, and the
rest holds as above.
Malformed tools or choices raise ``InvalidRequestError`` naming ``tools`` / ``tool_choice``
(the gateway's 400s). The gateway (``gateway/sampling.py``, ``gateway/responses.py``) and the
Python client (``AsyncClient.generate``'s ``tools``) share this module: over gRPC a tool call
travels as what it is made of, a chat message and, when forced, a grammar.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from splitserve.client.hermes_tools import (
    TaggedAnswer,
    TaggedCallStream,
    TaggedStream,
    parse_tagged,
    tagged_grammar,
)
from splitserve.client.pythonic_tools import PythonicScanner, pythonic_grammar
from splitserve.client.reasoning import after_reasoning, split_reasoning
from splitserve.client.tool_call_scanner import (
    PYTHON_TAG,
    TOOL_CALLS_TAG,
    CallScanner,
    ToolCallScanner,
)
from splitserve.client.types import ChatMessage, ChatTemplate, Generation, Sampling, ToolCall
from splitserve.client.xml_tools import XmlCallStream, parse_xml_calls, xml_grammar
from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarSpec

TOOLS_PREAMBLE = (
    "You can call tools. To call tools, answer with only a JSON object of the form "
    '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]} and nothing else. '
    "Otherwise answer normally. The tools:"
)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JSON_FORMAT = "json"
HERMES_FORMAT = "hermes"
LLAMA3_JSON_FORMAT = "llama3_json"
MISTRAL_FORMAT = "mistral"
PYTHONIC_FORMAT = "pythonic"
QWEN3_CODER_FORMAT = "qwen3_coder"
TOOL_FORMATS = (
    JSON_FORMAT,
    HERMES_FORMAT,
    LLAMA3_JSON_FORMAT,
    MISTRAL_FORMAT,
    PYTHONIC_FORMAT,
    QWEN3_CODER_FORMAT,
)
TAGGED_FORMATS = (HERMES_FORMAT, QWEN3_CODER_FORMAT)
"""The formats whose calls come in ``<tool_call>`` blocks after the answer's content."""
"""The tool-call formats: splitserve's JSON (in a system message), Hermes-style blocks,
Llama 3's JSON calls (the answer is ``{"name": ..., "parameters": {...}}``, several joined by
``;``, after an optional ``<|python_tag|>``), or Mistral's (a JSON array of call objects after
an optional ``[TOOL_CALLS]``), or a Python list of calls with keyword arguments
(``client/pythonic_tools.py``), or Qwen3-Coder's ``<tool_call>`` blocks of XML-like
parameters (``client/xml_tools.py``)."""


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and how it may call them (module docstring)."""

    functions: tuple[ToolFunction, ...]
    choice: str
    """"none", "auto", "required", or the one function's name that must be called."""
    parallel: bool
    format: str = JSON_FORMAT
    """One of ``TOOL_FORMATS``."""

    @property
    def in_template(self) -> bool:
        """Whether the chat template shows the tools (else a system message does)."""
        return self.format != JSON_FORMAT and self.shown

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables for the tools (none unless ``in_template``)."""
        if not self.in_template:
            return {}
        tools = []
        for f in self.functions:
            function: dict[str, Any] = {"name": f.name}
            if f.description:  # as sent: none where the request gave none
                function["description"] = f.description
            tools.append({"type": "function", "function": {**function, "parameters": f.parameters}})
        return {"tools": tools}

    @property
    def shown(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def system_text(self) -> str:
        tools = [
            {"name": f.name, "description": f.description, "parameters": f.parameters}
            for f in self.functions
        ]
        return f"{TOOLS_PREAMBLE}\n{json.dumps(tools)}"

    def grammar(self) -> GrammarSpec | None:
        """The JSON schema a forced choice's answer must match (None unless forced)."""
        if not self.forced:
            return None
        allowed = [f for f in self.functions if self.choice in ("required", f.name)]
        one = not self.parallel or self.choice != "required"
        call_schemas = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in allowed
        ]
        if self.format == HERMES_FORMAT:
            return tagged_grammar(call_schemas, one)
        if self.format == QWEN3_CODER_FORMAT:
            return xml_grammar({f.name: f.parameters for f in allowed}, one)
        if self.format == LLAMA3_JSON_FORMAT:
            return _llama3_grammar(allowed, one)
        if self.format == PYTHONIC_FORMAT:
            return pythonic_grammar([(f.name, f.parameters) for f in allowed], one)
        calls: dict[str, Any] = {"type": "array", "items": {"anyOf": call_schemas}, "minItems": 1}
        if one:
            calls["maxItems"] = 1
        if self.format == MISTRAL_FORMAT:
            return GrammarSpec.json_schema(calls)
        return GrammarSpec.json_schema({
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        })  # fmt: skip

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    def scanner(self) -> CallScanner:
        """A scanner of one ``json``, ``llama3_json``, ``mistral`` or ``pythonic`` answer, calls
        streamed as they are written (``client/tool_call_scanner.py``,
        ``client/pythonic_tools.py``)."""
        if self.format == PYTHONIC_FORMAT:
            return PythonicScanner(self.names)
        return ToolCallScanner(
            self.names,
            sequence=self.format == LLAMA3_JSON_FORMAT,
            array=self.format == MISTRAL_FORMAT,
        )

    @property
    def tagged(self) -> bool:
        """Whether calls come in ``<tool_call>`` blocks after content (``TAGGED_FORMATS``)."""
        return self.format in TAGGED_FORMATS

    def stream(self) -> TaggedStream:
        """A reader of one ``hermes`` or ``qwen3_coder`` answer as it is written
        (``client/hermes_tools.py``, ``client/xml_tools.py``)."""
        if self.format == QWEN3_CODER_FORMAT:
            return XmlCallStream(self._schemas())
        return TaggedCallStream(self.names)

    def _schemas(self) -> dict[str, dict[str, Any]]:
        return {f.name: f.parameters for f in self.functions}

    def answer(self, text: str) -> TaggedAnswer | None:
        """What a whole answer makes: its calls and its content beside them (None: none in
        ``json``), or None when it makes no calls."""
        if self.format == HERMES_FORMAT:
            return parse_tagged(text, self.names)
        if self.format == QWEN3_CODER_FORMAT:
            return parse_xml_calls(text, self._schemas())
        calls = self.parse(text)
        return None if not calls else TaggedAnswer(None, calls)

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls a whole ``json``, ``llama3_json``, ``mistral`` or ``pythonic`` answer makes
        (each call's arguments as the model wrote them, a pythonic call's as the JSON of its
        keywords), or None when it is not valid in the format."""
        scanner = self.scanner()
        scanner.feed(text)
        calls = scanner.finish()
        if calls is None or self.format == PYTHONIC_FORMAT:
            return calls  # a pythonic scan parsed each call whole (client/pythonic_tools.py)
        try:
            if self.format == LLAMA3_JSON_FORMAT:
                _each_object(text)
            elif self.format == MISTRAL_FORMAT:
                json.loads(text.strip().removeprefix(TOOL_CALLS_TAG))
            else:
                json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than it parses
            return None
        return calls


def _llama3_grammar(allowed: list[ToolFunction], one: bool) -> GrammarSpec:
    """A forced ``llama3_json`` answer: one call object of an allowed tool, or (parallel)
    several joined by ``; ``."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in allowed
        ]
    }
    if one:
        return GrammarSpec.json_schema(call)
    each = {"type": "json_schema", "json_schema": call}
    more = {"type": "sequence", "elements": [{"type": "const_string", "value": "; "}, each]}
    fmt = {"type": "sequence", "elements": [each, {"type": "star", "content": more}]}
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})


def _each_object(text: str) -> None:
    """Check ``text`` holds JSON objects joined by ``;`` (after an optional
    ``<|python_tag|>``); ``ValueError`` where it does not."""
    decoder = json.JSONDecoder()
    text = text.strip().removeprefix(PYTHON_TAG).lstrip()
    at = 0
    while True:
        _, at = decoder.raw_decode(text, at)
        rest = text[at:].lstrip()
        if not rest:
            return
        if not rest.startswith(";"):
            raise ValueError("text after a call")
        at = len(text) - len(rest) + 1
        at += len(text[at:]) - len(text[at:].lstrip())


def tool_plan(
    tools: list[dict[str, Any]] | None,
    choice: Any,
    parallel: bool | None,
    tool_format: str = JSON_FORMAT,
) -> ToolPlan | None:
    """The request's ``ToolPlan`` in ``tool_format`` (None without tools);
    ``InvalidRequestError`` for malformed tools or choices."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    functions = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tools.{index} must be a function tool", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"tools.{index}.function.name must match {_NAME.pattern}", "tools"
            )
        parameters = function.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            raise InvalidRequestError(
                f"tools.{index}.function.parameters must be a JSON schema", "tools"
            )
        description = function.get("description") or ""
        functions.append(ToolFunction(name, str(description), parameters))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be unique", "tools")
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call format {tool_format!r} (one of {TOOL_FORMATS})")
    return ToolPlan(tuple(functions), _choice(choice, names), parallel is not False, tool_format)


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name in names:
            return str(name)
        raise InvalidRequestError(
            f"tool_choice names no tool of this request: {name!r}", "tool_choice"
        )
    raise InvalidRequestError(
        "tool_choice must be none, auto, required or a named function", "tool_choice"
    )


def with_tools(messages: Sequence[ChatMessage], plan: ToolPlan | None) -> list[ChatMessage]:
    """``messages`` with ``plan``'s tools described in the system message when they are shown
    there (``json``: appended to a first system message, else one put first)."""
    messages = list(messages)
    if plan is None or not plan.shown or plan.in_template:
        return messages
    if messages and messages[0].role == "system":
        first = messages[0]
        messages[0] = ChatMessage("system", f"{first.content}\n\n{plan.system_text()}")
    else:
        messages.insert(0, ChatMessage("system", plan.system_text()))
    return messages


def with_template_tools(
    template: ChatTemplate | None, plan: ToolPlan | None
) -> ChatTemplate | None:
    """``template`` with ``plan``'s tools among its variables where the chat template shows
    them (``hermes``); ``InvalidRequestError`` naming ``chat_template_kwargs`` where those set
    ``tools`` too."""
    tools = {} if plan is None else plan.template_kwargs()
    if not tools:
        return template
    template = template or ChatTemplate()
    if "tools" in template.kwargs:
        raise InvalidRequestError(
            "tools are given twice: as tools and in chat_template_kwargs", "chat_template_kwargs"
        )
    return replace(template, kwargs={**template.kwargs, **tools})


@dataclass(frozen=True)
class ToolRequest:
    """A chat request with its tools applied: its messages, sampling, template and plan."""

    messages: list[ChatMessage] | None
    sampling: Sampling | None
    chat_template: ChatTemplate | None
    plan: ToolPlan | None


def tool_request(
    messages: Sequence[ChatMessage | Mapping[str, str]] | None,
    sampling: Sampling | None,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool | None,
    tool_format: str = JSON_FORMAT,
    chat_template: ChatTemplate | None = None,
    reasoning_format: str = "",
) -> ToolRequest:
    """A chat request with its tools applied (the Python clients' ``generate``), its plan
    None without tools: the tools shown as ``tool_format`` shows them (a system message, or
    the chat template's variables), a forced choice's grammar as the sampling's.
    ``InvalidRequestError`` for malformed tools or choices, tools without messages, or a
    forced choice beside another grammar."""
    plan = tool_plan(
        None if tools is None else [dict(tool) for tool in tools],
        tool_choice,
        parallel_tool_calls,
        tool_format,
    )
    if plan is None:
        chats = None if messages is None else [_chat(m) for m in messages]
        return ToolRequest(chats, sampling, chat_template, None)
    if messages is None:
        raise InvalidRequestError("tools need a chat (messages)", "tools")
    given = with_tools([_chat(m) for m in messages], plan)
    template = with_template_tools(chat_template, plan)
    grammar = plan.grammar()
    if grammar is None:
        return ToolRequest(given, sampling, template, plan)
    if reasoning_format:  # a reasoning model thinks first, then calls
        grammar = after_reasoning(grammar, reasoning_format)
    if sampling is not None and sampling.grammar is not None:
        raise InvalidRequestError(
            "a forced tool call and a structured output exclude each other", "tool_choice"
        )
    return ToolRequest(given, replace(sampling or Sampling(), grammar=grammar), template, plan)


def with_tool_calls(
    generation: Generation, plan: ToolPlan | None, reasoning_format: str = ""
) -> Generation:
    """``generation`` with its reasoning split off (a reasoning model's:
    ``client/reasoning.py``) and the calls its content makes (``ToolPlan.answer``) as
    ``tool_calls`` with finish reason ``tool_calls`` (its text stays the whole answer as
    written)."""
    content = generation.text
    if reasoning_format:
        split = split_reasoning(generation.text, reasoning_format)
        generation, content = replace(generation, reasoning=split.reasoning), split.content
    answer = None if plan is None or not plan.shown else plan.answer(content)
    if answer is None:
        return generation
    return replace(generation, tool_calls=tuple(answer.calls), finish_reason="tool_calls")


def _chat(message: ChatMessage | Mapping[str, str]) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    return ChatMessage(message["role"], message["content"])
