"""The coordinator's Prometheus metrics: request latencies (``common/metrics.py``, role
``coordinator``), per-stage latency of the disaggregated path, recoveries, and workers.

``splitserve_request_stage_seconds{stage}``: reserve (decode worker reserved blocks for a
pushed prompt), prefill (reservation -> first token: prompt computed and KV pushed),
local_prefill (prompt computed on the decode worker). ``splitserve_request_recoveries_total
{kind}``: prefill_fallback (prefill failed, prompt computed on the decode worker),
decode_resume (decode worker failed, request resumed on another), coordinator_continuation
(a client continued here a stream whose coordinator died, ``continue_after``).
``splitserve_num_workers{worker_role}``: registered, healthy workers.
Admission by KV (``coordinator/admission.py``): ``splitserve_admission_kv_tokens{state}``
(capacity | admitted), ``splitserve_admission_queued_requests``,
``splitserve_admission_queued_prompt_tokens``, ``splitserve_admission_prefill_backlog_tokens``,
``splitserve_admission_refusals_total{reason}`` (queue_full | predicted_wait | waited_out |
tenant_inflight | tenant_tokens), ``splitserve_admission_decisions_total{tenant, outcome}``
(outcome: admitted, or the refusal's reason; the anonymous tenant "" is labelled
``anonymous``), ``splitserve_admission_retry_after_seconds`` (the retry hints refusals
carried), ``splitserve_admission_tpot_seconds`` and
``splitserve_admission_ttft_seconds`` (the times its wait predictions use),
``splitserve_admission_prefill_drain_tokens_per_second`` (the prefill backlog's measured drain
rate they use; absent until measured), ``splitserve_admission_late_waiters_total`` (waiters
that could no longer meet their TTFT target and yielded to those that could).
``splitserve_stalled_clients_total``: streams cut because their client stopped reading.
``splitserve_desired_workers{role}`` (prefill | decode): the workers this coordinator's load
needs now, in worker units (``capacity.py``), which the autoscalers scale on.
``splitserve_placement_decisions_total{where, reason}``: where requests' prompts were computed
(remote | local) and why (``coordinator/placement.py:Reason``);
``splitserve_placement_ttft_ratio{where}``: first token time / predicted TTFT, for decisions
that predicted one (how far the step-time models are off). Each decision with a prediction is
logged at DEBUG with its inputs' outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from splitserve.common.loop_lag import LoopLag
from splitserve.common.membership import Role
from splitserve.common.metrics import TIME_TO_FIRST_TOKEN_BUCKETS, RequestMetricFamilies
from splitserve.coordinator.admission import AdmissionOutcome, AdmissionSnapshot, KvAdmission
from splitserve.coordinator.capacity import DesiredWorkers
from splitserve.coordinator.flow import PlacementOutcome, RequestFlow
from splitserve.coordinator.registry import WorkerRegistry

logger = logging.getLogger(__name__)

STAGES = ("reserve", "prefill", "local_prefill")
TTFT_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
RECOVERIES = ("prefill_fallback", "decode_resume", "coordinator_continuation")
PLACEMENT_WHERE = ("remote", "local")
RETRY_AFTER_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
ANONYMOUS_TENANT_LABEL = "anonymous"
"""The ``tenant`` label of callers without an API key's tenant (tenant "")."""


class CoordinatorMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        worker_registry: WorkerRegistry,
        admission: KvAdmission | None = None,
        desired: Callable[[], DesiredWorkers] | None = None,
    ) -> None:
        """``desired``: the workers the load needs now (``capacity.py``), read at each
        scrape as ``splitserve_desired_workers{role}``."""
        self.requests = RequestMetricFamilies(registry).for_model(model_name, "coordinator")
        self._add_path_metrics(registry, model_name)
        self._add_placement_metrics(registry, model_name)
        self._add_stream_metrics(registry, model_name)
        self._model_name = model_name
        registry.register(_WorkerCollector(worker_registry))
        if admission is not None:
            registry.register(_AdmissionCollector(admission))
            admission.outcome_listeners.append(_AdmissionOutcomes(registry).observe)
        if desired is not None:
            registry.register(_DesiredCollector(desired))

    def _add_path_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        """Each stage's latency and the recoveries by kind (``record_flow``)."""
        stage = Histogram(
            "splitserve_request_stage_seconds",
            "Latency of each stage of a request's path through the workers.",
            ["model_name", "stage"],
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=registry,
        )
        self._stages = {name: stage.labels(model_name, name) for name in STAGES}
        recoveries = Counter(
            "splitserve_request_recoveries",
            "Worker failures a request survived, by kind.",
            ["model_name", "kind"],
            registry=registry,
        )
        self._recoveries = {kind: recoveries.labels(model_name, kind) for kind in RECOVERIES}

    def _add_placement_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        """Where prompts were computed and why, and how far off the placement's predicted
        TTFT was (``_record_placement``)."""
        self._placements = Counter(
            "splitserve_placement_decisions",
            "Where requests' prompts were computed, and why.",
            ["model_name", "where", "reason"],
            registry=registry,
        )
        self._ttft_ratio = Histogram(
            "splitserve_placement_ttft_ratio",
            "First token time over the placement's predicted TTFT.",
            ["model_name", "where"],
            buckets=TTFT_RATIO_BUCKETS,
            registry=registry,
        )
        for where in PLACEMENT_WHERE:  # both series from the start (dashboards query them)
            self._ttft_ratio.labels(model_name, where)

    def _add_stream_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        """Streams that stalled: on a worker, by its role and the phase (resumed elsewhere,
        ``record_flow``), or at their client (cut); and the items each ``GenerateStreams``
        write batched."""
        stalls = Counter(
            "splitserve_stream_stalls",
            "Streams that went silent past their stall limit (the worker's expected step time "
            "times --stall-factor, at least --stall-floor-s) and were resumed elsewhere, by "
            "the stalled worker's role and the phase they stalled in.",
            ["model_name", "role", "reason"],
            registry=registry,
        )
        self._stalls = {
            kind: stalls.labels(model_name, *kind)
            for kind in (("decode", "no_token"), ("prefill", "no_first_token"))
        }
        self.stalled_clients = Counter(
            "splitserve_stalled_clients",
            "Streams cut because their client read nothing for the send timeout.",
            registry=registry,
        )
        self.relay_batch_items = Histogram(
            "splitserve_relay_batch_items",
            "Stream items per message written on GenerateStreams calls (responses of many "
            "streams batched while the previous write was in flight): 1 at low load.",
            buckets=RELAY_BATCH_BUCKETS,
            registry=registry,
        )

    def record_flow(self, flow: RequestFlow) -> None:
        """Observe a finished flow's stages and recoveries (once, at its end)."""
        for name, seconds in flow.stage_seconds:
            if name in self._stages:
                self._stages[name].observe(seconds)
        for kind in flow.stalls:
            self._stalls[kind].inc()
        for kind in flow.recoveries:
            if kind in self._recoveries:
                self._recoveries[kind].inc()
        if flow.placement is not None:
            self._record_placement(flow.request_id, flow.placement)

    def _record_placement(self, request_id: str, outcome: PlacementOutcome) -> None:
        placement = outcome.placement
        where = placement.where
        self._placements.labels(self._model_name, where, placement.reason.value).inc()
        predicted, actual = placement.predicted_ttft_s, outcome.first_token_s
        if predicted is None or actual is None or predicted <= 0:
            return
        self._ttft_ratio.labels(self._model_name, where).observe(actual / predicted)
        logger.debug(
            "%s: prompt %s (%s), TTFT predicted %.3f s, took %.3f s; local TPOT would be %s",
            request_id,
            where,
            placement.reason.value,
            predicted,
            actual,
            "?"
            if placement.predicted_local_tpot_s is None
            else f"{placement.predicted_local_tpot_s:.3f} s",
        )


RELAY_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class LoopLagCollector(Collector):
    """``splitserve_event_loop_lag_seconds_total{role="coordinator"}``: how late the
    coordinator's event loop ran (``common/loop_lag.py``), the time its stall checks leave
    out; its rate is the share of time the coordinator is behind on everything it serves
    (streams, health checks, heartbeats)."""

    def __init__(self, meter: LoopLag) -> None:
        self._meter = meter

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "splitserve_event_loop_lag_seconds",
            "Seconds the process's event loop ran late (work waiting for the loop).",
            labels=["role"],
        )
        family.add_metric(["coordinator"], self._meter.total_s)
        yield family


