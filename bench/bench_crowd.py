"""A crowd arriving at once (issue 31): ``--streams`` streamed completions sent in the same
instant to ``make serve``'s gateway, from ``--clients`` client processes so that no one
client's event loop is the bottleneck.

Starts ``splitserve up --placement adaptive`` (``cluster_process.LocalCluster``) unless
``--url`` names a running gateway; with ``--baseline-tree`` it also runs that checkout's
cluster, a fresh cluster per tree and repetition, the trees alternating (a change's before
and after in one run); ``--tree`` runs "this" from a checkout too (e.g. a worktree of a
commit, so that uncommitted edits in the working tree stay out of the figures). Every client
process opens its share of the streams over its own connection (HTTP/1.1 written by hand on
asyncio streams, uvloop: a few hundred microseconds of client CPU a request), all at one
wall-clock instant agreed in advance, and times each request from the moment its bytes went
to the socket:

- ``status_s``: until the response's status line arrived (a 429's whole answer),
- ``first_token_s`` / ``last_token_s``: until the first and the last streamed token,
- the outcome: ``served`` (every token, then ``[DONE]``), ``refused`` (429 with a
  ``Retry-After``), ``refused_no_retry_after`` (429 without one), ``http_<status>`` (any other
  status, a 5xx is a bug), ``stream_error`` (an error event after tokens), ``cut_short``
  (fewer tokens than asked, no ``[DONE]``), ``closed_without_response`` (the connection ended
  before any status line; always a bug), ``connect_error``, ``timeout``.

With ``--via grpc`` the crowd skips the gateway: each client process opens one channel to the
coordinator's public port and makes its share of ``Generate`` calls at once (``status_s``: to
the first response or the error; a refusal is RESOURCE_EXHAUSTED, any other code is named):
the coordinator's own share of a crowd's wait.

With ``--busy N``, N long streams start ``--busy-lead-s`` before the crowd, so that it meets
engines already busy (a serving cluster's case); their outcomes are reported apart. While the
crowd runs, the parent process sends ``GET /health`` every second and one short
completion every two seconds from a separate connection, timing each (a server that holds its
crowd still answers newcomers). Reports counts per outcome, percentiles of each time per
outcome, the probes' latencies, each process's CPU in cores (``process_cpu.py``: the cluster's
roles with their niceness, and the client processes) over the ``--door-s`` seconds from the
first request's send ("door") and from then to the crowd's end ("rest"), and, from the
cluster's log, any line that names an error.
Prints rows to stderr and the JSON report to stdout (``--out`` writes it too). Nothing
asserted.

    .venv/bin/python bench/bench_crowd.py --streams 2000 --out bench/results/crowd-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from bench_security import tree_cluster
from cluster_process import LocalCluster
from machine_bound import cpu_name
from process_cpu import ProcessCpu
from timing_stats import Json, emit_report, log_row, wait_for_quiet

from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

CPU_SAMPLE_S = 0.1
"""How often each process's CPU time is read while the crowd runs."""
PROMPT = "Tell me a story about a lighthouse keeper and the sea. "


