"""Per-token logprob records (torch-free: the coordinator passes them on without torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob information for one generated position (from the raw model logits)."""

    token_id: int
    """The sampled token."""
    logprob: float
    """Its log-probability under ``log_softmax(raw logits)``."""
    rank: int
    """1 + number of tokens strictly more likely than it (1 = most likely)."""
    top: tuple[tuple[int, float], ...]
    """The ``params.logprobs`` most likely ``(token_id, logprob)``, most likely first."""
