"""The decode worker's engine steps over a load window, against the HBM bound of the same run.

``StepCounters.read(url)`` reads the decode worker's ``/metrics`` (``worker/metrics.py:
StepMetrics``): how many engine steps decoded rows, the rows they decoded and their wall time
(steps of kind ``decode`` and ``mixed``: a step with prompt tokens beside its decode rows counts,
as its rows waited for it). Two readings' difference (``minus``) is a window's figures;
``DecodeVsBound.of`` sets them against the HBM bound: a decode step must read every weight
but the embedding table once, so it takes at least ``weight_bytes / copy rate``
(``bench_kernels_gpu.copy_gbps``: bytes read plus written per second; the KV a step reads is
left out, so the bound is a floor). urllib only: the GPU image has no httpx.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_text import metric_total

DECODE_KINDS = ("decode", "mixed")
"""The step kinds (``splitserve_engine_step_seconds{kind}``) that decoded rows."""


@dataclass(frozen=True)
class StepCounters:
    """Cumulative counts of the steps that decoded rows, as one scrape read them."""

    steps: float
    rows: float
    seconds: float
    ahead: float = 0.0
    """Steps launched before the step before them was read (``splitserve_engine_steps_ahead``)."""

    @classmethod
    def read(cls, metrics_url: str, timeout_s: float = 10.0) -> StepCounters:
        """The counters at ``metrics_url`` (raises ``OSError`` when it cannot be read)."""
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
            text = response.read().decode()
        seconds = sum(
            metric_total(text, "splitserve_engine_step_seconds_sum", {"kind": kind})
            for kind in DECODE_KINDS
        )
        return cls(
            steps=metric_total(text, "splitserve_engine_step_decode_requests_count"),
            rows=metric_total(text, "splitserve_engine_step_decode_requests_sum"),
            seconds=seconds,
            ahead=metric_total(text, "splitserve_engine_steps_ahead_total"),
        )

    def minus(self, earlier: StepCounters) -> StepCounters:
        return StepCounters(
            self.steps - earlier.steps,
            self.rows - earlier.rows,
            self.seconds - earlier.seconds,
            self.ahead - earlier.ahead,
        )


@dataclass(frozen=True)
class DecodeVsBound:
    """A window's decode steps: their mean batch and time, and the tokens per second they
    decoded while stepping, beside what the HBM bound allows at that batch (None where no
    bound was measured: no CUDA)."""

    decode_steps: int
    decode_batch_mean: float
    decode_step_ms_mean: float
    decode_tok_per_s_in_steps: float
    """Rows decoded per second of decode step time (a row is one token without drafts)."""
    hbm_bound_step_ms: float | None
    """``weight_bytes`` at the measured copy rate: the fastest any decode step can be."""
    hbm_bound_tok_per_s: float | None
    """``decode_batch_mean`` rows per ``hbm_bound_step_ms``."""
    fraction_of_hbm_bound: float | None
    """``hbm_bound_step_ms / decode_step_ms_mean``."""
    steps_ahead_fraction: float
    """Of the steps that decoded, those launched before the step before them was read."""

    @classmethod
    def of(cls, window: StepCounters, bound_step_ms: float | None) -> DecodeVsBound:
        steps = max(window.steps, 1.0)
        batch = window.rows / steps
        step_ms = window.seconds / steps * 1e3
        in_steps = window.rows / window.seconds if window.seconds > 0 else 0.0
        bound_tok = None if bound_step_ms is None else batch / bound_step_ms * 1e3
        fraction = None if bound_step_ms is None or step_ms <= 0 else bound_step_ms / step_ms
        return cls(
            decode_steps=int(window.steps),
            decode_batch_mean=round(batch, 2),
            decode_step_ms_mean=round(step_ms, 3),
            decode_tok_per_s_in_steps=round(in_steps, 1),
            hbm_bound_step_ms=None if bound_step_ms is None else round(bound_step_ms, 3),
            hbm_bound_tok_per_s=None if bound_tok is None else round(bound_tok, 1),
            fraction_of_hbm_bound=None if fraction is None else round(fraction, 3),
            steps_ahead_fraction=round(window.ahead / steps, 3),
        )