@dataclass
class CrowdRecord:
    """One crowd request as its client saw it; times in seconds from its own send."""

    outcome: str
    sent_at: float = 0.0
    """Wall-clock time (``time.time()``) of the send."""
    status_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0
    retry_after: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class ClientPlan:
    """What one client process sends: ``count`` streams at wall time ``start_at``."""

    url: str
    model: str
    grpc_address: str | None
    """Send to the coordinator's gRPC ``Generate`` here instead of the gateway (``--via grpc``)."""
    count: int
    max_tokens: int
    start_at: float
    timeout_s: float


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and headers (lower-cased names) of an HTTP/1.1 response."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("connection closed before a status line")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _one_stream(plan: ClientPlan, index: int) -> CrowdRecord:
    """One streamed completion over its own connection, HTTP/1.1 written by hand (an httpx
    client spends milliseconds of CPU per request: 2,000 of them at once took more than half
    of this 2-core machine, delaying its own sends by seconds). Timed from the moment the
    request's bytes were handed to the socket."""
    body = json.dumps({
        "model": plan.model, "prompt": f"{PROMPT}({index})", "max_tokens": plan.max_tokens,
        "min_tokens": plan.max_tokens, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip
    host, port = plan.url.removeprefix("http://").split(":")
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body
    record = CrowdRecord(outcome="connect_error")
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), limit=1 << 20), plan.timeout_s
        )
    except (TimeoutError, OSError) as error:
        record.detail = f"{type(error).__name__}: {error}"[:200]
        return record
    try:
        writer.write(request)
        await writer.drain()
        sent = time.perf_counter()
        record.sent_at = time.time()
        record.outcome = "closed_without_response"
        async with asyncio.timeout(plan.timeout_s):
            status, headers = await _read_head(reader)
            record.status_s = time.perf_counter() - sent
            record.outcome = "cut_short"
            if status != 200:
                record.retry_after = headers.get("retry-after")
                text = await reader.read()
                if status == 429:
                    record.outcome = "refused" if record.retry_after else "refused_no_retry_after"
                    record.detail = refusal_kind(text.decode(errors="replace"))
                else:
                    record.outcome = f"http_{status}"
                    record.detail = text[:200].decode(errors="replace")
                return record
            while line := await reader.readline():
                if not line.startswith(b"data: "):
                    continue  # chunk sizes and blank lines of the chunked body
                payload = line[len(b"data: ") :].strip()
                if payload == b"[DONE]":
                    if record.outcome == "cut_short" and record.tokens >= plan.max_tokens:
                        record.outcome = "served"
                    break
                event = json.loads(payload)
                if "error" in event:
                    record.outcome = "stream_error"
                    record.detail = str(event["error"])[:200]
                    continue
                if any(choice.get("text") for choice in event.get("choices", [])):
                    now = time.perf_counter() - sent
                    if record.first_token_s is None:
                        record.first_token_s = now
                    record.last_token_s = now
                if usage := event.get("usage"):
                    record.tokens = usage.get("completion_tokens", record.tokens)
    except (OSError, asyncio.IncompleteReadError, ValueError) as error:
        record.detail = f"{type(error).__name__}: {error}"[:200]
    except TimeoutError:
        record.outcome = "timeout"
    finally:
        writer.close()
    return record


async def _one_call(stub: Any, plan: ClientPlan, index: int) -> CrowdRecord:
    """One ``Generate`` call straight to the coordinator (one channel per client process):
    ``status_s`` is the time to its first response or its error."""
    request = coordinator_pb2.GenerateRequest(
        text=f"{PROMPT}({index})",
        sampling=common_pb2.SamplingParams(
            max_tokens=plan.max_tokens, min_tokens=plan.max_tokens, ignore_eos=True
        ),
    )
    record = CrowdRecord(outcome="cut_short", sent_at=time.time())
    sent = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=plan.timeout_s):
            now = time.perf_counter() - sent
            if record.status_s is None:
                record.status_s = record.first_token_s = now
            record.last_token_s = now
            record.tokens += len(response.chunk.token_ids)
        record.outcome = "served" if record.tokens >= plan.max_tokens else "cut_short"
    except grpc.aio.AioRpcError as error:
        if record.status_s is None:
            record.status_s = time.perf_counter() - sent
        code = error.code()
        refused = code == grpc.StatusCode.RESOURCE_EXHAUSTED
        record.outcome = "refused" if refused else f"grpc_{code.name}"
        record.detail = "" if refused else (error.details() or "")[:200]
    return record


