"""What ``splitserve plan`` prints (``launch/plan.py``): the workload, the chosen
configuration with the figures of its own simulation run (goodput, SLO attainment, latency
quantiles, worker-hours, cost per million tokens, the run's seed and simulated minutes) and the
flags that deploy it; with ``--explain`` the runners-up and what the simulation leaves out."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from splitserve.launch.fleet_results import SimResult
from splitserve.launch.fleet_sim import SIMPLIFICATIONS, FleetParams
from splitserve.launch.fleet_workload import WorkloadSpec

if TYPE_CHECKING:
    from splitserve.launch.plan import Plan


def describe_workload(spec: WorkloadSpec) -> str:
    shape = spec.shape
    rate = f"{spec.rate:g} req/s"
    if shape.kind == "burst":
        rate += f", {shape.factor:g}x for {shape.length_s:g} s from {shape.start_s:g} s"
    elif shape.kind == "sinusoid":
        rate += f" to {spec.peak_rate:g} (sinusoid, period {shape.period_s / 60:g} min)"
    turns = (
        f", {spec.multi_turn_share:.0%} continue a conversation" if spec.multi_turn_share else ""
    )
    return (
        f"{spec.name}: {rate}; prompts {spec.prompt.mean}+-{spec.prompt.std:g}, outputs "
        f"{spec.output.mean}+-{spec.output.std:g} tokens{turns}; {spec.duration_s / 60:g} minutes"
    )


def report(result: Plan, params: FleetParams, explain: bool) -> str:
    """The plan as printed."""
    spec, per_hour = result.workload, result.per_worker_hour
    lines = [
        f"workload: {describe_workload(spec)}",
        f"SLO: TTFT <= {spec.slo.ttft_s * 1000:g} ms and ITL <= {spec.slo.tpot_s * 1000:g} ms "
        f"for {result.target:.0%} of requests",
        f"capacity estimate: {result.seed.describe()}",
        f"searched: {len(result.evaluated)} configurations, {result.simulated} simulations in "
        f"{result.search_s:.1f} s",
    ]
    chosen = result.chosen
    if chosen is None:
        best = result.evaluated[0] if result.evaluated else None
        lines.append("no configuration searched meets the SLO; the closest:")
        if best is not None:
            lines.append(f"  {best.config.describe()}: {best.attainment:.1%} ({best.missed_by()})")
    else:
        lines += _chosen_lines(chosen, params, per_hour)
    if explain:
        lines += _runners_up(result)
        lines.append("what the simulation leaves out:")
        lines += [f"  - {line}" for line in SIMPLIFICATIONS]
    return "\n".join(lines)


def _chosen_lines(chosen: SimResult, params: FleetParams, per_hour: float) -> list[str]:
    config = chosen.config
    placement = f"--placement {config.mode.value} --local-prefill-max-tokens "
    placement += str(config.local_prefill_max_tokens)
    slo = f"--ttft-slo-ms {chosen.ttft_slo_s * 1000:g} --tpot-slo-ms {chosen.itl_slo_s * 1000:g}"
    if config.autoscale:
        counts = (
            f"plan: at most {config.prefill} prefill and {config.decode} decode workers, scaled "
            f"(KEDA maxReplicaCount; {chosen.worker_seconds / chosen.duration_s:.1f} workers on "
            f"average, each serving {params.startup_s:g} s after it is asked for), "
            f"{config.dual} dual-role"
        )
        run = f"  coordinator: {placement} {slo} --scale-utilization {config.scale_utilization:g}"
    else:
        counts = (
            f"plan: {config.prefill} prefill, {config.decode} decode, {config.dual} dual-role "
            "workers (static)"
        )
        flags = f"--prefill {config.prefill} --decode {config.decode} --dual {config.dual}"
        run = f"  splitserve up {flags} {placement} (coordinator: {slo})"
    return [
        counts,
        f"  placement: {config.mode.value}, local_prefill_max_tokens "
        f"{config.local_prefill_max_tokens}" + ("" if config.places else " (no choice: all local)"),
        run,
        f"  expected goodput {chosen.goodput:.2f} req/s; {chosen.attainment:.1%} of requests "
        f"within the SLO ({chosen.missed_by()} missed); TTFT p90 "
        f"{chosen.quantile('ttft_s', 0.9):.2f} s, ITL p90 "
        f"{chosen.quantile('itl_s', 0.9) * 1000:.1f} ms, queue wait p90 "
        f"{chosen.quantile('queue_wait_s', 0.9):.2f} s",
        f"  {chosen.worker_hours:.2f} worker-hours = {chosen.cost(per_hour):.2f} at "
        f"{per_hour:g}/worker-hour: {chosen.cost_per_million_tokens(per_hour):.2f} per million "
        "tokens (prompt and output)",
        f"  from the {chosen.describe_run()}",
    ]


def _runners_up(result: Plan, most: int = 8) -> list[str]:
    """The dearer configurations that met the SLO, then those as cheap or cheaper that
    missed it (why the plan is not cheaper), each with its own run's figures."""
    per_hour = result.per_worker_hour
    chosen = result.chosen
    ranked = result.ranked()
    met = [r for r in ranked if r.meets(result.target) and r is not chosen]
    limit = math.inf if chosen is None else chosen.cost(per_hour) + 1e-9
    missed = [r for r in ranked if not r.meets(result.target) and r.cost(per_hour) <= limit]
    header = (
        f"  {'configuration':34} {'within SLO':>10} {'goodput':>8} {'worker-h':>8} "
        f"{'cost/Mtok':>9}  misses"
    )
    lines = ["runners-up (each from its own simulation run: same seed, same requests)"]
    for title, runs in (
        ("met the SLO, dearer:", met[:most]),
        ("as cheap or cheaper, missed the SLO:", missed[:most]),
    ):
        lines += [title, header] if runs else [f"{title} none simulated"]
        lines += [
            f"  {run.config.describe():34} {run.attainment:10.1%} {run.goodput:8.2f} "
            f"{run.worker_hours:8.2f} {run.cost_per_million_tokens(per_hour):9.2f}  "
            f"{run.missed_by()}"
            for run in runs
        ]
    return lines
