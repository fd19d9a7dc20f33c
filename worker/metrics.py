"""A worker's Prometheus metrics: engine figures (vLLM semantics) and KV-transfer figures.

Engine figures come from the engine's reports only (``AsyncEngine.latest_report``: load
figures, the scheduler's monotonic counters and the requests that ended, an immutable
snapshot published by the engine thread after every step and command batch), never from
the live scheduler. Gauges and counters read the latest report at scrape time (the metrics
HTTP thread), so stepping costs nothing extra; request phase times are observed from each
report as it is published (a report listener: on the engine thread, before the requests'
last outputs go out). Transfer figures are recorded by the prefill and decode domain objects.

Names (prefix ``splitserve_``; labels ``model_name``, ``role``):
- ``num_requests_running`` / ``num_requests_waiting`` (gauges), ``num_requests_reserved``
  (requests holding blocks for KV being pushed), ``kv_cache_usage_perc`` (0..1),
  ``prefill_time_share`` (0..1: of the ten seconds or so before its last command or step,
  the engine's time on prompt tokens; ``common/busy_share.py``);
- ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (tokens),
  ``num_preemptions_total``, ``prompt_tokens_total`` (prompt tokens computed here),
  ``generation_tokens_total`` (tokens sampled here), ``spec_decode_num_draft_tokens_total`` /
  ``spec_decode_num_accepted_tokens_total`` (speculative decoding: drafts verified / kept);
- ``request_queue_time_seconds``, ``request_prefill_time_seconds``,
  ``request_decode_time_seconds``, ``request_inference_time_seconds`` (histograms);
- ``kv_transfer_bytes_total``, ``kv_transfer_seconds``, ``kv_transfer_failures_total``
  (label ``direction``: send | receive; failures also ``reason``: timeout | aborted | error),
  ``kv_reservation_wait_seconds`` (decode: waiting for free blocks for a pushed prompt),
  ``kv_transfer_block_runs`` (decode: runs of consecutive blocks per reservation; the transfer
  sends K and V of each run per layer as separate messages, so more runs mean more messages),
  ``kv_unsettled_blocks`` (decode, gauge: blocks a withdrawn transfer's unsettled receives
  keep out of the pool);
- ``engine_step_seconds`` (histogram, label ``kind``: decode | prefill | mixed: the step ran
  decode rows only, prompt tokens only, or both) and ``engine_step_decode_requests``
  (histogram: requests decoded per step that decoded any, the decode batch size), observed
  from each report that follows a step (steps that ran nothing are left out);
- ``step_cost_seconds`` (gauge, label ``term``: the engine's learned step-time model,
  ``common/step_cost.py``: decode_base, per_decode_seq, per_context_token, prefill_base,
  per_prefill_token) and ``step_cost_steps`` (label ``part``: decode | prefill, steps fitted);
- ``lora_requests`` (gauge, labels ``adapter`` and ``state``: running | waiting): each LoRA
  adapter served here (or still taken by a running request after an unload) and its
  requests, waiting ones queued or parked by ``--max-loras`` (vLLM's
  ``lora_requests_info`` says the same in one label string).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from splitserve.common.errors import TransferAbortedError, TransferTimeoutError
from splitserve.common.load import EngineLoad
from splitserve.common.metrics import KV_TRANSFER_BUCKETS, REQUEST_LATENCY_BUCKETS
from splitserve.common.step_cost import StepCost
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.engine_report import AdapterRequests, EngineReport, SchedulerStats
from splitserve.engine.step_threads import StepThreads

_LABELS = ("model_name", "role")
BLOCK_RUN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
STEP_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
    2.5, 5.0,
)  # fmt: skip
"""One engine step: a millisecond (a GPU decode row) to seconds (a long prompt on a CPU)."""
TRANSFER_DIRECTIONS = ("send", "receive")
TRANSFER_FAILURE_REASONS = ("timeout", "aborted", "error")
DECODE_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_KINDS = ("decode", "prefill", "mixed")
STEP_COST_TERMS = (
    "decode_base",
    "per_decode_seq",
    "per_context_token",
    "prefill_base",
    "per_prefill_token",
)


class TransferMetrics:
    """KV handoff figures of one worker. Without a registry they are recorded but not exported
    (a private registry), so domain objects can always record."""

    def __init__(
        self, registry: CollectorRegistry | None = None, model_name: str = "", role: str = ""
    ) -> None:
        registry = registry or CollectorRegistry()
        values = (model_name, role)
        self._bytes = Counter(
            "splitserve_kv_transfer_bytes",
            "KV bytes pushed (send) or landed (receive).",
            [*_LABELS, "direction"],
            registry=registry,
        )
        self._seconds = Histogram(
            "splitserve_kv_transfer_seconds",
            "One request's KV handoff: send = last layer computed -> all layers confirmed sent; "
            "receive = blocks reserved -> last layer landed.",
            [*_LABELS, "direction"],
            buckets=KV_TRANSFER_BUCKETS,
            registry=registry,
        )
        self._failures = Counter(
            "splitserve_kv_transfer_failures",
            "KV transfers that did not complete.",
            [*_LABELS, "direction", "reason"],
            registry=registry,
        )
        for direction in TRANSFER_DIRECTIONS:  # every series from the start, at 0
            for reason in TRANSFER_FAILURE_REASONS:
                self._failures.labels(*values, direction, reason)
        self._values = values
        self._add_block_figures(registry, values)

    def _add_block_figures(self, registry: CollectorRegistry, values: tuple[str, str]) -> None:
        """The figures of a handoff's blocks, this worker's series only: a pushed prompt's
        wait for free blocks and their runs, and the blocks reused from the prefix cache or
        kept out of the pool by unsettled receives (decode); the blocks pulled (prefill)."""
        self.reservation_wait = Histogram(
            "splitserve_kv_reservation_wait_seconds",
            "Time a pushed prompt waited for free KV blocks on the decode worker.",
            _LABELS,
            buckets=KV_TRANSFER_BUCKETS,
            registry=registry,
        ).labels(*values)
        self.block_runs = Histogram(
            "splitserve_kv_transfer_block_runs",
            "Runs of consecutive KV blocks a pushed prompt's reservation took.",
            _LABELS,
            buckets=BLOCK_RUN_BUCKETS,
            registry=registry,
        ).labels(*values)
        self.cached_blocks = Counter(
            "splitserve_kv_reused_blocks",
            "KV blocks of pushed prompts that the decode worker already held in its prefix "
            "cache (a conversation's earlier turns): reserved from it, not sent.",
            _LABELS,
            registry=registry,
        ).labels(*values)
        self.pulled_blocks = Counter(
            "splitserve_kv_pulled_blocks",
            "KV blocks of prompts' leading blocks that a prefill worker received from the "
            "decode worker holding them (a conversation's history), instead of computing them.",
            _LABELS,
            registry=registry,
        ).labels(*values)
        self.unsettled_blocks = Gauge(
            "splitserve_kv_unsettled_blocks",
            "KV blocks kept out of the pool because a withdrawn transfer's receives have not "
            "settled (decode); they return when the receives do.",
            _LABELS,
            registry=registry,
        ).labels(*values)

    def completed(self, direction: str, num_bytes: int, seconds: float) -> None:
        self._bytes.labels(*self._values, direction).inc(num_bytes)
        self._seconds.labels(*self._values, direction).observe(seconds)

    def failed(self, direction: str, error: BaseException) -> None:
        if isinstance(error, TransferTimeoutError):
            reason = "timeout"
        elif isinstance(error, TransferAbortedError | GeneratorExit | asyncio.CancelledError):
            reason = "aborted"
        else:
            reason = "error"
        self._failures.labels(*self._values, direction, reason).inc()


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's latest report at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str, role: str) -> None:
        self._engine = engine
        self._values = [model_name, role]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        report = self._engine.latest_report  # one immutable snapshot: load and stats agree
        for name, doc, value in _load_gauges(report.load):
            family = GaugeMetricFamily(f"splitserve_{name}", doc, labels=_LABELS)
            family.add_metric(self._values, value)
            yield family
        counters = _scheduler_counters(report.stats)
        step_threads = self._engine.step_threads
        if step_threads is not None:  # a worker that lends or borrows cores
            counters += _lending_counters(step_threads)
        for name, doc, value in counters:
            family = CounterMetricFamily(f"splitserve_{name}", doc, labels=_LABELS)
            family.add_metric(self._values, value)
            yield family
        yield from self._step_cost(report.load.step_cost)
        yield self._lora_requests(report.lora_requests)

    def _lora_requests(self, adapters: tuple[AdapterRequests, ...]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            "splitserve_lora_requests",
            "Requests of each LoRA adapter served here, running in the batch or waiting "
            "(queued, or parked while --max-loras leaves their adapter no room).",
            labels=[*_LABELS, "adapter", "state"],
        )
        for adapter in adapters:
            family.add_metric([*self._values, adapter.adapter, "running"], adapter.running)
            family.add_metric([*self._values, adapter.adapter, "waiting"], adapter.waiting)
        return family

    def _step_cost(self, cost: StepCost) -> Iterator[GaugeMetricFamily]:
        terms = GaugeMetricFamily(
            "splitserve_step_cost_seconds",
            "The engine's learned step-time model: seconds per unit of each term.",
            labels=[*_LABELS, "term"],
        )
        for term in STEP_COST_TERMS:
            terms.add_metric([*self._values, term], getattr(cost, f"{term}_s"))
        yield terms
        steps = GaugeMetricFamily(
            "splitserve_step_cost_steps",
            "Steps each part of the step-time model was fitted on.",
            labels=[*_LABELS, "part"],
        )
        steps.add_metric([*self._values, "decode"], cost.decode_steps)
        steps.add_metric([*self._values, "prefill"], cost.prefill_steps)
        yield steps


_Figure = tuple[str, str, float]
"""A figure's name (after ``splitserve_``), its help text and its value."""


