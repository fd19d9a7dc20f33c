"""Workloads for the fleet simulator (``launch/fleet_sim.py``) and the planner
(``launch/plan.py``): who sends what, when, and the latency targets it is served against.

A ``WorkloadSpec`` is an open-loop request stream: arrivals at ``rate`` req/s times a shape
over time (``RateShape``: constant, a burst, a sinusoid), or a recorded ``trace``; prompt and
output lengths drawn from ``LengthDist``; and a ``multi_turn_share`` of arrivals that continue
an earlier conversation (an agent's next step, a user's next turn): such a prompt is that
session's whole previous context (its previous prompt and reply) plus ``turn_prompt`` new
tokens. ``requests`` draws the stream, deterministic in the seed and independent of any fleet,
so every configuration the planner compares serves exactly the same requests. A
continuation arrives at least ``think_s`` after its session's previous turn arrived; whether
that turn has finished by then, and so whether its KV is cached where it decoded, is up to the
fleet.

``SCENARIOS`` names the issue's five (steady chat, long prompts, multi-turn agents, a 5x burst,
a sinusoid between 1x and 24x a base rate), each at two sizes: ``full`` (the bench, 10 or 30
simulated minutes) and ``small`` (the tests: a few simulated minutes at low rates).
``from_json`` reads a spec of one's own (or a trace).
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from splitserve.coordinator.placement import Slo

CHAT_SLO = Slo(ttft_s=2.0, tpot_s=0.05)
"""``bench/bench_goodput.py``'s chat targets (TTFT <= 2 s, ITL <= 50 ms)."""
LONG_SLO = Slo(ttft_s=4.0, tpot_s=0.05)
"""... and its long-prompt ones."""
SIZES = ("small", "full")
TRACE_WINDOW_S = 60.0
"""A trace's rate at a time is its requests over this long from then."""


@dataclass(frozen=True)
class LengthDist:
    """Token counts drawn from a normal distribution, clipped to ``[1, 2 x mean]`` (std 0:
    always ``mean``)."""

    mean: int
    std: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1 or self.std < 0:
            raise ValueError(f"a length distribution needs mean >= 1 and std >= 0: {self}")

    def sample(self, rng: random.Random) -> int:
        drawn = round(rng.gauss(self.mean, self.std)) if self.std else self.mean
        return min(2 * self.mean, max(1, drawn))


@dataclass(frozen=True)
class RateShape:
    """The arrival rate's multiplier over time: ``constant`` (1), ``burst`` (``factor`` from
    ``start_s`` for ``length_s``, else 1) or ``sinusoid`` (from 1 at t = 0 up to ``factor`` at
    half a ``period_s`` and back: ``1 + (factor - 1) (1 - cos(2 pi t / period)) / 2``)."""

    kind: str = "constant"
    factor: float = 1.0
    start_s: float = 0.0
    length_s: float = 0.0
    period_s: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "burst", "sinusoid"):
            raise ValueError(f"unknown rate shape {self.kind!r}")
        if self.factor < 1 or self.period_s <= 0 or self.length_s < 0:
            raise ValueError(f"bad rate shape {self}")

    def multiplier(self, t: float) -> float:
        if self.kind == "burst":
            return self.factor if self.start_s <= t < self.start_s + self.length_s else 1.0
        if self.kind == "sinusoid":
            return 1.0 + (self.factor - 1.0) * (1.0 - math.cos(2 * math.pi * t / self.period_s)) / 2
        return 1.0

    @property
    def peak(self) -> float:
        return 1.0 if self.kind == "constant" else self.factor


