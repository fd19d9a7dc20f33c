"""The scale benchmark (issue 31): coordinators (each with a gateway) x simulated workers x
concurrent streams, through the real services over real HTTP.

For every combination of ``--coordinators``, ``--workers`` and ``--streams`` it starts a fresh
``splitserve up --placement adaptive --coordinators C --gateways C`` whose workers are
simulated (``--engine sim`` with ``--sim-profile``, a quarter prefill and the rest decode,
``--workers-per-process`` to a process), waits for the machine to go quiet, then sends the
streams at once from ``--clients`` client processes (``bench_crowd``'s hand-written HTTP/1.1
client: every stream its own connection to the gateways' shared port, timed from its own
send) and asks ``--max-tokens`` tokens of each (EOS ignored). While the streams run it
samples every cluster process's resident memory; before and after, each process's CPU time.

Reported per run (JSON, one row per run on stderr):
- ``tokens``: streamed tokens the clients received; ``tokens_per_s`` over the run's wall time;
- ``cpu_s`` per role and ``us_per_token`` (coordinator, gateway, decode, prefill, up, the
  clients); ``tokens_per_coordinator_core_s`` / ``tokens_per_gateway_core_s``: tokens per
  CPU-second of all coordinators / all gateways (what one core of that role relays);
- ``ttft_s`` and ``itl_ms`` percentiles of the served streams (ITL: a stream's mean gap
  between tokens) and ``itl_added_ms`` (the ITL p50 / p99 less the simulated step time of
  the profile at that batch: what the relay and the CPU it shares added);
- ``memory``: the coordinators' and gateways' peak resident memory over their idle memory,
  per open stream (KB);
- ``outcomes``: counts by kind (``served``, ``refused`` = 429 with Retry-After, anything else
  is an error and named).

And per (coordinators, workers) at the most streams: the relayed throughput's growth from one
coordinator (``efficiency``: tok/s at C over C x tok/s at 1). A PNG (``--png``) plots tok/s and
ITL p99 against streams, one line per (C, W). Every figure is this machine's; nothing is
asserted.

    .venv/bin/python bench/bench_scale.py --out bench/results/scale-<date>.json \\
        --png bench/results/scale-<date>.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench_crowd import CrowdRecord, _run_crowd, percentiles
from bench_relay_cpu import role_of, ticks_by_role
from bench_security import tree_cluster
from cluster_process import CLK_TCK
from machine_bound import cpu_name
from timing_stats import Json, emit_report, log_row, wait_for_quiet

PROFILE = Path(__file__).resolve().parent / "profiles" / "relay-stand-in.json"
RELAY_ROLES = ("coordinator", "gateway")


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class MemorySampler:
    """The peak resident memory per role over a run, sampled every ``every_s``."""

    def __init__(self, pids: Sequence[int], every_s: float = 0.5) -> None:
        self._roles = {pid: role_of(pid) for pid in pids}
        self.idle_kb = self._by_role()
        self.peak_kb = dict(self.idle_kb)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _by_role(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for pid, role in self._roles.items():
            totals[role] = totals.get(role, 0) + _rss_kb(pid)
        return totals

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            for role, kb in self._by_role().items():
                self.peak_kb[role] = max(self.peak_kb.get(role, 0), kb)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _step_ms(profile: Json, batch: int) -> float:
    """The profile's decode step time at ``batch`` requests (context cost left out: the
    streams' contexts are short)."""
    cost = profile["step_cost"]
    return (cost["decode_base_s"] + cost["per_decode_seq_s"] * batch) * 1e3


