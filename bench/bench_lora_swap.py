"""What swapping a served LoRA adapter's files costs the requests of it while they run: vLLM's
``load_inplace`` (as RL trainers swap a policy's adapter every training step) against the
unload-then-load a user without it does, and against no swap, in the same cluster.

``splitserve up`` (its default topology, the serving dtype, ``--up-flags`` added) serves two
adapters' folders under ``--lora-dir`` (rank ``--rank`` on all seven projections, random
factors, PEFT's saved format). The adapter ``policy`` is loaded from the first. Then rounds
of ``--round-s`` seconds, the modes alternating round by round; in each, ``--streams``
clients over gRPC each send greedy requests of ``policy`` (``--tokens`` tokens) one after
another, and a swapper, every ``--every-s`` seconds:

- ``none``: does nothing (the baseline);
- ``inplace``: loads ``policy`` in place from the other folder (``load_inplace=True``);
- ``reload``: unloads ``policy``, then loads it from the other folder.

Per round: requests finished and failed (by status), output tokens a second over the round
(and its ratio to ``none``'s median), each finished request's seconds a token after its
first, the gaps between a stream's chunks (p50, p99, max: what a swap's hold of the engine
thread adds to the other requests' inter-token latency), and the swap calls' seconds. A
request that fails in ``reload`` is one that arrived while no worker served ``policy``
(NOT_FOUND); ``inplace`` should lose none. Nothing is asserted.

    .venv/bin/python bench/bench_lora_swap.py --rounds 3 --round-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_lora import write_adapter
from bench_relay_cpu import SPLITSERVE
from cluster_process import LocalCluster
from splitserve_runner import alternated_rounds, write_report

from splitserve.client import AsyncClient, Chunk, ClientError, Sampling
from splitserve.common.cpu_info import cpu_name
from splitserve.engine.checkpoint import describe_checkpoint

Json = dict[str, Any]
MODES = ("none", "inplace", "reload")
NAME = "policy"
PROMPT = "Write a short story about a lighthouse keeper and the storm that changed his life."


async def _client_loop(
    address: str,
    tokens: int,
    until: float,
    finished: list[float],
    failed: list[str],
    gaps: list[float],
) -> int:
    """Streamed requests of ``NAME`` one after another until ``until``; their output
    tokens. Each finished request's seconds a token after its first go to ``finished``, the
    gaps between its chunks to ``gaps``."""
    sampling = Sampling(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
    produced = 0
    async with AsyncClient(address, timeout_s=120) as client:
        while time.monotonic() < until:
            arrivals: list[float] = []
            count = 0
            try:
                async for item in client.stream(PROMPT, sampling=sampling, model=NAME):
                    if isinstance(item, Chunk) and item.token_ids:
                        arrivals.append(time.monotonic())
                        count += len(item.token_ids)
            except ClientError as error:
                failed.append(error.code.name)
                await asyncio.sleep(0.05)
                continue
            produced += count
            if count > 1:
                finished.append((arrivals[-1] - arrivals[0]) / (count - 1))
            gaps.extend(
                later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)
            )
    return produced


async def _swapper(
    address: str, mode: str, folders: list[str], every_s: float, until: float, state: Json
) -> list[float]:
    """Every ``every_s`` seconds: the swap of ``mode``; each swap's seconds."""
    seconds: list[float] = []
    async with AsyncClient(address, timeout_s=120) as client:
        while time.monotonic() + every_s < until:
            await asyncio.sleep(every_s)
            state["version"] = 1 - state["version"]
            folder = folders[state["version"]]
            started = time.monotonic()
            if mode == "inplace":
                await client.load_lora_adapter(NAME, folder, load_inplace=True)
            elif mode == "reload":
                await client.unload_lora_adapter(NAME)
                await client.load_lora_adapter(NAME, folder)
            seconds.append(time.monotonic() - started)
    return seconds


