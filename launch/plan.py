"""``splitserve plan``: the cheapest fleet that serves a workload within its latency targets,
by simulation (``launch/fleet_sim.py``) of the step-time profile's workers.

    splitserve plan --workload chat --rate 3
    splitserve plan --workload sinusoid --explain
    splitserve plan --workload my-workload.json --ttft-slo-ms 1500 --cost-per-worker-hour 2.4

A configuration (``FleetConfig``) is the prefill, decode and dual-role worker counts, the
placement mode and rule threshold (``coordinator/placement.py``), and, for a workload whose
rate changes, whether the fleet scales and to what utilization (``--scale-utilization``; its
prefill and decode counts then cap each role, ``launch/fleet_scaler.py``). A configuration
meets the SLO when at least ``target`` of the requests are served within both the TTFT and
the ITL target in its simulation (queue wait and refusals count against it; a scaled fleet's
workers serve ``startup_s`` after they are asked for); its cost is the worker-hours it is paid
for over the workload's duration. The plan is the cheapest that meets the SLO (ties: the
higher attainment, then fewer workers).

The search (``plan``):
1. A capacity estimate seeds it (``capacity_seed``): ``launch/layout.py``'s queueing model
   (``capacity``), given one worker's phase times from the profile's step-time model at the
   workload's mean prompt and context, gives the rate one prefill worker sustains within the
   TTFT target (its prompt tokens per second against the workload's, the queue's wait inside
   the target), one decode worker within the ITL target (the batch its steps allow) and one
   dual-role worker within both, at ``layout.HEADROOM``; divided into the peak rate, these
   are the counts the search starts from.
2. For every placement setting (``placement_options``), dual-role count up to ``max_dual``
   and scaling setting (``scaling_options``), it walks the frontier of the fewest prefill
   workers meeting the SLO for each decode count (``_Search.staircase``): more decode workers
   never serve worse, so the walk simulates about one configuration per count of each role
   instead of every pair. Static fleets dearer than the cheapest found are not simulated. A
   scaled family is first run with caps it may not reach (``_Search.reach``): if it never
   reached them and still missed, no caps meet; if it met, the frontier lies within the
   workers it used. Prefill-free fleets (every prompt computed where it decodes) are a column
   of their own: the first prefill worker changes where prompts go.
3. The cheapest configuration meeting the SLO among those simulated is the plan; every
   figure printed comes from its simulation run (seed and simulated minutes said,
   ``launch/plan_report.py``).

``brute_force`` evaluates every configuration of the same space (every prefill, decode and
dual count with at most ``max_workers`` workers, every placement and scaling setting),
skipping only static fleets whose cost alone is above the cheapest found (and simulating a
scaled fleet once for all caps above what it used, ``Evaluator``): the check the plan is held
to (``tests/test_plan.py``, ``bench/bench_plan.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.errors import ModelLoadError
from splitserve.common.layout_probe import BATCH, PhaseTimes, ProbeResult
from splitserve.coordinator.capacity import CapacityTargets
from splitserve.coordinator.placement import PlacementMode, Slo
from splitserve.engine.sim_profile import SimProfile, load_profile
from splitserve.launch import layout
from splitserve.launch.fleet_results import SimResult
from splitserve.launch.fleet_sim import FleetConfig, FleetParams, simulate
from splitserve.launch.fleet_workload import (
    SCENARIOS,
    SIZES,
    SimRequest,
    WorkloadSpec,
    from_json,
    requests,
    scenario,
)
from splitserve.launch.plan_report import report

DEFAULT_TARGET = 0.9
"""Share of requests within both targets a plan must reach."""
SCALE_UTILIZATIONS = (0.6, 0.8, 1.0)
"""The shares of a worker's capacity a scaled fleet may be sized to (headroom for the
workers still starting against a cheaper fleet)."""
UNBOUNDED_S = 1e9
"""A target that never binds (the capacity estimate of one phase alone)."""


@dataclass(frozen=True)
class SearchSpace:
    """What configurations exist: at most ``max_workers`` workers (at the peak), at most
    ``max_dual`` of them dual-role."""

    max_workers: int = 12
    max_dual: int = 2

    def fits(self, prefill: int, decode: int, dual: int) -> bool:
        return (
            min(prefill, decode, dual) >= 0
            and decode + dual >= 1
            and dual <= self.max_dual
            and prefill + decode + dual <= self.max_workers
        )


@dataclass(frozen=True)
class CapacitySeed:
    """One worker's sustainable rate per role (req/s) and the counts the peak rate needs."""

    prefill_rate: float
    decode_rate: float
    dual_rate: float
    prefill: int
    decode: int
    dual: int

    def describe(self) -> str:
        return (
            f"one prefill worker {self.prefill_rate:.2f} req/s, one decode worker "
            f"{self.decode_rate:.2f}, one dual-role worker {self.dual_rate:.2f}: the peak "
            f"needs about {self.prefill}P+{self.decode}D or {self.dual}X"
        )