def _load_gauges(load: EngineLoad) -> tuple[_Figure, ...]:
    """The gauges of an engine report's load figures."""
    usage = load.num_used_blocks / load.num_total_blocks if load.num_total_blocks else 0.0
    return (
        ("num_requests_running", "Requests in the running batch.", load.num_running_requests),
        (
            "num_requests_waiting",
            "Requests waiting to be scheduled.",
            load.num_waiting_requests,
        ),
        (
            "num_requests_reserved",
            "Requests holding blocks for KV another worker is pushing.",
            load.num_reserved_requests,
        ),
        ("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", usage),
        (
            "prefill_time_share",
            "Fraction of the ten seconds or so before its last command or step that its "
            "steps spent on prompt tokens.",
            load.prefill_share,
        ),
    )


def _scheduler_counters(stats: SchedulerStats) -> tuple[_Figure, ...]:
    """The counters of an engine report's scheduler counters."""
    return (
        ("prefix_cache_queries", "Prefix-cache queries, in tokens.", stats.prefix_query_tokens),
        ("prefix_cache_hits", "Prefix-cache hits, in tokens.", stats.prefix_hit_tokens),
        ("num_preemptions", "Cumulative preemptions.", stats.num_preemptions),
        (
            "prompt_tokens",
            "Prompt tokens computed on this worker.",
            stats.num_prompt_tokens_computed,
        ),
        ("generation_tokens", "Tokens sampled on this worker.", stats.num_generation_tokens),
        (
            "spec_decode_num_draft_tokens",
            "Speculated (prompt-lookup) tokens verified on this worker.",
            stats.num_draft_tokens,
        ),
        (
            "spec_decode_num_accepted_tokens",
            "Speculated tokens the model chose too, kept as output.",
            stats.num_accepted_draft_tokens,
        ),
    )