async def one_round(
    address: str, mode: str, args: argparse.Namespace, folders: list[str], state: Json
) -> Json:
    finished: list[float] = []
    failed: list[str] = []
    gaps: list[float] = []
    started = time.monotonic()
    until = started + args.round_s
    clients = [
        _client_loop(address, args.tokens, until, finished, failed, gaps)
        for _ in range(args.streams)
    ]
    swaps = (
        _swapper(address, mode, folders, args.every_s, until, state)
        if mode != "none"
        else asyncio.sleep(0, result=[])
    )
    *produced, swap_seconds = await asyncio.gather(*clients, swaps)
    elapsed = time.monotonic() - started
    return {
        "mode": mode,
        "finished": len(finished),
        "failed": len(failed),
        "failed_by_status": {code: failed.count(code) for code in sorted(set(failed))},
        "tokens_per_s": sum(produced) / elapsed,
        "s_per_token_p50": statistics.median(finished) if finished else None,
        "gap_s_p50": _quantile(gaps, 0.50),
        "gap_s_p99": _quantile(gaps, 0.99),
        "gap_s_max": max(gaps, default=None),
        "swaps": len(swap_seconds),
        "swap_s": swap_seconds,
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-s", type=float, default=20.0)
    parser.add_argument("--every-s", type=float, default=4.0, help="seconds between swaps")
    parser.add_argument("--streams", type=int, default=8, help="concurrent clients")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {MODES}")
    parser.add_argument("--up-flags", default="", help="more flags of splitserve up")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if "none" not in args.modes.split(",") or not set(args.modes.split(",")) <= set(MODES):
        parser.error(f"--modes: some of {MODES}, none among them (the baseline)")
    config = describe_checkpoint("default").config
    with tempfile.TemporaryDirectory() as lora_dir:
        folders = []
        for version in range(2):
            write_adapter(Path(lora_dir) / f"v{version}", config, args.rank, seed=version)
            folders.append(f"v{version}")
        log_path = Path(lora_dir) / "up.log"
        flags = shlex.split(args.up_flags)
        env = {"SPLITSERVE_LORA_DIR": lora_dir}
        with LocalCluster(SPLITSERVE, flags, log_path, env=env) as cluster:
            state: Json = {"version": 0}

            async def load_first() -> None:
                async with AsyncClient(cluster.address, timeout_s=120) as client:
                    await client.load_lora_adapter(NAME, folders[0])

            asyncio.run(load_first())

            def run(mode: str, _round: int) -> Json:
                row = asyncio.run(one_round(cluster.address, mode, args, folders, state))
                print(json.dumps(row), flush=True)
                return row

            rounds = alternated_rounds(tuple(args.modes.split(",")), args.rounds, run)
    base = statistics.median(r["tokens_per_s"] for r in rounds["none"])
    summary = {
        mode: {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows),
            "ratio_to_none": statistics.median(r["tokens_per_s"] for r in rows) / base,
            "gap_s_p99_median": statistics.median(r["gap_s_p99"] for r in rows),
            "gap_s_max_median": statistics.median(r["gap_s_max"] for r in rows),
            "finished": sum(r["finished"] for r in rows),
            "failed": sum(r["failed"] for r in rows),
            "swaps": sum(r["swaps"] for r in rows),
            "swap_s_median": (
                statistics.median(s for r in rows for s in r["swap_s"])
                if any(r["swap_s"] for r in rows)
                else None
            ),
        }
        for mode, rows in rounds.items()
    }
    report: Json = {
        "cpu": cpu_name(),
        "setup": {
            "streams": args.streams,
            "tokens": args.tokens,
            "round_s": args.round_s,
            "every_s": args.every_s,
            "rank": args.rank,
            "up_flags": flags,
        },
        "summary": summary,
        "rounds": rounds,
    }
    print(json.dumps(summary, indent=2))
    write_report(report, args.out, "lora-swap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
