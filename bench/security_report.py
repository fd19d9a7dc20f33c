"""The security benchmark's results (``bench_security.py``; ``failover_report.py`` reuses them
for the etcd membership part): the figures of one run that the table shows, per configuration
their medians over the quiet runs, the ratios between configurations (of the medians, and
paired by round), and the Markdown table and summary lines that print them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from timing_stats import Json

PHASES = ("poisson", "burst", "sequential")
"""The load's phases, in the order each run drives them."""
METRICS: dict[str, tuple[tuple[str, ...], ...]] = {
    "poisson": (
        ("ttft_ms", "p50"),
        ("ttft_ms", "p99"),
        ("itl_ms", "p50"),
        ("tpot_ms", "p50"),
        ("output_throughput",),
        ("request_throughput",),
    ),
    "burst": (
        ("output_throughput",),
        ("request_throughput",),
        ("ttft_ms", "p50"),
        ("tpot_ms", "p50"),
    ),
    "sequential": (("ttft_ms", "p50"), ("tpot_ms", "p50")),
}
"""Per phase, the summary fields (paths into ``ServingSummary.to_json()``) the table shows."""


def row_figures(summary: Json) -> str:
    return (
        f"ok {summary['completed']}/{summary['num_requests']}  "
        f"{summary['output_throughput']:.1f} out tok/s  "
        f"{summary['request_throughput']:.3f} req/s  "
        f"TTFT p50/p99 {summary['ttft_ms']['p50']:.0f}/{summary['ttft_ms']['p99']:.0f} ms  "
        f"TPOT p50 {summary['tpot_ms']['p50']:.1f} ms  ITL p50 {summary['itl_ms']['p50']:.1f} ms"
    )


def lookup(summary: Json, path: Sequence[str]) -> float:
    value = summary
    for key in path:
        value = value[key]
    return float(value)


def shown_metrics(run: Json) -> dict[str, float]:
    """The table's metrics of one run, named ``<phase> <field>_<stat>``."""
    return {
        f"{phase} {'_'.join(path)}": lookup(run["phases"][phase], path)
        for phase, paths in METRICS.items()
        for path in paths
    }


def failed_requests(runs: Sequence[Json]) -> int:
    return sum(run["phases"][phase]["failed"] for run in runs for phase in PHASES)


def quiet_or_all(runs: Sequence[Json]) -> list[Json]:
    """The quiet runs, or every run when none was quiet."""
    return [run for run in runs if run["quiet"]] or list(runs)


def medians(runs: Sequence[Json]) -> Json:
    """Per shown metric, the median over the quiet runs (every run if none was quiet);
    failed requests summed over every run, noisy ones too; how many runs counted; the
    median CPU share other processes took in those."""
    counted = quiet_or_all(runs)
    per_run = [shown_metrics(run) for run in counted]
    out: Json = {name: round(statistics.median(m[name] for m in per_run), 3) for name in per_run[0]}
    out["failed_requests"] = failed_requests(runs)
    out["runs_counted"] = f"{len(counted)} of {len(runs)}" + (
        "" if counted[0]["quiet"] else " (none quiet)"
    )
    out["other_cpu_share"] = round(
        statistics.median(run["cpu"]["other_share"] for run in counted), 3
    )
    return out


RATIO_PAIRS = (("secured", "plain"), ("plain", "no-credential"))
NOT_RATIOS = ("failed_requests", "runs_counted", "other_cpu_share")


def ratios(runs: dict[str, list[Json]], table: dict[str, Json]) -> dict[str, Json]:
    """secured/plain and plain/no-credential per metric: the ratio of the medians, and the
    ratios of the two runs of each round in which both were quiet (paired: they ran back to
    back; every round if there is no such round)."""
    out: dict[str, Json] = {}
    for top, bottom in RATIO_PAIRS:
        if top not in runs or bottom not in runs:
            continue
        rounds = list(zip(runs[top], runs[bottom], strict=True))
        quiet = [(a, b) for a, b in rounds if a["quiet"] and b["quiet"]]
        pairs = [(shown_metrics(a), shown_metrics(b)) for a, b in quiet or rounds]
        out[f"{top}/{bottom}"] = {
            name: {
                "of_medians": round(table[top][name] / table[bottom][name], 3),
                "paired": [round(a[name] / b[name], 3) for a, b in pairs],
                "paired_rounds": [a["round"] for a, _ in quiet or rounds],
            }
            for name in pairs[0][0]
        }
    return out


def format_table(table: dict[str, Json], ratio_table: dict[str, Json]) -> str:
    """Markdown: medians per configuration, then each ratio of medians with the range of
    the paired (same-round) ratios."""
    names = list(table)
    header = ["metric", *names, *(f"{pair} (paired range)" for pair in ratio_table)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for metric in table[names[0]]:
        cells = [metric, *(str(table[n][metric]) for n in names)]
        for pair in ratio_table.values():
            if metric not in pair:
                cells.append("")
                continue
            paired = pair[metric]["paired"]
            cells.append(f"{pair[metric]['of_medians']:.3f} ({min(paired):.2f}-{max(paired):.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarized(document: Json) -> Json:
    """The document with the medians and ratios of its runs (before the runs)."""
    runs = document["runs"]
    table = {name: medians(config_runs) for name, config_runs in runs.items()}
    head = {key: value for key, value in document.items() if key not in ("runs", "medians")}
    return head | {"medians": table, "ratios": ratios(runs, table), "runs": runs}


def print_summary(document: Json) -> None:
    print(format_table(document["medians"], document["ratios"]), flush=True)
    failed = {name: row["failed_requests"] for name, row in document["medians"].items()}
    counted = {name: row["runs_counted"] for name, row in document["medians"].items()}
    print(
        f"rounds: {document['rounds']}; quiet runs counted: {counted}; failed requests (every "
        f"run): {failed}; wall time {document['wall_s']} s",
        flush=True,
    )
