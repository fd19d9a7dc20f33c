"""Pythonic tool calls (``--tool-call-parser pythonic``: Llama 3.2 and Llama 4's templates, and
models trained on them): the answer is a Python list of calls with keyword arguments,
``[get_weather(city="Paris", unit="c"), now()]``, after an optional ``<|python_start|>`` and
before an optional ``<|python_end|>`` (Llama 4's tags, kept in the text only where special
tokens are).

``PythonicScanner`` reads such an answer as it is written, with ``ToolCallScanner``'s contract
(``client/tool_call_scanner.py``): ``feed`` says what became known of each call, ``failed``
turns true as soon as the text cannot begin such an answer, ``finish`` returns the calls of a
whole answer in the form. A call is known once its closing parenthesis is read: its name and
its arguments at once, as the JSON object of its keyword arguments (Python literals: strings,
numbers, ``True``/``False``/``None``, lists, tuples and dicts of them), since the model's text
is not JSON.

Not calls (the answer is then content): positional arguments, ``**`` arguments, a value that
is not a literal (a name, an expression), a name that is none of the tools', text before the
list or after it.

``pythonic_grammar`` is a forced choice's Lark grammar: a list of one call (or, parallel,
several) of the allowed tools, each with its parameters as keywords in its schema's order,
each at most once and the required ones always, each value a literal of its parameter's JSON
type where that is a plain one (string, integer, number, boolean), any literal otherwise (not
checked against the rest of its schema, as the JSON formats' are).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from splitserve.client.tool_call_scanner import CallPiece
from splitserve.client.types import ToolCall
from splitserve.common.grammar import GrammarSpec

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_WHITESPACE = frozenset(" \t\n\r")
_PAIRS = {"(": ")", "[": "]", "{": "}"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class PythonicScanner:
    """One answer's scan (module docstring); ``names``: the tools it may call."""

    def __init__(self, names: frozenset[str]) -> None:
        self._names = names
        self._text = ""
        self._at = 0  # the next character of ``_text`` to read
        self._phase = "lead"  # lead -> list -> after
        self._open: list[str] = []  # closers of the brackets open inside the list
        self._quote = ""  # the quote of the string being read ("" outside strings)
        self._escaped = False
        self._call_start: int | None = None
        self._calls: list[ToolCall] = []
        self._announced = 0
        self.failed = False

    def feed(self, text: str) -> list[CallPiece]:
        """Read the next piece of the answer; the calls it completed, in order."""
        if not self.failed:
            self._text += text
            self._read()
        pieces = [
            CallPiece(index, call.name, call.arguments)
            for index, call in enumerate(self._calls)
            if index >= self._announced
        ]
        self._announced = len(self._calls)
        return pieces

    def finish(self) -> list[ToolCall] | None:
        """The end of the answer: its calls if the whole text has the form, else None."""
        if self.failed or self._phase != "after" or not self._calls:
            return None
        rest = self._text[self._at :].strip()
        if rest not in ("", PYTHON_END):
            return None
        return list(self._calls)

    def _read(self) -> None:
        text = self._text
        while self._at < len(text) and not self.failed:
            if self._phase == "lead":
                if not self._read_lead():
                    return  # all whitespace, or the start of the tag: wait for more
            elif self._phase == "list":
                self._read_list_char(text[self._at])
            else:  # after the list: whitespace and an optional <|python_end|>
                rest = text[self._at :].strip()
                if rest and not PYTHON_END.startswith(rest):
                    self.failed = True
                return

    def _read_lead(self) -> bool:
        """Whitespace, an optional ``<|python_start|>``, then the list's ``[``; whether it
        read on."""
        rest = self._text[self._at :]
        stripped = rest.lstrip()
        self._at += len(rest) - len(stripped)
        if not stripped or (PYTHON_START.startswith(stripped) and stripped != PYTHON_START):
            return False
        if stripped.startswith(PYTHON_START):
            self._at += len(PYTHON_START)
            return True
        if stripped[0] != "[":
            self.failed = True
            return False
        self._at += 1
        self._phase = "list"
        return True

    def _read_list_char(self, char: str) -> None:
        at = self._at
        self._at += 1
        if self._quote:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == self._quote:
                self._quote = ""
            return
        if self._call_start is None:  # between calls: whitespace, commas, a call's start
            if char in _WHITESPACE or (char == "," and self._calls):
                return
            if char == "]" and self._calls:
                self._phase = "after"
                return
            if _IDENTIFIER.match(char):
                self._call_start = at
                return
            self.failed = True
            return
        if char in ("'", '"'):
            self._quote = char
        elif char in _PAIRS:
            if char == "(" and not self._open and not self._named(at):
                self.failed = True
                return
            self._open.append(_PAIRS[char])
        elif char in (")", "]", "}"):
            if not self._open or self._open.pop() != char:
                self.failed = True
                return
            if not self._open:  # the call's closing parenthesis
                call = _call(self._text[self._call_start : at + 1], self._names)
                if call is None:
                    self.failed = True
                    return
                self._calls.append(call)
                self._call_start = None
        elif not self._open and not (char.isalnum() or char == "_"):
            self.failed = True  # a name must run straight into its "("

    def _named(self, paren: int) -> bool:
        """Whether the text from the call's start to ``paren`` is one of the tools' names."""
        assert self._call_start is not None
        return self._text[self._call_start : paren] in self._names


