"""What an engine step costs on this worker, learned online from its own steps (torch-free).

A step's wall time is modelled as two linear parts (``StepCost``):

- decode: ``decode_base_s + per_decode_seq_s * decode_seqs + per_context_token_s *
  context_tokens``, fitted on steps that computed no prompt token (``decode_seqs``: requests
  that sampled one token from one new token; ``context_tokens``: the KV those requests
  attended over);
- prefill: ``prefill_base_s + per_prefill_token_s * prefill_tokens``, fitted on steps that
  computed prompt tokens, on what is left of the step's time after the decode part the model
  predicts for the step's decode chunks.

Each part is an ``OnlineLinearFit``: least squares with exponential forgetting applied per
observation (a part that sees no steps keeps its last fit; it never decays to nothing), a small
ridge so that a feature that never varied gets a coefficient near 0 instead of noise, and
coefficients clamped at 0 (no step gets cheaper with more work). ``StepCostLearner`` feeds
both parts from ``StepShape`` + seconds and says whether each part has seen enough steps to be
trusted (``StepCost.decode_steps`` / ``prefill_steps``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

MIN_STEPS = 8
"""Steps a part must have seen before ``StepCost`` calls it known."""


@dataclass(frozen=True)
class StepShape:
    """The work of one engine step, as the cost model's features."""

    decode_seqs: int
    """Requests that ran one already-sampled token (decode)."""
    prefill_tokens: int
    """Prompt tokens computed (chunks of more than one token, or a prompt's last one)."""
    context_tokens: int
    """Sum over the decode requests of the tokens they attend over (their end position)."""


@dataclass(frozen=True)
class StepCost:
    """A worker's fitted step-time model, seconds; see the module docstring."""

    decode_base_s: float = 0.0
    per_decode_seq_s: float = 0.0
    per_context_token_s: float = 0.0
    prefill_base_s: float = 0.0
    per_prefill_token_s: float = 0.0
    decode_steps: int = 0
    """Steps the decode part was fitted on (saturates; 0: unknown)."""
    prefill_steps: int = 0

    @property
    def knows_decode(self) -> bool:
        return self.decode_steps >= MIN_STEPS

    @property
    def knows_prefill(self) -> bool:
        return self.prefill_steps >= MIN_STEPS

    def decode_step_s(self, decode_seqs: int, context_tokens: int) -> float:
        """A decode-only step of this many requests over this much context."""
        if decode_seqs <= 0:
            return 0.0
        return (
            self.decode_base_s
            + self.per_decode_seq_s * decode_seqs
            + self.per_context_token_s * context_tokens
        )

    def prefill_s(self, prefill_tokens: int) -> float:
        """The prompt part of a step (or steps) computing this many prompt tokens."""
        if prefill_tokens <= 0:
            return 0.0
        return self.prefill_base_s + self.per_prefill_token_s * prefill_tokens

    def prefill_tokens_per_s(self, prefill_tokens: int) -> float:
        """Prompt tokens a second, read at a step (or steps) of ``prefill_tokens`` of them."""
        return prefill_tokens / self.prefill_s(prefill_tokens)

    def step_s(self, shape: StepShape) -> float:
        return self.decode_step_s(shape.decode_seqs, shape.context_tokens) + self.prefill_s(
            shape.prefill_tokens
        )

    def predicts(self, shape: StepShape) -> bool:
        """Whether each part ``shape`` has work in has been fitted on enough steps."""
        decode_known = shape.decode_seqs == 0 or self.knows_decode
        return decode_known and (shape.prefill_tokens == 0 or self.knows_prefill)


