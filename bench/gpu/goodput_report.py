"""What ``bench/gpu/serve_goodput.py`` reports (``Report``, written as JSON) and how one rate's
records become its figures (``rate_result``).

Every request of a rate is in its figures exactly once: completed, or failed under one reason
(``failure_reasons``: the client's error, a finish other than a completion, or a stream the
deadline cut). Latencies come from ``serving_stats.summarize`` over the completed requests;
rates are per second of the window, or of first send to last end where that is longer.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from decode_steps import DecodeVsBound, StepCounters
from serving_stats import LatencyStats, RequestRecord, Slo, summarize


@dataclass(frozen=True)
class Budget:
    """Seconds: the whole run, each rate's window, its drain and the pause after it."""

    total_s: float
    window_s: float
    drain_s: float
    settle_s: float


@dataclass(frozen=True)
class SloReport:
    """The SLO a request must meet to count towards goodput."""

    ttft_ms: float
    mean_itl_ms: float
    meaning: str = (
        "completed, TTFT <= ttft_ms and mean ITL (TPOT: (e2e - TTFT) / (tokens - 1)) <= "
        "mean_itl_ms; goodput: such requests per second of the rate's span_s"
    )

    def slo(self) -> Slo:
        return Slo(ttft_ms=self.ttft_ms, tpot_ms=self.mean_itl_ms)


@dataclass(frozen=True)
class Bounds:
    """The GPU's own bounds, measured in this run before the cluster started."""

    copy_gbps: float
    """Device-to-device copy, bytes read plus written per second."""
    matmul_bf16_tflops: float
    weight_bytes: int
    """Bytes a decode step must read: every weight but the embedding table, in ``--dtype``."""
    hbm_bound_step_ms: float


@dataclass(frozen=True)
class Skipped:
    skipped: str


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class RateResult:
    """One rate's figures (latencies in ms over the completed requests)."""

    rate: float
    offered_req_per_s: float
    """The requests whose Poisson arrival fell in the window, per second of it."""
    requests: int
    completed: int
    failed: int
    failures: dict[str, int]
    """Reason -> requests: every failed request under exactly one reason."""
    short: int
    """Completed with fewer tokens than asked."""
    window_s: float
    span_s: float
    """What the rates below are per: the window, or first send to last end where that is
    longer (a stream cut at the deadline ends there)."""
    ttft_ms: Percentiles
    itl_ms: Percentiles
    mean_itl_ms: Percentiles
    """Per request (TPOT), the figure the SLO holds."""
    output_tok_per_s: float
    """Output tokens of completed requests per second of ``span_s``."""
    request_per_s: float
    goodput_req_per_s: float
    slo_attainment: float
    """Fraction of the requests sent that completed within the SLO."""
    engine: DecodeVsBound | Skipped


@dataclass(frozen=True)
class SkippedRate:
    rate: float
    skipped: str


@dataclass(frozen=True)
class WorkloadResult:
    name: str
    input_len: str
    output_len: str
    warmup_s: float
    warmup_failures: list[str]
    rates: list[RateResult | SkippedRate]


@dataclass
class Report:
    """What ``--out`` holds."""

    device: str
    device_name: str
    host_cpu: str
    model: str
    shape: str
    dtype: str
    placement: str
    slo: SloReport
    budget: Budget
    bounds: Bounds | Skipped
    cluster_start_s: float | None = None
    workloads: list[WorkloadResult] = dataclasses.field(default_factory=list)
    cluster_stopped_cleanly: bool | None = None
    error: str | None = None
    wall_s: float = 0.0

    def passed(self) -> bool:
        """Served, every request accounted for, some completed at each lowest rate, stopped."""
        if self.error is not None or not self.cluster_stopped_cleanly or not self.workloads:
            return False
        for workload in self.workloads:
            ran = [rate for rate in workload.rates if isinstance(rate, RateResult)]
            if (
                not ran
                or ran[0].rate != min(r.rate for r in workload.rates)
                or not ran[0].completed
            ):
                return False
            if any(r.completed + sum(r.failures.values()) != r.requests for r in ran):
                return False
        return True


def failure_reasons(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Reason -> count over the records that did not complete."""
    reasons = collections.Counter(
        record.error or f"finish_reason={record.finish_reason}"
        for record in records
        if not record.completed
    )
    return dict(reasons.most_common())


def rate_result(
    rate: float,
    window_s: float,
    records: list[RequestRecord],
    slo: Slo,
    engine: DecodeVsBound | Skipped,
) -> RateResult:
    """One rate's figures; rates per second of ``span_s``: the window, or longer where the
    last stream ended after it (``serving_stats.summarize``'s first send to last end)."""
    summary = summarize(records, slo)
    span = max(window_s, summary.duration_s)
    good = sum(slo.met_by(record) for record in records)

    def three(stats: LatencyStats) -> Percentiles:
        return Percentiles(stats.p50, stats.p90, stats.p99)

    return RateResult(
        rate=rate,
        offered_req_per_s=round(summary.num_requests / window_s, 3),
        requests=summary.num_requests,
        completed=summary.completed,
        failed=summary.failed,
        failures=failure_reasons(records),
        short=summary.short,
        window_s=window_s,
        span_s=round(span, 3),
        ttft_ms=three(summary.ttft_ms),
        itl_ms=three(summary.itl_ms),
        mean_itl_ms=three(summary.tpot_ms),
        output_tok_per_s=round(summary.total_output_tokens / span, 1),
        request_per_s=round(summary.completed / span, 3),
        goodput_req_per_s=round(good / span, 3),
        slo_attainment=summary.slo_attainment,
        engine=engine,
    )


def engine_figures(
    before: StepCounters | Skipped, after: StepCounters | Skipped, bound_step_ms: float | None
) -> DecodeVsBound | Skipped:
    """The decode steps between two readings against the bound, or why there are none."""
    if isinstance(before, Skipped):
        return before
    if isinstance(after, Skipped):
        return after
    return DecodeVsBound.of(after.minus(before), bound_step_ms)
