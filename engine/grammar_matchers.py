"""Each constrained request's llguidance matcher in one engine, and the token mask it allows.

Contract (engine thread only, through ``ModelRunner``):
- a request's matcher is made when it is first sampled, from its ``GrammarSpec`` (compiled
  once per spec: ``common/grammar.py:GrammarCompiler``), and before each mask it consumes
  the request's output tokens it has not seen yet. So whatever way the output tokens came
  (sampled here, sampled by the prefill worker and carried with the KV, streamed before a
  resume, kept through a preemption), the mask is the grammar's state after exactly them:
  the first token of a disaggregated request is the prefill worker's, never sampled again.
- once the grammar is complete (or the matcher failed: a token it refuses, which sampling
  under its own mask cannot produce), only the end-of-sequence tokens are allowed, so the
  request ends with finish reason "stop".
- ``free`` drops a finished request's matcher.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.common.grammar import GrammarCompiler, GrammarSpec

logger = logging.getLogger(__name__)
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # [32]


@dataclass
class _Matcher:
    matcher: Any
    """An ``llguidance.LLMatcher``."""
    consumed: int = 0
    """Output tokens fed to it so far."""


class GrammarMatchers:
    """Matchers by request id; ``vocab_size`` is the width of the model's logits."""

    def __init__(self, compiler: GrammarCompiler, vocab_size: int) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self._matchers: dict[str, _Matcher] = {}

    def allowed(
        self,
        request_id: str,
        spec: GrammarSpec,
        output_token_ids: Sequence[int],
        eos_token_ids: Collection[int],
    ) -> torch.Tensor:
        """The tokens the grammar allows next: bool ``[vocab_size]``."""
        entry = self._matchers.get(request_id)
        if entry is None:
            from llguidance import LLMatcher

            grammar = self.compiler.compile(spec)  # the coordinator checked it
            entry = _Matcher(LLMatcher(self.compiler.tokenizer, grammar))
            self._matchers[request_id] = entry
        matcher = entry.matcher
        if entry.consumed < len(output_token_ids):
            matcher.consume_tokens(list(output_token_ids[entry.consumed :]))
            entry.consumed = len(output_token_ids)
        if matcher.is_error() or matcher.is_stopped():
            if matcher.is_error():
                logger.warning("request %s: grammar error: %s", request_id, matcher.get_error())
            return self._only(eos_token_ids)
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words[:, None] >> _BIT_SHIFTS) & 1  # [words, 32]
        return bits.flatten()[: self.vocab_size].bool()  # [vocab]

    def _only(self, token_ids: Collection[int]) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)  # [vocab]
        mask[[token_id for token_id in token_ids if token_id < self.vocab_size]] = True
        return mask

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
