"""Incremental (streaming) detokenization with stop strings.

``IncrementalDetokenizer`` turns a request's output tokens, fed a few at a time, into text
deltas that are safe to stream:

- **No broken UTF-8.** New tokens are decoded after a few tokens of context and only the text
  past the context's own is emitted. When that text ends with U+FFFD (a multi-byte character
  split across tokens), the new tokens are held back until a later token completes it. The
  context makes leading spaces right (SentencePiece-style decoders drop the space of a decode's
  first token); the first output token uses the prompt's last tokens as its context, or none
  when they end in an incomplete character. Cost per call is O(context), not O(output).
- **Lossless.** Without stop strings, the deltas plus ``finish()`` concatenate to
  ``decoder.decode(output_ids)`` for decoders whose output is the concatenation of their
  tokens' bytes (byte-level BPE such as GPT-2/Llama 3/SmolLM). With SentencePiece-style decoders
  the stream keeps the leading space the first output token has after the prompt.
- **Stop strings.** Emitted text never contains a stop string nor ends with a proper prefix of
  one: such a tail (at most ``len(longest stop) - 1`` characters) is held back until it can no
  longer start a stop string, or released by ``finish()``. When a stop string completes (it may
  span tokens), only the text before it is emitted (up to its end with ``include_stop``) and
  ``stop_string`` names it; the match that
  completes first wins, and among those completing at the same character the one starting
  first, so the result does not depend on how tokens were grouped into calls. After a stop
  (or after ``finish()``), ``add_tokens`` raises ``RuntimeError``.

Who decodes. A decoder that exposes its ``tokenizers.Tokenizer`` as ``backend`` (splitserve's
``Tokenizer`` does, so every request the engine or the coordinator detokenizes) is streamed by
the library's ``tokenizers.decoders.DecodeStream`` (tokenizers >= 0.22: prompt context and
lists of ids), which holds split characters back the same way with the previous chunk's tokens
as context. It emits the same deltas as the windowed decoding below (checked on prose, code,
multi-byte text, special tokens, random chunkings, byte-level and SentencePiece decoders) and
costs half as much: 1.6-1.8 us/token against 3.4-3.7 us/token for the windowed decoding of
the same tokenizer, ratio 0.46-0.49 within each run (SmolLM2, one token per call, no stop
strings, medians of 21-31 repetitions; ``bench/bench_detokenizer.py`` on this 2-CPU machine,
2026-11-23). What it lacks stays ours: stop strings; ``finish()``'s release of a dangling
incomplete character (``DecodeStream`` has no flush), for which the ids since the last emitted
text and up to ``CONTEXT_TOKENS`` before them are kept; and a bound on the tokens it holds
(``STREAM_HELD_TOKENS_MAX``), since it re-decodes a run of tokens that add no text (skipped
special tokens) at every step: 4000 EOS in a row cost it 173 us/token, bounded 2 us/token.

Our windowed decoding (each call decodes the context window, up to ``CONTEXT_TOKENS`` emitted
tokens, and the window plus the new tokens) is kept only where ``DecodeStream`` cannot serve:
decoders offering just ``decode`` (adapters, test fakes); one whose text for more tokens does
not start with its text for fewer, which ``DecodeStream`` rejects mid-stream (its "invalid
prefix" error), after which the request goes on windowed; and that over-long held run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import tokenizers
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5
"""Tokens before the new ones decoded as context for spacing (the prompt's last ones before the
first output token, ``DecodeStream``'s starting context)."""
STREAM_HELD_TOKENS_MAX = 8
"""Held tokens past which ``DecodeStream``'s run is decoded windowed: a split character spans
at most 4 tokens (UTF-8 bytes); longer runs are tokens that add no text."""


class TokenDecoder(Protocol):
    """Anything that turns token ids into text (a tokenizer adapter).

    One that also has a ``backend`` attribute holding the ``tokenizers.Tokenizer`` its
    ``decode`` calls (splitserve's ``Tokenizer``) is streamed by ``DecodeStream``.
    """

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
    in an incomplete character (or, with ``DecodeStream``, adds no text yet);
    ``_prefix_offset`` starts the context window, at most ``CONTEXT_TOKENS`` ids before
    ``_read_offset``. ``_stream``, while set, was started from a complete context (the prompt's,
    or that of a run it held too long) and fed exactly the ids appended to ``_token_ids`` since;
    ``None`` means windowed decoding.
    """

    def __init__(
        self,
        decoder: TokenDecoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        """``include_stop``: the stop string that matched ends the text (else the text ends
        before it)."""
        self._decoder = decoder
        self._include_stop = include_stop
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(stop)
        self._max_held_chars = max((len(s) for s in self._stops), default=1) - 1
        self._token_ids: list[int] = self._complete_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._held_text = ""
        self._emitted: list[str] = []
        self._done = False
        backend = getattr(decoder, "backend", None)
        self._backend = backend if isinstance(backend, tokenizers.Tokenizer) else None
        self._stream = (
            DecodeStream(self._token_ids, skip_special_tokens=skip_special_tokens)
            if self._backend is not None
            else None
        )

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
        text = self._held_text + self._decode_new(token_ids)
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

    def _complete_context(self, token_ids: Sequence[int]) -> list[int]:
        """The last ``CONTEXT_TOKENS`` ids, or none if they end in an incomplete character."""
        context = list(token_ids[-CONTEXT_TOKENS:]) if CONTEXT_TOKENS else []
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _decode_new(self, new_ids: Sequence[int]) -> str:
        """Complete text of the tokens past ``_read_offset``; "" while a character is split.

        ``new_ids`` are the ids this call appended (the stream is fed only those). Tokens that
        add no text (skipped special tokens) may advance the window or stay held; either way
        they never show up in the text.
        """
        if self._read_offset == len(self._token_ids):
            return ""
        text = self._stream_step(new_ids) if self._stream is not None else self._window_step()
        if text is None:
            return ""  # a character is still split: wait for the tokens that complete it
        self._read_offset = len(self._token_ids)
        self._prefix_offset = max(0, self._read_offset - CONTEXT_TOKENS)
        # Keep the id list short: the context window is all later calls ever look at.
        if self._prefix_offset > 4 * CONTEXT_TOKENS:
            del self._token_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return text

    def _stream_step(self, new_ids: Sequence[int]) -> str | None:
        """``DecodeStream``'s next chunk, None while it holds the tokens back.

        ``DecodeStream`` raises (its "invalid prefix" error) for a decoder whose text for more
        tokens does not start with its text for fewer; the request then goes on windowed. It
        holds tokens that add no text (skipped special tokens) until some text follows; a held
        run longer than ``STREAM_HELD_TOKENS_MAX`` is decoded windowed instead, so a step's cost
        stays bounded.
        """
        if not new_ids:
            return None
        try:
            text = self._stream.step(self._backend, new_ids[0] if len(new_ids) == 1 else new_ids)
        except Exception:
            self._stream = None
            return self._window_step()
        if text is None and len(self._token_ids) - self._read_offset > STREAM_HELD_TOKENS_MAX:
            # Tokens adding no text: DecodeStream would re-decode the whole run at every step.
            text = self._window_step()
            if text is not None:  # the run is decoded: restart the stream after it
                context = self._complete_context(self._token_ids)
                self._stream = DecodeStream(context, skip_special_tokens=self._skip_special_tokens)
        return text

    def _window_step(self) -> str | None:
        """Windowed decoding: the window's text past its context, None while a char is split."""
        context_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        if window_text.endswith(REPLACEMENT_CHAR) and len(window_text) > len(context_text):
            return None
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
            end = start + len(stop_string) if self._include_stop else start
            return DetokenizedDelta(text=text[:end], stop_string=stop_string)
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