def _lending_counters(step_threads: StepThreads) -> tuple[_Figure, ...]:
    """The counters of a worker that lends or borrows cores: its steps, and how they used
    the borrowed cores."""
    return (
        ("engine_steps", "Engine steps run.", step_threads.steps),
        (
            "engine_steps_on_borrowed_cores",
            "Engine steps that also ran on a co-located worker's cores, lent while "
            "its engine idled.",
            step_threads.borrowed_steps,
        ),
        (
            "engine_steps_yielding_borrowed_cores",
            "Engine steps on borrowed cores that gave them back part-way, at a layer "
            "boundary, their owner's engine having turned busy.",
            step_threads.yielded_steps,
        ),
        (
            "engine_steps_growing_onto_borrowed_cores",
            "Engine steps begun on this worker's own cores, their owner busy, that "
            "took the borrowed cores part-way, at a layer boundary, once it idled.",
            step_threads.grown_steps,
        ),
        (
            "engine_steps_declining_borrow",
            "Engine steps that kept to this worker's own cores while the lender idled "
            "(steps on borrowed cores measured no faster here, or a trial of own ones).",
            step_threads.declined_steps,
        ),
    )


class _RequestPhaseMetrics:
    """Phase times of requests that ended on this engine, observed from its reports."""

    def __init__(self, registry: CollectorRegistry, model_name: str, role: str) -> None:
        def histogram(name: str, doc: str) -> Histogram:
            metric = Histogram(
                name, doc, _LABELS, buckets=REQUEST_LATENCY_BUCKETS, registry=registry
            )
            return metric.labels(model_name, role)

        self.queue = histogram(
            "splitserve_request_queue_time_seconds", "Arrival -> first scheduled."
        )
        self.prefill = histogram(
            "splitserve_request_prefill_time_seconds", "First scheduled -> first token."
        )
        self.decode = histogram(
            "splitserve_request_decode_time_seconds", "First token -> last token."
        )
        self.inference = histogram(
            "splitserve_request_inference_time_seconds", "First scheduled -> finished."
        )

    def observe(self, report: EngineReport) -> None:
        """A report listener (engine thread): the requests that ended since the last one."""
        for phases in report.finished:
            scheduled, first, end = (
                phases.first_scheduled_time,
                phases.first_token_time,
                phases.finished_time,
            )
            if scheduled is None:
                continue  # aborted while waiting: no phases to report
            self.queue.observe(scheduled - phases.arrival_time)
            self.inference.observe(end - scheduled)
            if first is not None:
                self.prefill.observe(max(0.0, first - scheduled))
                self.decode.observe(end - first)