class Evaluator:
    """Simulates configurations on one drawn request stream, each once (a simulation is
    deterministic in its configuration and the stream); ``results`` holds every
    configuration's run. A scaled fleet whose run never reached its caps (each scaled role's
    peak below its count) ran as a fleet with any caps above those peaks would: that run
    stands for them (``launch/fleet_scaler.py``), relabelled, and ``simulated`` counts only
    real runs."""

    def __init__(
        self, workload: WorkloadSpec, params: FleetParams, seed: int, per_worker_hour: float
    ) -> None:
        self.workload = workload
        self.params = params
        self.seed = seed
        self.per_worker_hour = per_worker_hour
        self.stream: list[SimRequest] = requests(workload, seed)
        self.results: dict[FleetConfig, SimResult] = {}
        self.simulated = 0
        self._uncapped: dict[FleetConfig, list[SimResult]] = {}
        """A scaled config with its counts zeroed -> the runs that never reached their caps."""

    def __call__(self, config: FleetConfig) -> SimResult:
        config = normalized(config)
        result = self.results.get(config)
        if result is None:
            result = self._uncapped_run(config)
        if result is None:
            result = simulate(config, self.params, self.workload, self.seed, self.stream)
            self.simulated += 1
            if config.autoscale and all(
                peak < config.count(role) for role, peak in result.peak_by_role if role != "dual"
            ):
                self._uncapped.setdefault(_caps_apart(config), []).append(result)
        self.results[config] = result
        return result

    def _uncapped_run(self, config: FleetConfig) -> SimResult | None:
        """A run of the same scaled fleet that never reached its caps, nor ``config``'s (the
        same roles scaled, each one's peak below ``config``'s count), relabelled as
        ``config``'s: the scaler never asked for more than it got, so these caps would not
        have bound it either."""
        if not config.autoscale:
            return None
        for run in self._uncapped.get(_caps_apart(config), ()):
            peaks = dict(run.peak_by_role)
            if all(
                (role in peaks) == (config.count(role) > 0)
                and peaks.get(role, 0) < max(config.count(role), 1)
                for role in ("prefill", "decode")
            ):
                return dataclasses.replace(run, config=config)
        return None

    def cost(self, result: SimResult) -> float:
        return result.cost(self.per_worker_hour)

    @property
    def wall_s(self) -> float:
        return sum(r.wall_s for r in self.results.values())


def _caps_apart(config: FleetConfig) -> FleetConfig:
    """``config`` but for its scaled roles' counts (a key for fleets alike but their caps)."""
    return dataclasses.replace(config, prefill=0, decode=1)


@dataclass(frozen=True)
class Plan:
    """The planner's answer: the chosen run (None: nothing in the space met the SLO) and
    every run it made."""

    workload: WorkloadSpec
    target: float
    per_worker_hour: float
    seed: CapacitySeed
    chosen: SimResult | None
    evaluated: tuple[SimResult, ...]
    simulated: int
    """Simulations run for it (fewer than ``evaluated`` where runs stood for others)."""
    search_s: float

    def ranked(self) -> list[SimResult]:
        return rank(self.evaluated, self.target, self.per_worker_hour)


def normalized(config: FleetConfig) -> FleetConfig:
    """``config`` with the placement settings a fleet without a choice ignores set to one
    value, a scaled fleet of at most one worker of each scaled role static (it scales between
    1 and 1), and a static fleet's scaling utilization to the default (so the same fleet is
    simulated once)."""
    if not config.places:
        config = dataclasses.replace(config, mode=PlacementMode.RULE, local_prefill_max_tokens=0)
    if config.autoscale and config.prefill <= 1 and config.decode <= 1:
        config = dataclasses.replace(config, autoscale=False)  # one of each at most: static
    if not config.autoscale:
        config = dataclasses.replace(config, scale_utilization=CapacityTargets.utilization)
    return config


def placement_options(workload: WorkloadSpec) -> tuple[tuple[PlacementMode, int], ...]:
    """The placement settings searched: the rule sending every prompt to a prefill worker,
    the rule keeping prompts up to the mean first prompt where they decode (about half of
    them; a conversation's next turn, whose history the decode worker holds, too), and
    adaptive placement."""
    return (
        (PlacementMode.RULE, 0),
        (PlacementMode.RULE, workload.prompt.mean),
        (PlacementMode.ADAPTIVE, 0),
    )


