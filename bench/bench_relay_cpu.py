"""CPU time per streamed token of each process of ``make serve`` (issue 31's relay cost,
issue 60's front end).

Per repetition and per variant of ``--variants`` (alternated; ``variants_of``: ``merged``,
``up``'s default, the gateway inside the coordinator's process; ``apart``, each its own
process; ``per-stream``, apart with a ``Generate`` call per stream; ``baseline``, the tree of
``--baseline-tree`` as its ``up`` starts it), starts ``splitserve up`` (``cluster_process.
LocalCluster``) afresh, then sends ``--streams`` streamed completions at once through the
gateway (``/v1/completions``, short prompts, ``--max-tokens`` tokens each with EOS ignored,
``stream_options.include_usage`` for the token count) and reads every cluster process's
utime + stime from ``/proc`` before and after. Each process is named by its role
(``coordinator``, ``gateway``, ``frontend``, ``prefill``, ``decode``, ``up``) from its
command line. The client is ``--client light`` (``sse_burst.py``: a few microseconds of CPU
a token, so thousands of streams do not starve the server on a small machine) or ``httpx``.

``--up-flags`` replaces ``make serve``'s flags, e.g. a cluster of simulated workers hosted
several to a process: ``--up-flags "--placement adaptive --prefill 2 --decode 8
--workers-per-process 8 --max-inflight 16384 -- --engine sim --sim-profile
bench/profiles/relay-stand-in.json --max-num-seqs 1024 --num-blocks 16384 --sim-startup-s 0"
--env SPLITSERVE_MAX_QUEUED=16384`` (a role's CPU is then the sum over its processes).

Also the machine's floor: the CPU one SSE frame's send costs the kernel over loopback TCP
(``send_floor_us``). Reported per role and variant: CPU microseconds per streamed token (the
burst's CPU ticks over the tokens the client received), ``front_end`` (coordinator + gateway
+ frontend), the median over ``--reps`` repetitions, and what one core of that role could
relay at that cost (1e6 / us). Also the client's own CPU per token and the machine's other
load during the run (``CpuMeter``). Prints rows to stderr and the JSON report to stdout
(``--out`` writes it too). Nothing asserted.

    .venv/bin/python bench/bench_relay_cpu.py --out bench/results/relay-cpu-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from bench_security import tree_cluster
from cluster_process import CLK_TCK, CpuMeter, LocalCluster, process_ticks
from machine_bound import cpu_name
from sse_burst import run_burst
from timing_stats import Json, emit_report, log_row, wait_for_quiet

from splitserve.launch.child_process import role_of_process

SPLITSERVE = Path(sys.executable).with_name("splitserve")


def role_of(pid: int) -> str:
    """The role a cluster process runs, from its command line: ``python -m
    splitserve.<role>.main`` for the children (``launch/child_process.py:role_of_process``),
    ``splitserve up`` for the launcher."""
    role = role_of_process(pid)
    if role is not None:
        return role
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    return "up" if b"up" in argv else "other"


def ticks_by_role(pids: list[int]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for pid in pids:
        role = role_of(pid)
        totals[role] = totals.get(role, 0) + process_ticks(pid)
    return totals


@dataclass(frozen=True)
class Streamed:
    """One streamed completion of a burst."""

    tokens: int
    """Completion tokens its usage chunk reported (0 without one)."""
    how: str
    """How it ended: "ok", "http <status>", "no usage" (cut before its usage chunk), or the
    client error's class name."""
    ttft_s: float | None
    """Sent -> first chunk with text (None: none came)."""


