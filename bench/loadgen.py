"""Serving load generator: requests at a given rate against a ``Target``, latency and goodput.

Builds a seeded workload (``workload.py``: Poisson or evenly spaced arrivals at ``--rate``
req/s, ``inf`` = all at once; input and output lengths from fixed, uniform or clipped normal
distributions; prompts of random token ids), sends each request at its arrival time (waiting
for a slot first when ``--max-concurrency`` is set; the send time is taken after the wait),
stamps every streamed token on arrival and prints the summary of ``serving_stats.py``: TTFT,
TPOT and ITL mean/p50/p90/p99, request and output-token throughput, failures, and goodput
(completed requests per second meeting both ``--slo-ttft-ms`` and ``--slo-tpot-ms``).
``--out`` writes the summary, the settings and every request's figures as JSON.

``--warmup-requests N`` first sends N requests one at a time (other prompts than the run's,
so they leave nothing in a prefix cache the run could hit), not counted.

Targets (``targets.py``): the coordinator's gRPC API (``--address host:port``). Other APIs
implement the same ``Target`` protocol.

Usage: ``python bench/loadgen.py --address 127.0.0.1:50051 --num-requests 100 --rate 2
--input-len 256 --input-dist uniform:128:384 --output-len 96 --slo-tpot-ms 60 --out r.json``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from serving_stats import RequestRecord, ServingSummary, Slo, format_summary, summarize
from targets import GrpcTarget, OpenAITarget, Target
from timing_stats import Json
from workload import LengthDist, RequestSpec, WorkloadConfig, build_workload


@dataclass(frozen=True)
class LoadConfig:
    """One load run: the workload, how many requests may be in flight, the SLO."""

    workload: WorkloadConfig
    max_concurrency: int | None = None
    """At most this many requests in flight (None: no limit)."""
    slo: Slo = Slo()
    warmup_requests: int = 0
    """Requests sent one at a time before the run and not counted."""

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError("max_concurrency must be positive")
        if self.warmup_requests < 0:
            raise ValueError("warmup_requests must be >= 0")


@dataclass(frozen=True)
class LoadResult:
    summary: ServingSummary
    records: list[RequestRecord]


async def _send(target: Target, request: RequestSpec) -> RequestRecord:
    """Send one request now and record its stream."""
    record = RequestRecord(request.index, len(request.prompt_token_ids), request.output_len)
    record.send_time = time.perf_counter()
    async for event in target.stream(request):
        now = time.perf_counter()
        record.token_times.extend([now] * event.num_tokens)
        if event.final:
            record.finish_reason, record.error = event.finish_reason, event.error
            record.end_time = now
            break
    if not record.end_time:
        record.error, record.end_time = "no final event", time.perf_counter()
    return record


async def _send_at(
    target: Target, request: RequestSpec, start: float, slots: asyncio.Semaphore | None
) -> RequestRecord:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    async with slots if slots is not None else contextlib.nullcontext():
        return await _send(target, request)


async def run_requests(
    target: Target, requests: Sequence[RequestSpec], max_concurrency: int | None = None
) -> list[RequestRecord]:
    """Send every request at its arrival time (relative to now); their records in order."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()
    tasks = [asyncio.create_task(_send_at(target, r, start, slots)) for r in requests]
    return list(await asyncio.gather(*tasks))


async def run_requests_against(
    target: Target, requests: Sequence[RequestSpec], max_concurrency: int | None = None
) -> list[RequestRecord]:
    """``run_requests`` with the target opened before and closed after."""
    await target.open()
    try:
        return await run_requests(target, requests, max_concurrency)
    finally:
        await target.close()


async def run_load(target: Target, config: LoadConfig) -> LoadResult:
    """Warm up, run the workload against an opened target, and summarize."""
    if config.warmup_requests:
        warmup = dataclasses.replace(
            config.workload,
            num_requests=config.warmup_requests,
            rate=math.inf,
            seed=-1 - config.workload.seed,
        )
        for request in build_workload(warmup):
            await _send(target, request)
    records = await run_requests(target, build_workload(config.workload), config.max_concurrency)
    return LoadResult(summarize(records, config.slo), records)


async def run_against(target: Target, config: LoadConfig) -> LoadResult:
    """``run_load`` with the target opened before and closed after."""
    await target.open()
    try:
        return await run_load(target, config)
    finally:
        await target.close()


def report(config: LoadConfig, target_name: str, result: LoadResult) -> Json:
    """The JSON report of one run: settings, summary, per-request figures."""
    workload = config.workload
    return {
        "target": target_name,
        "settings": {
            "num_requests": workload.num_requests,
            "rate": "inf" if math.isinf(workload.rate) else workload.rate,
            "arrivals": "poisson" if workload.poisson else "fixed",
            "seed": workload.seed,
            "input_len": workload.input_len.describe(),
            "output_len": workload.output_len.describe(),
            "max_concurrency": config.max_concurrency,
            "warmup_requests": config.warmup_requests,
        },
        "summary": result.summary.to_json(),
        "requests": [r.row() for r in result.records],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="coordinator host:port")
    parser.add_argument(
        "--openai-url",
        default=None,
        help="drive an OpenAI-compatible server (e.g. http://127.0.0.1:8000) instead of gRPC",
    )
    parser.add_argument("--model", default=None, help="model name for --openai-url")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--rate", type=float, default=math.inf, help="req/s; inf = all at once")
    parser.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--input-len", type=int, default=256, help="mean input tokens")
    parser.add_argument("--input-dist", default="fixed", help="fixed|uniform:LO:HI|normal:STD")
    parser.add_argument("--output-len", type=int, default=128, help="mean output tokens")
    parser.add_argument("--output-dist", default="fixed", help="fixed|uniform:LO:HI|normal:STD")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--warmup-requests", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    return parser


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    workload = WorkloadConfig(
        num_requests=args.num_requests,
        rate=args.rate,
        input_len=LengthDist.parse(args.input_dist, args.input_len),
        output_len=LengthDist.parse(args.output_dist, args.output_len),
        poisson=args.arrivals == "poisson",
        seed=args.seed,
    )
    return LoadConfig(
        workload=workload,
        max_concurrency=args.max_concurrency,
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms),
        warmup_requests=args.warmup_requests,
    )


def served_model(base_url: str) -> str:
    """The first model an OpenAI-compatible server lists."""
    import httpx

    return httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=30).json()["data"][0]["id"]


def main(argv: Sequence[str] | None = None) -> Json:
    """Run the load described by ``argv``; print the summary and return the JSON report."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        raise SystemExit(f"loadgen: {error}") from error
    target: Target
    if args.openai_url:
        model = args.model or served_model(args.openai_url)
        target = OpenAITarget(args.openai_url, model, timeout_s=args.timeout)
    else:
        target = GrpcTarget(args.address, timeout_s=args.timeout)
    result = asyncio.run(run_against(target, config))
    print(format_summary(result.summary), flush=True)
    document = report(config, target.name, result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=2) + "\n")
    return document


if __name__ == "__main__":
    main(sys.argv[1:])
