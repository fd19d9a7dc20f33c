"""Relayed tokens per coordinator CPU-second from 1 to 4 coordinators (issue 60, item 3).

Per repetition and per coordinator count N of ``--coordinators`` (default 1,2,3,4),
alternated, starts ``splitserve up --coordinators N`` afresh (``cluster_process.
LocalCluster``) with simulated workers (``--up-flags``, default ``SIM_FLAGS``: 2 prefill and
8 decode workers hosted 8 to a process; every worker registers with every coordinator, and
the gateway spreads its streams round robin over the coordinators,
``client/stream_mux.py``), the gateway in a process of its own at every N (``APART``), and
``SPLITSERVE_MAX_QUEUED`` and ``SPLITSERVE_MAX_QUEUE_WAIT`` raised so the burst is not
refused for the admission queue. After a warm-up it sends one burst of ``--streams``
streamed completions at once through the gateway (``sse_burst.run_burst``, ``--max-tokens``
each, EOS ignored; the same burst at every N, so each coordinator relays 1/N of it, or with
``--per-coordinator`` N times ``--streams``, so each relays as many at every N and its
batches keep their size) and reads, before and after the burst:

- each coordinator's utime + stime from ``/proc`` (its process found by ``role_of`` and named
  by its ``--port``, which ``up``'s log ties to the ``coordinator metrics at`` address it
  printed);
- the tokens it relayed: ``splitserve_request_generation_tokens_sum{role="coordinator"}`` on
  its ``/metrics`` (the generated tokens of the requests it finished; ``COORDINATOR_TOKENS``),
  scraped outside the CPU-time window.

Reported per run: each coordinator's tokens, CPU seconds, tokens per CPU-second and stream
items per message it wrote (``splitserve_relay_batch_items``: fewer streams a coordinator
means smaller batches, a reason a figure may fall with N), their mean
(and the pooled figure, all tokens over all coordinator CPU), the gateway's and every other
role's CPU microseconds per token the client received, how the streams ended (``errors``:
any end other than "ok" and "http 429") and the machine's other load (``CpuMeter``). Per N:
the median over repetitions of the mean, and its ratio to the first count's (N=1; flat
scaling: every ratio 1.0; issue 60 asks within 10%).

Method: where the CPUs this process may use number at least max(N) plus ``--rest-cores``,
coordinator i is pinned to a core of its own and everything else (workers, gateway, ``up``,
this client) to the remaining cores (``cpu_sets.CoreSplit``; ``up`` pins no coordinator to a
set of its own: ``--control-cores prefill`` puts them all on the prefill workers' cores);
otherwise nothing is pinned and the per-coordinator CPU-time count is the method (the report's
``method`` says which). Unpinned on a small machine, coordinators share cores with the workers
and the gateway, so a starved coordinator batches more items per write and may spend less CPU
per token than it would on a core of its own. The CPU is named. Prints rows to stderr and the
JSON report to stdout (``--out`` writes it too). Nothing asserted.

    .venv/bin/python bench/bench_coordinator_scale.py \\
        --out bench/results/coordinator-scale-<date>.json
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from bench_relay_cpu import add_burst_args, burst_report, role_of
from cluster_process import CLK_TCK, CpuMeter, LocalCluster, process_ticks
from cpu_sets import CoreSplit, pin_tree
from prometheus_text import metric_total, scrape
from sse_burst import BurstStream, run_burst
from timing_stats import Json, emit_report, log_row, wait_for_quiet

from splitserve.coordinator import COORDINATOR_METRICS, PUBLIC_READY

SPLITSERVE = Path(sys.executable).with_name("splitserve")
PROFILE = Path(__file__).resolve().parent / "profiles" / "relay-stand-in.json"
SIM_FLAGS = (
    "--placement adaptive --prefill 2 --decode 8 --workers-per-process 8 --max-inflight 16384 "
    f"-- --engine sim --sim-profile {PROFILE} --max-num-seqs 1024 --num-blocks 16384 "
    "--sim-startup-s 0"
)
ENV = {"SPLITSERVE_MAX_QUEUED": "16384", "SPLITSERVE_MAX_QUEUE_WAIT": "600"}
APART = "--apart"
"""``up``'s flag that keeps the gateway out of a lone coordinator's process, where ``up`` has
it (without it one coordinator and one gateway share a ``splitserve frontend`` process, whose
CPU is not the coordinator's alone): passed at every N where ``up --help`` names it."""
COORDINATOR_TOKENS = "splitserve_request_generation_tokens_sum"
"""Generated tokens of the requests a coordinator finished (a histogram's sum)."""
COORDINATOR_LABELS = {"role": "coordinator"}
BATCH_ITEMS = "splitserve_relay_batch_items"
"""Stream items per ``GenerateStreams`` message the coordinator wrote (a histogram)."""
NOT_ERRORS = ("ok", "http 429")
"""How a stream may end without counting as an error."""


@dataclass(frozen=True)
class CoordinatorProcess:
    """One coordinator of a running cluster."""

    name: str
    """``up``'s name for it: ``coordinator`` (N=1) or ``coordinator-<i>``."""
    pid: int
    metrics_url: str


def _named(lines: list[str], marker: str) -> dict[str, str]:
    """``{name: address}`` of ``up``'s ``[name] <marker><address>`` lines (the last of each
    name: a restarted child printed again)."""
    named = {}
    for line in lines:
        if line.startswith("[") and marker in line:
            named[line[1 : line.index("]")]] = line.split(marker, 1)[1].strip()
    return named


def _port_flag(pid: int) -> int | None:
    """The ``--port`` value on ``pid``'s command line, as ``--port=N`` (how ``up`` renders
    its children's flags) or ``--port N``; None: none, or the process is gone."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    for flag, value in zip(words, [*words[1:], ""], strict=True):
        if flag.startswith("--port="):
            given = flag.removeprefix("--port=")
        elif flag == "--port":
            given = value
        else:
            continue
        if given.isdigit():
            return int(given)
    return None


def coordinators_of(cluster: LocalCluster) -> list[CoordinatorProcess]:
    """Every coordinator of ``cluster``, by name, with its process and its ``/metrics``."""
    public = _named(cluster.log_lines(f"{PUBLIC_READY} at "), f"{PUBLIC_READY} at ")
    metrics = _named(cluster.log_lines(f"{COORDINATOR_METRICS} at "), f"{COORDINATOR_METRICS} at ")
    name_of_port = {int(address.rsplit(":", 1)[1]): name for name, address in public.items()}
    found = []
    for pid in cluster.pids():
        if role_of(pid) != "coordinator":
            continue
        name = name_of_port.get(_port_flag(pid) or -1)
        if name is None or name not in metrics:
            raise RuntimeError(f"coordinator pid {pid}: no ready or metrics line in up's log")
        found.append(CoordinatorProcess(name, pid, metrics[name]))
    if not found:
        raise RuntimeError("no coordinator process among up's children (merged into another?)")
    return sorted(found, key=lambda coordinator: coordinator.name)


@dataclass(frozen=True)
class Relayed:
    """A coordinator's cumulative relay figures at one moment."""

    tokens: float
    items: float
    """Stream items it wrote on ``GenerateStreams`` calls."""
    writes: float
    """Messages it wrote them in."""


def relayed(coordinators: list[CoordinatorProcess]) -> dict[str, Relayed]:
    """Each coordinator's ``Relayed`` figures now, from its ``/metrics``."""
    figures = {}
    for c in coordinators:
        text = scrape(c.metrics_url)
        figures[c.name] = Relayed(
            metric_total(text, COORDINATOR_TOKENS, COORDINATOR_LABELS),
            metric_total(text, f"{BATCH_ITEMS}_sum"),
            metric_total(text, f"{BATCH_ITEMS}_count"),
        )
    return figures


def pin(coordinators: list[CoordinatorProcess], split: CoreSplit) -> None:
    """This client, ``up`` and all its children on the split's rest, then coordinator i
    alone on core i."""
    pin_tree(os.getpid(), split.rest)
    for coordinator, core in zip(coordinators, split.own, strict=False):
        pin_tree(coordinator.pid, {core})


def coordinator_rows(
    coordinators: list[CoordinatorProcess],
    ticks: tuple[dict[int, int], dict[int, int]],
    figures: tuple[dict[str, Relayed], dict[str, Relayed]],
) -> list[Json]:
    """Each coordinator's tokens, CPU seconds, tokens per CPU-second and stream items per
    message written over the burst."""
    rows = []
    for c in coordinators:
        cpu_s = (ticks[1][c.pid] - ticks[0][c.pid]) / CLK_TCK
        before, after = figures[0][c.name], figures[1][c.name]
        tokens = after.tokens - before.tokens
        writes = after.writes - before.writes
        rows.append({
            "name": c.name,
            "tokens": int(tokens),
            "cpu_s": round(cpu_s, 2),
            "tokens_per_cpu_s": round(tokens / cpu_s) if cpu_s > 0 else None,
            "items_per_write": round((after.items - before.items) / writes, 1) if writes else None,
        })  # fmt: skip
    return rows


def role_us_per_token(
    roles: dict[int, str], ticks: tuple[dict[int, int], dict[int, int]], tokens: int
) -> dict[str, float]:
    """CPU microseconds per token the client received, summed over each role's processes
    (``roles``: each process's role, read while it ran)."""
    totals: dict[str, int] = collections.Counter()
    for pid, role in roles.items():
        totals[role] += ticks[1][pid] - ticks[0].get(pid, 0)
    return {role: round(t / CLK_TCK / tokens * 1e6, 1) for role, t in totals.items() if tokens}


def up_knows(flag: str) -> bool:
    """Whether this tree's ``splitserve up`` has ``flag`` (its ``--help`` names it)."""
    shown = subprocess.run(
        [str(SPLITSERVE), "up", "--help"], capture_output=True, text=True, check=True
    ).stdout
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", shown) is not None


def measure(
    args: argparse.Namespace, count: int, split: CoreSplit | None, apart: list[str]
) -> Json:
    """One burst through a fresh cluster of ``count`` coordinators (``apart``: ``[APART]``
    or nothing)."""
    log_path = Path(tempfile.mkdtemp(prefix="coordinator-scale-")) / "up.log"
    flags = ["--coordinators", str(count), *apart, *shlex.split(args.up_flags)]
    with LocalCluster(SPLITSERVE, flags, log_path, env=ENV) as cluster:
        coordinators = coordinators_of(cluster)
        if split is not None:
            pin(coordinators, split)
        model = httpx.get(f"{cluster.http_url}/v1/models", timeout=30).json()["data"][0]["id"]
        run_burst(cluster.http_url, model, 4 * count, 8)  # warm-up: every coordinator
        wait_for_quiet(args.wait_quiet_s)
        roles = {pid: role_of(pid) for pid in cluster.pids()}
        figures_before = relayed(coordinators)
        meter = CpuMeter(cluster)
        meter.start()
        before = {pid: process_ticks(pid) for pid in roles}
        started = time.perf_counter()
        streams = args.streams * count if args.per_coordinator else args.streams
        ended = run_burst(cluster.http_url, model, streams, args.max_tokens)
        wall_s = time.perf_counter() - started
        after = {pid: process_ticks(pid) for pid in roles}
        cpu = meter.stop()
        figures_after = relayed(coordinators)
    return burst_row(count, ended, wall_s, args.max_tokens) | {
        "per_coordinator": coordinator_rows(
            coordinators, (before, after), (figures_before, figures_after)
        ),
        "us_per_token": role_us_per_token(roles, (before, after), sum(s.tokens for s in ended)),
        "cpu": cpu,
    }


def burst_row(count: int, ended: list[BurstStream], wall_s: float, max_tokens: int) -> Json:
    """What the client saw of one burst."""
    tokens = sum(stream.tokens for stream in ended)
    ends = collections.Counter(stream.how for stream in ended)
    return {
        "coordinators": count,
        "tokens": tokens,
        "streams_whole": sum(stream.tokens == max_tokens for stream in ended),
        "ends": dict(ends),
        "errors": sum(n for how, n in ends.items() if how not in NOT_ERRORS),
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(tokens / wall_s, 1),
    }


def with_means(row: Json) -> Json:
    """``row`` with its coordinators' mean tokens per CPU-second and the pooled figure."""
    per = [c for c in row["per_coordinator"] if c["tokens_per_cpu_s"] is not None]
    cpu_s = sum(c["cpu_s"] for c in per)
    row["tokens_per_cpu_s"] = (
        round(statistics.mean(c["tokens_per_cpu_s"] for c in per)) if per else None
    )
    row["pooled_tokens_per_cpu_s"] = round(sum(c["tokens"] for c in per) / cpu_s) if cpu_s else None
    row["coordinator_tokens"] = sum(c["tokens"] for c in row["per_coordinator"])
    return row


def summary(rows: list[Json], counts: list[int]) -> Json:
    """Per coordinator count: the median over repetitions of the mean tokens per CPU-second,
    its ratio to the first count's, the gateway's median CPU per token, and errors."""
    by_count: Json = {}
    for count in counts:
        mine = [row for row in rows if row["coordinators"] == count]
        means = [row["tokens_per_cpu_s"] for row in mine if row["tokens_per_cpu_s"] is not None]
        gateway = [row["us_per_token"].get("gateway", 0.0) for row in mine]
        by_count[str(count)] = {
            "tokens_per_cpu_s": round(statistics.median(means)) if means else None,
            "gateway_us_per_token": round(statistics.median(gateway), 1) if gateway else None,
            "errors": sum(row["errors"] for row in mine),
        }
    base = by_count[str(counts[0])]["tokens_per_cpu_s"]
    for figures in by_count.values():
        value = figures["tokens_per_cpu_s"]
        figures["ratio_to_first"] = round(value / base, 3) if value and base else None
    return by_count


def run(args: argparse.Namespace) -> Json:
    counts = [int(count) for count in args.coordinators.split(",") if count.strip()]
    cpus = sorted(os.sched_getaffinity(0))
    split = None if args.no_pin else CoreSplit.of(cpus, max(counts), args.rest_cores)
    report = burst_report(args)
    apart = [APART] if up_knows(APART) else []
    report["setup"] |= {"coordinators": counts, "env": ENV, "extra_up_flags": apart}
    report["setup"]["per_coordinator"] = args.per_coordinator
    report["method"] = (
        f"pinned: {split.describe()}"
        if split is not None
        else f"per-coordinator CPU-time count, unpinned ({len(cpus)} CPUs"
        f"{'' if args.no_pin else f' < {max(counts)} coordinators + {args.rest_cores}'})"
    )
    log_row({"method": report["method"], "cpu": report["machine"]["cpu"]})
    for rep in range(args.reps):  # the counts alternate, a fresh cluster each
        for count in counts:
            row = with_means(measure(args, count, split, apart))
            row["rep"] = rep
            report["reps"].append(row)
            log_row(row)
    report["by_coordinators"] = summary(report["reps"], counts)
    log_row({"by_coordinators": report["by_coordinators"]})
    return report


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the flags, measure, emit the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_burst_args(parser, streams=2048, max_tokens=96)
    parser.add_argument("--coordinators", default="1,2,3,4", help="counts, alternated per rep")
    parser.add_argument("--up-flags", default=SIM_FLAGS, help="splitserve up's flags")
    parser.add_argument(
        "--rest-cores",
        type=int,
        default=3,
        help="cores besides one per coordinator needed to pin (workers, gateway, client)",
    )
    parser.add_argument("--no-pin", action="store_true", help="never pin; count CPU time only")
    parser.add_argument(
        "--per-coordinator",
        action="store_true",
        help="--streams per coordinator (the burst grows with N, each coordinator relaying as "
        "many streams at every N, so its batches stay the same size) instead of in all",
    )
    args = parser.parse_args(argv)
    emit_report(run(args), args.out)


if __name__ == "__main__":
    main()
