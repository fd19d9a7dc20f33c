"""Hermes-style tool calls, the format of Qwen2.5, Qwen3, Hermes 2 and 3 and the models
trained like them (vLLM's ``hermes`` tool-call parser): the model's own chat template shows
the tools (its ``tools`` variable, OpenAI's function tools as given), and the model calls them,
after any text of its own, with one block per call::

    <tool_call>
    {"name": "<tool name>", "arguments": {<arguments>}}
    </tool_call>

Contract:
- ``parse_tagged``: an answer holding at least one block makes calls when every block it
  opens is closed and holds one call object of a known tool (``arguments``, or
  ``parameters``; ``{}`` when it has neither), as valid JSON; the calls' arguments are the JSON
  text the model wrote; the answer's content is its text before the first block (None when
  that is empty or whitespace). Anything else makes no calls (None): the whole answer is
  content. Text after the last block is not part of the answer's content (as vLLM's parser).
- ``TaggedCallStream`` reads an answer as it is written: content streams until a block opens
  (the end of the text that could still be the start of ``<tool_call>`` is held back), then
  each call is announced once its name is read and its arguments follow piece by piece
  (``client/tool_call_scanner.py``, call indexes counted across blocks). What it streamed of
  content, joined, is what ``parse_tagged`` gives as content, whenever the answer makes calls
  (but for content of whitespace alone, streamed as it came and null in the whole answer).
- ``tagged_grammar``: the structural tag a forced choice's answer must match: one block per
  call (only the allowed tools, each one's arguments by its own schema), blocks separated by a
  line break, at least one, only one where parallel calls are off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from splitserve.client.markers import held_back
from splitserve.client.tool_call_scanner import CallPiece, ToolCallScanner
from splitserve.client.types import ToolCall
from splitserve.common.grammar import GrammarSpec

START = "<tool_call>"
END = "</tool_call>"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class TaggedAnswer:
    """An answer that makes calls: its content before them (None: none) and the calls."""

    content: str | None
    calls: list[ToolCall]


def parse_tagged(text: str, names: frozenset[str]) -> TaggedAnswer | None:
    """The calls ``text`` makes and its content (module docstring), or None for none. A
    block's end is the first ``</tool_call>`` after its JSON object (one inside a string of
    the object does not end it)."""
    first = text.find(START)
    if first < 0:
        return None
    calls, start = [], first
    while start >= 0:
        body_start = start + len(START)
        body_start += len(text[body_start:]) - len(text[body_start:].lstrip())
        try:
            _, body_end = _DECODER.raw_decode(text, body_start)
        except (ValueError, RecursionError):
            return None
        call = _one_call(text[body_start:body_end], names)
        after = text[body_end:].lstrip()
        if call is None or not after.startswith(END):
            return None
        calls.append(call)
        start = text.find(START, len(text) - len(after) + len(END))
    content = text[:first]
    return TaggedAnswer(content if content.strip() else None, calls)


def _one_call(body: str, names: frozenset[str]) -> ToolCall | None:
    """The call one block's JSON object ``body`` holds, or None where it holds no call of a
    tool."""
    scanner = ToolCallScanner(names, single=True)
    scanner.feed(body)
    calls = scanner.finish()
    return calls[0] if calls else None


class TaggedStream(Protocol):
    """A reader of one answer whose calls come in ``<tool_call>`` blocks after its content:
    ``TaggedCallStream`` here, ``client/xml_tools.py:XmlCallStream`` (the contract above)."""

    @property
    def started(self) -> bool: ...

    def feed(self, text: str) -> tuple[str, list[CallPiece]]: ...

    def finish(self) -> str: ...


def before_block(pending: str, in_calls: bool) -> tuple[str, str, bool]:
    """Read ``pending`` up to the next ``<tool_call>``: the content it lets out (none once
    ``in_calls``; the end that could begin the tag held back), the text left, and whether a
    block opened (the text left then starts inside it)."""
    start = pending.find(START)
    if start < 0:
        keep = held_back(pending, START)
        content = "" if in_calls else pending[: len(pending) - keep]
        return content, pending[len(pending) - keep :], False
    return ("" if in_calls else pending[:start]), pending[start + len(START) :], True


class _ObjectEnd:
    """Follows a JSON object's text character by character to where it closes (strings and
    escapes followed, so a brace or a tag inside a string closes nothing)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.closed = False

    def take(self, char: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            self.closed = self.depth <= 0


class BlockStream:
    """What the tagged streams share: the text read but not yet handed out (a possible start
    of a marker, or the open block's), whether a block was opened, and the end."""

    def __init__(self) -> None:
        self._pending = ""
        self._in_calls = False

    @property
    def started(self) -> bool:
        """Whether a block was opened (the answer now makes calls, or none at all)."""
        return self._in_calls

    def finish(self) -> str:
        """The end of the answer: the content still held back (before any block)."""
        held, self._pending = ("" if self._in_calls else self._pending), ""
        return held


class TaggedCallStream(BlockStream):
    """One answer read as it is written (module docstring); ``names``: the tools it may
    call. Outside a block it looks for ``<tool_call>``; inside, it hands the object's
    characters to the block's scanner until the object closes, then looks for the end tag."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__()
        self.names = names
        self._scanner: ToolCallScanner | None = None
        """The open block's scanner (None outside a block)."""
        self._object: _ObjectEnd | None = None
        """Where the open block's object stands (None once it closed: its end tag is next)."""
        self._blocks = 0
        """Calls announced before the open block (its pieces' index offset)."""

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """The next piece of the answer: the content it lets out and what it makes known of
        the calls."""
        self._pending += text
        content, pieces = "", []
        while True:
            if self._scanner is None:
                let_out, self._pending, opened = before_block(self._pending, self._in_calls)
                content += let_out
                if not opened:
                    return content, pieces
                self._in_calls = True
                self._scanner = ToolCallScanner(self.names, single=True)
                self._object = _ObjectEnd()
                continue
            if self._object is not None:  # inside the block's object: up to where it closes
                taken = 0
                for char in self._pending:
                    taken += 1
                    if self._object.depth or not char.isspace():
                        self._object.take(char)
                    if self._object.closed:
                        break
                pieces += self._scan(self._pending[:taken])
                self._pending = self._pending[taken:]
                if not self._object.closed:
                    return content, pieces
                self._object = None
            end = self._pending.find(END)
            if end < 0:
                return content, pieces
            self._pending = self._pending[end + len(END) :]
            self._blocks += 1
            self._scanner = None

    def _scan(self, text: str) -> list[CallPiece]:
        assert self._scanner is not None
        if not text or self._scanner.failed:
            return []
        return [
            CallPiece(piece.index + self._blocks, piece.name, piece.arguments)
            for piece in self._scanner.feed(text)
        ]


def tagged_grammar(calls: list[dict[str, Any]], one: bool) -> GrammarSpec:
    """The structural tag of an answer of such blocks, each call one of ``calls`` (JSON
    schemas of ``{"name", "arguments"}``); ``one``: a single block."""
    tags = [
        {
            "type": "tag",
            "begin": f"{START}\n",
            "content": {"type": "json_schema", "json_schema": schema},
            "end": f"\n{END}",
        }
        for schema in calls
    ]
    fmt = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": one,
    }
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})