class _AdmissionOutcomes:
    """Admission's decisions per tenant and the retry hints of its refusals."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._decisions = Counter(
            "splitserve_admission_decisions",
            "Admission decisions by tenant: admitted, or the refusal's reason.",
            ["tenant", "outcome"],
            registry=registry,
        )
        self._retry_after = Histogram(
            "splitserve_admission_retry_after_seconds",
            "The Retry-After hint each refusal carried.",
            buckets=RETRY_AFTER_BUCKETS,
            registry=registry,
        )

    def observe(self, outcome: AdmissionOutcome) -> None:
        tenant = outcome.tenant or ANONYMOUS_TENANT_LABEL
        self._decisions.labels(tenant, outcome.refused or "admitted").inc()
        if outcome.retry_after_s is not None:
            self._retry_after.observe(outcome.retry_after_s)


class _WorkerCollector(Collector):
    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "splitserve_num_workers", "Healthy registered workers.", labels=["worker_role"]
        )
        for role in Role:
            family.add_metric([role.name.lower()], len(self._registry.workers(role)))
        yield family


class _DesiredCollector(Collector):
    """``splitserve_desired_workers{role}``: what the load needs now, in worker units."""

    def __init__(self, desired: Callable[[], DesiredWorkers]) -> None:
        self._desired = desired

    def collect(self) -> Iterator[GaugeMetricFamily]:
        desired = self._desired()
        family = GaugeMetricFamily(
            "splitserve_desired_workers",
            "Workers of each role this coordinator's load needs now, in worker units (not "
            "rounded: the fleet needs the sum over coordinators, rounded up).",
            labels=["role"],
        )
        family.add_metric(["prefill"], desired.prefill)
        family.add_metric(["decode"], desired.decode)
        yield family


class _AdmissionCollector(Collector):
    """Admission's figures, read at each scrape."""

    def __init__(self, admission: KvAdmission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from _snapshot_gauges(self._admission.snapshot())
        refusals = CounterMetricFamily(
            "splitserve_admission_refusals",
            "Requests refused by admission, by reason.",
            labels=["reason"],
        )
        for reason, count in self._admission.refusals.items():
            refusals.add_metric([reason], count)
        yield refusals
        yield CounterMetricFamily(
            "splitserve_admission_late_waiters",
            "Waiting requests that could no longer meet their TTFT target and let those that "
            "still could go first.",
            value=self._admission.late_waiters,
        )


def _snapshot_gauges(snapshot: AdmissionSnapshot) -> Iterator[GaugeMetricFamily]:
    """The gauges of admission's figures now: KV capacity and use, the queue, the prefill
    backlog and the times and drain rate its wait predictions use."""
    kv = GaugeMetricFamily(
        "splitserve_admission_kv_tokens",
        "Decode KV this coordinator admits against, and what admitted requests may use.",
        labels=["state"],
    )
    kv.add_metric(["capacity"], snapshot.capacity_tokens)
    kv.add_metric(["admitted"], snapshot.admitted_tokens)
    yield kv
    yield GaugeMetricFamily(
        "splitserve_admission_queued_requests",
        "Requests waiting for KV.",
        value=snapshot.num_queued,
    )
    yield GaugeMetricFamily(
        "splitserve_admission_prefill_backlog_tokens",
        "Prompt tokens admitted and not yet computed (no first token).",
        value=snapshot.prefill_backlog_tokens,
    )
    yield GaugeMetricFamily(
        "splitserve_admission_queued_prompt_tokens",
        "Prompt tokens of the requests waiting for KV.",
        value=snapshot.queued_prompt_tokens,
    )
    yield GaugeMetricFamily(
        "splitserve_admission_tpot_seconds",
        "Time per output token the wait predictions use (measured, smoothed).",
        value=snapshot.tpot_s,
    )
    yield GaugeMetricFamily(
        "splitserve_admission_ttft_seconds",
        "Time from admission to first token the wait predictions use (measured, smoothed).",
        value=snapshot.ttft_s,
    )
    if snapshot.prefill_drain_tokens_per_s is not None:
        yield GaugeMetricFamily(
            "splitserve_admission_prefill_drain_tokens_per_second",
            "Prompt tokens a second the loaded prefill backlog was measured to drain "
            "(what the wait predictions use; absent until measured).",
            value=snapshot.prefill_drain_tokens_per_s,
        )
