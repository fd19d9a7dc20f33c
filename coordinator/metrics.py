"""The coordinator's Prometheus metrics: request latencies (``common/metrics.py``, role
``coordinator``), per-stage latency of the disaggregated path, recoveries, and workers.

``splitserve_request_stage_seconds{stage}``: reserve (decode worker reserved blocks for a
pushed prompt), prefill (reservation -> first token: prompt computed and KV pushed),
local_prefill (prompt computed on the decode worker). ``splitserve_request_recoveries_total
{kind}``: prefill_fallback (prefill failed, prompt computed on the decode worker),
decode_resume (decode worker failed, request resumed on another), coordinator_continuation
(a client continued here a stream whose coordinator died, ``continue_after``).
``splitserve_num_workers{worker_role}``: registered, healthy workers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from splitserve.common.membership import Role
from splitserve.common.metrics import TIME_TO_FIRST_TOKEN_BUCKETS, RequestMetrics
from splitserve.coordinator.flow import RequestFlow
from splitserve.coordinator.registry import WorkerRegistry

STAGES = ("reserve", "prefill", "local_prefill")
RECOVERIES = ("prefill_fallback", "decode_resume", "coordinator_continuation")


class CoordinatorMetrics:
    def __init__(
        self, registry: CollectorRegistry, model_name: str, worker_registry: WorkerRegistry
    ) -> None:
        self.requests = RequestMetrics(registry, model_name, "coordinator")
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
        registry.register(_WorkerCollector(worker_registry))

    def record_flow(self, flow: RequestFlow) -> None:
        """Observe a finished flow's stages and recoveries (once, at its end)."""
        for name, seconds in flow.stage_seconds:
            if name in self._stages:
                self._stages[name].observe(seconds)
        for kind in flow.recoveries:
            if kind in self._recoveries:
                self._recoveries[kind].inc()


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
