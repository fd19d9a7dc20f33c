"""``splitserve plan`` against a brute-force sweep, in simulation (issue 59's first "must show").

For each of the five scenarios at full size (``launch/fleet_workload.py:SCENARIOS``: steady
chat, long prompts, multi-turn agents for 10 simulated minutes; a 5x burst over 10 minutes; a
sinusoid between 1x and 24x a base rate over 30), under the same SLO (each scenario's TTFT
and ITL targets for 90% of requests) and the same search space (``--max-workers``,
``--max-dual``): the planner's choice (``launch/plan.py:plan``) and the cheapest configuration
meeting the SLO by simulating every one (``launch/plan.py:brute_force``), each with its own
evaluator (nothing shared: the simulation counts are each side's own). The criterion: the plan
is the cheapest configuration meeting the SLO in at least 4 of the 5 scenarios and within 10%
of it in all. Prints a table and writes ``bench/results/plan-vs-brute-force-<date>.json``.

Pure simulation on the shipped step-time profile (``--profile``): no processes, no model.
``--size small --max-workers 6`` is the default test's check (``tests/test_plan.py``), in
seconds; the full size takes minutes (the sinusoid's brute force most of them).
Usage: ``python bench/bench_plan.py [--size small --max-workers 6] [--scenarios chat,long]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from splitserve.engine.sim_profile import load_profile
from splitserve.launch import plan
from splitserve.launch.fleet_results import SimResult
from splitserve.launch.fleet_sim import FleetParams
from splitserve.launch.fleet_workload import SCENARIOS, SIZES, scenario
from splitserve.launch.plan_report import describe_workload

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WITHIN = 1.10
"""The plan's cost may be at most this times the brute force's cheapest."""


def _run_json(run: SimResult | None, per_worker_hour: float) -> dict[str, object] | None:
    if run is None:
        return None
    return {
        "config": run.config.describe(),
        "prefill": run.config.prefill,
        "decode": run.config.decode,
        "dual": run.config.dual,
        "mode": run.config.mode.value,
        "local_prefill_max_tokens": run.config.local_prefill_max_tokens,
        "autoscale": run.config.autoscale,
        "attainment": run.attainment,
        "goodput": run.goodput,
        "worker_hours": run.worker_hours,
        "cost": run.cost(per_worker_hour),
        "cost_per_million_tokens": run.cost_per_million_tokens(per_worker_hour),
        "requests": run.requests,
        "ttft_p90_s": run.quantile("ttft_s", 0.9),
        "itl_p90_s": run.quantile("itl_s", 0.9),
    }


def compare(name: str, size: str, params: FleetParams, space: plan.SearchSpace, seed: int) -> dict:
    """One scenario: the plan and the brute force, each timed and counted."""
    workload = scenario(name, size)
    planner = plan.Evaluator(workload, params, seed, 1.0)
    began = time.perf_counter()
    chosen = plan.plan(planner, space)
    plan_s = time.perf_counter() - began
    checker = plan.Evaluator(workload, params, seed, 1.0)  # nothing shared with the plan
    began = time.perf_counter()
    best, evaluated = plan.brute_force(checker, space)
    brute_s = time.perf_counter() - began
    mine, theirs = chosen.chosen, best
    ratio = None
    if mine is not None and theirs is not None:
        ratio = mine.cost(1.0) / theirs.cost(1.0)
    return {
        "scenario": name,
        "workload": describe_workload(workload),
        "ttft_slo_s": workload.slo.ttft_s,
        "itl_slo_s": workload.slo.tpot_s,
        "simulated_minutes": workload.duration_s / 60,
        "plan": _run_json(mine, 1.0),
        "plan_configurations": len(chosen.evaluated),
        "plan_simulations": planner.simulated,
        "plan_s": plan_s,
        "capacity_seed": chosen.seed.describe(),
        "brute_force": _run_json(theirs, 1.0),
        "brute_force_configurations": evaluated,
        "brute_force_simulations": checker.simulated,
        "brute_force_s": brute_s,
        "cost_ratio": ratio,
        "cheapest": ratio is not None and ratio <= 1 + 1e-9,
    }


def table(rows: list[dict]) -> str:
    header = (
        f"{'scenario':9} {'plan':34} {'w-h':>5} {'SLO%':>5} {'sims':>5} {'s':>5} | "
        f"{'brute force':34} {'w-h':>5} {'SLO%':>5} {'sims':>5} {'s':>6} | {'ratio':>5}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        mine, theirs = row["plan"] or {}, row["brute_force"] or {}
        ratio = "-" if row["cost_ratio"] is None else f"{row['cost_ratio']:.3f}"
        lines.append(
            f"{row['scenario']:9} {mine.get('config', 'none'):34} "
            f"{mine.get('worker_hours', 0):5.2f} {mine.get('attainment', 0) * 100:5.1f} "
            f"{row['plan_simulations']:5d} {row['plan_s']:5.1f} | "
            f"{theirs.get('config', 'none'):34} {theirs.get('worker_hours', 0):5.2f} "
            f"{theirs.get('attainment', 0) * 100:5.1f} {row['brute_force_simulations']:5d} "
            f"{row['brute_force_s']:6.1f} | {ratio:>5}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="default")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument(
        "--size", choices=SIZES, default="full", help="small: the test's (tests/test_plan.py)"
    )
    parser.add_argument("--max-workers", type=int, default=plan.SearchSpace.max_workers)
    parser.add_argument("--max-dual", type=int, default=plan.SearchSpace.max_dual)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--date", default=time.strftime("%F"))
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main() -> int:
    args = _parser().parse_args()
    params = FleetParams.from_profile(load_profile(args.profile))
    space = plan.SearchSpace(args.max_workers, args.max_dual)
    rows = []
    for name in args.scenarios.split(","):
        rows.append(compare(name, args.size, params, space, args.seed))
        print(f"{name}: done ({rows[-1]['plan_s'] + rows[-1]['brute_force_s']:.0f} s)", flush=True)
    print(table(rows))
    cheapest = sum(row["cheapest"] for row in rows)
    within = all(row["cost_ratio"] is not None and row["cost_ratio"] <= WITHIN for row in rows)
    met = cheapest >= min(4, len(rows)) and within
    print(
        f"the plan is the cheapest configuration meeting the SLO in {cheapest} of {len(rows)} "
        f"scenarios, within {WITHIN - 1:.0%} of it in {'all' if within else 'not all'}: "
        f"criterion {'met' if met else 'NOT met'}"
    )
    infix = "" if args.size == "full" else f"-{args.size}"
    out = args.out or RESULTS_DIR / f"plan-vs-brute-force{infix}-{args.date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "date": args.date,
        "size": args.size,
        "profile": args.profile,
        "seed": args.seed,
        "space": {"max_workers": space.max_workers, "max_dual": space.max_dual},
        "target": plan.DEFAULT_TARGET,
        "params": {
            "startup_s": params.startup_s,
            "kv_tokens_per_worker": params.kv_tokens_per_worker,
            "transfer_gbps": params.transfer_gbps,
            "transfer_latency_s": params.transfer_latency_s,
        },
        "scenarios": rows,
        "cheapest_in": cheapest,
        "within_10_percent_in_all": within,
        "criterion_met": met,
    }
    out.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
