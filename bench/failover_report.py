"""The failover benchmark's results (``bench_failover.py``): each part's summary, recomputed
from its runs (the membership part's medians and etcd/default ratios, as the security
benchmark's: ``security_report.py``; the failover part's gaps, continued streams and
restarts), the lines and tables printed at the end, and the bench log section of a results
file (``--render-readme``).
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence

from security_report import format_table, medians, quiet_or_all, shown_metrics
from serving_stats import LatencyStats
from timing_stats import Json

CONFIGS = ("default", "etcd")


# ---------------------------------------------------------------- membership


EXTRA_FIGURES = ("start_s", "cluster_cpu_share")


def figures(run: Json) -> dict[str, float]:
    """The table's metrics of one run: bench_security's, the start time (``up`` launched to
    its ready line) and the cluster's CPU share during the load."""
    extra = {"start_s": run["start_s"], "cluster_cpu_share": run["cpu"]["cluster_share"]}
    return shown_metrics(run) | extra


def membership_medians(runs: Sequence[Json]) -> Json:
    counted = quiet_or_all(runs)
    extra = {n: round(statistics.median(figures(r)[n] for r in counted), 3) for n in EXTRA_FIGURES}
    return medians(runs) | extra


def etcd_ratios(runs: dict[str, list[Json]], table: dict[str, Json]) -> dict[str, Json]:
    """etcd/default per metric: of the medians, and per round (the rounds in which both runs
    were quiet; every round if none)."""
    rounds = list(zip(runs["etcd"], runs["default"], strict=False))
    paired = [(e, d) for e, d in rounds if e["quiet"] and d["quiet"]] or rounds
    ratio = {
        name: {
            "of_medians": round(table["etcd"][name] / table["default"][name], 3),
            "paired": [round(figures(e)[name] / figures(d)[name], 3) for e, d in paired],
            "paired_rounds": [e["round"] for e, _ in paired],
        }
        for name in figures(rounds[0][0])
    }
    return {"etcd/default": ratio}


def membership_summary(part: Json) -> Json:
    """The membership part with its medians and ratios (recomputed from its runs)."""
    runs = part["runs"]
    table = {name: membership_medians(runs[name]) for name in CONFIGS if runs.get(name)}
    ratios = etcd_ratios(runs, table) if len(table) == len(CONFIGS) else {}
    etcd = [run["etcd"] for run in runs.get("etcd", []) if "etcd" in run]
    etcd_figures = {
        key: round(statistics.median(note[key] for note in etcd), 2)
        for key in ("etcd_start_s", "etcd_cpu_s")
        if etcd and all(key in note for note in etcd)
    }
    return part | {"medians": table, "ratios": ratios, "etcd_server": etcd_figures}


# ---------------------------------------------------------------- failover


def round_figures(row: Json) -> str:
    gaps = [s["gap_ms"] for s in row["streams"] if s["gap_ms"] is not None]
    continued = sorted((s["gap_ms"] for s in row["streams"] if s["continued"]), reverse=True)
    return (
        f"killed {row['victim']}; continued {row['continued']} (gaps ms "
        f"{', '.join(f'{g:.0f}' for g in continued)}); other spanning gaps p50 "
        f"{statistics.median([g for g in gaps if g not in continued] or [0]):.0f} ms; "
        f"baseline ITL p50 {LatencyStats.of(row['other_gaps_ms']).p50:.1f} ms; "
        f"failed {row['failed']}, mismatches {row['mismatches']}; serving again after "
        f"{row['restart_s']:.1f} s; other CPU {row['cpu']['other_share']:.0%}"
    )


def gap_stats(values: Sequence[float]) -> Json:
    stats = LatencyStats.of(values)
    return {"count": stats.count, "p50": stats.p50, "p99": stats.p99, "max": max(values, default=0)}


