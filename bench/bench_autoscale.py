"""``splitserve up --autoscale`` under a changing load, measured (issue 59, item 4).

One run: ``splitserve up --autoscale`` (a real coordinator, a real gateway, workers that the
local autoscaler adds and drains; simulated ones with ``--engine sim``, whose start-up is
``--startup-s``) serves a scenario of ``launch/fleet_workload.py`` (the sinusoid between 1x
and 24x a base rate over 30 minutes, a burst, ...) through the gateway's
``/v1/completions`` (streamed, ``ignore_eos``: each request generates its drawn length).
Every ``--sample-s`` it reads the coordinator's ``splitserve_desired_workers{role}`` and
counts ``up``'s live worker processes per role (a worker is paid from its start to its exit,
drain included). It reports:

- requests within the SLO (TTFT and mean inter-token time, as the plan's simulation counts
  them), failed ones, and cut ones (a stream that ended short of its tokens);
- worker-hours (the live worker processes integrated over the load's duration), against the
  best static layout: the cheapest static prefill/decode count whose fleet simulation
  (``launch/fleet_sim.py``, same profile, start-up and request stream) serves at least
  ``--target`` of the requests within the SLO; and the same simulation's prediction of this
  autoscaled run;
- changes of direction per role (an add after a drain or the reverse), the most in any
  ``DIRECTION_WINDOW_S``;
- a timeline picture (``--out`` with ``.svg``): load, desired and live workers per role,
  TTFT and ITL p90 per window.

Usage: ``python bench/bench_autoscale.py --workload sinusoid --engine sim --startup-s 30``
writes ``bench/results/autoscale-sinusoid-<date>.json`` and ``.svg``. ``--engine model`` runs
real workers (``--rate`` / ``--minutes`` scale the scenario down to what the machine holds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from cluster_process import LocalCluster
from loadgen import run_requests_against, served_model
from serving_stats import RequestRecord
from targets import OpenAITarget
from timeline_svg import Panel, Series, timeline_svg
from timing_stats import percentile
from workload import PROMPT_TOKEN_RANGE, RequestSpec

from splitserve.common.cpu_info import cpu_name
from splitserve.coordinator.placement import PlacementMode
from splitserve.engine.sim_profile import load_profile
from splitserve.launch.child_process import children_by_role
from splitserve.launch.fleet_sim import FleetConfig, FleetParams, simulate
from splitserve.launch.fleet_workload import SimRequest, WorkloadSpec, requests, scenario
from splitserve.launch.local_autoscaler import desired_of
from splitserve.launch.scale_policy import ScalerSettings

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
DIRECTION_WINDOW_S = 600.0
ROLES = ("prefill", "decode")


@dataclass
class Sample:
    t: float
    desired: dict[str, float]
    live: dict[str, int]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="sinusoid", help="a fleet_workload scenario")
    parser.add_argument("--size", default="full", choices=("small", "full"))
    parser.add_argument("--rate", type=float, default=None, help="base rate (req/s) instead")
    parser.add_argument("--minutes", type=float, default=None, help="duration instead")
    parser.add_argument("--factor", type=float, default=None, help="the shape's peak instead")
    parser.add_argument("--engine", default="sim", choices=("sim", "model"))
    parser.add_argument("--profile", default="default", help="the simulated workers' profile")
    parser.add_argument("--startup-s", type=float, default=30.0, help="a simulated start-up")
    parser.add_argument("--max-workers", type=int, default=6)
    parser.add_argument("--interval-s", type=float, default=15.0)
    parser.add_argument("--window-s", type=float, default=300.0)
    parser.add_argument("--period-s", type=float, default=60.0)
    parser.add_argument("--target", type=float, default=0.9, help="share within the SLO")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--static",
        default=None,
        help="no autoscaling: 'P,D' prefill and decode workers, or 'best' (the simulation's "
        "cheapest static layout meeting --target), the baseline's real run",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON (and .svg beside it)")
    parser.add_argument(
        "--render", type=Path, default=None, help="only draw the picture of a result JSON again"
    )
    return parser


def with_prompts(stream: Sequence[SimRequest], seed: int) -> list[RequestSpec]:
    """A fleet simulation's request stream (``fleet_workload.requests``) as the load
    generator's requests, with random prompts of the drawn lengths."""
    rng = random.Random(f"prompts-{seed}")
    low, high = PROMPT_TOKEN_RANGE
    return [
        RequestSpec(
            r.index,
            r.arrival_s,
            tuple(rng.randrange(low, high) for _ in range(r.prompt_tokens)),
            r.output_tokens,
        )
        for r in stream
    ]


