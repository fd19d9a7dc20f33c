"""A worker's step metrics (``worker/metrics.py``), observed from engine reports: each step
that ran is counted once under its kind, its decode rows as the batch size; reports after
commands (no step) and steps that ran nothing are left out. The LoRA adapters' requests are
read from the latest report at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from splitserve.common.step_cost import StepShape
from splitserve.engine.engine_report import AdapterRequests, EngineReport, StepTiming
from splitserve.worker.metrics import StepMetrics, install_engine_metrics


def test_each_step_counts_once_under_its_kind_with_its_decode_batch() -> None:
    registry = CollectorRegistry()
    metrics = StepMetrics(registry, "m", "decode")
    shapes = [
        (StepShape(8, 0, 800), 0.030),  # decode only, 8 requests
        (StepShape(0, 256, 0), 0.120),  # a prompt chunk only
        (StepShape(3, 64, 300), 0.050),  # both
        (StepShape(0, 0, 0), 0.001),  # nothing ran: left out
    ]
    for shape, seconds in shapes:
        metrics.observe(EngineReport(step=StepTiming(seconds, 0.0, shape)))
    metrics.observe(EngineReport())  # after a command batch: no step
    ahead = StepTiming(0.02, 0.0, StepShape(8, 0, 808), ran_ahead=True)
    metrics.observe(EngineReport(step=ahead))  # launched before the step before was read

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "role": "decode", **labels})

    for kind, seconds, count in (("decode", 0.050, 2), ("prefill", 0.120, 1), ("mixed", 0.050, 1)):
        assert value("splitserve_engine_step_seconds_count", kind=kind) == count
        assert value("splitserve_engine_step_seconds_sum", kind=kind) == seconds
    assert value("splitserve_engine_step_decode_requests_count") == 3
    assert value("splitserve_engine_step_decode_requests_sum") == 19
    assert value("splitserve_engine_steps_ahead_total") == 1


class _Engine:
    """What ``install_engine_metrics`` reads of an ``AsyncEngine``: its latest report."""

    step_threads = None

    def __init__(self, report: EngineReport) -> None:
        self.latest_report = report

    def add_report_listener(self, listener) -> None:  # noqa: ANN001
        pass


def test_each_lora_adapters_requests_are_exported_running_and_waiting() -> None:
    registry = CollectorRegistry()
    adapters = (AdapterRequests("sql", 3, 0), AdapterRequests("chat", 0, 2))
    engine = _Engine(EngineReport(lora_requests=adapters))
    install_engine_metrics(registry, engine, "m", "decode")  # type: ignore[arg-type]

    def value(adapter: str, state: str) -> float | None:
        labels = {"model_name": "m", "role": "decode", "adapter": adapter, "state": state}
        return registry.get_sample_value("splitserve_lora_requests", labels)

    assert [value("sql", "running"), value("sql", "waiting")] == [3, 0]
    assert [value("chat", "running"), value("chat", "waiting")] == [0, 2]
    engine.latest_report = EngineReport()  # none served any more: no series
    assert value("sql", "running") is None
