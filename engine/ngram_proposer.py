"""Draft tokens for speculative decoding by prompt lookup: no second model.

A request's text often repeats itself (code being edited, a document being summarised or
quoted, structured output, a conversation's earlier turns): when the last ``n`` tokens of its
context appeared before, the tokens that followed them then are a likely continuation now.
``NgramIndex`` proposes those tokens as a draft; the decode step verifies them all at once
(``engine/scheduler.py``), so an accepted draft token costs a row of a step instead of a step.

The index maps every n-gram of the context (``min_n <= n <= max_n``) to the position right
after its latest occurrence whose continuation is known. ``extend`` adds tokens in O(max_n) dict
updates each; ``propose`` looks up the context's own suffix, longest n first, in O(max_n).

``Drafter`` is one request's proposer: its index, kept up to date with the request's tokens;
a back-off for text that does not repeat itself (after a step whose drafts were all rejected
it proposes nothing for the next 1, 2, 4, ... up to ``MAX_SKIP`` steps it is asked; a kept
draft ends the back-off); and the request's acceptance ``continuation``: of the drafts the
model reached (every one after a kept draft, the first of each step), the decayed share it
kept, starting from ``PRIOR`` as if one of two had been kept. Under it a draft at depth ``i``
is kept with probability ``continuation ** i``: ``worth_proposing`` cuts a draft where that
falls below what a row costs (``engine/scheduler.py``). Torch free; one per speculating
request, owned by the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_SKIP = 16
"""The longest run of steps a ``Drafter`` sits out after drafts were rejected."""
PRIOR = (1.0, 2.0)
"""The acceptance a request starts from: 1 draft kept of 2 reached."""
DECAY = 0.9
"""Weight of the acceptance seen so far against one more step's."""


class NgramIndex:
    """Where each recent n-gram of one token sequence was followed, for ``propose``."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        """The sequence indexed so far (the request's prompt and output)."""
        self._next: dict[tuple[int, ...], int] = {}
        """n-gram -> position of the token that followed its latest occurrence."""

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens to the indexed sequence."""
        for token in token_ids:
            position = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, position) + 1):
                self._next[tuple(self.tokens[position - n : position])] = position
            self.tokens.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the longest earlier occurrence of the
        sequence's own suffix (``max_n`` tokens down to ``min_n``); empty if none occurred."""
        if max_tokens <= 0:
            return []
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._next.get(tuple(self.tokens[length - n :]))
            if start is not None:
                return self.tokens[start : start + max_tokens]
        return []


class Drafter:
    """One request's drafts: its ``NgramIndex`` and the back-off (module docstring)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.index = NgramIndex(min_n, max_n)
        self._misses = 0
        """Steps in a row whose drafts were all rejected."""
        self._skip = 0
        """Steps still to sit out."""
        self._kept, self._reached = PRIOR
        """Decayed counts behind ``continuation``."""

    @property
    def continuation(self) -> float:
        """The chance that the model keeps a draft it reaches (module docstring)."""
        return self._kept / self._reached

    def worth_proposing(self, drafts: Sequence[int], min_chance: float) -> list[int]:
        """The leading drafts whose chance of being kept (``continuation ** depth``) is at
        least ``min_chance``."""
        chance, count = 1.0, 0
        for _ in drafts:
            chance *= self.continuation
            if chance < min_chance:
                break
            count += 1
        return list(drafts[:count])

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Drafts after ``token_ids`` (the request's whole sequence so far: the index takes
        what it has not seen), or none while backing off."""
        self.index.extend(token_ids[len(self.index.tokens) :])
        if self._skip:
            self._skip -= 1
            return []
        return self.index.propose(max_tokens)

    def record(self, proposed: int, kept: int) -> None:
        """How many of the last ``proposed`` drafts the model kept."""
        reached = kept + (kept < proposed)
        self._kept = DECAY * self._kept + kept
        self._reached = DECAY * self._reached + reached
        if kept:
            self._misses = 0
            return
        self._misses += 1
        self._skip = min(1 << (self._misses - 1), MAX_SKIP)