def _live_workers(up_pid: int) -> dict[str, int]:
    """``up``'s worker processes now, per role (from their command lines)."""
    running = children_by_role(up_pid)
    return {role: running[role] for role in ROLES}


class Sampler:
    """Every ``every_s`` on a thread: the coordinator's figure and ``up``'s live workers."""

    def __init__(self, cluster: LocalCluster, metrics_url: str, every_s: float) -> None:
        self.samples: list[Sample] = []
        self._cluster, self._url, self._every_s = cluster, metrics_url, every_s
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                with urllib.request.urlopen(self._url, timeout=5) as response:  # noqa: S310
                    desired = desired_of(response.read().decode())
            except Exception:  # noqa: BLE001 - a missed reading is a gap, not a failure
                desired = dict.fromkeys(ROLES, math.nan)
            child = self._cluster.child
            live = _live_workers(child.pid) if child is not None else {}
            self.samples.append(Sample(time.perf_counter() - self._t0, desired, live))

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join(10)
        return self.samples


def _worker_hours(samples: list[Sample], duration_s: float) -> dict[str, float]:
    """Each role's live workers integrated over [0, duration] (held between samples)."""
    hours = dict.fromkeys(ROLES, 0.0)
    for earlier, later in zip(samples, samples[1:], strict=False):
        if earlier.t >= duration_s:
            break
        span = min(later.t, duration_s) - earlier.t
        for role in ROLES:
            hours[role] += earlier.live.get(role, 0) * span / 3600
    return hours


def _direction_changes(samples: list[Sample], role: str) -> tuple[int, int]:
    """(changes of direction of the role's live count, the most within DIRECTION_WINDOW_S)."""
    moves: list[tuple[float, int]] = []
    for earlier, later in zip(samples, samples[1:], strict=False):
        delta = later.live.get(role, 0) - earlier.live.get(role, 0)
        if delta:
            moves.append((later.t, 1 if delta > 0 else -1))
    flips = [t for (_, a), (t, b) in zip(moves, moves[1:], strict=False) if a != b]
    most = max((sum(1 for u in flips if t <= u < t + DIRECTION_WINDOW_S) for t in flips), default=0)
    return len(flips), most


def within_slo(record: RequestRecord, workload: WorkloadSpec) -> bool:
    """Served whole within the TTFT target and with a mean inter-token time within the ITL
    target (as ``launch/fleet_results.py:RequestOutcome.within`` counts a simulated one)."""
    ttft, tpot = record.ttft_ms, record.tpot_ms
    return (
        record.completed
        and record.num_output_tokens == record.output_len
        and ttft is not None
        and ttft <= workload.slo.ttft_s * 1e3
        and (tpot is None or tpot <= workload.slo.tpot_s * 1e3)
    )


def _simulated(
    workload: WorkloadSpec, params: FleetParams, most: int, target: float, seed: int
) -> dict[str, object]:
    """The fleet simulation of this autoscaled run, and the cheapest static layout meeting
    ``target`` (prefill and decode counts up to ``most`` each)."""
    mode = PlacementMode.ADAPTIVE
    scaled = simulate(FleetConfig(most, most, mode=mode, autoscale=True), params, workload, seed)
    statics = [
        simulate(FleetConfig(p, d, mode=mode), params, workload, seed)
        for p in range(0, most + 1)
        for d in range(1, most + 1)
    ]
    meeting = [r for r in statics if r.meets(target)]
    best = min(meeting, key=lambda r: r.worker_hours) if meeting else None
    return {
        "autoscaled": {
            "attainment": round(scaled.attainment, 4),
            "worker_hours": round(scaled.worker_hours, 4),
            "peak_by_role": dict(scaled.peak_by_role),
        },
        "best_static": None
        if best is None
        else {
            "config": best.config.describe(),
            "counts": [best.config.prefill, best.config.decode],
            "attainment": round(best.attainment, 4),
            "worker_hours": round(best.worker_hours, 4),
        },
    }