@dataclass(frozen=True)
class TracedRequest:
    """One request of a recorded trace: when, its lengths, its session (-1: none)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    session: int = -1


@dataclass(frozen=True)
class WorkloadSpec:
    """See the module docstring. ``rate``: the base rate, req/s (the shape multiplies it)."""

    name: str
    rate: float
    duration_s: float
    prompt: LengthDist
    output: LengthDist
    slo: Slo = CHAT_SLO
    shape: RateShape = RateShape()
    multi_turn_share: float = 0.0
    turn_prompt: LengthDist = LengthDist(100)
    """New tokens a continuation adds to its session's previous context."""
    think_s: float = 10.0
    max_context: int = 8192
    """A continuation whose prompt would pass this starts a new session instead."""
    trace: tuple[TracedRequest, ...] = field(default=(), repr=False)
    """When given, the requests (the rate, shape and lengths above then describe it only)."""

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.duration_s <= 0 or not 0 <= self.multi_turn_share <= 1:
            raise ValueError(f"a workload needs a positive rate and duration: {self.name}")

    def rate_at(self, t: float) -> float:
        """Requests per second at ``t`` (a trace's: over the minute from ``t``)."""
        if self.trace:
            times = self._trace_times
            return (
                bisect.bisect_left(times, t + TRACE_WINDOW_S) - bisect.bisect_left(times, t)
            ) / (TRACE_WINDOW_S)
        return self.rate * self.shape.multiplier(t)

    @property
    def peak_rate(self) -> float:
        """The highest ``rate_at`` (a trace's busiest minute)."""
        if self.trace:
            return max(self.rate_at(t) for t in self._trace_times)
        return self.rate * self.shape.peak

    @property
    def varies(self) -> bool:
        """Whether the rate changes over time (a fleet may then scale)."""
        return self.shape.kind != "constant" or bool(self.trace)

    @property
    def _trace_times(self) -> list[float]:
        return sorted(r.arrival_s for r in self.trace)

    def scaled(self, rate: float | None = None, duration_s: float | None = None) -> WorkloadSpec:
        """This workload at another base rate or length (a burst keeps its place in time)."""
        return replace(
            self,
            rate=self.rate if rate is None else rate,
            duration_s=self.duration_s if duration_s is None else duration_s,
        )