def _own_cpu_s() -> float:
    """This process's CPU time and that of its waited-for children (the client processes)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def up_flags(args: argparse.Namespace, coordinators: int, workers: int) -> list[str]:
    prefill = max(1, workers // 4)
    decode = workers - prefill
    per_process = min(args.workers_per_process, workers)
    return [
        "--placement", "adaptive", "--coordinators", str(coordinators),
        "--gateways", str(coordinators), "--prefill", str(prefill), "--decode", str(decode),
        "--workers-per-process", str(per_process), "--max-inflight", str(args.max_inflight),
        "--", "--engine", "sim", "--sim-profile", str(args.profile),
    ]  # fmt: skip


def one_run(args: argparse.Namespace, coordinators: int, workers: int, streams: int) -> Json:
    flags = up_flags(args, coordinators, workers)
    log_path = Path(tempfile.mkdtemp(prefix="scale-")) / "up.log"
    env = {"SPLITSERVE_MAX_QUEUED": str(args.max_queued)}
    row: Json = {"coordinators": coordinators, "workers": workers, "streams": streams}
    with tree_cluster(flags, log_path, args.tree, env, ready_timeout_s=600) as cluster:
        wait_for_quiet(args.wait_quiet_s)
        pids = cluster.pids()
        crowd_args = argparse.Namespace(
            via="http", streams=streams, clients=args.clients, lead_s=args.lead_s,
            timeout_s=args.timeout_s, max_tokens=args.max_tokens, records=None,
        )  # fmt: skip
        before, own_before = ticks_by_role(pids), _own_cpu_s()
        started = time.perf_counter()
        with MemorySampler(pids) as memory:
            crowd, records = asyncio.run(_crowd(cluster.http_url, crowd_args))
        wall_s = time.perf_counter() - started - args.lead_s
        after, own_after = ticks_by_role(pids), _own_cpu_s()
        errors = [line for line in cluster.log_lines("Traceback")][:10]
    served = [r for r in records if r.outcome == "served"]
    tokens = sum(r.tokens for r in records)
    cpu_s = {role: (after[role] - before.get(role, 0)) / CLK_TCK for role in after}
    cpu_s["clients"] = own_after - own_before  # the bench and its client processes
    itl_ms = [
        (r.last_token_s - r.first_token_s) / (r.tokens - 1) * 1e3
        for r in served
        if r.tokens > 1 and r.first_token_s is not None and r.last_token_s is not None
    ]
    itl = percentiles(itl_ms)
    batch = len(served) / max(1, workers - max(1, workers // 4))
    step_ms = _step_ms(args.profile_json, round(batch))
    open_peak = min(streams, len(served) + 1)
    row |= {
        "wall_s": round(wall_s, 1),
        "tokens": tokens,
        "tokens_per_s": round(tokens / max(wall_s, 1e-9), 1),
        "outcomes": crowd["counts"],
        "cpu_s": {role: round(s, 2) for role, s in sorted(cpu_s.items())},
        "us_per_token": {
            role: round(s / tokens * 1e6, 1) for role, s in sorted(cpu_s.items()) if tokens
        },
        "ttft_s": percentiles([r.first_token_s for r in served if r.first_token_s]),
        "itl_ms": itl,
        "sim_step_ms": round(step_ms, 1),
        "itl_added_ms": {q: round(itl[q] - step_ms, 1) for q in ("p50", "p99") if q in itl},
        "memory_kb_per_stream": {
            role: round((memory.peak_kb[role] - memory.idle_kb.get(role, 0)) / open_peak, 1)
            for role in RELAY_ROLES
            if role in memory.peak_kb
        },
        "peak_rss_mb": {role: round(kb / 1024) for role, kb in sorted(memory.peak_kb.items())},
        "cluster_tracebacks": errors,
    }
    for role in RELAY_ROLES:
        if cpu_s.get(role):
            row[f"tokens_per_{role}_core_s"] = round(tokens / cpu_s[role])
    return row


async def _crowd(url: str, crowd_args: argparse.Namespace) -> tuple[Json, list[CrowdRecord]]:
    """``bench_crowd``'s crowd, returning its summary and every record."""
    records_path = Path(tempfile.mkdtemp(prefix="scale-records-")) / "records.jsonl"
    crowd_args.records = records_path
    report = await _run_crowd(url, None, crowd_args)
    records = [
        CrowdRecord(**json.loads(line))
        for line in records_path.read_text().splitlines()
        if line.strip()
    ]
    return report["crowd"], records


def efficiency(rows: Sequence[Json]) -> list[Json]:
    """Per workers count, at the most streams: tok/s at C coordinators over C x tok/s at 1."""
    out = []
    for workers in sorted({row["workers"] for row in rows}):
        most = max(row["streams"] for row in rows if row["workers"] == workers)
        at = {
            row["coordinators"]: row["tokens_per_s"]
            for row in rows
            if row["workers"] == workers and row["streams"] == most
        }
        one = at.get(1)
        for coordinators, rate in sorted(at.items()):
            out.append({
                "workers": workers, "streams": most, "coordinators": coordinators,
                "tokens_per_s": rate,
                "efficiency": None if not one else round(rate / (coordinators * one), 2),
            })  # fmt: skip
    return out


def plot(rows: Sequence[Json], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rate_axes, itl_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for coordinators in sorted({row["coordinators"] for row in rows}):
        for workers in sorted({row["workers"] for row in rows}):
            line = sorted(
                (row for row in rows
                 if row["coordinators"] == coordinators and row["workers"] == workers),
                key=lambda row: row["streams"],
            )  # fmt: skip
            if not line:
                continue
            label = f"{coordinators} coord x {workers} workers"
            streams = [row["streams"] for row in line]
            rate_axes.plot(streams, [row["tokens_per_s"] for row in line], marker="o", label=label)
            itl_axes.plot(
                streams, [row["itl_ms"].get("p99", float("nan")) for row in line], marker="o"
            )
    rate_axes.set(xlabel="concurrent streams", ylabel="relayed tokens/s", title="throughput")
    itl_axes.set(xlabel="concurrent streams", ylabel="ITL p99 (ms)", title="inter-token latency")
    rate_axes.legend(fontsize=7)
    figure.suptitle(f"splitserve scale, simulated workers ({cpu_name()})")
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinators", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--streams", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--workers-per-process", type=int, default=16)
    parser.add_argument("--max-inflight", type=int, default=16384, help="per coordinator")
    parser.add_argument("--max-queued", type=int, default=4096, help="per coordinator")
    parser.add_argument("--profile", type=Path, default=PROFILE, help="the sim step profile")
    parser.add_argument("--lead-s", type=float, default=3.0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--wait-quiet-s", type=float, default=20.0)
    parser.add_argument(
        "--tree", type=Path, default=None,
        help="run the clusters from this checkout (e.g. a git worktree), not the working tree",
    )  # fmt: skip
    parser.add_argument("--out", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    args.profile_json = json.loads(args.profile.read_text())
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    report: Json = {
        "machine": {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0))},
        "setup": {
            key: value for key, value in vars(args).items()
            if key not in ("out", "png", "profile_json", "tree")
        } | {"profile": str(args.profile), "tree": str(args.tree)},
        "runs": [],
    }  # fmt: skip
    report["setup"]["up_flags_example"] = shlex.join(up_flags(args, 1, args.workers[0]))
    for workers in args.workers:
        for coordinators in args.coordinators:
            for streams in args.streams:
                row = one_run(args, coordinators, workers, streams)
                report["runs"].append(row)
                log_row(row)
                if args.out is not None:  # what is measured survives a later failure
                    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    report["efficiency"] = efficiency(report["runs"])
    log_row({"efficiency": report["efficiency"]})
    if args.png is not None:
        plot(report["runs"], args.png)
    emit_report(json.loads(json.dumps(report, default=str)), args.out)


if __name__ == "__main__":
    main()