def _windows(
    records: list[RequestRecord], specs: list[RequestSpec], duration_s: float, width_s: float
) -> list[dict[str, float]]:
    """Per window of arrivals: the load (req/s) and the TTFT and ITL p90 (ms)."""
    rows = []
    for start in range(0, math.ceil(duration_s), int(width_s)):
        inside = [
            rec for rec, spec in zip(records, specs, strict=True)
            if start <= spec.arrival_s < start + width_s
        ]  # fmt: skip
        ttfts = [r.ttft_ms for r in inside if r.ttft_ms is not None]
        itls = [r.tpot_ms for r in inside if r.tpot_ms is not None]
        rows.append(
            {
                "t": start + width_s / 2,
                "rate": len(inside) / width_s,
                "ttft_p90_ms": percentile(ttfts, 90) if ttfts else math.nan,
                "itl_p90_ms": percentile(itls, 90) if itls else math.nan,
            }
        )
    return rows


def _picture(
    samples: list[Sample], windows: list[dict[str, float]], workload: WorkloadSpec, title: str
) -> str:
    colors = {"prefill": "#1f77b4", "decode": "#ff7f0e"}
    workers = []
    for role in ROLES:
        workers.append(
            Series(f"{role} desired", [(s.t, s.desired[role]) for s in samples],
                   colors[role], dashed=True)
        )  # fmt: skip
        workers.append(
            Series(f"{role} live", [(s.t, s.live.get(role, 0)) for s in samples],
                   colors[role], step=True)
        )  # fmt: skip
    latency = [
        Series("TTFT p90", [(w["t"], w["ttft_p90_ms"] / 1e3) for w in windows], "#2ca02c"),
        Series("ITL p90 x 20", [(w["t"], w["itl_p90_ms"] * 20 / 1e3) for w in windows],
               "#9467bd"),
    ]  # fmt: skip
    slo = workload.slo
    panels = [
        Panel(
            f"{title}: arrivals",
            [Series("req/s", [(w["t"], w["rate"]) for w in windows], "#333")],
            "req/s",
        ),
        Panel("workers: desired (coordinator's figure) and live processes", workers, "workers"),
        Panel(
            "latency per window of arrivals",
            latency,
            "seconds",
            references=[
                (f"TTFT SLO {slo.ttft_s:g} s", slo.ttft_s),
                (f"ITL SLO {slo.tpot_s * 1e3:g} ms (x 20)", slo.tpot_s * 20),
            ],
        ),  # fmt: skip
    ]
    return timeline_svg(panels, "seconds since the load began")


def render(path: Path) -> None:
    """Draw ``path``'s picture (``.svg`` beside it) from its recorded timeline."""
    result = json.loads(path.read_text())
    workload = scenario(result["workload"])
    samples = [Sample(t["t"], t["desired"], t["live"]) for t in result["timeline"]]
    path.with_suffix(".svg").write_text(
        _picture(samples, result["windows"], workload, result["title"])
    )


