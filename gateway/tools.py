"""Tool calling in a documented JSON format (the default model's chat template has none).

The request's tools are described to the model in a system message (``ToolPlan.system_text``:
``TOOLS_PREAMBLE``, then each tool's name, description and JSON-schema parameters); the model
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
- History: an assistant message's ``tool_calls`` are rendered in the format above, a tool
  message's content as its text (``render_tool_calls``).
Malformed tools or choices are 400s naming ``tools`` / ``tool_choice``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from splitserve.common.grammar import GrammarSpec
from splitserve.gateway.errors import invalid

TOOLS_PREAMBLE = (
    "You can call tools. To call tools, answer with only a JSON object of the form "
    '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]} and nothing else. '
    "Otherwise answer normally. The tools:"
)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON text (OpenAI's ``function.arguments``)."""


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and how it may call them (module docstring)."""

    functions: tuple[ToolFunction, ...]
    choice: str
    """"none", "auto", "required", or the one function's name that must be called."""
    parallel: bool

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
        call_schemas = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in allowed
        ]
        calls: dict[str, Any] = {"type": "array", "items": {"anyOf": call_schemas}, "minItems": 1}
        if not self.parallel or self.choice != "required":
            calls["maxItems"] = 1
        return GrammarSpec.json_schema({
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        })  # fmt: skip

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls an answer makes, or None when it is not a call in the format."""
        try:
            answer = json.loads(text)
        except ValueError:
            return None
        if not isinstance(answer, dict) or set(answer) != {"tool_calls"}:
            return None
        names = {f.name for f in self.functions}
        calls = answer["tool_calls"]
        if not isinstance(calls, list) or not calls:
            return None
        parsed = []
        for call in calls:
            if not isinstance(call, dict) or call.get("name") not in names:
                return None
            parsed.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}))))
        return parsed


def tool_plan(
    tools: list[dict[str, Any]] | None, choice: Any, parallel: bool | None
) -> ToolPlan | None:
    """The request's ``ToolPlan`` (None without tools); 400s for malformed tools or choices."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    functions = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise invalid(f"tools.{index} must be a function tool", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid(f"tools.{index}.function.name must match {_NAME.pattern}", "tools")
        parameters = function.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            raise invalid(f"tools.{index}.function.parameters must be a JSON schema", "tools")
        description = function.get("description") or ""
        functions.append(ToolFunction(name, str(description), parameters))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise invalid("tool names must be unique", "tools")
    return ToolPlan(tuple(functions), _choice(choice, names), parallel is not False)


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name in names:
            return str(name)
        raise invalid(f"tool_choice names no tool of this request: {name!r}", "tool_choice")
    raise invalid("tool_choice must be none, auto, required or a named function", "tool_choice")


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant message's ``tool_calls`` as the model writes them (module docstring)."""
    calls = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments") or "{}"
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise invalid("a tool call's arguments must be JSON", "messages") from None
        calls.append({"name": function.get("name"), "arguments": parsed})
    return json.dumps({"tool_calls": calls})


def openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` list (ids fresh per call)."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]