@dataclass(frozen=True)
class SimRequest:
    """One request of a drawn stream."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    """It generates exactly this many tokens (``max_tokens``, as the bench's ``ignore_eos``)."""
    session: int = -1
    """Its conversation (-1: none)."""
    prefix_tokens: int = 0
    """Of its prompt, the session's previous context (prompt and reply of its last turn)."""


def requests(spec: WorkloadSpec, seed: int) -> list[SimRequest]:
    """The request stream of ``spec``, in arrival order, deterministic in ``seed``."""
    if spec.trace:
        return _traced(spec.trace)
    arrivals = _arrival_times(spec, random.Random(f"arrivals-{seed}"))
    rng = random.Random(f"lengths-{seed}")
    sessions: list[tuple[float, int]] = []  # (last arrival, context after that turn)
    stream = []
    for index, arrival in enumerate(arrivals):
        output = spec.output.sample(rng)
        session, prefix = -1, 0
        if spec.multi_turn_share and rng.random() < spec.multi_turn_share:
            session = _idle_session(sessions, arrival - spec.think_s, rng)
            if session >= 0:
                prefix = sessions[session][1]
        fresh = spec.turn_prompt.sample(rng) if session >= 0 else spec.prompt.sample(rng)
        if prefix + fresh + output > spec.max_context:
            session, prefix, fresh = -1, 0, spec.prompt.sample(rng)
        if spec.multi_turn_share and session < 0:
            session = len(sessions)
            sessions.append((arrival, 0))
        prompt = prefix + fresh
        if session >= 0:
            sessions[session] = (arrival, prompt + output)
        stream.append(SimRequest(index, arrival, prompt, output, session, prefix))
    return stream


def _arrival_times(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    """A Poisson process of rate ``spec.rate_at(t)`` over the duration (thinning a process at
    the peak rate)."""
    peak = spec.peak_rate
    times, now = [], 0.0
    while True:
        now += rng.expovariate(peak)
        if now >= spec.duration_s:
            return times
        if rng.random() * peak < spec.rate_at(now):
            times.append(now)


def _idle_session(sessions: list[tuple[float, int]], before: float, rng: random.Random) -> int:
    """A session whose last turn arrived before ``before`` (-1: none), drawn among the most
    recent 32 such, so conversations continue while they are fresh."""
    idle = [i for i in range(max(0, len(sessions) - 64), len(sessions)) if sessions[i][0] <= before]
    return rng.choice(idle[-32:]) if idle else -1


def _traced(trace: tuple[TracedRequest, ...]) -> list[SimRequest]:
    """A trace's requests; a request of a session continues the context of its previous one
    when its prompt holds it."""
    context: dict[int, int] = {}
    stream = []
    for index, traced in enumerate(sorted(trace, key=lambda r: r.arrival_s)):
        prefix = context.get(traced.session, 0) if traced.session >= 0 else 0
        prefix = prefix if prefix < traced.prompt_tokens else 0
        if traced.session >= 0:
            context[traced.session] = traced.prompt_tokens + traced.output_tokens
        stream.append(
            SimRequest(
                index,
                traced.arrival_s,
                traced.prompt_tokens,
                traced.output_tokens,
                traced.session,
                prefix,
            )
        )
    return stream


def _chat(size: str) -> WorkloadSpec:
    rate, minutes = (1.5, 2.0) if size == "small" else (3.0, 10.0)
    return WorkloadSpec("chat", rate, minutes * 60, LengthDist(320, 100), LengthDist(96, 30))


def _long(size: str) -> WorkloadSpec:
    rate, minutes = (0.4, 2.0) if size == "small" else (1.0, 10.0)
    prompt, output = LengthDist(1400, 150), LengthDist(100, 30)
    return WorkloadSpec("long", rate, minutes * 60, prompt, output, slo=LONG_SLO)


def _agents(size: str) -> WorkloadSpec:
    rate, minutes = (1.0, 3.0) if size == "small" else (2.5, 10.0)
    return WorkloadSpec(
        "agents",
        rate,
        minutes * 60,
        LengthDist(600, 150),
        LengthDist(120, 40),
        multi_turn_share=0.75,
        turn_prompt=LengthDist(150, 50),
        think_s=5.0,
        max_context=6000,
    )


def _burst(size: str) -> WorkloadSpec:
    rate, minutes, burst_s = (0.4, 4.0, 60.0) if size == "small" else (0.8, 10.0, 120.0)
    shape = RateShape("burst", 5.0, start_s=minutes * 60 * 0.4, length_s=burst_s)
    return replace(_chat(size), name="burst", rate=rate, duration_s=minutes * 60, shape=shape)


def _sinusoid(size: str) -> WorkloadSpec:
    rate, minutes = (0.1, 5.0) if size == "small" else (0.25, 30.0)
    shape = RateShape("sinusoid", 24.0, period_s=minutes * 60)
    return replace(_chat(size), name="sinusoid", rate=rate, duration_s=minutes * 60, shape=shape)


SCENARIOS = {
    "chat": _chat,
    "long": _long,
    "agents": _agents,
    "burst": _burst,
    "sinusoid": _sinusoid,
}
"""The issue's five scenarios: name -> the spec at a size (``SIZES``)."""


def scenario(name: str, size: str = "full") -> WorkloadSpec:
    """A named scenario (``SCENARIOS``) at ``size``; ``KeyError`` / ``ValueError`` otherwise."""
    if size not in SIZES:
        raise ValueError(f"size is one of {SIZES}, not {size!r}")
    return SCENARIOS[name](size)


def from_json(text: str) -> WorkloadSpec:
    """A spec from JSON: ``{"name", "rate", "duration_s", "isl": [mean, std], "osl": [mean,
    std], "ttft_ms", "itl_ms", "multi_turn_share", "turn_isl": [mean, std], "think_s",
    "shape": {"kind", "factor", "start_s", "length_s", "period_s"}, "trace": [{"t", "prompt",
    "output", "session"}]}``; every key but ``rate`` optional (chat's values), or a trace
    alone. ``ValueError`` on anything else."""
    try:
        raw: Mapping[str, Any] = json.loads(text)
        base = _chat("full")
        trace = tuple(
            TracedRequest(float(r["t"]), int(r["prompt"]), int(r["output"]), r.get("session", -1))
            for r in raw.get("trace", ())
        )
        if trace:
            end = max(r.arrival_s for r in trace)
            duration = raw.get("duration_s", end + 1e-3)
            rate = raw.get("rate", len(trace) / max(duration, 1e-3))
        else:
            duration, rate = raw.get("duration_s", base.duration_s), raw["rate"]
        return WorkloadSpec(
            name=str(raw.get("name", "custom")),
            rate=float(rate),
            duration_s=float(duration),
            prompt=LengthDist(*raw.get("isl", (base.prompt.mean, base.prompt.std))),
            output=LengthDist(*raw.get("osl", (base.output.mean, base.output.std))),
            slo=Slo(raw.get("ttft_ms", 2000) / 1000, raw.get("itl_ms", 50) / 1000),
            shape=RateShape(**raw.get("shape", {})),
            multi_turn_share=float(raw.get("multi_turn_share", 0.0)),
            turn_prompt=LengthDist(*raw.get("turn_isl", (100, 0))),
            think_s=float(raw.get("think_s", 10.0)),
            trace=trace,
        )
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"not a workload spec: {error!r}") from error