def scaling_options(workload: WorkloadSpec) -> tuple[float | None, ...]:
    """Static fleets (None) always; where the rate changes, scaled ones at each of
    ``SCALE_UTILIZATIONS`` (the coordinator's ``--scale-utilization``)."""
    return (None, *SCALE_UTILIZATIONS) if workload.varies else (None,)


def rank(results: Iterable[SimResult], target: float, per_worker_hour: float) -> list[SimResult]:
    """Best first: meeting the SLO, then the cheapest, the higher attainment, fewer workers."""
    return sorted(
        results,
        key=lambda r: (
            not r.meets(target),
            r.cost(per_worker_hour) if r.meets(target) else -r.attainment,
            -r.attainment,
            r.config.workers,
            r.config.describe(),
        ),
    )


def cheapest(
    results: Iterable[SimResult], target: float, per_worker_hour: float
) -> SimResult | None:
    """The cheapest run meeting the SLO (None: none)."""
    ranked = rank(results, target, per_worker_hour)
    return ranked[0] if ranked and ranked[0].meets(target) else None


# ---- the capacity estimate ----------------------------------------------------------------------


def capacity_seed(
    workload: WorkloadSpec, params: FleetParams, stream: Sequence[SimRequest]
) -> CapacitySeed:
    """Counts for the peak rate from ``launch/layout.py``'s queueing model (module docstring).
    The prompt tokens a worker computes exclude a continuation's history (cached where its
    conversation decoded): the estimate errs low, and the search walks up from it."""
    prompt = statistics.fmean(r.prompt_tokens - r.prefix_tokens for r in stream) if stream else 1
    context = (
        statistics.fmean(r.prompt_tokens + r.output_tokens / 2 for r in stream) if stream else 1
    )
    output = statistics.fmean(r.output_tokens for r in stream) if stream else 1
    cost = params.cost
    phase = PhaseTimes(
        threads=1,
        prefill_s=cost.prefill_s(round(prompt)),
        decode_one_s=cost.decode_step_s(1, round(context)),
        decode_batch_s=cost.decode_step_s(BATCH, round(BATCH * context)),
    )
    probe = ProbeResult("simulated", 1, "profile", max(1, round(prompt)), (phase,), 0.0)
    slo = workload.slo
    prefill_only = layout.Workload(max(1, round(prompt)), 1, slo.ttft_s, UNBOUNDED_S)
    decode_only = layout.Workload(1, max(1, round(output)), UNBOUNDED_S, slo.tpot_s)
    both = layout.Workload(max(1, round(prompt)), max(1, round(output)), slo.ttft_s, slo.tpot_s)
    rates = (
        layout.capacity(probe, prefill_only, "split"),
        layout.capacity(probe, decode_only, "split"),
        layout.capacity(probe, both, "aggregated"),
    )
    peak = workload.peak_rate
    counts = [math.ceil(peak / rate) if rate > 0 else 10**6 for rate in rates]
    return CapacitySeed(*rates, *counts)


# ---- the search ----------------------------------------------------------------------------------


