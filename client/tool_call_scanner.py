"""Reading an answer in the tool-call format (``client/tools.py``) as it is written, so that
its calls can be streamed while the model writes them.

``ToolCallScanner`` is fed the answer's text piece by piece and says, after each piece, what
became known of each call (``CallPiece``): a call is announced once its name is read (one of
the tools'), with the arguments written so far; then each further piece of its arguments
follows, exactly as the model wrote them (the raw JSON text of the ``arguments`` value,
``{}`` for a call without one), so the pieces of a call joined are its arguments text.

Contract:
- The format read: a JSON object whose one key is ``tool_calls``, an array of at least one
  call object, each with one ``name`` (a string naming a tool), at most one ``arguments``
  (any JSON value) and any other keys (skipped), whitespace anywhere JSON allows it, and
  nothing but whitespace after the object. With ``single``, one call object alone (the body
  of a Hermes-style ``<tool_call>`` block, ``client/hermes_tools.py``), its arguments also
  under ``parameters`` (as Llama-style models write them). With ``sequence`` (Llama 3's
  JSON tool calls, ``llama3_json``): after an optional ``<|python_tag|>``, one or more call
  objects separated by ``;``, arguments under ``parameters`` or ``arguments``. With ``array``
  (Mistral's tool calls, ``mistral``): after an optional ``[TOOL_CALLS]``, a JSON array of at
  least one call object, arguments under ``arguments``.
- ``failed`` turns true as soon as the text read cannot begin an answer in that form, and
  stays true: a failed text never becomes a call, whatever follows.
- ``finish`` (the end of the answer) returns the calls when the whole text has the form;
  whether it is valid JSON besides is ``ToolPlan.parse``'s check. Inside values the scanner
  only follows strings and brackets, which is all it needs to know where each ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol

from splitserve.client.types import ToolCall

_WHITESPACE = frozenset(" \t\n\r")
_SCALAR = frozenset("0123456789+-.eEtruefalsn")
"""The characters of JSON numbers, true, false and null."""
_CLOSING = {"{": "}", "[": "]"}
_END = ""
"""What the parser receives once the answer has ended."""
PYTHON_TAG = "<|python_tag|>"
"""Llama 3's tag before a call (kept in the text only where special tokens are)."""
TOOL_CALLS_TAG = "[TOOL_CALLS]"
"""Mistral's token before its calls (kept in the text only where special tokens are)."""

_Parser = Generator[None, str, str]
"""A step of the parser: receives characters (``yield``), returns the first one it did not
consume (or, for ``_string``, the decoded string)."""


class _NotACall(Exception):
    """The text read so far cannot be the start of an answer in the format."""


@dataclass(frozen=True)
class CallPiece:
    """What became known of call ``index``: its ``name`` when announced (else None) and the
    next piece of its arguments text (possibly "")."""

    index: int
    name: str | None
    arguments: str


class CallScanner(Protocol):
    """What reads an answer's calls as it is written: this module's ``ToolCallScanner`` and
    ``client/pythonic_tools.py:PythonicScanner`` (the contract above)."""

    failed: bool

    def feed(self, text: str) -> list[CallPiece]: ...

    def finish(self) -> list[ToolCall] | None: ...


@dataclass
class _Call:
    name: str | None = None
    arguments: list[str] | None = None
    announced: bool = False
    sent: int = 0
    """Parts of ``arguments`` (a character each, or the ``{}`` of none) handed out."""


