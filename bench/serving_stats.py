"""Per-request serving latencies and a run's summary: TTFT, TPOT, ITL, e2e, throughput, goodput.

For one request (times from ``time.perf_counter()``, reported in ms):

- TTFT: first output token's arrival - send;
- ITL: the gaps between consecutive output tokens' arrivals, per token: a message with ``k``
  tokens contributes its gap to the previous message and then ``k - 1`` zero gaps;
- TPOT: ``(e2e - TTFT) / (output tokens - 1)``, for requests with at least 2 tokens;
- e2e: the final message's arrival (completion or error) - send.

A run's summary: mean/p50/p90/p99 of TTFT, TPOT and e2e over the completed requests, of ITL
over all their gaps pooled; request and output-token throughput over the run's duration (the
first send to the last final message); failures (an error, an abort, or a stream that ended
without completion); and goodput: completed requests per second whose TTFT and TPOT both meet
the SLOs (an unset SLO always holds; a 1-token request meets any TPOT SLO).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from timing_stats import Json, percentile

COMPLETED_REASONS = ("length", "stop")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the load generator saw of one request."""

    index: int
    input_len: int
    output_len: int
    """Tokens requested."""
    send_time: float = 0.0
    token_times: list[float] = field(default_factory=list)
    """Arrival time of each output token (a message's tokens share its arrival time)."""
    end_time: float = 0.0
    """Arrival of the final message (completion or error)."""
    finish_reason: str | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason in COMPLETED_REASONS

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft_ms(self) -> float | None:
        return (self.token_times[0] - self.send_time) * 1e3 if self.token_times else None

    @property
    def e2e_ms(self) -> float:
        return (self.end_time - self.send_time) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        ttft = self.ttft_ms
        if ttft is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_ms - ttft) / (self.num_output_tokens - 1)

    @property
    def itls_ms(self) -> list[float]:
        times = self.token_times
        return [(later - earlier) * 1e3 for earlier, later in zip(times, times[1:], strict=False)]

    def row(self) -> Json:
        """The request's figures for a JSON report."""
        return {
            "index": self.index,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "output_tokens": self.num_output_tokens,
            "ttft_ms": _round(self.ttft_ms),
            "tpot_ms": _round(self.tpot_ms),
            "e2e_ms": _round(self.e2e_ms),
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


@dataclass(frozen=True)
class Slo:
    """Service-level objectives a request must meet to count towards goodput (None: none)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.completed:
            return False
        ttft, tpot = record.ttft_ms, record.tpot_ms
        if self.ttft_ms is not None and (ttft is None or ttft > self.ttft_ms):
            return False
        return self.tpot_ms is None or tpot is None or tpot <= self.tpot_ms


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles of one latency, in ms (all 0 when there were no samples)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0)
        p50, p90, p99 = (round(percentile(values, q), 3) for q in PERCENTILES)
        return cls(len(values), round(statistics.fmean(values), 3), p50, p90, p99)


@dataclass(frozen=True)
class ServingSummary:
    """One load run's figures."""

    num_requests: int
    completed: int
    failed: int
    short: int
    """Completed requests that returned fewer tokens than requested."""
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    """Completed requests per second."""
    output_throughput: float
    """Output tokens of completed requests per second."""
    goodput: float
    """Completed requests per second that met the SLO."""
    slo_attainment: float
    """Fraction of all sent requests that completed and met the SLO."""
    slo: Slo
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    errors: list[str]
    """Distinct error messages (at most 5)."""

    def to_json(self) -> Json:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], slo: Slo) -> ServingSummary:
    """The summary of one run's records (all of them sent; failures included)."""
    done = [r for r in records if r.completed]
    sent = [r for r in records if r.send_time > 0]
    start = min((r.send_time for r in sent), default=0.0)
    end = max((r.end_time for r in sent), default=start)
    duration = max(end - start, 1e-9)
    good = sum(slo.met_by(r) for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    errors = sorted(
        {r.error or f"finish_reason={r.finish_reason}" for r in records if not r.completed}
    )
    return ServingSummary(
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        short=sum(r.num_output_tokens < r.output_len for r in done),
        duration_s=round(duration, 3),
        total_input_tokens=sum(r.input_len for r in done),
        total_output_tokens=output_tokens,
        request_throughput=round(len(done) / duration, 4),
        output_throughput=round(output_tokens / duration, 2),
        goodput=round(good / duration, 4),
        slo_attainment=round(good / len(records), 4) if records else 0.0,
        slo=slo,
        ttft_ms=LatencyStats.of([r.ttft_ms for r in done if r.ttft_ms is not None]),
        tpot_ms=LatencyStats.of([r.tpot_ms for r in done if r.tpot_ms is not None]),
        itl_ms=LatencyStats.of([gap for r in done for gap in r.itls_ms]),
        e2e_ms=LatencyStats.of([r.e2e_ms for r in done]),
        errors=errors[:5],
    )


def format_summary(summary: ServingSummary) -> str:
    """A short human-readable report."""
    slo = summary.slo
    lines = [
        f"requests: {summary.completed}/{summary.num_requests} completed, "
        f"{summary.failed} failed, {summary.short} short, in {summary.duration_s:.2f} s",
        f"throughput: {summary.request_throughput:.3f} req/s, "
        f"{summary.output_throughput:.1f} output tok/s",
        f"goodput: {summary.goodput:.3f} req/s (TTFT <= {slo.ttft_ms} ms, TPOT <= "
        f"{slo.tpot_ms} ms; attainment {summary.slo_attainment:.1%})",
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats: LatencyStats = getattr(summary, name)
        lines.append(
            f"{name[:-3].upper():>5} ms: mean {stats.mean:9.2f}  p50 {stats.p50:9.2f}  "
            f"p90 {stats.p90:9.2f}  p99 {stats.p99:9.2f}"
        )
    lines += [f"error: {e}" for e in summary.errors]
    return "\n".join(lines)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
