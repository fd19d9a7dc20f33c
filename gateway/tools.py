"""Tool calls in OpenAI's response shape, whole and streamed as deltas (the plan and its
format: ``client/tools.py``; reading an answer as it is written:
``client/tool_call_scanner.py``).

Contract of ``ToolCallDeltas`` (one answer's):
- ``feed`` turns each piece of the answer into OpenAI's ``delta.tool_calls`` entries as
  soon as they are known: a call's first entry has its ``index``, ``id``, ``type:
  "function"`` and ``function.name`` with the arguments written so far (often ""); each
  later one only its ``index`` and the next piece of ``function.arguments``, so a client
  (the openai SDK's stream helpers) appends the pieces;
- ``whole`` is the answer's ``tool_calls`` with the ids the stream used, each call's
  arguments the text its pieces join to; ``rest`` the entries a stream still lacks for it
  (none when every call was written in the order the format gives: name before arguments).
"""

from __future__ import annotations

import secrets
import string
import uuid
from typing import Any

from splitserve.client.tool_call_scanner import CallPiece, CallScanner
from splitserve.client.tools import JSON_FORMAT, MISTRAL_FORMAT, ToolPlan
from splitserve.client.types import ToolCall

_ALPHANUMERIC = string.ascii_letters + string.digits
MISTRAL_CALL_ID_CHARS = 9
"""Mistral's chat templates refuse a history whose call ids are not 9 letters or digits."""


def new_call_id(tool_format: str = JSON_FORMAT) -> str:
    """A new call's id: ``call_`` and 24 hex digits, or for ``mistral`` 9 random letters and
    digits (what its chat templates take back in the next turn's history)."""
    if tool_format == MISTRAL_FORMAT:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(MISTRAL_CALL_ID_CHARS))
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallDeltas:
    """One answer's tool calls, streamed as they are written (module docstring)."""

    def __init__(self, plan: ToolPlan) -> None:
        self._scanner: CallScanner = plan.scanner()
        self._format = plan.format
        self._ids: list[str] = []
        self._sent: list[str] = []
        """Each announced call's arguments text as streamed so far."""

    @property
    def started(self) -> bool:
        """Whether some call was announced (the stream carries a tool call)."""
        return bool(self._sent)

    @property
    def failed(self) -> bool:
        """Whether the answer so far cannot be a call in the format (and never will be)."""
        return self._scanner.failed

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The ``delta.tool_calls`` entries the answer's next piece ``text`` makes known."""
        return self.entries(self._scanner.feed(text))

    def entries(self, pieces: list[CallPiece]) -> list[dict[str, Any]]:
        """The ``delta.tool_calls`` entries of ``pieces`` read elsewhere (a ``hermes``
        answer's: ``client/hermes_tools.py:TaggedCallStream``)."""
        return [self._entry(piece) for piece in pieces]

    def _entry(self, piece: CallPiece) -> dict[str, Any]:
        if piece.name is None:
            self._sent[piece.index] += piece.arguments
            return {"index": piece.index, "function": {"arguments": piece.arguments}}
        self._sent.append(piece.arguments)
        return {
            "index": piece.index,
            "id": self._id(piece.index),
            "type": "function",
            "function": {"name": piece.name, "arguments": piece.arguments},
        }

    def _id(self, index: int) -> str:
        """Call ``index``'s id, made when first asked for."""
        while len(self._ids) <= index:
            self._ids.append(new_call_id(self._format))
        return self._ids[index]

    def whole(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """OpenAI's ``tool_calls`` of the answer's parsed ``calls`` (ids as streamed)."""
        return [
            {
                "id": self._id(index),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for index, call in enumerate(calls)
        ]

    def rest(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The entries a stream of the answer's parsed ``calls`` has not carried yet."""
        entries = []
        for index, call in enumerate(calls):
            if index >= len(self._sent):
                entries.append(self._entry(CallPiece(index, call.name, call.arguments)))
            elif call.arguments != self._sent[index]:
                missing = call.arguments.removeprefix(self._sent[index])
                entries.append(self._entry(CallPiece(index, None, missing)))
        return entries