class ToolCallScanner:
    """One answer's scan (module docstring); ``names``: the tools it may call."""

    def __init__(
        self,
        names: frozenset[str],
        single: bool = False,
        sequence: bool = False,
        array: bool = False,
    ) -> None:
        self._names = names
        self._single = single
        self._sequence = sequence
        self._array = array
        self._calls: list[_Call] = []
        self.failed = False
        self._complete = False
        self._parser = self._answer()
        next(self._parser)

    def feed(self, text: str) -> list[CallPiece]:
        """Read the next piece of the answer; what became known of each call, in order."""
        for char in text:
            if self.failed:
                break
            self._send(char)
        return self._pieces()

    def finish(self) -> list[ToolCall] | None:
        """The end of the answer: its calls (name, arguments text) if the whole text has
        the form, else None."""
        if not self.failed and not self._complete:
            self._send(_END)
        if self.failed or not self._complete:
            return None
        return [ToolCall(call.name or "", "".join(call.arguments or ())) for call in self._calls]

    def _send(self, char: str) -> None:
        try:
            self._parser.send(char)
        except (_NotACall, StopIteration):
            self.failed = True

    def _pieces(self) -> list[CallPiece]:
        pieces = []
        for index, call in enumerate(self._calls):
            if call.name is None:
                continue
            parts = call.arguments or []
            new = "".join(parts[call.sent :])
            if not call.announced:
                call.announced = True
                pieces.append(CallPiece(index, call.name, new))
            elif new:
                pieces.append(CallPiece(index, None, new))
            call.sent = len(parts)
        return pieces

    # ---- the parser: a generator fed one character at a time ----------------------------

    def _answer(self) -> Generator[None, str, None]:
        char = yield from _skip_whitespace((yield))
        if self._sequence:
            if char == PYTHON_TAG[0]:
                for wanted in PYTHON_TAG:
                    _expect(char, wanted)
                    char = yield
                char = yield from _skip_whitespace(char)
            while True:
                char = yield from _skip_whitespace((yield from self._call(char)))
                if char != ";":
                    break
                char = yield from _skip_whitespace((yield))
            _expect(char, _END)
            self._complete = True
            yield
            return
        if self._single:
            char = yield from _skip_whitespace((yield from self._call(char)))
            _expect(char, _END)
            self._complete = True
            yield
            return
        if self._array:
            _expect(char, "[")  # the array's, or the tag's: the next character tells
            char = yield
            if char == TOOL_CALLS_TAG[1]:
                for wanted in TOOL_CALLS_TAG[1:]:
                    _expect(char, wanted)
                    char = yield
                char = yield from _skip_whitespace(char)
                _expect(char, "[")
                char = yield
            yield from self._calls_until(char, "]")
            return
        _expect(char, "{")
        char = yield from _skip_whitespace((yield))
        if (yield from _string(char)) != "tool_calls":
            raise _NotACall
        char = yield from _skip_whitespace((yield))
        _expect(char, ":")
        char = yield from _skip_whitespace((yield))
        _expect(char, "[")
        yield from self._calls_until((yield), "]", "}")

    def _calls_until(self, char: str, *closing: str) -> Generator[None, str, None]:
        """Call objects separated by ``,`` from ``char`` (after an array's ``[``), then the
        ``closing`` characters, then the end of the answer; whitespace between any two."""
        char = yield from _skip_whitespace(char)
        while True:
            char = yield from _skip_whitespace((yield from self._call(char)))
            if char != ",":
                break
            char = yield from _skip_whitespace((yield))
        for wanted in closing:
            _expect(char, wanted)
            char = yield from _skip_whitespace((yield))
        _expect(char, _END)
        self._complete = True
        yield

    def _call(self, char: str) -> _Parser:
        """One call object, from its ``{``; returns the character after its ``}``."""
        _expect(char, "{")
        call = _Call()
        self._calls.append(call)
        char = yield from _skip_whitespace((yield))
        while True:
            key = yield from _string(char)
            char = yield from _skip_whitespace((yield))
            _expect(char, ":")
            char = yield from _skip_whitespace((yield))
            if key == "name":
                name = yield from _string(char)
                if call.name is not None or name not in self._names:
                    raise _NotACall
                call.name = name
                char = yield
            elif key == "arguments" or (key == "parameters" and (self._single or self._sequence)):
                if call.arguments is not None:
                    raise _NotACall
                call.arguments = []
                char = yield from _value(char, call.arguments.append)
            else:
                char = yield from _value(char, None)
            char = yield from _skip_whitespace(char)
            if char != ",":
                break
            char = yield from _skip_whitespace((yield))
        _expect(char, "}")
        if call.name is None:
            raise _NotACall
        if call.arguments is None:
            call.arguments = ["{}"]
        return (yield)


def _expect(char: str, wanted: str) -> None:
    if char != wanted:
        raise _NotACall


def _skip_whitespace(char: str) -> _Parser:
    while char != _END and char in _WHITESPACE:
        char = yield
    return char


def _string(char: str) -> Generator[None, str, str]:
    """A JSON string from its opening quote through its closing one; returns it decoded."""
    _expect(char, '"')
    raw = [char]
    escaped = False
    while True:
        char = yield
        if char == _END:
            raise _NotACall
        raw.append(char)
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            break
    try:
        return json.loads("".join(raw))
    except ValueError:
        raise _NotACall from None


def _value(char: str, sink: Callable[[str], object] | None) -> _Parser:
    """Any JSON value from its first character, each of its characters handed to ``sink``
    as it is read; returns the first character after it."""

    def take(char: str) -> None:
        if sink is not None:
            sink(char)

    if char == '"' or char in _CLOSING:
        closers: list[str] = []
        in_string = escaped = False
        while True:
            if char == _END:
                raise _NotACall
            take(char)
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in _CLOSING:
                closers.append(_CLOSING[char])
            elif char in ("}", "]") and (not closers or closers.pop() != char):
                raise _NotACall  # a closing bracket that closes nothing open, or not its own
            if not in_string and not closers:
                return (yield)
            char = yield
    if char == _END or char not in _SCALAR:
        raise _NotACall
    while char != _END and char in _SCALAR:
        take(char)
        char = yield
    return char
