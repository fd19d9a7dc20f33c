"""``bench/prometheus_text.py:metric_total`` on a coordinator's real exposition: the token
count ``bench/bench_coordinator_scale.py`` reads per coordinator."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from prometheus_client import CollectorRegistry, generate_latest

from splitserve.common.metrics import RequestMetricFamilies

BENCH = Path(__file__).resolve().parent.parent / "bench"
TOKENS = "splitserve_request_generation_tokens_sum"


def _prometheus_text() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prometheus_text", BENCH / "prometheus_text.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exposition() -> str:
    """Two finished requests at the coordinator (32 + 5 tokens) and one at the gateway (7)."""
    registry = CollectorRegistry()
    families = RequestMetricFamilies(registry)
    coordinator = families.for_model("m", "coordinator")
    for count in (32, 5):
        timer = coordinator.start()
        timer.tokens(count)
        timer.finish("length", 10, count)
    gateway = families.for_model("m", "gateway").start()
    gateway.tokens(7)
    gateway.finish("length", 10, 7)
    return generate_latest(registry).decode()


def test_sums_the_samples_whose_labels_match() -> None:
    metric_total = _prometheus_text().metric_total
    text = _exposition()
    assert metric_total(text, TOKENS, {"role": "coordinator"}) == 37
    assert metric_total(text, TOKENS) == 44
    finished = "splitserve_request_generation_tokens_count"
    assert metric_total(text, finished, {"role": "gateway"}) == 1


def test_an_absent_name_or_label_totals_zero() -> None:
    metric_total = _prometheus_text().metric_total
    text = _exposition()
    assert metric_total(text, "splitserve_no_such_metric") == 0.0
    assert metric_total(text, TOKENS, {"role": "decode"}) == 0.0
    assert metric_total("", TOKENS) == 0.0