def main() -> int:
    args = _parser().parse_args()
    if args.render is not None:
        render(args.render)
        return 0
    workload = scenario(args.workload, args.size)
    workload = workload.scaled(
        rate=args.rate, duration_s=None if args.minutes is None else args.minutes * 60
    )
    if args.factor is not None:
        workload = replace(workload, shape=replace(workload.shape, factor=args.factor))
    if args.minutes is not None and workload.shape.kind == "sinusoid":
        workload = replace(workload, shape=replace(workload.shape, period_s=args.minutes * 60))
    specs = with_prompts(requests(workload, args.seed), args.seed)
    settings = ScalerSettings(
        check_interval_s=args.interval_s,
        stabilization_s=args.window_s,
        scale_down_period_s=args.period_s,
    )
    profile = load_profile(args.profile)
    params = FleetParams.from_profile(profile, startup_s=args.startup_s, scaler=settings)
    simulated = _simulated(workload, params, args.max_workers, args.target, args.seed)
    best = simulated["best_static"]
    worker_flags = ["--speculative-tokens=0"]
    if args.engine == "sim":
        worker_flags += ["--engine=sim", f"--sim-profile={args.profile}",
                         f"--sim-startup-s={args.startup_s}"]  # fmt: skip
    scaling = [
        "--autoscale", f"--max-workers={args.max_workers}",
        f"--autoscale-interval-s={args.interval_s}", f"--scale-down-window-s={args.window_s}",
        f"--scale-down-period-s={args.period_s}", "--prefill=1", "--decode=1",
    ]  # fmt: skip
    if args.static is not None:
        counts = best["counts"] if args.static == "best" and best else args.static.split(",")
        scaling = [f"--prefill={counts[0]}", f"--decode={counts[1]}"]
    up_flags = [*scaling, "--placement=adaptive", "--", *worker_flags]
    date = time.strftime("%Y-%m-%d")
    kind = "static" if args.static is not None else "autoscaled"
    if args.engine == "sim":
        kind += f"-startup-{args.startup_s:g}s"
    out = args.out or RESULTS_DIR / f"autoscale-{args.workload}-{args.engine}-{kind}-{date}.json"
    log = out.with_suffix(".log")
    print(f"workload: {workload.name}, {len(specs)} requests over {workload.duration_s:.0f} s; "
          f"up {' '.join(up_flags)}", flush=True)  # fmt: skip
    splitserve = Path(os.environ.get("SPLITSERVE_BIN", ROOT / ".venv" / "bin" / "splitserve"))
    with LocalCluster(splitserve, up_flags, log) as cluster:
        metrics_url = cluster.log_lines("[coordinator] coordinator metrics at")[0].split()[-1]
        model = served_model(cluster.http_url)
        sampler = Sampler(cluster, metrics_url, args.sample_s)
        target = OpenAITarget(cluster.http_url, model, timeout_s=900)
        records = asyncio.run(run_requests_against(target, specs))
        samples = sampler.stop()
        moves = cluster.log_lines("splitserve up: autoscale")
    served = sum(r.completed and r.num_output_tokens == r.output_len for r in records)
    failed = sum(r.error is not None for r in records)
    cut = sum(r.error is None and r.num_output_tokens < r.output_len for r in records)
    within = sum(within_slo(r, workload) for r in records)
    hours = _worker_hours(samples, workload.duration_s)
    total_hours = sum(hours.values())
    windows = _windows(records, specs, workload.duration_s, 30.0)
    directions = {role: _direction_changes(samples, role) for role in ROLES}
    result = {
        "date": date,
        "cpu": cpu_name(),
        "workload": workload.name,
        "rate": workload.rate,
        "peak_rate": workload.peak_rate,
        "duration_s": workload.duration_s,
        "engine": args.engine,
        "static": up_flags[:2] if args.static is not None else None,
        "profile": args.profile,
        "startup_s": args.startup_s if args.engine == "sim" else None,
        "settings": {
            "interval_s": args.interval_s,
            "window_s": args.window_s,
            "period_s": args.period_s,
            "max_workers": args.max_workers,
        },  # fmt: skip
        "requests": len(records),
        "served_whole": served,
        "failed": failed,
        "errors": sorted({(r.error or "")[:200] for r in records if r.error}),
        "cut": cut,
        "within_slo": within,
        "attainment": round(within / max(len(records), 1), 4),
        "worker_hours": {role: round(h, 4) for role, h in hours.items()},
        "worker_hours_total": round(total_hours, 4),
        "vs_best_static": None if not best else round(total_hours / best["worker_hours"], 3),
        "direction_changes": {
            role: {"total": n, "most_in_10_min": m} for role, (n, m) in directions.items()
        },  # fmt: skip
        "simulated": simulated,
        "autoscale_lines": moves,
        "timeline": [
            {"t": round(s.t, 1), "desired": s.desired, "live": s.live} for s in samples
        ],  # fmt: skip
        "windows": windows,
    }
    how = f"static {up_flags[0]} {up_flags[1]}" if args.static else "autoscaled"
    workers = (
        f"sim workers (start-up {args.startup_s:g} s)" if args.engine == "sim" else "real workers"
    )
    title = f"{workload.name}, {how}, {workers}"
    result["title"] = title
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    out.with_suffix(".svg").write_text(_picture(samples, windows, workload, title))
    print(json.dumps({k: v for k, v in result.items()
                      if k not in ("timeline", "windows", "autoscale_lines")}, indent=1,
                     default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
