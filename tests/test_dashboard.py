"""The Grafana dashboard (``deploy/base/grafana/splitserve.json``): well formed, and every
panel's query evaluated by a real Prometheus (Debian's ``prometheus``, installed by ``make
install``) scraping the shared served cluster (``tests/cluster.py:served_cluster``: a
coordinator, a prefill and a decode worker, the gateway) after a short load through the
gateway.

Each query must parse and return at least one series, and every label a panel's legend names
(``{{label}}``) must be on each series it returns: so a metric or label name the code does not
emit fails here. Grafana's ``$__rate_interval`` is evaluated as ``RATE_WINDOW``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from splitserve.launch.local_prometheus import LocalPrometheus, prometheus_binary
from tests.cluster import SERVED_MAX_INFLIGHT, Served

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy/base/grafana/splitserve.json"
RATE_WINDOW = "1m"
SCRAPE_INTERVAL = "500ms"
pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class PanelQuery:
    """One target of one panel."""

    panel: str
    expr: str
    legend: str

    @property
    def legend_labels(self) -> list[str]:
        return re.findall(r"\{\{\s*(\w+)\s*\}\}", self.legend)


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _queries(dashboard: dict[str, Any]) -> list[PanelQuery]:
    return [
        PanelQuery(panel["title"], target["expr"], target.get("legendFormat", ""))
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def test_the_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    panels = dashboard["panels"]
    assert dashboard["uid"] and dashboard["title"] == "splitserve"
    assert len({panel["id"] for panel in panels}) == len(panels)
    (variable,) = dashboard["templating"]["list"]
    assert variable == variable | {
        "name": "datasource",
        "type": "datasource",
        "query": "prometheus",
    }
    rows = [panel["title"] for panel in panels if panel["type"] == "row"]
    # request-flow order: what users send, what they see, then each stage of the path
    assert rows[:3] == ["Front end: the gateway", "Latency users see", "Admission"]
    assert rows.index("Placement") < rows.index("Prefill") < rows.index("KV transfer")
    assert rows.index("KV transfer") < rows.index("Decode") < rows.index("Stalls and health")
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and panel.get("description"), panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
    metrics = {name for query in _queries(dashboard) for name in _metric_names(query.expr)}
    # the panels the issue names: admission per tenant, placement reasons, KV transfer,
    # decode batch and step time, prefix hits, recoveries, stalls
    for name in (
        "splitserve_admission_decisions_total",
        "splitserve_admission_retry_after_seconds_bucket",
        "splitserve_placement_decisions_total",
        "splitserve_kv_transfer_failures_total",
        "splitserve_engine_step_decode_requests_sum",
        "splitserve_engine_step_seconds_bucket",
        "splitserve_prefix_cache_hits_total",
        "splitserve_request_recoveries_total",
        "splitserve_stream_stalls_total",
    ):
        assert name in metrics, name


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(splitserve_\w+|up)\b(?=\s*[\[{)])", expr))


@pytest.fixture
def prometheus(served_cluster: Served) -> Iterator[LocalPrometheus]:
    """A Prometheus scraping every process of the served cluster, each scraped once."""
    if prometheus_binary() is None:
        pytest.skip("no prometheus binary: `make install` installs Debian's package as root")
    targets = dict(served_cluster.metrics_urls)
    targets["gateway"] = f"{served_cluster.url}/metrics"
    with LocalPrometheus(targets, SCRAPE_INTERVAL) as server:
        yield server


async def _load(url: str) -> list[int]:
    """Streamed chats through the gateway: a round the cluster serves, then a burst past its
    ``--max-inflight`` (some answered 429); the statuses."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def chat(i: int) -> int:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Tell me about the number {i}. " * 8}],
                "max_tokens": 8,
                "stream": True,
            }
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                await response.aread()
                return response.status_code

        statuses = list(await asyncio.gather(*(chat(i) for i in range(4))))
        return statuses + list(
            await asyncio.gather(*(chat(i) for i in range(SERVED_MAX_INFLIGHT + 8)))
        )


def _scraped_since(prometheus: LocalPrometheus, moment: float) -> bool:
    """Whether every target has been scraped after ``moment`` (Unix time)."""
    series = prometheus.query("timestamp(up)")
    return len(series) == 4 and all(float(s["value"][1]) > moment for s in series)


def test_every_panel_query_returns_the_series_it_names(
    prometheus: LocalPrometheus, served_cluster: Served
) -> None:
    statuses = asyncio.run(_load(served_cluster.url))
    assert set(statuses) == {200, 429}, statuses
    loaded = time.time()
    deadline = time.monotonic() + 20
    while not _scraped_since(prometheus, loaded + 1):
        assert time.monotonic() < deadline, prometheus.query("up")
        time.sleep(0.25)
    empty, unlabelled = [], []
    for query in _queries(_dashboard()):
        series = prometheus.query(query.expr.replace("$__rate_interval", RATE_WINDOW))
        if not series:
            empty.append(f"{query.panel}: {query.expr}")
            continue
        for label in query.legend_labels:
            if any(label not in s["metric"] for s in series):
                unlabelled.append(f"{query.panel}: {label} in {query.expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert not unlabelled, "legend labels missing from the series:\n" + "\n".join(unlabelled)
    # what the load did is what Prometheus holds (counters since the cluster started: other
    # tests may have used it before)
    refused = prometheus.query('sum(splitserve_http_requests_total{status="429"})')
    assert float(refused[0]["value"][1]) >= statuses.count(429)
    admitted = prometheus.query('sum(splitserve_admission_decisions_total{outcome="admitted"})')
    assert float(admitted[0]["value"][1]) >= statuses.count(200)
