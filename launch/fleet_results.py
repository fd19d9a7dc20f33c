"""What a fleet simulation measured (``launch/fleet_sim.py:simulate``): each request's
``RequestOutcome`` and the run's ``SimResult`` with the figures the planner ranks by
(``launch/plan.py``): the share of requests within both latency targets, goodput, and the
worker-hours paid over the workload's duration, so the cost."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.launch.fleet_sim import FleetConfig


@dataclass(frozen=True)
class RequestOutcome:
    """What happened to one request; times in seconds from the run's start (None: never)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    admitted_s: float | None
    first_token_s: float | None
    finished_s: float | None
    refused: str = ""
    """Why admission refused it ("": it was not)."""
    placed: str = ""
    """``local`` or ``remote`` (``Placement.where``)."""

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def itl_s(self) -> float | None:
        """Mean time between its output tokens (0 for a one-token output)."""
        if self.finished_s is None or self.first_token_s is None:
            return None
        return (self.finished_s - self.first_token_s) / max(1, self.output_tokens - 1)

    def within(self, ttft_s: float, itl_s: float) -> bool:
        ttft, itl = self.ttft_s, self.itl_s
        return ttft is not None and itl is not None and ttft <= ttft_s and itl <= itl_s


@dataclass(frozen=True)
class SimResult:
    """One simulation run and what it measured."""

    config: FleetConfig
    workload: str
    seed: int
    duration_s: float
    """The workload's duration: arrivals and paid worker time end there."""
    ttft_slo_s: float
    itl_slo_s: float
    outcomes: tuple[RequestOutcome, ...] = field(repr=False)
    worker_seconds: float
    peak_workers: int
    """The most workers paid for at once."""
    peak_by_role: tuple[tuple[str, int], ...]
    """(role, the most of its workers paid for at once), each role the fleet has."""
    wall_s: float
    """How long the simulation took to run."""

    @property
    def requests(self) -> int:
        return len(self.outcomes)

    @functools.cached_property
    def good(self) -> int:
        return sum(o.within(self.ttft_slo_s, self.itl_slo_s) for o in self.outcomes)

    @functools.cached_property
    def refused(self) -> int:
        return sum(bool(o.refused) for o in self.outcomes)

    @property
    def attainment(self) -> float:
        """Share of requests served within both targets (refused ones count as missed)."""
        return self.good / self.requests if self.outcomes else 1.0

    @property
    def goodput(self) -> float:
        """Requests per second served within both targets."""
        return self.good / self.duration_s

    @functools.cached_property
    def tokens(self) -> int:
        """Prompt and output tokens of the requests served."""
        return sum(o.prompt_tokens + o.output_tokens for o in self.outcomes if o.finished_s)

    @property
    def worker_hours(self) -> float:
        return self.worker_seconds / 3600

    def cost(self, per_worker_hour: float) -> float:
        return self.worker_hours * per_worker_hour

    def cost_per_million_tokens(self, per_worker_hour: float) -> float:
        return self.cost(per_worker_hour) / max(self.tokens, 1) * 1e6

    def meets(self, target: float) -> bool:
        return self.attainment >= target

    def quantile(self, what: str, q: float) -> float:
        """A quantile of ``ttft_s``, ``itl_s`` or ``queue_wait_s`` over the requests that had
        one (nan: none)."""
        values = sorted(v for o in self.outcomes if (v := getattr(o, what)) is not None)
        if not values:
            return math.nan
        return values[min(len(values) - 1, int(q * len(values)))]

    def missed_by(self) -> str:
        """What the misses missed: counts of refused, late first token, slow tokens."""
        late = sum(1 for o in self.outcomes if o.ttft_s is not None and o.ttft_s > self.ttft_slo_s)
        slow = sum(1 for o in self.outcomes if o.itl_s is not None and o.itl_s > self.itl_slo_s)
        return f"refused {self.refused}, TTFT {late}, ITL {slow}"

    def describe_run(self) -> str:
        """Which run this is, for every figure taken from it."""
        return (
            f"simulation: seed {self.seed}, {self.duration_s / 60:g} simulated minutes, "
            f"{self.requests} requests, {self.wall_s:.2f} s to simulate"
        )