def failover_summary(part: Json) -> Json:
    """The failover part with its summary (recomputed from its rounds)."""
    rounds = part["rounds"]
    rows = [s for r in rounds for s in r["streams"]]
    reference = part["reference"]
    summary = {
        "rounds": len(rounds),
        "streams": len(rows),
        "continued_streams": sum(r["continued"] for r in rounds),
        "continued_per_round": [r["continued"] for r in rounds],
        "gap_continued_ms": gap_stats([s["gap_ms"] for s in rows if s["continued"]]),
        "gap_not_continued_ms": gap_stats(
            [s["gap_ms"] for s in rows if not s["continued"] and s["gap_ms"] is not None]
        ),
        "ended_before_kill": sum(s["gap_ms"] is None for s in rows),
        "baseline_itl_ms": gap_stats([g for r in rounds for g in r["other_gaps_ms"]]),
        "reference_itl_ms": reference["itl_ms"],
        "extra_ms": None,
        "failed_requests": sum(r["failed"] for r in rounds) + reference["failed"],
        "mismatches": sum(r["mismatches"] for r in rounds),
        "restart_s": {
            "median": round(statistics.median(r["restart_s"] for r in rounds), 2)
            if rounds
            else None,
            "max": max((r["restart_s"] for r in rounds), default=None),
        },
        "noisy_rounds": sum(not r["quiet"] for r in rounds),
        "other_cpu_share_max": max((r["cpu"]["other_share"] for r in rounds), default=None),
    }
    continued, baseline = summary["gap_continued_ms"], summary["baseline_itl_ms"]
    if continued["count"]:  # what the failover adds to a continued stream's usual gap
        summary["extra_ms"] = {
            q: round(continued[q] - baseline["p50"], 1) for q in ("p50", "p99", "max")
        }
    return part | {"summary": summary}


# ---------------------------------------------------------------- printed


def ms(stats: Json) -> str:
    return f"{stats['p50']:.0f} / {stats['p99']:.0f} / {stats['max']:.0f}"


def failover_table(summary: Json) -> str:
    rows = [
        ("continued", summary["gap_continued_ms"]),
        ("not continued", summary["gap_not_continued_ms"]),
        ("baseline: every other gap, same rounds", summary["baseline_itl_ms"]),
        ("uninterrupted reference run", summary["reference_itl_ms"]),
    ]
    lines = [
        "| streams | gaps | gap p50 / p99 / max ms |",
        "|---|---|---|",
        *(f"| {name} | {stats['count']} | {ms(stats)} |" for name, stats in rows),
    ]
    return "\n".join(lines)


def failover_line(summary: Json) -> str:
    restart = summary["restart_s"]
    extra = summary["extra_ms"] or {}
    return (
        f"continued streams: {summary['continued_streams']} of {summary['streams']} "
        f"(per round {summary['continued_per_round']}); their gap across the failover minus the "
        f"baseline ITL p50: {extra.get('p50')} ms at p50, {extra.get('p99')} ms at p99, "
        f"{extra.get('max')} ms at most; failed requests: "
        f"{summary['failed_requests']}; streams differing from the reference (text or token "
        f"count): {summary['mismatches']}; ended before the kill: "
        f"{summary['ended_before_kill']}; coordinator serving again after the SIGKILL: median "
        f"{restart['median']} s, max {restart['max']} s; noisy rounds: "
        f"{summary['noisy_rounds']} (other processes took at most "
        f"{summary['other_cpu_share_max'] or 0:.0%} of the CPUs)"
    )


def membership_line(part: Json) -> str:
    table, etcd = part["medians"], part["etcd_server"]
    counted = ", ".join(f"{name} {row['runs_counted']}" for name, row in table.items())
    failed = ", ".join(f"{name} {row['failed_requests']}" for name, row in table.items())
    return (
        f"rounds: {part['rounds']}; runs counted: {counted}; failed requests (every run): "
        f"{failed}; the etcd server (median per run) started in {etcd.get('etcd_start_s')} s "
        f"and used {etcd.get('etcd_cpu_s')} CPU s over its life; wall time {part['wall_s']} s"
    )


