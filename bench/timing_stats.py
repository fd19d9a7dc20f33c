"""Per-request latency metrics, their statistics, and CPU contention on a shared machine.

Measures, for one burst of requests: TTFT (first token - submit), TPOT per request
((last token - first token) / (tokens - 1)) at p50 and p99, output-token throughput over the
burst's wall time, and the run's CPU share (process CPU time / (wall * torch threads)); a share
below ``CONTENDED_CPU_SHARE`` marks a run other processes competed with. Repetitions reduce to
medians, over all of them and over the uncontended ones. Before a run, ``wait_for_quiet``
samples /proc/stat for the fraction of all CPUs busy and waits for it to drop.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

QUIET_BUSY_FRACTION = 0.1
CONTENDED_CPU_SHARE = 0.8

Json = dict[str, Any]


@dataclass
class RequestTiming:
    """When one request was submitted, and when each of its output tokens came back."""

    submit_time: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RunMetrics:
    """One repetition at one concurrency level (times in ms, throughput in tokens/s)."""

    output_tokens_per_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    wall_s: float
    cpu_share: float
    """Process CPU time / (wall * torch threads): well below 1 means other processes competed."""


@dataclass(frozen=True)
class RunResult:
    """One repetition: its metrics, request 0's output tokens and system-specific checks."""

    metrics: RunMetrics
    first_output: list[int]
    checks: Json


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def run_metrics(
    timings: Sequence[RequestTiming], start: float, end: float, cpu_seconds: float
) -> RunMetrics:
    """Throughput, TPOT and TTFT percentiles of one burst of requests."""
    done = [t for t in timings if t.token_times]
    ttfts = [(t.token_times[0] - t.submit_time) * 1e3 for t in done]
    tpots = [
        (t.token_times[-1] - t.token_times[0]) * 1e3 / (len(t.token_times) - 1)
        for t in done
        if len(t.token_times) > 1
    ]
    wall = end - start
    return RunMetrics(
        output_tokens_per_s=sum(len(t.token_times) for t in timings) / wall,
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p99_ms=percentile(tpots, 99),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        wall_s=wall,
        cpu_share=cpu_seconds / (wall * torch.get_num_threads()),
    )


def medians(runs: Sequence[RunMetrics]) -> Json:
    values = {name: statistics.median(getattr(r, name) for r in runs) for name in asdict(runs[0])}
    return {name: round(value, 3) for name, value in values.items()} | {"reps": len(runs)}


def summarize(runs: Sequence[RunMetrics]) -> Json:
    """Medians over all repetitions, and over the uncontended ones alone (None if none was)."""
    clean = [r for r in runs if r.cpu_share >= CONTENDED_CPU_SHARE]
    return medians(runs) | {"uncontended": medians(clean) if clean else None}


def headline(row: Json) -> Json:
    """The figures a level is judged by: uncontended medians where there are any."""
    return row["uncontended"] or row


def machine_busy_fraction(sample_s: float = 1.0) -> float | None:
    """Fraction of all CPUs busy over ``sample_s`` (from /proc/stat); None where unreadable."""

    def ticks() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    try:
        total_before, idle_before = ticks()
        time.sleep(sample_s)
        total_after, idle_after = ticks()
    except (OSError, ValueError, IndexError):
        return None
    total = total_after - total_before
    return 1.0 - (idle_after - idle_before) / total if total else None


def wait_for_quiet(max_wait_s: float) -> float | None:
    """While idle, wait up to ``max_wait_s`` for other processes to leave the CPUs idle.

    Returns the last busy fraction seen (None where /proc/stat is unreadable).
    """
    deadline = time.monotonic() + max_wait_s
    busy = machine_busy_fraction() if max_wait_s > 0 else None
    while busy is not None and busy > QUIET_BUSY_FRACTION and time.monotonic() < deadline:
        busy = machine_busy_fraction()
    return busy


def log_row(row: Json) -> None:
    """One result row as a JSON line on stderr, as it is measured."""
    print(json.dumps(row), file=sys.stderr, flush=True)


def emit_report(report: Json, out: Path | None) -> None:
    """The whole report as indented JSON on stdout, and into ``out`` when given."""
    text = json.dumps(report, indent=2)
    if out is not None:
        out.write_text(text + "\n")
    print(text)
