"""Overload: ``make serve``'s cluster at its sustainable rate, then at twice it, through the
OpenAI gateway (streamed completions over HTTP, Poisson arrivals, chat-like lengths), with
the coordinator admitting within the TPOT target (``--admit-within-tpot``) unless
``--no-admit-within-tpot``.

For each rate, for ``--duration-s`` seconds of arrivals: how many requests were accepted
(HTTP 200) and refused (429), the accepted ones' TTFT and TPOT percentiles and the share
meeting the TPOT target, how long a refusal took to arrive, any other status (a 5xx is a
bug), and the coordinator's and gateway's resident memory (VmRSS, sampled every 0.5 s: start,
peak, end). The sustainable rate is an input (``--rate``, default: the chat knee measured in
bench/log/2026-11.md); the 1x run is the baseline of the 2x run, in the same cluster.

Writes ``bench/results/overload-<date>.json`` and prints a table.

Usage: ``python bench/bench_overload.py [--rate 2.5] [--duration-s 60]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cluster_process import LocalCluster
from loadgen import run_requests
from serving_stats import RequestRecord
from targets import OpenAITarget
from timing_stats import Json, wait_for_quiet
from workload import LengthDist, WorkloadConfig, build_workload

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SPLITSERVE = Path(sys.executable).parent / "splitserve"
ROLES = {"coordinator": "splitserve.coordinator", "gateway": "splitserve.gateway"}


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _role_pids(cluster: LocalCluster) -> dict[str, int]:
    """The coordinator's and the gateway's pids among ``up``'s children."""
    found = {}
    for pid in cluster.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        for role, module in ROLES.items():
            if module in argv:
                found[role] = pid
    return found