def plan(
    evaluate: Evaluator, space: SearchSpace = SearchSpace(), target: float = DEFAULT_TARGET
) -> Plan:
    """The cheapest configuration of ``space`` meeting the SLO for ``evaluate``'s workload,
    found as the module docstring says."""
    began = time.perf_counter()
    simulated = evaluate.simulated
    workload = evaluate.workload
    capacity = capacity_seed(workload, evaluate.params, evaluate.stream)
    search = _Search(evaluate, target)
    prefills = range(1, min(space.max_workers, 2 * capacity.prefill + 1) + 1)
    decodes = range(0, min(space.max_workers, 2 * capacity.decode + 1) + 1)
    for family in _families(workload):
        for dual in range(space.max_dual + 1):
            make = _maker(space, dual, family)
            room = space.max_workers - dual
            if family.scaled_to is None:
                search.staircase(make, prefills, decodes, capacity.prefill)
                search.column(make, decodes)  # no prefill worker
                continue
            # a scaled family, first with caps it may not reach: what it can do at best
            reach = search.reach(make, room // 2, room - room // 2)
            if reach is not None:
                top_p, top_d = reach
                search.staircase(make, range(1, top_p + 1), range(0, top_d + 1), top_p)
            reach = search.reach(make, 0, room)
            if reach is not None:
                search.column(make, range(0, reach[1] + 1))
    ranked = rank(search.runs.values(), target, evaluate.per_worker_hour)
    chosen = ranked[0] if ranked and ranked[0].meets(target) else None
    return Plan(
        workload,
        target,
        evaluate.per_worker_hour,
        capacity,
        chosen,
        tuple(ranked),
        evaluate.simulated - simulated,
        time.perf_counter() - began,
    )


@dataclass(frozen=True)
class _Family:
    """Configurations alike but for their worker counts."""

    mode: PlacementMode
    threshold: int
    scaled_to: float | None
    """None: a static fleet; else scaled, to this utilization."""

    def config(self, prefill: int, decode: int, dual: int) -> FleetConfig:
        if self.scaled_to is None:
            return FleetConfig(prefill, decode, dual, self.mode, self.threshold)
        return FleetConfig(prefill, decode, dual, self.mode, self.threshold, True, self.scaled_to)


def _families(workload: WorkloadSpec) -> Iterator[_Family]:
    for (mode, threshold), scaled_to in itertools.product(
        placement_options(workload), scaling_options(workload)
    ):
        yield _Family(mode, threshold, scaled_to)


def _maker(
    space: SearchSpace, dual: int, family: _Family
) -> Callable[[int, int], FleetConfig | None]:
    """(prefill, decode) -> the configuration of ``family``, None outside ``space``."""

    def make(prefill: int, decode: int) -> FleetConfig | None:
        if not space.fits(prefill, decode, dual):
            return None
        return family.config(prefill, decode, dual)

    return make


class _Search:
    """The planner's walks over one evaluator, keeping every run and the cheapest cost
    that met the SLO so far."""

    def __init__(self, evaluate: Evaluator, target: float) -> None:
        self.evaluate = evaluate
        self.target = target
        self.runs: dict[FleetConfig, SimResult] = {}
        self.best_cost = math.inf

    def check(self, config: FleetConfig | None) -> bool | None:
        """Whether ``config`` meets the SLO (False outside the space); None, not simulated,
        for a static fleet whose cost alone is above the cheapest that met it."""
        if config is None:
            return False
        evaluate = self.evaluate
        if not config.autoscale:
            static_cost = config.workers * evaluate.workload.duration_s / 3600
            if static_cost * evaluate.per_worker_hour > self.best_cost + 1e-9:
                return None
        result = evaluate(config)
        self.runs[normalized(config)] = result
        if result.meets(self.target):
            self.best_cost = min(self.best_cost, evaluate.cost(result))
            return True
        return False

    def staircase(
        self,
        make: Callable[[int, int], FleetConfig | None],
        prefills: range,
        decodes: range,
        seed_prefill: int,
    ) -> None:
        """Walk the frontier of the fewest prefill workers meeting the SLO for each decode
        count, decode counts ascending, each from the previous count's fewest (the seed's
        count at first): down while the SLO holds, else up until it does. Up from below, not
        down from the most: more prefill workers than the decode workers can take flood
        their batches past the ITL target, so the fewest that meet is the first met on the
        way up. About one simulation per count of each role; stops once a decode count needs
        the fewest prefill workers there are (more decode workers only cost more)."""
        fewest: int | None = None
        for decode in decodes:
            start = fewest if fewest is not None else seed_prefill
            prefill = min(max(start, prefills.start), prefills.stop - 1)
            verdict = self.check(make(prefill, decode))
            while verdict is False and prefill + 1 < prefills.stop:
                prefill += 1
                verdict = self.check(make(prefill, decode))
                if verdict is None:  # dearer than the best found, as is all above it
                    verdict = False
            if verdict is False:
                continue  # no prefill count meets at this decode count
            # it meets, or costs more than the best found while fewer prefill workers may meet
            while (
                prefill - 1 >= prefills.start and self.check(make(prefill - 1, decode)) is not False
            ):
                prefill -= 1
            fewest = prefill
            if fewest == prefills.start:
                return

    def reach(
        self, make: Callable[[int, int], FleetConfig | None], prefill: int, decode: int
    ) -> tuple[int, int] | None:
        """Where a scaled family's frontier may lie, from one run with these caps: None when
        the run never reached its caps and missed the SLO (no caps meet it, more capacity
        never serving worse); the most workers of each role it used when it never reached
        them and met it (larger caps run the same: the frontier is at or below); else the
        caps themselves."""
        config = make(prefill, decode)
        if config is None:
            return None
        meets = self.check(config)
        if meets is None:  # so few it runs static, and dearer than the best found
            return prefill, decode
        result = self.runs[normalized(config)]
        peaks = dict(result.peak_by_role)
        capped = any(peaks.get(role, 0) >= config.count(role) for role in ("prefill", "decode"))
        if capped:
            return prefill, decode
        if not meets:
            return None
        return peaks.get("prefill", 0), peaks.get("decode", 0)

    def column(self, make: Callable[[int, int], FleetConfig | None], decodes: range) -> None:
        """Fleets without a prefill worker: the fewest decode workers meeting the SLO."""
        for decode in decodes:
            if self.check(make(0, decode)) is not False:
                return


def brute_force(
    evaluate: Evaluator, space: SearchSpace = SearchSpace(), target: float = DEFAULT_TARGET
) -> tuple[SimResult | None, int]:
    """The cheapest configuration of ``space`` meeting the SLO for ``evaluate``'s workload,
    by simulating every one (a static fleet whose cost alone is above the cheapest found so
    far is skipped: it cannot be cheaper), and how many configurations were evaluated."""
    workload, per_worker_hour = evaluate.workload, evaluate.per_worker_hour
    configs = {
        normalized(family.config(p, d, x))
        for p, d, x in itertools.product(range(space.max_workers + 1), repeat=3)
        if space.fits(p, d, x)
        for family in _families(workload)
    }
    scaled = sorted(  # smaller caps first: a run that never reached them stands for larger
        (c for c in configs if c.autoscale),
        key=lambda c: (_caps_apart(c).describe(), c.prefill + c.decode, c.prefill),
    )
    static = sorted(
        (c for c in configs if not c.autoscale), key=lambda c: (c.workers, c.describe())
    )
    results = [evaluate(c) for c in scaled]
    best = cheapest(results, target, per_worker_hour)
    for config in static:
        static_cost = config.workers * workload.duration_s / 3600 * per_worker_hour
        if best is not None and static_cost > evaluate.cost(best) + 1e-9:
            break
        results.append(evaluate(config))
        best = cheapest(
            [results[-1]] if best is None else [best, results[-1]], target, per_worker_hour
        )
    return best, len(results)


# ---- the command ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve plan", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("--profile", default="default", help="step-time profile, or 'default'")
    parser.add_argument(
        "--workload",
        default="chat",
        help=f"one of {', '.join(SCENARIOS)}, or a JSON spec (a file or inline; "
        "launch/fleet_workload.py:from_json)",
    )
    parser.add_argument("--size", choices=SIZES, default="full", help="a named workload's size")
    parser.add_argument("--rate", type=float, default=None, help="base rate, req/s")
    parser.add_argument("--minutes", type=float, default=None, help="simulated minutes")
    parser.add_argument("--ttft-slo-ms", type=float, default=None)
    parser.add_argument("--itl-slo-ms", type=float, default=None)
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET)
    parser.add_argument("--max-workers", type=int, default=SearchSpace.max_workers)
    parser.add_argument("--max-dual", type=int, default=SearchSpace.max_dual)
    parser.add_argument("--cost-per-worker-hour", type=float, default=1.0)
    parser.add_argument("--startup-s", type=float, default=None, help="worker start-up")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--explain", action="store_true", help="show the runners-up")
    return parser


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    """The workload the flags name, at their rate, length and targets; ``ValueError``."""
    name = args.workload
    if name in SCENARIOS:
        spec = scenario(name, args.size)
    else:
        path = Path(name)
        spec = from_json(path.read_text(encoding="utf-8") if path.is_file() else name)
    spec = spec.scaled(
        rate=args.rate, duration_s=None if args.minutes is None else args.minutes * 60
    )
    ttft_s = spec.slo.ttft_s if args.ttft_slo_ms is None else args.ttft_slo_ms / 1000
    itl_s = spec.slo.tpot_s if args.itl_slo_ms is None else args.itl_slo_ms / 1000
    return dataclasses.replace(spec, slo=Slo(ttft_s, itl_s))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan; 0 when a configuration meets the SLO, 1 when none does, 2 on bad
    input."""
    args = build_parser().parse_args(argv)
    try:
        profile: SimProfile = load_profile(args.profile)
        workload = workload_from_args(args)
    except (ModelLoadError, ValueError, KeyError, OSError) as error:
        print(f"splitserve plan: error: {error}", file=sys.stderr)
        return 2
    overrides = {} if args.startup_s is None else {"startup_s": args.startup_s}
    params = FleetParams.from_profile(profile, **overrides)
    space = SearchSpace(args.max_workers, args.max_dual)
    evaluator = Evaluator(workload, params, args.seed, args.cost_per_worker_hour)
    result = plan(evaluator, space, args.target)
    print(f"profile: {args.profile} ({profile.model_name} on {profile.cpu})")
    print(report(result, params, args.explain))
    return 0 if result.chosen is not None else 1


if __name__ == "__main__":
    sys.exit(main())
