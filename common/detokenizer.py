"""Incremental (streaming) detokenization with stop strings.

``IncrementalDetokenizer`` turns a request's output tokens, fed a few at a time, into text
deltas that are safe to stream:

- **No broken UTF-8.** Each call decodes only a short window: up to ``CONTEXT_TOKENS`` tokens
  already emitted, plus the new ones, and keeps the suffix past the context's own text. Context
  makes leading spaces right (SentencePiece-style decoders drop the space of a window's first
  token); the first output token uses the prompt's last tokens as its context. When the
  window's text ends with U+FFFD (a multi-byte character split across tokens), the new tokens
  are held back until a later token completes it. Cost per call is O(window), not O(output).
- **Lossless.** Without stop strings, the deltas plus ``finish()`` concatenate to
  ``decoder.decode(output_ids)`` for decoders whose output is the concatenation of their
  tokens' bytes (byte-level BPE such as GPT-2/Llama 3/SmolLM). With SentencePiece-style decoders
  the stream keeps the leading space the first output token has after the prompt.
- **Stop strings.** Emitted text never contains a stop string nor ends with a proper prefix of
  one: such a tail (at most ``len(longest stop) - 1`` characters) is held back until it can no
  longer start a stop string, or released by ``finish()``. When a stop string completes (it may
  span tokens), only the text before it is emitted and ``stop_string`` names it; the match that
  completes first wins, and among those completing at the same character the one starting
  first, so the result does not depend on how tokens were grouped into calls. After a stop
  (or after ``finish()``), ``add_tokens`` raises ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5
"""Tokens before the new ones that are re-decoded as context for spacing."""


class TokenDecoder(Protocol):
    """Anything that turns token ids into text (a tokenizer adapter)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class DetokenizedDelta:
    """What one ``add_tokens`` call produced."""

    text: str
    """New text safe to emit now (may be empty)."""
    stop_string: str | None
    """The stop string that matched, if generation must stop now."""


class IncrementalDetokenizer:
    """Streaming detokenizer for one request; see the module docstring for the contract.

    Invariants: ``_token_ids[:_read_offset]`` has been decoded and its text emitted or held in
    ``_held_text``; ``_token_ids[_read_offset:]`` are tokens held back because their text ends
    in an incomplete character; ``_prefix_offset`` starts the context window.
    """

    def __init__(
        self,
        decoder: TokenDecoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = decoder
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(stop)
        self._max_held_chars = max((len(s) for s in self._stops), default=1) - 1
        self._token_ids: list[int] = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._held_text = ""
        self._emitted: list[str] = []
        self._done = False

    @property
    def text(self) -> str:
        """All text emitted so far (deltas and ``finish()``)."""
        return "".join(self._emitted)

    @property
    def stopped(self) -> bool:
        """True once a stop string matched or ``finish()`` was called."""
        return self._done

    def add_tokens(self, token_ids: Sequence[int], check_stops: bool = True) -> DetokenizedDelta:
        """Feed newly generated tokens; return the text that may be emitted now.

        With ``check_stops`` False (a request still below its ``min_tokens``), stop strings are
        neither matched nor held back in this call's text.
        """
        if self._done:
            raise RuntimeError("add_tokens after the detokenizer stopped or finished")
        self._token_ids.extend(token_ids)
        text = self._held_text + self._decode_new()
        if not check_stops:
            self._held_text = ""
            self._emitted.append(text)
            return DetokenizedDelta(text=text, stop_string=None)
        delta = self._apply_stops(text)
        self._emitted.append(delta.text)
        return delta

    def finish(self) -> str:
        """Text still held back, to emit when the request ends without a stop-string match.

        That is a held partial stop-string prefix plus any incomplete-character tail, rendered
        as ``decode()`` renders it. Returns "" after a stop or a previous ``finish()``.
        """
        if self._done:
            return ""
        self._done = True
        tail = ""
        if self._read_offset < len(self._token_ids):
            context_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
            tail = self._decode(self._token_ids[self._prefix_offset :])[len(context_text) :]
        remaining = self._held_text + tail
        self._held_text = ""
        self._emitted.append(remaining)
        return remaining

    # ----------------------------------------------------------------- internals

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._decoder.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last tokens, or none if they end in an incomplete character."""
        context = list(prompt_token_ids[-CONTEXT_TOKENS:]) if CONTEXT_TOKENS else []
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _decode_new(self) -> str:
        """Complete text of the tokens past ``_read_offset``; "" while a character is split.

        Tokens that add no text (skipped special tokens) still advance the window.
        """
        if self._read_offset == len(self._token_ids):
            return ""
        context_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        if window_text.endswith(REPLACEMENT_CHAR) and len(window_text) > len(context_text):
            return ""  # a character is still split: wait for the tokens that complete it
        self._read_offset = len(self._token_ids)
        self._prefix_offset = max(0, self._read_offset - CONTEXT_TOKENS)
        # Keep the id list short: the context window is all later calls ever look at.
        if self._prefix_offset > 4 * CONTEXT_TOKENS:
            del self._token_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return window_text[len(context_text) :]

    def _apply_stops(self, text: str) -> DetokenizedDelta:
        """Split ``text`` (held + new) into what to emit now and what to hold back."""
        if not self._stops:
            return DetokenizedDelta(text=text, stop_string=None)
        match = _first_stop(text, self._stops)
        if match is not None:
            start, stop_string = match
            self._done = True
            self._held_text = ""
            return DetokenizedDelta(text=text[:start], stop_string=stop_string)
        held = _partial_stop_suffix_len(text, self._stops, self._max_held_chars)
        self._held_text = text[len(text) - held :] if held else ""
        return DetokenizedDelta(text=text[: len(text) - held], stop_string=None)


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """``(start, stop)`` of the match that ends first (then starts first), or None."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        candidate = (start + len(stop), start, stop)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return None if best is None else (best[1], best[2])


def _partial_stop_suffix_len(text: str, stops: Sequence[str], max_len: int) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    for length in range(min(len(text), max_len), 0, -1):
        suffix = text[-length:]
        if any(len(stop) > length and stop.startswith(suffix) for stop in stops):
            return length
    return 0
