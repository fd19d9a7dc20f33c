"""What the gateway alone spends on a crowd's refusals (issue 31): a real gateway process in
front of ``full_coordinator.py`` (a stand-in whose admission queue is always full), a crowd of
``--streams`` sent at once from ``--clients`` processes (``bench_crowd.py``'s clients: HTTP/1.1
by hand, each request timed from its own send), and the gateway's CPU from ``/proc``.

Per repetition, for each of ``--refuses-all-ms`` (alternated; 0 = the coordinator's refusals
say nothing of other requests, so every request is parsed, validated and sent, as before
refusals at the door; 100 = what a full queue's refusals say, ``coordinator/admission.py:
REFUSES_ALL_S``), a fresh pair of processes. Reported per run: the outcomes, the 429s' status
time percentiles, the gateway's CPU microseconds per request (its probes included), and how
many streams reached the coordinator. Prints rows to stderr and the JSON report to stdout
(``--out`` writes it too). Nothing asserted.

    .venv/bin/python bench/bench_gateway_refusals.py --out bench/results/gateway-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench_crowd import _run_crowd
from cluster_process import CLK_TCK, process_ticks
from machine_bound import cpu_name
from timing_stats import Json, emit_report, log_row, wait_for_quiet

HERE = Path(__file__).parent
READY = re.compile(r"ready at (\S+)")


def _start(argv: list[str], marker: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``argv`` with its output in ``log``; the process and the address its ``<marker>
    ready at`` line names."""
    process = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and process.poll() is None:
        for line in log.read_text(errors="replace").splitlines():
            if marker in line and (match := READY.search(line)):
                return process, match.group(1)
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{argv[1:3]} did not get ready:\n{log.read_text(errors='replace')}")


def _asked(log: Path) -> int:
    """The stand-in's last ``asked N`` line."""
    counts = re.findall(r"asked (\d+)", log.read_text(errors="replace"))
    return int(counts[-1]) if counts else 0


def one_run(args: argparse.Namespace, refuses_all_ms: int, rep: int, logs: Path) -> Json:
    coordinator_log = logs / f"coordinator-{refuses_all_ms}-{rep}.log"
    coordinator, address = _start(
        [sys.executable, str(HERE / "full_coordinator.py"), f"--refuses-all-ms={refuses_all_ms}"],
        "full coordinator",
        coordinator_log,
    )
    gateway = None
    try:
        gateway, url = _start(
            [sys.executable, "-m", "splitserve.gateway.main", f"--coordinator={address}",
             "--port=0"],
            "splitserve gateway",
            logs / f"gateway-{refuses_all_ms}-{rep}.log",
        )  # fmt: skip
        wait_for_quiet(30.0)
        before = process_ticks(gateway.pid)
        crowd = asyncio.run(_run_crowd(url, None, args))
        cpu_s = (process_ticks(gateway.pid) - before) / CLK_TCK
        time.sleep(2.5)  # the stand-in's next count line
    finally:
        for process in (gateway, coordinator):
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
    refused = crowd["crowd"].get("refused", {}).get("status_s", {})
    return {
        "refuses_all_ms": refuses_all_ms,
        "rep": rep,
        "counts": crowd["crowd"]["counts"],
        "refused_status_s": refused,
        "gateway_cpu_s": round(cpu_s, 2),
        "gateway_us_per_request": round(cpu_s / args.streams * 1e6),
        "coordinator_asked": _asked(coordinator_log),
        "probe": crowd["probe"],
    }


def main(argv: Sequence[str] | None = None) -> Json:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--refuses-all-ms", default="0,100")
    parser.add_argument("--lead-s", type=float, default=3.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.max_tokens, args.via, args.records = 16, "http", None  # what _run_crowd reads
    windows = [int(value) for value in args.refuses_all_ms.split(",")]
    report: Json = {"cpu": cpu_name(), "streams": args.streams, "clients": args.clients,
                    "runs": []}  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="gateway-refusals-"))
    for rep in range(args.reps):
        for window in windows:
            run = one_run(args, window, rep, logs)
            report["runs"].append(run)
            log_row({key: value for key, value in run.items() if key != "probe"})
    emit_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
