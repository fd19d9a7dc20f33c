"""Qwen3-Coder's tool calls (vLLM's ``qwen3_coder`` parser): the model's chat template shows
the tools, and the model calls them, after any text of its own, with one block per call whose
arguments are XML-like parameters, each value as raw text::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Contract:
- ``parse_xml_calls``: an answer holding at least one ``<tool_call>`` makes calls when every
  block holds one ``<function=NAME>`` of a known tool with its ``<parameter=KEY>`` elements,
  closed as above (whitespace between elements); anything else makes no calls (None) and the
  whole answer is content. The content is the text before the first block (None when empty
  or whitespace); text after the last block is not part of it (as ``hermes``).
- A call's arguments are the JSON object of its parameters in the order written, each value
  its text less one line break on each side, read by its parameter's JSON-schema type:
  ``string`` (or no schema) as the text; ``integer``/``number`` as the JSON number it spells;
  ``boolean`` from ``true``/``false`` (any case); ``null`` from ``null``/``None``; ``object``
  and ``array`` as the JSON (or Python literal) it spells. A value its type cannot read is
  kept as the text (as vLLM's parser does). A parameter given twice makes no call.
- ``XmlCallStream`` reads an answer as it is written (``hermes_tools.TaggedCallStream``'s
  contract): content streams until a block opens (the end that could begin ``<tool_call>``
  held back); a call is announced once its ``<function=NAME>`` is read and its arguments come
  whole once its block closes.
- ``xml_grammar``: a forced choice's structural tag: one block per call of the allowed tools,
  each tool's parameters in its schema's order, each at most once, the required ones always,
  a value by its type (JSON for objects and arrays, their literals for numbers and booleans,
  any text for strings), blocks separated by a line break, at least one, only one where
  parallel calls are off.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from splitserve.client.hermes_tools import END, START, BlockStream, TaggedAnswer, before_block
from splitserve.client.tool_call_scanner import CallPiece
from splitserve.client.types import ToolCall
from splitserve.common.grammar import GrammarSpec

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_FUNCTION_END = "</function>"
_PARAMETER_END = "</parameter>"
Schemas = Mapping[str, dict[str, Any]]
"""Each tool's JSON-schema parameters, by its name."""


def parse_xml_calls(text: str, tools: Schemas) -> TaggedAnswer | None:
    """The calls ``text`` makes and its content (module docstring), or None for none."""
    first = text.find(START)
    if first < 0:
        return None
    calls, start = [], first
    while start >= 0:
        end = text.find(END, start)
        if end < 0:
            return None
        call = _block_call(text[start + len(START) : end], tools)
        if call is None:
            return None
        calls.append(call)
        start = text.find(START, end + len(END))
    content = text[:first]
    return TaggedAnswer(content if content.strip() else None, calls)


def _block_call(body: str, tools: Schemas) -> ToolCall | None:
    """The call one block's ``body`` (between its tags) holds, or None."""
    function = _FUNCTION.match(body)
    if function is None or function.group(1) not in tools:
        return None
    name, at = function.group(1), function.end()
    properties = tools[name].get("properties") or {}
    arguments: dict[str, Any] = {}
    while (parameter := _PARAMETER.match(body, at)) is not None:
        key = parameter.group(1)
        close = body.find(_PARAMETER_END, parameter.end())
        if close < 0 or key in arguments:
            return None
        raw = body[parameter.end() : close].removeprefix("\n").removesuffix("\n")
        arguments[key] = _typed(raw, properties.get(key))
        at = close + len(_PARAMETER_END)
    if body[at:].strip() != _FUNCTION_END:
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _typed(raw: str, schema: Any) -> Any:  # noqa: ANN401 - a JSON value
    """``raw`` read by ``schema``'s type (module docstring)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    text = raw.strip()
    if kind == "integer" and re.fullmatch(r"-?\d+", text):
        return int(text)
    if kind == "number":
        try:
            number = json.loads(text)
        except ValueError:
            return raw
        return number if isinstance(number, int | float) and not isinstance(number, bool) else raw
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind == "null" and text in ("null", "None"):
        return None
    if kind in ("object", "array"):
        for read in (json.loads, ast.literal_eval):
            try:
                value = read(text)
            except (ValueError, SyntaxError, RecursionError):
                continue
            if isinstance(value, dict if kind == "object" else list | tuple):
                return list(value) if isinstance(value, tuple) else value
    return raw


class XmlCallStream(BlockStream):
    """One answer read as it is written (module docstring); ``tools``: the tools' schemas."""

    def __init__(self, tools: Schemas) -> None:
        super().__init__()
        self.tools = tools
        self._in_block = False
        self._announced = False
        """Whether the open block's call was announced."""
        self._calls = 0
        """Calls announced before the open block."""

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """The next piece of the answer: the content it lets out and what it makes known of
        the calls."""
        self._pending += text
        content, pieces = "", []
        while True:
            if not self._in_block:
                let_out, self._pending, opened = before_block(self._pending, self._in_calls)
                content += let_out
                if not opened:
                    return content, pieces
                self._in_calls = self._in_block = True
                self._announced = False
                continue
            function = _FUNCTION.match(self._pending)
            if not self._announced and function is not None and function.group(1) in self.tools:
                self._announced = True
                pieces.append(CallPiece(self._calls, function.group(1), ""))
            end = self._pending.find(END)
            if end < 0:
                return content, pieces
            call = _block_call(self._pending[:end], self.tools)
            if call is not None and self._announced:
                pieces.append(CallPiece(self._calls, None, call.arguments))
            self._calls += self._announced
            self._pending = self._pending[end + len(END) :]
            self._in_block = False


_VALUE_PATTERN = {
    "integer": r"-?(0|[1-9][0-9]*)",
    "number": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    "boolean": r"(true|false)",
}


def xml_grammar(tools: Schemas, one: bool) -> GrammarSpec:
    """A forced choice's structural tag (module docstring) over the allowed ``tools``."""
    tags = [
        {
            "type": "tag",
            "begin": f"{START}\n<function={name}>\n",
            "content": _parameters_format(parameters),
            "end": f"{_FUNCTION_END}\n{END}",
        }
        for name, parameters in tools.items()
    ]
    fmt = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": one,
    }
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})


def _parameters_format(parameters: dict[str, Any]) -> dict[str, Any]:
    """A call's parameters in schema order, each at most once, the required ones always."""
    required = set(parameters.get("required") or ())
    elements: list[dict[str, Any]] = []
    for key, schema in (parameters.get("properties") or {}).items():
        element = {
            "type": "tag",
            "begin": f"<parameter={key}>\n",
            "content": _value_format(schema),
            "end": f"\n{_PARAMETER_END}\n",
        }
        elements.append(element if key in required else {"type": "optional", "content": element})
    if not elements:
        return {"type": "const_string", "value": ""}
    return {"type": "sequence", "elements": elements}


def _value_format(schema: Any) -> dict[str, Any]:  # noqa: ANN401 - a JSON schema
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in ("object", "array"):
        return {"type": "json_schema", "json_schema": schema}
    if isinstance(kind, str) and kind in _VALUE_PATTERN:
        return {"type": "regex", "pattern": _VALUE_PATTERN[kind]}
    return {"type": "any_text"}