def _call(text: str, names: frozenset[str]) -> ToolCall | None:
    """``name(key=literal, ...)`` as a call with its JSON arguments, or None."""
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return None
    if node.func.id not in names or node.args:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    try:
        return ToolCall(node.func.id, json.dumps(arguments))
    except (TypeError, ValueError):  # a literal JSON has no form for (a set, bytes, complex)
        return None


_VALUE_RULES = r"""
value: STRING | NUMBER | "True" | "False" | "None" | list | dict
list: "[" (value (", " value)*)? "]"
dict: "{" (STRING ": " value (", " STRING ": " value)*)? "}"
STRING: /"([^"\\\n]|\\.)*"/
NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
INTEGER: /-?(0|[1-9][0-9]*)/
"""
_TYPED_VALUE = {
    "string": "STRING",
    "integer": "INTEGER",
    "number": "NUMBER",
    "boolean": '("True" | "False")',
}


def pythonic_grammar(tools: Sequence[tuple[str, dict[str, Any]]], one: bool) -> GrammarSpec:
    """A forced choice's Lark grammar (module docstring): ``tools`` are the allowed tools'
    names and JSON-schema parameters; ``one``: a list of exactly one call."""
    rules = []
    for index, (name, parameters) in enumerate(tools):
        head, call_rules = _arguments(index, parameters)
        rules += call_rules
        if head is None:
            rules.append(f'call_{index}: "{name}()"')
        else:
            rules.append(f'call_{index}: "{name}(" {head} ")"')
    call = " | ".join(f"call_{index}" for index in range(len(tools)))
    calls = '"[" call "]"' if one else '"[" call (", " call)* "]"'
    lark = f"start: {calls}\ncall: {call}\n" + "\n".join(rules) + _VALUE_RULES
    return GrammarSpec("grammar", lark)


def _arguments(index: int, parameters: dict[str, Any]) -> tuple[str | None, list[str]]:
    """The keyword arguments of tool ``index``: each parameter at most once, in the schema's
    order, the required ones always (a keyword Python cannot write is left out). Returns the
    expression inside the call's parentheses (None: no parameters) and its rules: ``head_i``
    from parameter ``i`` on (its first argument), ``tail_i`` (``, `` and the next ones)."""
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    keywords = []  # (its expression, required)
    for key, schema in properties.items():
        if not _IDENTIFIER.fullmatch(key):
            continue  # not a keyword Python can write: such a parameter is never given
        kind = schema.get("type") if isinstance(schema, dict) else None
        value = _TYPED_VALUE.get(kind, "value") if isinstance(kind, str) else "value"
        keywords.append((f'"{key}=" {value}', key in required))
    if not keywords:
        return None, []
    count = len(keywords)
    needed = [any(must for _, must in keywords[at:]) for at in range(count + 1)]
    rules = []
    for at in range(count - 1, -1, -1):
        keyword, must = keywords[at]
        after = ""
        if at + 1 < count:
            after = f"tail_{index}_{at + 1}" + ("" if needed[at + 1] else "?")
        if at > 0:
            tail = [f'", " {keyword} {after}'.rstrip()]
            if not must and at + 1 < count:
                tail.append(f"tail_{index}_{at + 1}")
            rules.append(f"tail_{index}_{at}: " + " | ".join(tail))
        head = [f"{keyword} {after}".rstrip()]
        if not must and at + 1 < count:
            head.append(f"head_{index}_{at + 1}")
        rules.append(f"head_{index}_{at}: " + " | ".join(head))
    return f"head_{index}_0" + ("" if needed[0] else "?"), rules