async def one_stream(
    client: httpx.AsyncClient, url: str, model: str, index: int, tokens: int
) -> Streamed:
    """One streamed completion of ``tokens`` tokens (EOS ignored)."""
    body = {
        "model": model,
        "prompt": f"Request {index}: tell me a long story about the sea.",
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    used = 0
    sent, ttft_s = time.perf_counter(), None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Streamed(0, f"http {response.status_code}", None)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft_s is None and any(c.get("text") for c in chunk.get("choices", ())):
                    ttft_s = time.perf_counter() - sent
                if chunk.get("usage"):
                    used = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as error:
        return Streamed(used, type(error).__name__, ttft_s)
    return Streamed(used, "ok" if used else "no usage", ttft_s)


async def burst(url: str, model: str, streams: int, tokens: int) -> list[Streamed]:
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(
            *(one_stream(client, url, model, index, tokens) for index in range(streams))
        )


def burst_report(args: argparse.Namespace) -> Json:
    """A report's opening: the machine, the burst's flags (``add_burst_args``) and
    ``--up-flags``, no repetitions yet."""
    setup = {"streams": args.streams, "max_tokens": args.max_tokens, "reps": args.reps}
    setup["up_flags"] = shlex.split(args.up_flags)
    return {"machine": {"cpu": cpu_name()}, "setup": setup, "reps": []}


FRONT_END_ROLES = ("coordinator", "gateway", "frontend")
"""The processes whose CPU per token is the front end's (``frontend``: both in one)."""


@dataclass(frozen=True)
class Variant:
    """One cluster the burst runs against: ``up``'s flags added, the tree it runs from (None:
    this checkout), the gateway's relay."""

    name: str
    up_flags: tuple[str, ...] = ()
    tree: Path | None = None
    relay: str = "multiplexed"


def variants_of(args: argparse.Namespace) -> list[Variant]:
    """``--variants``: ``merged`` (this tree, ``up``'s default: gateway and coordinator in one
    process), ``apart`` (this tree, ``up --apart``), ``per-stream`` (apart, a gRPC call per
    stream), ``baseline`` (``--baseline-tree``, as ``up`` starts it there)."""
    known = {
        "merged": Variant("merged"),
        "apart": Variant("apart", ("--apart",)),
        "per-stream": Variant("per-stream", ("--apart",), relay="per-stream"),
        "baseline": Variant("baseline", (), args.baseline_tree),
    }
    chosen = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(known)}")
    if "baseline" in chosen and args.baseline_tree is None:
        raise SystemExit("the baseline variant needs --baseline-tree")
    return [known[name] for name in chosen]


SSE_FRAME_BYTES = 230
"""About one streamed completion chunk's SSE frame."""


