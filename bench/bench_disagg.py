"""Disaggregated vs colocated serving on this machine: goodput under a tight TPOT SLO.

Two cluster configurations of ``splitserve up``, each worker pinned to its own core:

- ``disaggregated``: ``--prefill 1 --decode 1 --local-prefill-max-tokens 0``: every prompt is
  prefilled on the prefill worker and its KV pushed over UCX to the decode worker, whose
  decode steps are never interrupted by a prefill;
- ``colocated``: ``--prefill 0 --decode 2``: two decode workers, each prefilling its own
  requests' prompts in the same steps as its running requests' decodes (each worker does both
  phases);
- ``adaptive`` (only with ``--configs``): 1 + 1 with ``--placement adaptive``: per request, a
  prompt runs on the decode worker when the prefill queue puts the TTFT target at risk and the
  decode batch keeps its TPOT target (explicit ``--slo-*-ms`` are also the coordinator's
  targets, through ``SPLITSERVE_TTFT_SLO_MS`` / ``SPLITSERVE_TPOT_SLO_MS``);
- ``always-local`` (only with ``--configs``): 1 + 1 with ``--placement local``: every prompt
  on the decode worker, the prefill worker idle (the baseline that shows what the prefill
  worker adds).

For each configuration: start the cluster (wait for its ready line), send a few warm-up
requests, measure unloaded latencies (requests one at a time at the mean input and output
length: TTFT and TPOT medians), then run the load generator (``loadgen.py``) at each request
rate (Poisson arrivals, ``rate * --window-s`` requests, at least ``--min-requests``), and stop
the cluster with SIGTERM. Both configurations get the same requests at each rate (a seed per
rate, so no prompt repeats across rates and the prefix cache never helps); inputs uniform in
128..512 tokens, outputs uniform in 64..128, greedy, ``ignore_eos``.

SLOs (unless given): TPOT = ``--tpot-slo-factor`` x the unloaded TPOT, TTFT =
``--ttft-slo-factor`` x the unloaded TTFT, each the larger of the two configurations' figures
(neither is favoured when idle). Goodput = completed requests per second meeting both; it is
also reported at looser TPOT SLOs. The machine is shared: before each cluster starts the bench
waits for idle CPUs, and each run records the CPU share other processes took while it ran.

Writes ``bench/results/disagg-<date>[-<tag>].json`` and ``disagg-goodput-<date>[-<tag>].png``
(goodput and TPOT p99 against the request rate) and prints a table. ``--cluster-env KEY=VALUE``
runs the clusters with extra environment variables (e.g. ``UCXPY_ENABLE_PYTHON_FUTURE=1``).

Usage: ``python bench/bench_disagg.py [--rates 0.4,0.8,...] [--window-s 40] [--configs ...]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from cluster_process import CpuMeter, LocalCluster
from loadgen import run_requests
from serving_stats import RequestRecord, Slo, summarize
from targets import GrpcTarget
from timing_stats import Json, wait_for_quiet
from workload import LengthDist, WorkloadConfig, build_workload

CONFIGS: dict[str, list[str]] = {
    "disaggregated": ["--prefill", "1", "--decode", "1", "--local-prefill-max-tokens", "0"],
    "colocated": ["--prefill", "0", "--decode", "2"],
    "adaptive": ["--prefill", "1", "--decode", "1", "--placement", "adaptive"],
    "always-local": ["--prefill", "1", "--decode", "1", "--placement", "local"],
}
DEFAULT_CONFIGS = ("disaggregated", "colocated")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SPLITSERVE = Path(sys.executable).parent / "splitserve"
CALIBRATION_SEED_OFFSET = 1000
WARMUP_SEED_OFFSET = 2000
LOOSE_TPOT_FACTORS = (2.0, 3.0)


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.25,0.5,0.8,1.2,1.6", help="req/s, comma-separated")
    parser.add_argument("--window-s", type=float, default=40.0, help="arrival window per rate")
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"which configurations, of {', '.join(CONFIGS)}",
    )
    parser.add_argument("--input-dist", default="uniform:128:512")
    parser.add_argument("--output-dist", default="uniform:64:128")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=3)
    parser.add_argument("--calibration-requests", type=int, default=5)
    parser.add_argument("--tpot-slo-factor", type=float, default=1.5)
    parser.add_argument("--ttft-slo-factor", type=float, default=4.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="overrides the factor")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="overrides the factor")
    parser.add_argument("--worker-args", default="", help="flags for every worker (after --)")
    parser.add_argument(
        "--cluster-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable of the cluster's processes (repeatable)",
    )
    parser.add_argument("--tag", default="", help="suffix of the output file names")
    parser.add_argument("--wait-quiet-s", type=float, default=180.0)
    parser.add_argument("--date", default="2026-11-21", help="date in the output file names")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "splitserve-bench-disagg"
    )
    parser.add_argument("--keep-requests", action="store_true", help="per-request rows in JSON")
    return parser.parse_args(argv)


def length_dists(args: argparse.Namespace) -> tuple[LengthDist, LengthDist]:
    # the mean argument only matters for fixed/normal specs: use a midpoint of the bounds
    return LengthDist.parse(args.input_dist, 320), LengthDist.parse(args.output_dist, 96)


def num_requests_at(rate: float, args: argparse.Namespace) -> int:
    return max(args.min_requests, round(rate * args.window_s))


# ---- one configuration: start, warm up, calibrate, run every rate, stop ---------------------


async def _sequential(target: GrpcTarget, workload: WorkloadConfig) -> list[RequestRecord]:
    return await run_requests(target, build_workload(workload), max_concurrency=1)


async def _drive(cluster: LocalCluster, args: argparse.Namespace) -> Json:
    input_len, output_len = length_dists(args)
    target = GrpcTarget(cluster.address, timeout_s=600.0)
    await target.open()
    try:
        warmup = WorkloadConfig(
            args.warmup_requests,
            math.inf,
            input_len,
            output_len,
            seed=args.seed + WARMUP_SEED_OFFSET,
        )
        await _sequential(target, warmup)
        fixed_in = LengthDist("fixed", input_len.mean, input_len.mean, input_len.mean)
        fixed_out = LengthDist("fixed", output_len.mean, output_len.mean, output_len.mean)
        calibration = WorkloadConfig(
            args.calibration_requests,
            math.inf,
            fixed_in,
            fixed_out,
            seed=args.seed + CALIBRATION_SEED_OFFSET,
        )
        calibration_records = await _sequential(target, calibration)
        runs = []
        for index, rate in enumerate(parse_rates(args.rates)):
            workload = WorkloadConfig(
                num_requests_at(rate, args), rate, input_len, output_len, seed=args.seed + index
            )
            log(f"  rate {rate} req/s: {workload.num_requests} requests")
            meter = CpuMeter(cluster)
            meter.start()
            records = await run_requests(target, build_workload(workload))
            cpu = meter.stop()
            quick = summarize(records, Slo())
            log(
                f"    done: {quick.completed}/{quick.num_requests} ok, "
                f"TTFT p50 {quick.ttft_ms.p50:.0f} ms, TPOT p50 {quick.tpot_ms.p50:.1f} ms "
                f"p99 {quick.tpot_ms.p99:.1f} ms, other CPU {cpu['other_share']:.0%}"
            )
            runs.append({"rate": rate, "seed": workload.seed, "cpu": cpu, "records": records})
            await asyncio.sleep(2.0)  # let stragglers' cleanup and heartbeats settle
    finally:
        await target.close()
    return {"calibration_records": calibration_records, "runs": runs}


def run_config(name: str, args: argparse.Namespace, log_dir: Path) -> Json:
    flags = ["--no-gateway", *CONFIGS[name]]  # gRPC load: no HTTP gateway process
    flags += ["--", *shlex.split(args.worker_args)] if args.worker_args else []
    busy = wait_for_quiet(args.wait_quiet_s)
    log(f"{name}: splitserve up {' '.join(flags)} (machine busy before: {busy})")
    env = dict(item.split("=", 1) for item in args.cluster_env)
    # explicit SLOs are also the coordinator's targets (adaptive placement decides by them)
    if args.slo_ttft_ms is not None:
        env.setdefault("SPLITSERVE_TTFT_SLO_MS", str(args.slo_ttft_ms))
    if args.slo_tpot_ms is not None:
        env.setdefault("SPLITSERVE_TPOT_SLO_MS", str(args.slo_tpot_ms))
    cluster = LocalCluster(SPLITSERVE, flags, log_dir / f"cluster-{name}.log", env=env)
    started = time.monotonic()
    with cluster:
        log(f"{name}: ready at {cluster.address} in {time.monotonic() - started:.1f}s")
        measured = asyncio.run(_drive(cluster, args))
    measured["warnings"] = cluster.log_lines("WARNING")[:20] + cluster.log_lines("ERROR")[:20]
    measured["flags"] = flags
    measured["busy_before"] = busy
    return measured


def parse_rates(spec: str) -> list[float]:
    return [float(r) for r in spec.split(",") if r.strip()]


# ---- SLOs, tables, the report ---------------------------------------------------------------


def unloaded(records: Sequence[RequestRecord]) -> Json:
    done = [r for r in records if r.completed]
    return {
        "ttft_ms": round(statistics.median(r.ttft_ms or 0.0 for r in done), 2),
        "tpot_ms": round(statistics.median(r.tpot_ms or 0.0 for r in done), 2),
        "requests": len(done),
    }


def choose_slo(calibration: dict[str, Json], args: argparse.Namespace) -> Slo:
    ttft = max(c["ttft_ms"] for c in calibration.values())
    tpot = max(c["tpot_ms"] for c in calibration.values())
    return Slo(
        ttft_ms=args.slo_ttft_ms or round(args.ttft_slo_factor * ttft, 1),
        tpot_ms=args.slo_tpot_ms or round(args.tpot_slo_factor * tpot, 1),
    )


def run_rows(name: str, measured: Json, slo: Slo, loose: Sequence[Slo], keep: bool) -> list[Json]:
    """One row per rate: the summary under ``slo``, the goodput under each looser SLO."""
    rows = []
    for run in measured["runs"]:
        row = {
            "config": name,
            "rate": run["rate"],
            "seed": run["seed"],
            "cpu": run["cpu"],
            "summary": summarize(run["records"], slo).to_json(),
            "goodput_at_tpot_slo_ms": {
                str(other.tpot_ms): summarize(run["records"], other).goodput for other in loose
            },
        }
        if keep:
            row["requests"] = [r.row() for r in run["records"]]
        rows.append(row)
    return rows


def print_table(rows: Sequence[Json], slo: Slo) -> None:
    print(f"\nSLO: TTFT <= {slo.ttft_ms} ms, TPOT <= {slo.tpot_ms} ms")
    header = (
        f"{'rate':>5} {'config':<14}{'goodput':>8}{'attain':>8}{'TTFT p50':>9}{'p99':>8}"
        f"{'TPOT p50':>9}{'p99':>7}{'req/s':>7}{'tok/s':>7}{'fail':>5}{'other':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in sorted(rows, key=lambda r: (r["rate"], r["config"])):
        s = row["summary"]
        print(
            f"{row['rate']:>5.2f} {row['config']:<14}{s['goodput']:>8.3f}"
            f"{s['slo_attainment']:>8.0%}{s['ttft_ms']['p50']:>9.0f}{s['ttft_ms']['p99']:>8.0f}"
            f"{s['tpot_ms']['p50']:>9.1f}{s['tpot_ms']['p99']:>7.1f}"
            f"{s['request_throughput']:>7.3f}{s['output_throughput']:>7.1f}{s['failed']:>5}"
            f"{row['cpu']['other_share']:>6.0%}"
        )


def comparison(rows: Sequence[Json]) -> Json:
    """Disaggregated / colocated goodput per rate and at each one's best rate, and the highest
    rate at which each kept SLO attainment >= 90% (DistServe's measure)."""
    by = {(r["config"], r["rate"]): r["summary"]["goodput"] for r in rows}
    per_rate = {}
    for (config, rate), goodput in sorted(by.items()):
        other = by.get(("colocated", rate))
        if config == "disaggregated" and other is not None:
            per_rate[str(rate)] = round(goodput / other, 2) if other else None
    best = {
        c: max((g for (config, _), g in by.items() if config == c), default=0.0)
        for c in DEFAULT_CONFIGS
    }
    peak_ratio = best["disaggregated"] / best["colocated"] if best["colocated"] else None
    attained = {
        c: max(
            (r["rate"] for r in rows if r["config"] == c and r["summary"]["slo_attainment"] >= 0.9),
            default=0.0,
        )
        for c in DEFAULT_CONFIGS
    }
    return {
        "max_rate_at_90pct_attainment": attained,
        "goodput_ratio_per_rate": per_rate,
        "peak_goodput": best,
        "peak_goodput_ratio": None if peak_ratio is None else round(peak_ratio, 2),
        "disaggregated_at_least_1_5x": peak_ratio is None or peak_ratio >= 1.5,
    }


def plot(rows: Sequence[Json], slo: Slo, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    rates = sorted({r["rate"] for r in rows})
    for config, marker in zip(CONFIGS, "osd^", strict=True):
        mine = sorted((r for r in rows if r["config"] == config), key=lambda r: r["rate"])
        if not mine:
            continue
        xs = [r["rate"] for r in mine]
        left.plot(xs, [r["summary"]["goodput"] for r in mine], marker=marker, label=config)
        right.plot(xs, [r["summary"]["tpot_ms"]["p99"] for r in mine], marker=marker, label=config)
    left.plot(rates, rates, "k:", linewidth=1, label="offered rate")
    left.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)")
    left.set_title(f"goodput (TTFT <= {slo.ttft_ms:.0f} ms, TPOT <= {slo.tpot_ms:.0f} ms)")
    right.axhline(slo.tpot_ms, color="k", linestyle="--", linewidth=1, label="TPOT SLO")
    right.set(xlabel="request rate (req/s)", ylabel="TPOT p99 (ms)", title="TPOT p99")
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> Json:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    measured = {}
    for name in args.configs.split(","):
        measured[name] = run_config(name, args, args.log_dir)
    calibration = {n: unloaded(m["calibration_records"]) for n, m in measured.items()}
    for name, figures in calibration.items():
        log(f"{name} unloaded: TTFT {figures['ttft_ms']} ms, TPOT {figures['tpot_ms']} ms")
    slo = choose_slo(calibration, args)
    base_tpot = max(c["tpot_ms"] for c in calibration.values())
    loose = [Slo(slo.ttft_ms, round(f * base_tpot, 1)) for f in LOOSE_TPOT_FACTORS]
    rows = [
        row
        for name, m in measured.items()
        for row in run_rows(name, m, slo, loose, args.keep_requests)
    ]
    print_table(rows, slo)
    report: Json = {
        "date": args.date,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "configs": {
            n: {"flags": m["flags"], "busy_before": m["busy_before"]} for n, m in measured.items()
        },
        "unloaded": calibration,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "comparison": comparison(rows) if set(DEFAULT_CONFIGS) <= set(measured) else None,
        "peak_goodput": {
            c: max((r["summary"]["goodput"] for r in rows if r["config"] == c), default=0.0)
            for c in measured
        },
        "cluster_warnings": {n: m["warnings"] for n, m in measured.items()},
        "runs": rows,
        "wall_s": round(time.monotonic() - started, 1),
    }
    suffix = f"-{args.tag}" if args.tag else ""
    json_path = args.out_dir / f"disagg-{args.date}{suffix}.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    png_path = args.out_dir / f"disagg-goodput-{args.date}{suffix}.png"
    plot(rows, slo, png_path)
    if report["comparison"]:
        print(f"\ncomparison: {json.dumps(report['comparison'])}")
    print(f"wrote {json_path} and {png_path} ({report['wall_s']} s)")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
