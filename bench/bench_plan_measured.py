"""``splitserve plan``'s predicted goodput against the goodput measured serving its plan on
this machine (issue 59: "the plan for bench/README's chat workload at two rates, predicted
goodput within 15% of the measured").

For each rate: the chat workload (``launch/fleet_workload.py``'s ``chat``: 320 +- 100 prompt
tokens, 96 +- 30 out, TTFT <= 2 s, ITL <= 50 ms; bench/README's) at that rate for
``--minutes``; ``launch/plan.py:plan`` on ``--profile`` (default: the shipped profile, fitted
to ``make serve``'s served steps on this machine kind) within what this machine holds
(``--max-workers``, one core each) picks a configuration and predicts its goodput; then
``splitserve up`` runs that configuration with real workers (pinned, drafts off as in the
simulation) and serves the same request stream (the simulation's, same seed) through the
gateway's streamed ``/v1/completions``. Goodput: requests served whole within both targets
(TTFT, and mean inter-token time as the simulation counts it) per second of the workload.

Usage: ``python bench/bench_plan_measured.py --rates 0.5,1 --minutes 5`` writes
``bench/results/plan-vs-measured-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from bench_autoscale import with_prompts, within_slo
from cluster_process import LocalCluster
from loadgen import run_requests_against, served_model
from targets import OpenAITarget

from splitserve.common.cpu_info import cpu_name
from splitserve.engine.sim_profile import load_profile
from splitserve.launch.fleet_sim import FleetConfig, FleetParams
from splitserve.launch.fleet_workload import WorkloadSpec, requests, scenario
from splitserve.launch.plan import Evaluator, SearchSpace, plan

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _up_flags(config: FleetConfig) -> list[str]:
    """``up``'s flags for a planned static configuration."""
    return [
        f"--prefill={config.prefill}",
        f"--decode={config.decode}",
        f"--dual={config.dual}",
        f"--placement={config.mode.value}",
        f"--local-prefill-max-tokens={config.local_prefill_max_tokens}",
        "--",
        "--speculative-tokens=0",
    ]


def _measure(config: FleetConfig, workload: WorkloadSpec, seed: int, log: Path) -> dict:
    specs = with_prompts(requests(workload, seed), seed)
    splitserve = Path(os.environ.get("SPLITSERVE_BIN", ROOT / ".venv" / "bin" / "splitserve"))
    with LocalCluster(splitserve, _up_flags(config), log) as cluster:
        target = OpenAITarget(cluster.http_url, served_model(cluster.http_url), timeout_s=900)
        records = asyncio.run(run_requests_against(target, specs))
    within = sum(within_slo(r, workload) for r in records)
    return {
        "requests": len(records),
        "failed": sum(r.error is not None for r in records),
        "within_slo": within,
        "goodput": round(within / workload.duration_s, 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,1.0")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--profile", default="default")
    parser.add_argument("--max-workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    params = FleetParams.from_profile(profile)
    rows = []
    date = time.strftime("%Y-%m-%d")
    out = args.out or RESULTS_DIR / f"plan-vs-measured-{date}.json"
    for rate in (float(r) for r in args.rates.split(",")):
        workload = scenario("chat").scaled(rate=rate, duration_s=args.minutes * 60)
        chosen = plan(
            Evaluator(workload, params, args.seed, 1.0),
            SearchSpace(max_workers=args.max_workers, max_dual=args.max_workers),
        ).chosen
        if chosen is None:
            rows.append({"rate": rate, "plan": None})
            continue
        measured = _measure(chosen.config, workload, args.seed, out.with_suffix(f".{rate:g}.log"))
        predicted = chosen.goodput
        row = {
            "rate": rate,
            "plan": chosen.config.describe(),
            "up_flags": _up_flags(chosen.config),
            "predicted_goodput": round(predicted, 4),
            "predicted_attainment": round(chosen.attainment, 4),
            "measured": measured,
            "error": round(predicted / measured["goodput"] - 1, 4) if measured["goodput"] else None,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {
        "date": date,
        "cpu": cpu_name(),
        "profile": args.profile,
        "minutes": args.minutes,
        "max_workers": args.max_workers,
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
