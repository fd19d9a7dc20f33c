"""What tracing costs (``common/tracing.py``): CPU per request of each process, tracing off
against on, the same burst through fresh clusters, alternated per repetition.

"on" points every process of ``splitserve up`` at an OTLP/gRPC receiver run by this script
(``SpanCounter``: it counts what arrives, so the export is real) through
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; "off" sets nothing. Each run sends ``--streams``
streamed completions at once through the gateway (``bench_relay_cpu.burst``: short prompts,
``--max-tokens`` tokens each) and reads every process's utime + stime from ``/proc`` before
and after. By default the workers are simulated (``--engine sim`` with the relay stand-in
profile): their CPU is then the serving code's, not the model's.

Reported per role and mode: CPU microseconds per request and per streamed token (medians over
``--reps``), the spans received per request when on, and on - off per request (within each
repetition, the median); per mode, the burst's tokens/s and TTFT p50/p99 (medians).
Prints rows to stderr and the JSON report to stdout (``--out`` writes it too). Nothing
asserted.

    .venv/bin/python bench/bench_tracing.py --out bench/results/tracing-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path

import grpc
import httpx
from bench_relay_cpu import SPLITSERVE, add_burst_args, burst, burst_report, ticks_by_role
from cluster_process import CLK_TCK, LocalCluster
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from timing_stats import Json, emit_report, log_row, wait_for_quiet

PROFILE = Path(__file__).resolve().parent / "profiles" / "relay-stand-in.json"
MODES = ("off", "on")


class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that counts the spans exported to it."""

    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        scopes = [scope for resource in request.resource_spans for scope in resource.scope_spans]
        count = sum(len(scope.spans) for scope in scopes)
        with self._lock:
            self.spans += count
        return trace_service_pb2.ExportTraceServiceResponse()


def measure(args: argparse.Namespace, mode: str, counter: SpanCounter, port: int) -> Json:
    """One burst through a fresh cluster, tracing ``mode``."""
    log_path = Path(tempfile.mkdtemp(prefix="tracing-")) / "up.log"
    env = {"OTEL_BSP_SCHEDULE_DELAY": "500"}
    if mode == "on":
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{port}"
    with LocalCluster(SPLITSERVE, shlex.split(args.up_flags), log_path, env=env) as cluster:
        model = httpx.get(f"{cluster.http_url}/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(burst(cluster.http_url, model, 4, 8))  # warm-up
        wait_for_quiet(args.wait_quiet_s)
        pids = cluster.pids()
        spans_before = counter.spans
        before = ticks_by_role(pids)
        started = time.perf_counter()
        ended = asyncio.run(burst(cluster.http_url, model, args.streams, args.max_tokens))
        burst_s = time.perf_counter() - started
        time.sleep(1.5)  # the batch export of the burst's last spans, counted in the CPU
        after = ticks_by_role(pids)
        wall_s = time.perf_counter() - started
    tokens = sum(stream.tokens for stream in ended)
    requests = sum(stream.how == "ok" for stream in ended)
    ttfts = sorted(s.ttft_s for s in ended if s.ttft_s is not None)
    cpu_us = {
        role: (after[role] - before.get(role, 0)) / CLK_TCK * 1e6
        for role in after
        if role not in ("gone", "up", "other")
    }
    return {
        "mode": mode,
        "requests": requests,
        "tokens": tokens,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(tokens / burst_s, 1),
        "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2]) if ttfts else None,
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, len(ttfts) * 99 // 100)])
        if ttfts
        else None,
        "us_per_request": {role: round(us / max(requests, 1)) for role, us in cpu_us.items()},
        "us_per_token": {role: round(us / max(tokens, 1), 1) for role, us in cpu_us.items()},
        "spans_per_request": round((counter.spans - spans_before) / max(requests, 1), 2),
    }


def run(args: argparse.Namespace) -> Json:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    counter = SpanCounter()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(counter, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    report = burst_report(args)
    try:
        for rep in range(args.reps):
            for mode in MODES:
                row = measure(args, mode, counter, port)
                row["rep"] = rep
                report["reps"].append(row)
                log_row(row)
    finally:
        server.stop(None)
    medians: Json = {}
    served: Json = {}
    for mode in MODES:
        rows = [row for row in report["reps"] if row["mode"] == mode]
        roles = sorted({role for row in rows for role in row["us_per_request"]})
        medians[mode] = {
            role: {
                "us_per_request": statistics.median(row["us_per_request"][role] for row in rows),
                "us_per_token": statistics.median(row["us_per_token"][role] for row in rows),
            }
            for role in roles
        }
        served[mode] = {
            figure: statistics.median(row[figure] or 0 for row in rows)
            for figure in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")
        }
    report["medians"] = medians
    report["served"] = served
    pairs = [
        (off, on)
        for off, on in zip(report["reps"][0::2], report["reps"][1::2], strict=True)
        if off["mode"] == "off" and on["mode"] == "on"
    ]
    report["added_us_per_request"] = {  # on - off within each repetition, the median
        role: statistics.median(
            on["us_per_request"][role] - off["us_per_request"][role] for off, on in pairs
        )
        for role in medians["off"]
        if all(role in on["us_per_request"] for _, on in pairs)
    }
    log_row({"served": served, "added_us_per_request": report["added_us_per_request"]})
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_burst_args(parser, streams=256, max_tokens=16)
    parser.add_argument(
        "--up-flags",
        default=f"--placement adaptive -- --engine sim --sim-profile {PROFILE}",
        help="splitserve up's flags (default: make serve's layout, simulated workers)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)  # "off" must be off
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    emit_report(run(args), args.out)


if __name__ == "__main__":
    main()
