"""The requests a load run sends and when: length distributions, arrival times, prompts.

Two generators seeded from ``seed`` draw it: one the arrival gaps, the other, per request in
order, the input length, the output length and the prompt token ids. So the same seed and
lengths give the same requests on every target and configuration, and at every rate (only
the send times change with the rate).

Length distributions (``LengthDist.parse``), around a mean length ``L``:

- ``fixed``: every request ``L`` tokens;
- ``uniform:LO:HI``: integers uniform in ``[LO, HI]`` (``L`` is ignored);
- ``normal:STD[:LO:HI]``: ``round(gauss(L, STD))`` clipped to ``[LO, HI]`` (default
  ``[1, 2 * L]``).

Arrivals: ``rate`` requests per second as a Poisson process (exponential gaps, mean
``1 / rate``) or, with ``poisson=False``, evenly spaced gaps of ``1 / rate``; ``rate = inf``
sends everything at time 0.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PROMPT_TOKEN_RANGE = (1000, 40000)
"""Prompt token ids are drawn from ``[low, high)``: ordinary vocabulary, no special tokens."""


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts; ``sample`` always returns at least 1."""

    kind: str
    """``fixed``, ``uniform`` or ``normal``."""
    mean: int
    low: int
    high: int
    std: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length bounds must satisfy 1 <= low <= high, got {self}")
        if self.std < 0:
            raise ValueError("std must be >= 0")

    @classmethod
    def parse(cls, spec: str, mean: int) -> LengthDist:
        """``fixed`` | ``uniform:LO:HI`` | ``normal:STD[:LO:HI]`` around ``mean`` tokens."""
        kind, *fields = spec.split(":")
        try:
            numbers = [float(f) for f in fields]
        except ValueError as error:
            raise ValueError(f"bad length distribution {spec!r}") from error
        if kind == "fixed" and not numbers:
            return cls("fixed", mean, mean, mean)
        if kind == "uniform" and len(numbers) == 2:
            low, high = int(numbers[0]), int(numbers[1])
            return cls("uniform", (low + high) // 2, low, high)
        if kind == "normal" and len(numbers) in (1, 3):
            low, high = (int(numbers[1]), int(numbers[2])) if len(numbers) == 3 else (1, 2 * mean)
            return cls("normal", mean, low, high, std=numbers[0])
        raise ValueError(
            f"bad length distribution {spec!r}: use fixed, uniform:LO:HI or normal:STD[:LO:HI]"
        )

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.mean
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        return min(self.high, max(self.low, round(rng.gauss(self.mean, self.std))))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.mean}"
        if self.kind == "uniform":
            return f"uniform [{self.low}, {self.high}]"
        return f"normal({self.mean}, {self.std:g}) clipped to [{self.low}, {self.high}]"


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int
    rate: float
    """Requests per second; ``math.inf`` sends all at once."""
    input_len: LengthDist
    output_len: LengthDist
    poisson: bool = True
    """Exponential gaps (Poisson arrivals); False: evenly spaced gaps."""
    seed: int = 0
    token_range: tuple[int, int] = PROMPT_TOKEN_RANGE
    """Prompt token ids are drawn from ``[low, high)`` (a small model's vocabulary: lower)."""

    def __post_init__(self) -> None:
        if not 0 <= self.token_range[0] < self.token_range[1]:
            raise ValueError(f"token_range must be [low, high) with 0 <= low < high: {self}")
        if self.num_requests <= 0:
            raise ValueError("num_requests must be positive")
        if not self.rate > 0:
            raise ValueError("rate must be > 0 (inf sends all at once)")


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload."""

    index: int
    arrival_s: float
    """When to send it, in seconds after the run's start."""
    prompt_token_ids: tuple[int, ...]
    output_len: int
    """Tokens to generate (sent as max_tokens and min_tokens, with ignore_eos)."""


def arrival_offsets(
    num_requests: int, rate: float, poisson: bool, rng: random.Random
) -> list[float]:
    """Send times in seconds after the start; the first request goes at 0."""
    if math.isinf(rate):
        return [0.0] * num_requests
    offsets, now = [], 0.0
    for index in range(num_requests):
        if index:
            now += rng.expovariate(rate) if poisson else 1.0 / rate
        offsets.append(now)
    return offsets


def build_workload(config: WorkloadConfig) -> list[RequestSpec]:
    """The requests in send order (deterministic in ``config``)."""
    arrivals_rng = random.Random(f"arrivals-{config.seed}")
    rng = random.Random(f"requests-{config.seed}")
    offsets = arrival_offsets(config.num_requests, config.rate, config.poisson, arrivals_rng)
    low, high = config.token_range
    requests = []
    for index, arrival in enumerate(offsets):
        input_len = config.input_len.sample(rng)
        output_len = config.output_len.sample(rng)
        prompt = tuple(rng.randrange(low, high) for _ in range(input_len))
        requests.append(RequestSpec(index, arrival, prompt, output_len))
    return requests