def send_floor_us(frames: int = 50_000) -> float:
    """CPU microseconds the sending thread spends on one ``SSE_FRAME_BYTES`` send over a
    loopback TCP connection (a thread drains the other end): the kernel's part of writing a
    token's frame, the floor under any front end's CPU per streamed token here."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
    sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def drain() -> None:
        while receiver.recv(1 << 20):
            pass

    reader = threading.Thread(target=drain)
    reader.start()
    frame = b"x" * SSE_FRAME_BYTES
    started = time.thread_time()
    for _ in range(frames):
        sender.sendall(frame)
    used_s = time.thread_time() - started
    sender.close()
    reader.join()
    receiver.close()
    return round(used_s / frames * 1e6, 2)


def run(args: argparse.Namespace) -> Json:
    variants = variants_of(args)
    report = burst_report(args)
    report["machine"]["send_floor_us"] = send_floor_us()
    report["setup"]["variants"] = [variant.name for variant in variants]
    report["setup"]["client"] = args.client
    if args.baseline_tree is not None:
        report["setup"]["baseline_tree"] = str(args.baseline_tree)
    for rep in range(args.reps):  # the variants alternate, a fresh cluster each
        for variant in variants:
            row = measure(args, variant)
            row["rep"] = rep
            report["reps"].append(row)
            log_row(row)
    report["median_us_per_token"] = {}
    report["tokens_per_core_s"] = {}
    for variant in variants:
        rows = [row for row in report["reps"] if row["variant"] == variant.name]
        roles = sorted({role for row in rows for role in row["us_per_token"]})
        medians = {
            role: statistics.median(row["us_per_token"].get(role, 0.0) for row in rows)
            for role in [*roles, "front_end"]
        }
        report["median_us_per_token"][variant.name] = medians
        report["tokens_per_core_s"][variant.name] = {
            role: round(1e6 / us) for role, us in medians.items() if us > 0
        }
    log_row({"median_us_per_token": report["median_us_per_token"]})
    return report


def _cluster(args: argparse.Namespace, variant: Variant, log_path: Path) -> LocalCluster:
    """``variant``'s cluster: this checkout's ``splitserve up``, or the tree's
    (``bench_security.tree_cluster``)."""
    flags = [*shlex.split(args.up_flags)]
    if variant.up_flags:  # before a "--" that starts the workers' flags
        cut = flags.index("--") if "--" in flags else len(flags)
        flags[cut:cut] = variant.up_flags
    env = {"SPLITSERVE_RELAY": variant.relay, **dict(args.env)}
    return tree_cluster(flags, log_path, variant.tree, env)


def _burst(args: argparse.Namespace, url: str, model: str, streams: int, tokens: int) -> list:
    """The burst by ``--client``: ``light`` (``sse_burst.py``) or ``httpx``."""
    if args.client == "light":
        return run_burst(url, model, streams, tokens)
    return asyncio.run(burst(url, model, streams, tokens))


def measure(args: argparse.Namespace, variant: Variant) -> Json:
    """One burst through a fresh cluster of ``variant``."""
    log_path = Path(tempfile.mkdtemp(prefix="relay-cpu-")) / "up.log"
    with _cluster(args, variant, log_path) as cluster:
        model = httpx.get(f"{cluster.http_url}/v1/models", timeout=30).json()["data"][0]["id"]
        _burst(args, cluster.http_url, model, 4, 8)  # warm-up
        wait_for_quiet(args.wait_quiet_s)
        pids = cluster.pids()
        meter = CpuMeter(cluster)
        meter.start()
        before, own_before = ticks_by_role(pids), process_ticks(os.getpid())
        started = time.perf_counter()
        ended = _burst(args, cluster.http_url, model, args.streams, args.max_tokens)
        wall_s = time.perf_counter() - started
        after, own_after = ticks_by_role(pids), process_ticks(os.getpid())
    used = [stream.tokens for stream in ended]
    tokens = sum(used)
    us_per_token = {
        role: round((after[role] - before.get(role, 0)) / CLK_TCK / tokens * 1e6, 1)
        for role in after
        if tokens
    }
    front = sum(us_per_token.get(role, 0.0) for role in FRONT_END_ROLES)
    return {
        "variant": variant.name,
        "tokens": tokens,
        "streams_whole": sum(n == args.max_tokens for n in used),
        "ends": dict(collections.Counter(stream.how for stream in ended)),
        "refusals": dict(
            collections.Counter(
                getattr(s, "detail", "")[:160] for s in ended if getattr(s, "detail", "")
            )
        ),
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(tokens / wall_s, 1),
        "us_per_token": {**us_per_token, "front_end": round(front, 1)},
        "client_us_per_token": round((own_after - own_before) / CLK_TCK / max(tokens, 1) * 1e6, 1),
        "cpu": meter.stop(),
    }


def add_burst_args(parser: argparse.ArgumentParser, streams: int, max_tokens: int) -> None:
    """The flags of a repeated burst: ``--streams`` sent at once of ``--max-tokens`` each,
    ``--reps``, ``--wait-quiet-s`` before each, ``--out`` for the JSON report."""
    parser.add_argument("--streams", type=int, default=streams)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--wait-quiet-s", type=float, default=20.0)
    parser.add_argument("--out", type=Path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_burst_args(parser, streams=64, max_tokens=128)
    parser.add_argument(
        "--variants",
        default="apart,merged",
        help="clusters to compare, alternated per repetition: merged, apart, per-stream, "
        "baseline (variants_of)",
    )
    parser.add_argument("--baseline-tree", type=Path, help="the tree before the change")
    parser.add_argument(
        "--up-flags", default="--placement adaptive", help="splitserve up's flags (make serve's)"
    )
    parser.add_argument(
        "--client",
        choices=("light", "httpx"),
        default="light",
        help="light: sse_burst.py (a few us of CPU a token); httpx: one asyncio httpx client",
    )
    parser.add_argument(
        "--env",
        type=lambda pair: tuple(pair.split("=", 1)),
        action="append",
        default=[],
        help="NAME=VALUE in every cluster process's environment (repeat)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    emit_report(run(args), args.out)


if __name__ == "__main__":
    main()
