"""Reasoning models' answers split into their reasoning and their content (vLLM's
``--reasoning-parser``), and a structured output constrained only after the reasoning.

Formats (``REASONING_FORMATS``), both with ``<think>`` ... ``</think>``:
- ``deepseek_r1`` (DeepSeek-R1 and its distills, whose chat template opens the reasoning in
  the prompt): the answer begins inside its reasoning (a ``<think>`` it writes anyway is
  dropped); everything before ``</think>`` is reasoning, everything after it content; an
  answer that never closes it is all reasoning.
- ``qwen3`` (Qwen3, QwQ: the model opens the reasoning itself, or writes none when thinking
  is off): an answer that begins with ``<think>`` (whitespace before it allowed) is reasoning
  up to ``</think>``, content after; any other answer is all content.

Contract of ``ReasoningStream`` (one answer's): ``feed`` hands out each piece's reasoning
and content as soon as they are known (text that could still be the start of a tag is held
back), ``finish`` what was held; the pieces joined are ``split_reasoning`` of the whole
answer, however the answer was cut into pieces. The tags themselves belong to neither part.

``after_reasoning``: a constraint applied to the content only, as a structural tag that lets
the reasoning run free first (``deepseek_r1``: any text up to ``</think>``; ``qwen3``: an
optional ``<think>`` block), then any whitespace, then the constraint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from splitserve.client.markers import held_back
from splitserve.common.grammar import GrammarSpec
from splitserve.common.structural_tag import structural_tag_format

DEEPSEEK_R1 = "deepseek_r1"
QWEN3 = "qwen3"
REASONING_FORMATS = (DEEPSEEK_R1, QWEN3)
START = "<think>"
END = "</think>"


@dataclass(frozen=True)
class SplitAnswer:
    """An answer's reasoning (None: it wrote none) and its content."""

    reasoning: str | None
    content: str


def split_reasoning(text: str, reasoning_format: str) -> SplitAnswer:
    """``text`` split as ``reasoning_format`` reads it (module docstring)."""
    stream = ReasoningStream(reasoning_format)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return SplitAnswer(
        reasoning + more_reasoning if stream.reasoned else None, content + more_content
    )


class ReasoningStream:
    """One answer read as it is written (module docstring)."""

    def __init__(self, reasoning_format: str) -> None:
        if reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"unknown reasoning format {reasoning_format!r}")
        self._format = reasoning_format
        self._pending = ""
        self._state = "opening"
        """opening (before the answer's first text is known), reasoning, content."""
        self.reasoned = False
        """Whether the answer has a reasoning part."""

    def feed(self, text: str) -> tuple[str, str]:
        """The next piece: the reasoning and the content it lets out."""
        self._pending += text
        reasoning = content = ""
        if self._state == "opening":
            stripped = self._pending.lstrip()
            if START.startswith(stripped) and len(stripped) < len(START):
                return "", ""  # may still open with <think>
            opened = stripped.startswith(START)
            if opened:
                self._pending = stripped[len(START) :]
            if opened or self._format == DEEPSEEK_R1:
                self._state, self.reasoned = "reasoning", True
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._pending.find(END)
            if end < 0:
                at = len(self._pending) - held_back(self._pending, END)
                reasoning, self._pending = self._pending[:at], self._pending[at:]
                return reasoning, ""
            reasoning = self._pending[:end]
            self._pending = self._pending[end + len(END) :]
            self._state = "content"
        content, self._pending = self._pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the answer: what was held back, as the part it belonged to."""
        held, self._pending = self._pending, ""
        if self._state == "opening":  # only a beginning of <think>, or whitespace
            if self._format == DEEPSEEK_R1:
                self.reasoned = True
                return held, ""
            return "", held
        return (held, "") if self._state == "reasoning" else ("", held)


def _format_of(spec: GrammarSpec) -> dict[str, Any]:
    """``spec`` as a structural tag's format (``common/structural_tag.py``)."""
    if spec.kind == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(spec.text)}
    if spec.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.text}
    if spec.kind == "grammar":
        return {"type": "grammar", "grammar": spec.text}
    if spec.kind == "choice":
        options = json.loads(spec.text)
        return {"type": "or", "elements": [{"type": "const_string", "value": o} for o in options]}
    return structural_tag_format(spec.text)  # a structural tag: its format


def after_reasoning(spec: GrammarSpec, reasoning_format: str) -> GrammarSpec:
    """``spec`` applied to the answer's content only (module docstring)."""
    think: dict[str, Any] = {"type": "any_text"}
    if reasoning_format == DEEPSEEK_R1:
        reasoning = {"type": "tag", "begin": "", "content": think, "end": END}
    else:
        block = {"type": "tag", "begin": START, "content": think, "end": END}
        reasoning = {"type": "optional", "content": block}
    elements = [reasoning, {"type": "regex", "pattern": r"\s*"}, _format_of(spec)]
    fmt = {"type": "sequence", "elements": elements}
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})