@dataclass
class MemorySampler:
    """VmRSS of each process every ``interval_s`` on a thread, until ``stop``."""

    pids: dict[str, int]
    interval_s: float = 0.5
    samples: dict[str, list[int]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for role, pid in self.pids.items():
                rss = _rss_kib(pid)
                if rss is not None:
                    self.samples.setdefault(role, []).append(rss)
            self._stop.wait(self.interval_s)

    def stop(self) -> Json:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return {
            role: {"start_mib": v[0] / 1024, "peak_mib": max(v) / 1024, "end_mib": v[-1] / 1024}
            for role, v in self.samples.items()
            if v
        }


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def _summary(records: Sequence[RequestRecord], tpot_slo_ms: float, memory: Json) -> Json:
    accepted = [r for r in records if r.completed]
    refused = [r for r in records if r.error and r.error.startswith("HTTP 429")]
    other = [r for r in records if not r.completed and r not in refused]
    tpots = [r.tpot_ms for r in accepted if r.tpot_ms is not None]
    ttfts = [r.ttft_ms for r in accepted if r.ttft_ms is not None]
    refusal_ms = [r.e2e_ms for r in refused]
    return {
        "sent": len(records),
        "accepted": len(accepted),
        "refused_429": len(refused),
        "other": len(other),
        "other_errors": sorted({r.error or str(r.finish_reason) for r in other})[:10],
        "ttft_ms": {f"p{q}": _percentile(ttfts, q) for q in (50, 99)},
        "tpot_ms": {f"p{q}": _percentile(tpots, q) for q in (50, 99)},
        "tpot_within_slo": (sum(t <= tpot_slo_ms for t in tpots) / len(tpots)) if tpots else None,
        "refused_after_100ms": sum(ms > 100 for ms in refusal_ms),
        "refusal_ms": {
            "p50": _percentile(refusal_ms, 50),
            "p99": _percentile(refusal_ms, 99),
            "max": max(refusal_ms, default=None),
        },
        "memory": memory,
    }


async def _run_rate(
    cluster: LocalCluster, model: str, rate: float, args: argparse.Namespace, seed: int
) -> Json:
    workload = WorkloadConfig(
        max(1, round(rate * args.duration_s)),
        rate,
        LengthDist.parse(args.input_dist, args.input_mean),
        LengthDist.parse(args.output_dist, args.output_mean),
        seed=seed,
    )
    target = OpenAITarget(cluster.http_url, model)
    sampler = MemorySampler(_role_pids(cluster))
    await target.open()
    sampler.start()
    try:
        records = await run_requests(target, build_workload(workload))
    finally:
        memory = sampler.stop()
        await target.close()
    return _summary(records, args.tpot_slo_ms, memory)


def _served_model(cluster: LocalCluster) -> str:
    import httpx  # the bench's own dependency, as in loadgen

    return httpx.get(f"{cluster.http_url}/v1/models", timeout=30).json()["data"][0]["id"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=2.5, help="sustainable rate, req/s")
    parser.add_argument("--factors", default="1,2", help="multiples of --rate to run")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--input-mean", type=int, default=320)
    parser.add_argument("--input-dist", default="uniform:220:420")
    parser.add_argument("--output-mean", type=int, default=96)
    parser.add_argument("--output-dist", default="uniform:66:126")
    parser.add_argument("--tpot-slo-ms", type=float, default=50.0)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--max-queue-wait", type=float, default=None, help="coordinator flag")
    parser.add_argument(
        "--no-admit-within-tpot", action="store_true", help="run without the TPOT admission cap"
    )
    parser.add_argument("--wait-quiet-s", type=float, default=60.0)
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Json:
    args = parse_args(argv)
    env = {
        "SPLITSERVE_TTFT_SLO_MS": str(args.ttft_slo_ms),
        "SPLITSERVE_TPOT_SLO_MS": str(args.tpot_slo_ms),
        "SPLITSERVE_ADMIT_WITHIN_TPOT": "0" if args.no_admit_within_tpot else "1",
    }
    if args.max_queue_wait is not None:
        env["SPLITSERVE_MAX_QUEUE_WAIT"] = str(args.max_queue_wait)
    busy = wait_for_quiet(args.wait_quiet_s)
    log(f"machine busy before: {busy:.0%}")
    log_path = Path("/tmp/splitserve-bench-overload/cluster.log")
    results: Json = {"date": args.date, "settings": vars(args) | {"out_dir": str(args.out_dir)}}
    with LocalCluster(SPLITSERVE, ["--placement", "adaptive"], log_path, env=env) as cluster:
        model = _served_model(cluster)
        runs = []
        for index, factor in enumerate(float(f) for f in args.factors.split(",")):
            rate = args.rate * factor
            log(f"{factor:g}x: {rate:g} req/s for {args.duration_s:g} s")
            summary = asyncio.run(_run_rate(cluster, model, rate, args, seed=100 + index))
            summary |= {"factor": factor, "rate": rate}
            log(json.dumps(summary))
            runs.append(summary)
            time.sleep(5.0)
        results["runs"] = runs
        results["warnings"] = cluster.log_lines("ERROR")[:20]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"overload-{args.date}.json"
    out.write_text(json.dumps(results, indent=2, default=str))
    print(
        f"{'x':>4} {'req/s':>6} {'sent':>5} {'200':>5} {'429':>5} {'other':>5} "
        f"{'TPOT p99':>9} {'in SLO':>7} {'429 p99 ms':>10} {'coord MiB':>14} {'gw MiB':>14}"
    )
    for run in runs:
        memory = run["memory"]

        def mib(role: str, memory: Json = memory) -> str:
            figures = memory.get(role)
            return f"{figures['start_mib']:.0f}->{figures['peak_mib']:.0f}" if figures else "?"

        share = run["tpot_within_slo"]
        print(
            f"{run['factor']:>4g} {run['rate']:>6.2f} {run['sent']:>5} {run['accepted']:>5} "
            f"{run['refused_429']:>5} {run['other']:>5} {run['tpot_ms']['p99'] or 0:>9.1f} "
            f"{(share or 0):>7.0%} {run['refusal_ms']['p99'] or 0:>10.1f} "
            f"{run['refused_after_100ms']:>10} "
            f"{mib('coordinator'):>14} {mib('gateway'):>14}"
        )
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