class OnlineLinearFit:
    """``y ~ coefficients . x`` by exponentially weighted ridge least squares.

    Invariant: ``_xtx`` and ``_xty`` are the weighted sums over every observation, each
    weighted by ``forgetting ** (observations since)``; ``coefficients`` solves
    ``(xtx + ridge * I) b = xty`` and clamps negative entries at 0."""

    def __init__(self, num_features: int, forgetting: float = 0.995, ridge: float = 1e-9) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        self.num_features = num_features
        self.forgetting = forgetting
        self.ridge = ridge
        self.num_observations = 0
        self._xtx = [[0.0] * num_features for _ in range(num_features)]
        self._xty = [0.0] * num_features

    def observe(self, features: Sequence[float], target: float) -> None:
        if len(features) != self.num_features:
            raise ValueError(f"expected {self.num_features} features, got {len(features)}")
        keep = self.forgetting
        for i, xi in enumerate(features):
            row = self._xtx[i]
            for j, xj in enumerate(features):
                row[j] = row[j] * keep + xi * xj
            self._xty[i] = self._xty[i] * keep + xi * target
        self.num_observations += 1

    def coefficients(self) -> list[float]:
        size = self.num_features
        # the augmented normal equations, solved by Gaussian elimination with partial pivoting
        rows = [
            [self._xtx[i][j] + (self.ridge if i == j else 0.0) for j in range(size)]
            + [self._xty[i]]
            for i in range(size)
        ]
        for column in range(size):
            pivot = max(range(column, size), key=lambda r: abs(rows[r][column]))
            rows[column], rows[pivot] = rows[pivot], rows[column]
            if abs(rows[column][column]) < 1e-300:
                return [0.0] * size
            for r in range(column + 1, size):
                factor = rows[r][column] / rows[column][column]
                for c in range(column, size + 1):
                    rows[r][c] -= factor * rows[column][c]
        solution = [0.0] * size
        for r in reversed(range(size)):
            known = sum(rows[r][c] * solution[c] for c in range(r + 1, size))
            solution[r] = (rows[r][size] - known) / rows[r][r]
        return [max(0.0, value) for value in solution]


class StepCostLearner:
    """Feeds ``StepShape`` + wall seconds of each step into the two fits; ``estimate()``
    is the current ``StepCost``. Not thread-safe: observe and estimate on one thread (the
    engine's), publish the frozen ``StepCost``."""

    CONTEXT_SCALE = 1000.0
    """Context features are in thousands of tokens (keeps the normal equations well scaled)."""

    def __init__(self, forgetting: float = 0.995) -> None:
        self._decode = OnlineLinearFit(3, forgetting)
        self._prefill = OnlineLinearFit(2, forgetting)
        self._estimate = StepCost()

    def observe(self, shape: StepShape, seconds: float) -> float:
        """Learn from one step; returns the seconds of it attributed to prompt tokens (the
        step's time less the decode part the model predicts for it; 0 for a decode-only step)."""
        if seconds <= 0.0 or (shape.decode_seqs == 0 and shape.prefill_tokens == 0):
            return 0.0
        if shape.prefill_tokens == 0:  # refit only the part this step informs
            context = shape.context_tokens / self.CONTEXT_SCALE
            self._decode.observe([1.0, float(shape.decode_seqs), context], seconds)
            base, per_seq, per_kilo_context = self._decode.coefficients()
            self._estimate = dataclasses.replace(
                self._estimate,
                decode_base_s=base,
                per_decode_seq_s=per_seq,
                per_context_token_s=per_kilo_context / self.CONTEXT_SCALE,
                decode_steps=self._decode.num_observations,
            )
            return 0.0
        decode_part = self._estimate.decode_step_s(shape.decode_seqs, shape.context_tokens)
        remainder = max(0.0, seconds - decode_part)
        self._prefill.observe([1.0, float(shape.prefill_tokens)], remainder)
        base, per_token = self._prefill.coefficients()
        self._estimate = dataclasses.replace(
            self._estimate,
            prefill_base_s=base,
            per_prefill_token_s=per_token,
            prefill_steps=self._prefill.num_observations,
        )
        return remainder

    def estimate(self) -> StepCost:
        return self._estimate