async def _client_main(plan: ClientPlan) -> list[CrowdRecord]:
    if plan.grpc_address is None:
        await asyncio.sleep(max(0.0, plan.start_at - time.time()))
        return list(await asyncio.gather(*(_one_stream(plan, i) for i in range(plan.count))))
    async with grpc.aio.insecure_channel(plan.grpc_address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        await channel.channel_ready()
        await asyncio.sleep(max(0.0, plan.start_at - time.time()))
        return list(await asyncio.gather(*(_one_call(stub, plan, i) for i in range(plan.count))))


def _client_process(plan: ClientPlan, results: multiprocessing.Queue) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    records = asyncio.run(_client_main(plan))
    results.put([asdict(record) for record in records])


@dataclass
class ProbeLog:
    """The newcomer's view while the crowd runs: seconds per answer, and its statuses."""

    health_s: list[float]
    completion_s: list[float]
    statuses: Counter[str]


async def _probe(url: str, model: str, stop: asyncio.Event, log_: ProbeLog) -> None:
    async with httpx.AsyncClient(timeout=120.0) as client:

        async def health() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    response = await client.get(f"{url}/health")
                    log_.statuses[f"health_{response.status_code}"] += 1
                except httpx.HTTPError as error:
                    log_.statuses[f"health_{type(error).__name__}"] += 1
                log_.health_s.append(time.perf_counter() - started)
                await asyncio.sleep(1.0)

        async def completion() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                body = {"model": model, "prompt": "Hello", "max_tokens": 4}
                try:
                    response = await client.post(f"{url}/v1/completions", json=body)
                    log_.statuses[f"completion_{response.status_code}"] += 1
                except httpx.HTTPError as error:
                    log_.statuses[f"completion_{type(error).__name__}"] += 1
                log_.completion_s.append(time.perf_counter() - started)
                await asyncio.sleep(2.0)

        await asyncio.gather(health(), completion())


def percentiles(values: Sequence[float]) -> Json:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"n": len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": at(1.0)}


REFUSAL_KINDS = (
    ("already wait for KV", "queue_full"),
    ("frees up in about", "predicted_wait"),
    ("for KV", "waited_out"),
    ("in flight", "in_flight"),
)
"""A 429's message (``coordinator/admission.py``, ``service.py``) to admission's reason."""


def refusal_kind(body: str) -> str:
    """Which refusal a 429's body is (``REFUSAL_KINDS``; ``other`` when none matches)."""
    return next((kind for phrase, kind in REFUSAL_KINDS if phrase in body), "other")


def summarize(records: Sequence[CrowdRecord]) -> Json:
    by_outcome: dict[str, list[CrowdRecord]] = {}
    for record in records:
        by_outcome.setdefault(record.outcome, []).append(record)
    summary: Json = {"counts": {name: len(group) for name, group in sorted(by_outcome.items())}}
    sent = sorted(r.sent_at for r in records if r.sent_at)
    if sent:
        summary["sends_spread_s"] = round(sent[-1] - sent[0], 3)
    for name, group in sorted(by_outcome.items()):
        times: Json = {"status_s": percentiles([r.status_s for r in group if r.status_s])}
        if name == "served":
            times["first_token_s"] = percentiles([r.first_token_s or 0.0 for r in group])
            times["last_token_s"] = percentiles([r.last_token_s or 0.0 for r in group])
        details = Counter(r.detail for r in group if r.detail)
        if details:
            times["details"] = dict(details.most_common(5))
        summary[name] = times
    return summary


def _served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


async def _run_crowd(
    url: str, grpc_address: str | None, args: argparse.Namespace, cluster: LocalCluster | None
) -> Json:
    model = _served_model(url)
    grpc_address = grpc_address if args.via == "grpc" else None
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    busy_at = time.time() + args.lead_s
    start_at = busy_at + (args.busy_lead_s if args.busy else 0.0)
    base, extra = divmod(args.streams, args.clients)
    plans = [
        ClientPlan(
            url, model, grpc_address, base + (i < extra), args.max_tokens, start_at, args.timeout_s
        )  # fmt: skip
        for i in range(args.clients)
    ]
    processes = [context.Process(target=_client_process, args=(plan, results)) for plan in plans]
    busy_results: multiprocessing.Queue = context.Queue()
    busy_plan = ClientPlan(url, model, None, args.busy, args.busy_tokens, busy_at, args.timeout_s)
    busy = context.Process(target=_client_process, args=(busy_plan, busy_results))
    for process in [*processes, busy] if args.busy else processes:
        process.start()
    clients = {p.pid: f"client-{i}" for i, p in enumerate(processes) if p.pid is not None}
    if busy.pid is not None:
        clients[busy.pid] = "busy-client"
    clients[os.getpid()] = "bench"  # the probes and these readings
    cluster_pids = cluster.pids if cluster is not None else list
    meter = ProcessCpu(lambda: [*cluster_pids(), *clients], names=dict(clients))
    probe_log = ProbeLog([], [], Counter())
    stop = asyncio.Event()
    await asyncio.sleep(max(0.0, start_at - time.time()))
    sampling = asyncio.create_task(meter.sample(CPU_SAMPLE_S))
    probe = asyncio.create_task(_probe(url, model, stop, probe_log))
    loop = asyncio.get_running_loop()
    records: list[CrowdRecord] = []
    for _ in processes:
        chunk = await loop.run_in_executor(None, results.get)
        records.extend(CrowdRecord(**fields) for fields in chunk)
    wall_s = time.time() - start_at
    sampling.cancel()
    meter.mark()
    first_send = min((r.sent_at for r in records if r.sent_at), default=start_at)
    door_end, ended = first_send + args.door_s, time.time()
    cpu = [meter.window("door", first_send, door_end), meter.window("rest", door_end, ended)]
    if args.records is not None:
        args.records.write_text("\n".join(json.dumps(asdict(r)) for r in records) + "\n")
    stop.set()
    await probe
    for process in processes:
        process.join()
    report: Json = {}
    if args.busy:
        busy_records = await loop.run_in_executor(None, busy_results.get)
        report["busy"] = summarize([CrowdRecord(**fields) for fields in busy_records])
        busy.join()
    return {
        "wall_s": round(wall_s, 1),
        **report,
        "crowd": summarize(records),
        "probe": {
            "health_s": percentiles(probe_log.health_s),
            "completion_s": percentiles(probe_log.completion_s),
            "statuses": dict(probe_log.statuses),
        },
        "cpu": cpu,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--lead-s", type=float, default=3.0, help="clients start this late")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--url", default=None, help="a running gateway (else start make serve)")
    parser.add_argument("--grpc-address", default=None, help="with --url: its coordinator")
    parser.add_argument(
        "--via", choices=("http", "grpc"), default="http",
        help="the crowd goes through the gateway (http) or straight to the coordinator (grpc)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline-tree", type=Path, default=None,
        help="also run this checkout (e.g. a git worktree of an earlier commit), alternating",
    )  # fmt: skip
    parser.add_argument(
        "--tree", type=Path, default=None,
        help="run 'this' from this checkout instead of the editable install's",
    )  # fmt: skip
    parser.add_argument(
        "--door-s", type=float, default=2.0,
        help="the first CPU window: this long from the crowd's send (the 429s' goal is 1 s)",
    )  # fmt: skip
    parser.add_argument(
        "--busy", type=int, default=0,
        help="streams of --busy-tokens started --busy-lead-s before the crowd, from a client "
        "process of their own, so the engines are busy when it comes (reported as 'busy')",
    )  # fmt: skip
    parser.add_argument("--busy-tokens", type=int, default=1500)
    parser.add_argument("--busy-lead-s", type=float, default=5.0)
    parser.add_argument("--up-flags", default="--placement adaptive")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--records", type=Path, default=None, help="every request, JSON lines")
    return parser


def _error_lines(cluster: LocalCluster) -> list[str]:
    needles = ("Traceback", "ERROR", "Error", "exception")
    lines: list[str] = []
    for needle in needles:
        lines += cluster.log_lines(needle)
    return sorted(set(lines))[:40]


def _cluster(tree: Path | None, log_path: Path, up_flags: list[str]) -> LocalCluster:
    """``make serve``'s cluster from this checkout, or from ``tree`` (``bench_security.
    tree_env``: its ``splitserve`` ahead of the editable install)."""
    return tree_cluster(up_flags, log_path, tree)


def main(argv: Sequence[str] | None = None) -> Json:
    args = build_parser().parse_args(argv)
    report: Json = {"cpu": cpu_name(), "streams": args.streams, "clients": args.clients,
                    "max_tokens": args.max_tokens, "runs": []}  # fmt: skip
    if args.url is not None:
        for rep in range(args.reps):
            _one_run(report, "given", rep, args.url, args.grpc_address, args)
        emit_report(report, args.out)
        return report
    trees: list[tuple[str, Path | None]] = [("this", args.tree)]
    if args.tree is not None:
        report["tree"] = str(args.tree)
    if args.baseline_tree is not None:
        trees.insert(0, ("baseline", args.baseline_tree))
        report["baseline_tree"] = str(args.baseline_tree)
    log_dir = Path(tempfile.mkdtemp(prefix="crowd-"))
    for rep in range(args.reps):  # a fresh cluster per tree and repetition, trees alternating
        for name, tree in trees:
            cluster = _cluster(tree, log_dir / f"{name}-{rep}.log", args.up_flags.split())
            cluster.start()
            try:
                run = _one_run(report, name, rep, cluster.http_url, cluster.address, args, cluster)
                run["cluster_error_lines"] = _error_lines(cluster)
            finally:
                cluster.stop()
    emit_report(report, args.out)
    return report


def _one_run(
    report: Json, tree: str, rep: int, url: str, grpc_address: str | None,
    args: argparse.Namespace, cluster: LocalCluster | None = None,
) -> Json:  # fmt: skip
    wait_for_quiet(30.0)
    run = {"tree": tree, "rep": rep, "via": args.via,
           **asyncio.run(_run_crowd(url, grpc_address, args, cluster))}  # fmt: skip
    report["runs"].append(run)
    crowd = run["crowd"]
    log_row({
        "tree": tree, "rep": rep, "counts": crowd["counts"],
        "refused_status_s": crowd.get("refused", {}).get("status_s", {}),
        "served_last_token_s": crowd.get("served", {}).get("last_token_s", {}),
        "probe_health_s": run["probe"]["health_s"],
        "probe_completion_s": run["probe"]["completion_s"],
        "cores": {window["window"]: {name: cpu["cores"] for name, cpu in
                                     window["processes"].items()} for window in run["cpu"]},
        "main_thread_waited_s": {window["window"]: {
            name: cpu["main_thread_waited_s"] for name, cpu in window["processes"].items()
            if not name.startswith("client")} for window in run["cpu"]},
    })  # fmt: skip
    return run


if __name__ == "__main__":
    main()