def summarized(document: Json) -> Json:
    """The document with each part's summary recomputed from its runs."""
    if "membership" in document:
        document["membership"] = membership_summary(document["membership"])
    if "failover" in document:
        document["failover"] = failover_summary(document["failover"])
    return document


def print_summary(document: Json) -> None:
    if "membership" in document:
        part = document["membership"]
        print(format_table(part["medians"], part["ratios"]), flush=True)
        print(membership_line(part), flush=True)
    if "failover" in document:
        summary = document["failover"]["summary"]
        print(failover_table(summary), flush=True)
        print(failover_line(summary), flush=True)


def readme_section(document: Json, results_path: str) -> str:
    """The bench log section (bench/log/) of a results document (the figures and how they were
    measured; what they mean is for the reader to add)."""
    settings = document["settings"]
    out = [
        "## Cost of etcd membership; a stream's gap when its coordinator dies "
        "(`bench/bench_failover.py`)",
        "",
        f"{document['date']}, this {document['machine']['cpus']}-core machine, "
        f"{document['wall_s'] / 60:.1f} minutes, `{results_path}`:",
        "",
        "```bash",
        document["command"],
        "```",
    ]
    if "membership" in document:
        part = document["membership"]
        out += [
            "",
            "**etcd membership vs the default.** `make serve`'s cluster (1 prefill + 1 decode "
            "worker, a core each, coordinator, gateway; "
            f"{part['configs']['default'].split(':')[0]}), one freshly started cluster per run, "
            "interleaved in rounds: **default** = workers register with the coordinator over "
            "gRPC; **etcd** = `--etcd-endpoints` at a fresh single-member etcd server per run "
            "(started before `up`; its CPU counts as the cluster's). Load through the gateway "
            "as in the security benchmark: "
            f"{settings['num_requests']} requests at {settings['rate']} req/s Poisson, a burst "
            f"of {settings['burst_requests']}, {settings['sequential_requests']} one at a time "
            f"({settings['input_len']} prompt + {settings['output_len']} output tokens). "
            "Medians of the quiet runs; etcd/default of the medians with the range of the "
            "per-round ratios; `start_s`: `up` launched to its ready line; "
            "`cluster_cpu_share`: the cluster's share of all CPUs during the load.",
            "",
            format_table(part["medians"], part["ratios"]),
            "",
            membership_line(part) + ".",
        ]
    if "failover" in document:
        summary = document["failover"]["summary"]
        out += [
            "",
            "**A stream's gap when its coordinator dies.** `up --coordinators 2` (1 prefill + 1 "
            "decode worker, the gateway balancing over both coordinators; worker flags: "
            f"`{settings.get('failover_worker_flags') or 'none'}`); "
            f"{summary['rounds']} rounds of {settings['failover_streams']} greedy streams at "
            f"once through the gateway ({settings['failover_input_len']} prompt tokens, "
            f"{settings['failover_max_tokens']} output tokens); once every stream has "
            f"{settings['kill_after']} tokens one coordinator is SIGKILLed (alternately); `up` "
            "restarts it and the next round waits until it serves. Gap across the failover: "
            "last token before the SIGKILL to the first after it, per stream; in each round "
            "the k largest are the continued streams, k = the coordinators' "
            '`splitserve_request_recoveries_total{kind="coordinator_continuation"}` increase. '
            "Baseline: every other gap of the same rounds; reference: an uninterrupted run of "
            "the same streams first, in the same cluster.",
            "",
            failover_table(summary),
            "",
            failover_line(summary) + ".",
        ]
    return "\n".join(wrap(line) for line in out) + "\n"


def wrap(line: str) -> str:
    """A prose line wrapped as the bench log (bench/log/) is (tables, code and headings kept)."""
    if line.startswith(("|", "#", "```", ".venv")):
        return line
    return textwrap.fill(line, 96, break_long_words=False, break_on_hyphens=False)
