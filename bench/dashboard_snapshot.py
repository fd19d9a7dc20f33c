"""The Grafana dashboard's panels drawn from a real Prometheus's answers (issue 34: no Grafana
can be installed here, so the same queries are drawn with matplotlib).

Starts ``splitserve up`` (``--up-flags``, by default ``make serve``'s) and a local Prometheus
(``launch/local_prometheus.py``) scraping every process each second, sends streamed chats
through the gateway for ``--seconds`` (Poisson arrivals at ``--rate``, prompts of a few to a
few hundred tokens, some turns of one session, and a burst of ``--burst`` at once two thirds
in), then asks Prometheus for every panel's queries over the run (``query_range``, Grafana's
``$__rate_interval`` as ``--rate-window``) and draws one subplot per panel, in the dashboard's
order, its series named by the panel's legend format.

Writes ``<out>.png`` and ``<out>.json`` (per panel, per query: the series returned, each with
its legend and the number of points): the list of panels and the series each returned.
Nothing asserted.

    .venv/bin/python bench/dashboard_snapshot.py --out bench/results/dashboard-<date>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from cluster_process import LocalCluster
from machine_bound import cpu_name
from timing_stats import Json, log_row

from splitserve.launch.local_prometheus import LocalPrometheus

SPLITSERVE = Path(sys.executable).with_name("splitserve")
DASHBOARD = Path(__file__).resolve().parent.parent / "deploy/base/grafana/splitserve.json"
WORDS = [
    "the",
    "sea",
    "keeper",
    "light",
    "tower",
    "storm",
    "ship",
    "harbour",
    "night",
    "lamp",
    "wave",
    "rock",
]


async def _chat(
    client: httpx.AsyncClient, model: str, rng: random.Random, session: str = ""
) -> int:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 40, 200))))
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me about {words}."}],
        "max_tokens": rng.randint(16, 64),
        "stream": True,
    }
    headers = {"x-session-id": session} if session else {}
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as response:
            await response.aread()
            return response.status_code
    except httpx.HTTPError:
        return 0


async def load(url: str, seconds: float, rate: float, burst: int, seed: int) -> dict[int, int]:
    """The run's requests; how many ended with each status (0: a transport error)."""
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    limits = httpx.Limits(max_connections=burst + 64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        tasks: list[asyncio.Task[int]] = []
        started = time.monotonic()
        burst_at = started + seconds * 2 / 3
        while (now := time.monotonic()) < started + seconds:
            session = f"conversation-{rng.randrange(4)}" if rng.random() < 0.3 else ""
            tasks.append(asyncio.create_task(_chat(client, model, rng, session)))
            if burst and now >= burst_at:
                tasks += [asyncio.create_task(_chat(client, model, rng)) for _ in range(burst)]
                burst = 0
            await asyncio.sleep(rng.expovariate(rate))
        for status in await asyncio.gather(*tasks):
            statuses[status] = statuses.get(status, 0) + 1
    return statuses


def _legend(template: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), "?"), template)
    return text.strip() or "value"


def snapshot(
    prometheus: LocalPrometheus, start: float, end: float, step_s: float, window: str
) -> list[Json]:
    """Every panel's queries over ``start``..``end``: [{title, unit, queries: [{expr,
    series: [{legend, points: [(t, value)]}]}]}] in the dashboard's order."""
    panels = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            continue
        queries = []
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", window)
            result = prometheus.query_range(expr, start, end, step_s)
            series = [
                {
                    "legend": _legend(target.get("legendFormat", ""), s["metric"]),
                    "points": [(float(t) - start, float(v)) for t, v in s["values"]],
                }
                for s in result
            ]
            queries.append({"expr": expr, "series": series})
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        panels.append({"title": panel["title"], "unit": unit, "queries": queries})
    return panels


def draw(panels: list[Json], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 4
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.1 * rows))
    for axis, panel in zip(axes.flat, panels, strict=False):
        for query in panel["queries"]:
            for series in query["series"]:
                points = [(t, v) for t, v in series["points"] if math.isfinite(v)]
                if points:
                    xs, ys = zip(*points, strict=True)
                    axis.plot(xs, ys, label=series["legend"][:40], linewidth=1)
        axis.set_title(panel["title"], fontsize=9)
        axis.set_xlabel(f"s ({panel['unit']})", fontsize=7)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=6, loc="upper left")
        else:
            axis.text(0.5, 0.5, "no finite values", ha="center", transform=axis.transAxes)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.99))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(args: argparse.Namespace) -> Json:
    log_path = Path(tempfile.mkdtemp(prefix="dashboard-")) / "up.log"
    with LocalCluster(SPLITSERVE, shlex.split(args.up_flags), log_path) as cluster:
        assert cluster.child is not None
        announced = cluster.child.announcements()
        targets = {
            what.split()[0]: url for what, url in announced.items() if what.endswith("metrics")
        }
        targets["gateway"] = f"{cluster.http_url}/metrics"
        with LocalPrometheus(targets, "1s") as prometheus:
            start = time.time()
            statuses = asyncio.run(
                load(cluster.http_url, args.seconds, args.rate, args.burst, args.seed)
            )
            time.sleep(5)  # the last scrapes
            end = time.time()
            panels = snapshot(prometheus, start, end, args.step, args.rate_window)
    title = (
        f"splitserve dashboard, {cpu_name()}: {args.up_flags}, chats at {args.rate}/s for "
        f"{args.seconds:g} s, a burst of {args.burst}; statuses {statuses}"
    )
    draw(panels, args.out.with_suffix(".png"), title)
    listing = [
        {
            "title": panel["title"],
            "queries": [
                {
                    "expr": query["expr"],
                    "series": [
                        {"legend": s["legend"], "points": len(s["points"])} for s in query["series"]
                    ],
                }
                for query in panel["queries"]
            ],
        }
        for panel in panels
    ]
    report: Json = {
        "machine": {"cpu": cpu_name()},
        "setup": vars(args) | {"out": str(args.out)},
        "statuses": statuses,
        "panels": listing,
        "panels_without_series": [p["title"] for p in listing if not any(
            q["series"] for q in p["queries"]
        )],
    }  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    log_row({"statuses": statuses, "empty": report["panels_without_series"]})
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="path without suffix")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--rate", type=float, default=1.5, help="chats per second")
    parser.add_argument("--burst", type=int, default=60)
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--step", type=float, default=2.0, help="seconds between points")
    parser.add_argument("--rate-window", default="20s")
    parser.add_argument("--up-flags", default="--placement adaptive")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Any:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
