"""KV transfer benchmark: bandwidth of a layer-wise KV push between two processes over UCX.

Two processes on this machine, each with its own asyncio loop and its own ``UcxTransport``
(same ``UcxSettings`` on both): this one plays the prefill worker (``LayerSender``), a child
started with multiprocessing "spawn" plays the decode worker (``LayerReceiver``, the production
receive path: every message received straight into its place in a KV cache tensor allocated as
the decode worker allocates its own (``zeros_huge_pages``), as it receives into its reserved
blocks; the regions come from ``kv_io.receive_destinations``). The child's UCX worker address
and all control messages go through a ``multiprocessing.Pipe``; the control traffic is outside
the timed part.

Workloads: the KV of a 128, 1024 and 4096 token prompt of the default model (SmolLM2-135M: 30
layers, 3 KV heads, head_dim 64, block_size 16, bf16: 6 KiB per block for K and as much for V)
received into consecutive blocks (one run: per layer one K and one V message), the 1024-token
prompt received into blocks in 4 runs (a fragmented cache: 8 messages per layer), and a 64 MiB
"layer" (one 32 MiB K and one 32 MiB V message). The sender's source is already in the plan's
block order, gathered layer by layer into a staging buffer as the prefill worker's engine thread
does (``kv_io.staging_buffer``: huge pages), outside the transfer.

One repetition: the child zeroes its cache, posts its receiver and answers "ready". The sender
then reads ``CLOCK_MONOTONIC`` (start), offers every layer at once (the transport's bandwidth,
not the engine's pace) and awaits ``finish``. The child reads ``CLOCK_MONOTONIC`` (end) when
``LayerReceiver.wait`` returns, i.e. when every message has landed in the cache, and sends it
back. Duration = end - start: both processes read the same system-wide clock, so no pipe
latency is in it. Then the child sends the CRC32 of the reserved blocks (gathered in block-table
order), which must equal the source's (checked every repetition, untimed). GB/s = bytes /
duration / 1e9, median over ``--reps`` repetitions after one warm-up.

UCX configurations: error handling off with UCX's default transports (shared memory / CMA on
one machine), error handling on (UCX then excludes transports that cannot detect a dead peer,
so traffic goes over TCP), and ``UCX_TLS=tcp``. Baseline, measured in the same run in this
process: libc ``memcpy`` of the same total bytes into another buffer (one copy, median of
``--reps``; the fastest of torch ``copy_``, numpy ``copyto`` and libc ``memcpy`` on this
machine), and the ratio transfer / memcpy.

The machine is shared and small: before the memcpy baseline and before each UCX
configuration, the bench waits (up to ``--wait-quiet-s``) for the CPUs to go idle and records
the busy fraction it saw (above ~0.1: the numbers next to it were contended). Both processes
run torch with ``--threads`` threads (default 1: two processes on two cores).

Usage: ``python bench/bench_kv_transfer.py [--reps 7] [--out [PATH]] [--skip-tcp]``; prints
a table to stderr and the JSON report to stdout; ``--out`` also writes the report
(default ``bench/results/kv-transfer-<date>.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import ucxx
from timing_stats import Json, wait_for_quiet

from splitserve.engine.host_memory import empty_huge_pages, zeros_huge_pages
from splitserve.transfer.layer_channel import LayerReceiver, LayerSender
from splitserve.transfer.plan import TransferPlan, new_transfer_secret
from splitserve.transfer.ucx import UcxSettings, UcxTransport
from splitserve.worker.kv_io import receive_destinations

SMOLLM2_LAYERS = 30
SMOLLM2_HALF_BLOCK_BYTES = 16 * 3 * 64 * 2
"""K (or V) bytes of one block of the default model in bf16: block_size x kv_heads x dim x 2."""
BLOCK_SIZE = 16
PROMPT_TOKENS = (128, 1024, 4096)
FRAGMENTED_RUNS = 4
BIG_MESSAGE_BYTES = 64 << 20
CONTROL_TIMEOUT_S = 60.0
"""Bound on every wait for the other process (a crashed child fails the bench, never hangs)."""
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Workload:
    """One transfer of ``num_layers`` layers into ``block_ids`` of a cache of ``uint8
    [num_layers, 2, cache_blocks, half_block_bytes]``."""

    name: str
    num_layers: int
    half_block_bytes: int
    block_ids: tuple[int, ...]

    @property
    def cache_blocks(self) -> int:
        return max(self.block_ids) + 1

    @property
    def layer_bytes(self) -> int:
        return 2 * len(self.block_ids) * self.half_block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def plan(self) -> TransferPlan:
        return TransferPlan.for_destination(self.block_ids)


def fragmented(num_blocks: int, runs: int) -> tuple[int, ...]:
    """``num_blocks`` ids in ``runs`` runs with a free block between runs, last run first."""
    per_run = -(-num_blocks // runs)
    starts = [run * (per_run + 1) for run in range(runs)]
    chunks = [
        list(range(start, start + min(per_run, num_blocks - run * per_run)))
        for run, start in enumerate(starts)
    ]
    return tuple(block for chunk in reversed(chunks) for block in chunk)


def workloads() -> list[Workload]:
    """The default model's KV of each prompt length, a fragmented one, and 64 MiB."""
    work = []
    for tokens in PROMPT_TOKENS:
        blocks = -(-tokens // BLOCK_SIZE)
        work.append(
            Workload(
                f"prompt-{tokens}",
                SMOLLM2_LAYERS,
                SMOLLM2_HALF_BLOCK_BYTES,
                tuple(range(blocks)),
            )
        )
        if tokens == 1024:
            work.append(
                Workload(
                    f"prompt-{tokens}-{FRAGMENTED_RUNS}runs",
                    SMOLLM2_LAYERS,
                    SMOLLM2_HALF_BLOCK_BYTES,
                    fragmented(blocks, FRAGMENTED_RUNS),
                )
            )
    work.append(Workload("message-64MiB", 1, BIG_MESSAGE_BYTES // 2, (0,)))
    return work


@dataclass(frozen=True)
class UcxConfig:
    name: str
    settings: UcxSettings


def ucx_configs(skip_tcp: bool) -> list[UcxConfig]:
    configs = [
        UcxConfig("ucx error_handling=off", UcxSettings()),
        UcxConfig("ucx error_handling=on", UcxSettings(error_handling=True)),
    ]
    if not skip_tcp:
        configs.append(UcxConfig("ucx tls=tcp", UcxSettings(tls="tcp")))
    return configs


def monotonic() -> float:
    """The system-wide monotonic clock, comparable between processes of this machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.numpy().data)


def recv_within(conn: Connection, timeout_s: float = CONTROL_TIMEOUT_S) -> object:
    """The next control message from the other process; ``TimeoutError`` if none comes."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no control message within {timeout_s:.0f}s")
    return conn.recv()


# ----------------------------------------------------------------------------- receiver (child)


def receiver_main(conn: Connection, config: UcxConfig, threads: int) -> None:
    """Child process entry: the decode side, serving transfers until told to stop."""
    torch.set_num_threads(threads)
    try:
        asyncio.run(_serve_receives(conn, config))
    finally:
        conn.close()


async def _serve_receives(conn: Connection, config: UcxConfig) -> None:
    transport = UcxTransport(config.settings)
    caches: dict[Workload, torch.Tensor] = {}
    conn.send(transport.address)
    try:
        while isinstance(command := await asyncio.to_thread(recv_within, conn), tuple):
            workload, transfer_id, secret = command
            cache = caches.get(workload)
            if cache is None:  # [layers, 2, blocks, half_block_bytes], allocated as a KV cache
                shape = (workload.num_layers, 2, workload.cache_blocks, workload.half_block_bytes)
                cache = zeros_huge_pages(shape, torch.uint8, "cpu")
                caches[workload] = cache
            cache.zero_()
            plan, destinations = receive_destinations(cache, workload.block_ids)
            receiver = LayerReceiver(transport, transfer_id, secret, plan, destinations)
            await asyncio.sleep(0.005)  # let the receiver post its receives
            conn.send("ready")
            await receiver.wait(CONTROL_TIMEOUT_S)
            conn.send(monotonic())
            conn.send(crc32(cache[:, :, list(workload.block_ids)].contiguous()))
    finally:
        await transport.close()


# ----------------------------------------------------------------------------- sender (parent)


async def _time_transfers(
    conn: Connection, settings: UcxSettings, work: Sequence[Workload], reps: int
) -> Json:
    """Run ``1 + reps`` transfers of each workload to the child; seconds per timed rep."""
    transport = UcxTransport(settings)
    loop = asyncio.get_running_loop()
    results: Json = {"context_transports": sorted(ucxx.get_active_transports())}
    try:
        peer = await asyncio.to_thread(recv_within, conn)
        assert isinstance(peer, bytes)
        endpoint = await transport.connect(peer)
        transfer_ids = iter(range(1, 1 << 20))
        for workload in work:
            plan = workload.plan  # in production it comes with the reservation
            # [layers, 2, blocks, half_block_bytes] random bytes, blocks in block-table order
            source = torch.randint(
                0,
                256,
                (workload.num_layers, 2, len(workload.block_ids), workload.half_block_bytes),
                dtype=torch.uint8,
            )
            expected_crc = crc32(source)
            # what the engine thread hands the sender: each layer gathered in plan order into
            # a staging buffer allocated as the prefill worker's (kv_io.staging_buffer)
            order = torch.tensor(plan.block_order)
            ordered = empty_huge_pages(tuple(source.shape), torch.uint8, "cpu")
            for layer in range(workload.num_layers):
                torch.index_select(source[layer], 1, order, out=ordered[layer])
            seconds = []
            for rep in range(1 + reps):
                transfer_id, secret = next(transfer_ids), new_transfer_secret()
                conn.send((workload, transfer_id, secret))  # in production: the reservation
                assert await asyncio.to_thread(recv_within, conn) == "ready"
                sender = LayerSender(endpoint, transfer_id, secret, workload.num_layers, plan, loop)
                start = monotonic()
                for layer in range(workload.num_layers):
                    sender.offer(layer, ordered[layer])
                await sender.finish(CONTROL_TIMEOUT_S)
                end = await asyncio.to_thread(recv_within, conn)
                assert isinstance(end, float)
                if await asyncio.to_thread(recv_within, conn) != expected_crc:
                    raise RuntimeError(f"{workload.name}: received bytes differ from the sent")
                if rep > 0:  # rep 0 warms up endpoints, pages and caches
                    seconds.append(end - start)
            results[workload.name] = seconds
    finally:
        with contextlib.suppress(OSError):  # the child may be gone already
            conn.send("stop")
        await transport.close()
    return results


def bench_config(config: UcxConfig, work: Sequence[Workload], args: argparse.Namespace) -> Json:
    """Spawn a receiver child with ``config`` and time every workload against it."""
    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    child = context.Process(
        target=receiver_main,
        args=(child_conn, config, args.threads),
        daemon=True,
    )
    child.start()
    child_conn.close()
    try:
        timings = asyncio.run(_time_transfers(parent_conn, config.settings, work, args.reps))
    finally:
        child.join(10)
        if child.is_alive():
            child.terminate()
            child.join(5)
        ucxx.reset()  # one context per process: the next configuration inits its own
    return timings


def memcpy_seconds(total_bytes: int, reps: int) -> list[float]:
    """libc ``memcpy`` of ``total_bytes`` between two buffers of this process, after one
    warm-up copy."""
    memcpy = ctypes.CDLL(None).memcpy
    memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    source = torch.randint(0, 256, (total_bytes,), dtype=torch.uint8)
    destination = torch.empty_like(source)
    destination.copy_(source)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        memcpy(destination.data_ptr(), source.data_ptr(), total_bytes)
        seconds.append(time.perf_counter() - start)
    if not torch.equal(destination, source):
        raise RuntimeError("memcpy baseline did not copy")
    return seconds


# ----------------------------------------------------------------------------- report


def bandwidth(total_bytes: int, seconds: Sequence[float]) -> Json:
    """Median GB/s (1e9 bytes) and ms over repetitions, and GB/s of each repetition."""
    median_s = statistics.median(seconds)
    return {
        "gbps_median": round(total_bytes / median_s / 1e9, 3),
        "ms_median": round(median_s * 1e3, 3),
        "gbps_per_rep": [round(total_bytes / s / 1e9, 3) for s in seconds],
        "reps": len(seconds),
    }


def machine_info() -> Json:
    return {
        "cpu": platform.processor() or platform.machine(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "ucx": ".".join(str(part) for part in ucxx.get_ucx_version()),
        "ucxx": getattr(ucxx, "__version__", None),
        "python": platform.python_version(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }


def run(args: argparse.Namespace) -> Json:
    torch.set_num_threads(args.threads)
    work = workloads()
    report: Json = {"machine": machine_info()}
    report["machine"]["busy_fraction_before"] = wait_for_quiet(args.wait_quiet_s)
    report["setup"] = {
        "torch_threads_per_process": args.threads,
        "receive": "straight into the reserved blocks of a cache tensor (no staging copy)",
        "memcpy": "libc memcpy, one thread",
        "timing": "sender CLOCK_MONOTONIC before the first offer -> receiver CLOCK_MONOTONIC "
        "when LayerReceiver.wait returns (every message landed in the cache)",
        "reps": args.reps,
        "warmup_reps": 1,
    }
    report["workloads"] = {
        w.name: {
            "num_layers": w.num_layers,
            "num_blocks": len(w.block_ids),
            "runs": w.plan.num_runs,
            "messages": w.num_layers * w.plan.messages_per_layer,
            "message_bytes": w.half_block_bytes * len(w.block_ids) // w.plan.num_runs,
            "total_bytes": w.total_bytes,
        }
        for w in work
    }
    memcpy = {
        w.name: bandwidth(w.total_bytes, memcpy_seconds(w.total_bytes, args.reps)) for w in work
    }
    report["memcpy"] = memcpy
    report["transfers"] = {}
    for config in ucx_configs(args.skip_tcp):
        log(f"{config.name} ...")
        entry: Json = {"settings": asdict(config.settings)}
        entry["busy_fraction_before"] = wait_for_quiet(args.wait_quiet_s)
        try:
            timings = bench_config(config, work, args)
        except Exception as error:  # one broken configuration does not sink the others
            entry["error"] = repr(error)
            log(f"{config.name} failed: {error!r}")
        else:
            entry["context_transports"] = timings.pop("context_transports")
            for w in work:
                row = bandwidth(w.total_bytes, timings[w.name])
                row["vs_memcpy"] = round(row["gbps_median"] / memcpy[w.name]["gbps_median"], 3)
                entry[w.name] = row
        report["transfers"][config.name] = entry
    report["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def table(report: Json) -> str:
    """GB/s medians: one row per workload, one column per UCX configuration, then memcpy."""
    configs = list(report["transfers"])
    header = [
        "workload",
        "MB",
        *configs,
        "memcpy",
        *(f"/memcpy {i + 1}" for i in range(len(configs))),
    ]
    rows = [header]
    for name, workload in report["workloads"].items():
        memcpy = report["memcpy"][name]["gbps_median"]
        cells = [report["transfers"][c].get(name) for c in configs]
        rows.append(
            [
                name,
                f"{workload['total_bytes'] / 1e6:.1f}",
                *(f"{cell['gbps_median']:.2f}" if cell else "error" for cell in cells),
                f"{memcpy:.2f}",
                *(f"{cell['vs_memcpy']:.3f}" if cell else "-" for cell in cells),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    legend = [f"  /memcpy {i + 1}: {name} GB/s / memcpy GB/s" for i, name in enumerate(configs)]
    return "\n".join(["KV transfer, GB/s (median)", *lines, *legend])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (after a warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--skip-tcp", action="store_true", help="skip the UCX_TLS=tcp runs")
    parser.add_argument(
        "--wait-quiet-s",
        type=float,
        default=15.0,
        help="wait up to this long for the CPUs to go idle before measuring (0: don't wait)",
    )
    default_out = RESULTS_DIR / f"kv-transfer-{datetime.date.today().isoformat()}.json"
    parser.add_argument(
        "--out",
        type=Path,
        nargs="?",
        const=default_out,
        help="also write the report to PATH (no value: bench/results/kv-transfer-<date>.json)",
    )
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error("--reps must be at least 5 (medians)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    report = run(args)
    report["bench_wall_s"] = round(time.perf_counter() - started, 1)
    print(table(report), file=sys.stderr, flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