class StepMetrics:
    """Each engine step's time by kind and its decode batch size, observed from reports."""

    def __init__(self, registry: CollectorRegistry, model_name: str, role: str) -> None:
        seconds = Histogram(
            "splitserve_engine_step_seconds",
            "Wall time of one engine step, by what it ran: decode rows only, prompt tokens "
            "only, or both (mixed).",
            [*_LABELS, "kind"],
            buckets=STEP_SECONDS_BUCKETS,
            registry=registry,
        )
        self._seconds = {kind: seconds.labels(model_name, role, kind) for kind in STEP_KINDS}
        self._decode_requests = Histogram(
            "splitserve_engine_step_decode_requests",
            "Requests decoded in one engine step (the decode batch), steps that decoded any.",
            _LABELS,
            buckets=DECODE_BATCH_BUCKETS,
            registry=registry,
        ).labels(model_name, role)
        self._ran_ahead = Counter(
            "splitserve_engine_steps_ahead",
            "Engine steps launched before the step before them was read (steps ahead: the "
            "host's part of a step done while the device computed the next).",
            _LABELS,
            registry=registry,
        ).labels(model_name, role)

    def observe(self, report: EngineReport) -> None:
        """A report listener (engine thread): the step the report follows, if one ran."""
        if report.step is None:
            return
        if report.step.ran_ahead:
            self._ran_ahead.inc()
        shape = report.step.shape
        if shape.decode_seqs and shape.prefill_tokens:
            kind = "mixed"
        elif shape.decode_seqs:
            kind = "decode"
        elif shape.prefill_tokens:
            kind = "prefill"
        else:
            return  # nothing ran
        self._seconds[kind].observe(report.step.seconds)
        if shape.decode_seqs:
            self._decode_requests.observe(shape.decode_seqs)


def install_engine_metrics(
    registry: CollectorRegistry, engine: AsyncEngine, model_name: str, role: str
) -> None:
    """Export ``engine``'s figures into ``registry`` (call before the engine serves)."""
    registry.register(_EngineCollector(engine, model_name, role))
    phases = _RequestPhaseMetrics(registry, model_name, role)
    engine.add_report_listener(phases.observe)
    engine.add_report_listener(StepMetrics(registry, model_name, role).observe)
