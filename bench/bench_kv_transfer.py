"""KV transfer benchmark: bandwidth of a layer-wise KV push between two processes over UCX.

Two processes on this machine, each with its own asyncio loop and its own ``UcxTransport``
(same ``UcxSettings`` on both): this one plays the prefill worker (``LayerSender``: one
message per group of layers, as the workload's plan says), a child started with multiprocessing
"spawn" plays the decode worker (``LayerReceiver``, the production receive path: each message
received into the
receiver's staging ring and copied into the reserved blocks of a KV cache tensor allocated as
the decode worker allocates its own (``zeros_huge_pages``); the destination is a
``transfer/destination.py:KvDestination`` of those blocks, as the decode worker makes it). The
child's UCX worker address and all control messages go through a ``multiprocessing.Pipe``; the
control traffic is outside the timed part. Every row reports the messages per transfer the
sender counted (``LayerSender.messages_sent``): layers / the plan's ``layers_per_message``.
Each prompt moves in the groups the device's workers use (``destination.MIN_MESSAGE_BYTES``);
the 128- and 1,024-token ones (and the fragmented one) also one layer a message
(``-per-layer``), in the same run.

Devices (``--device``): ``cpu`` (the default) moves host memory, as the CPU workers do; ``cuda``
moves GPU memory on one GPU (see "CUDA mode" below): the child's KV cache and the sender's
staging buffer are CUDA tensors, so UCX moves them with its CUDA transports, through the same
``UcxTransport`` / ``LayerSender`` / ``LayerReceiver`` code as two nodes with GPUDirect RDMA.

Workloads, cpu: the KV of a 128, 1024 and 4096 token prompt of the default model (SmolLM2-135M:
30 layers, 3 KV heads, head_dim 64, block_size 16, bf16: 6 KiB per block for K and as much for
V) received into consecutive blocks (one run; 1 MiB groups: 15 layers a message for 128
tokens, 2 for 1,024, one layer for 4,096), the 1024-token prompt received into blocks in 4 runs
(a fragmented cache: four copies out of staging per message, still one message), and a 64 MiB
"layer" (one message). Workloads, cuda: the KV of Llama-3-8B (32 layers, 8 KV heads, head_dim
128, block_size 16, bf16: 32 KiB per block for K and as much for V) of a 1024 and an 8192 token
prompt (128 MiB and 1 GiB; 16 MiB groups: 8 messages of 4 layers, and 32 of one 32 MiB layer),
the 1024-token prompt in 4 runs (one indexed copy out of staging per message), and one "layer"
of a 256 MiB K and a 256 MiB V (one 512 MiB message).
The sender's source is already in the plan's block order, gathered layer by layer into a
staging buffer as the prefill worker's engine thread does (``kv_io.staging_buffer``: huge pages
on cpu), outside the transfer.

One repetition: the child zeroes its cache, posts its receiver and answers "ready". The sender
then reads ``CLOCK_MONOTONIC`` (start), offers every layer at once (the transport's bandwidth,
not the engine's pace) and awaits ``finish``. The child reads ``CLOCK_MONOTONIC`` (end) when
``LayerReceiver.wait`` returns, i.e. when every message has landed in the cache, and sends it
back. Duration = end - start: both processes read the same system-wide clock, so no pipe
latency is in it. Then the child sends a checksum of the reserved blocks (gathered in
block-table order), which must equal the source's (checked every repetition, warm-up included,
untimed; a mismatch is recorded with the workload's numbers, as ``byte_check``, and the bench
goes on). GB/s = bytes / duration / 1e9, median over ``--reps`` repetitions after one warm-up.

UCX configurations, cpu: error handling off with UCX's default transports (shared memory / CMA
on one machine), error handling on (UCX then excludes transports that cannot detect a dead
peer, so traffic goes over TCP), and ``UCX_TLS=tcp``. Baseline, measured in the same run in
this process: libc ``memcpy`` of the same total bytes into another buffer (one copy, median of
``--reps``; the fastest of torch ``copy_``, numpy ``copyto`` and libc ``memcpy`` on this
machine), and the ratio transfer / memcpy.

The machine is shared and small: on cpu, before the memcpy baseline and before each UCX
configuration, the bench waits (up to ``--wait-quiet-s``) for the CPUs to go idle and records
the busy fraction it saw (above ~0.1: the numbers next to it were contended). Both processes
run torch with ``--threads`` threads (default 1: two processes on two cores).

CUDA mode (``--device cuda``, GPU 0): each process makes the CUDA primary context of GPU 0
current in its main thread (``torch.cuda.set_device`` and a first allocation) before it creates
its ``UcxTransport``: UCX's CUDA transports need a current context when ``ucxx.init`` creates
the worker, as dask-cuda / distributed-ucxx ensure before theirs (ucxx's progress thread makes
the same primary context current for itself). UCX is not stream-ordered, so every CUDA write
of the bench (random source, staging gather, cache zeroing) is synchronized before UCX may
touch that memory. Configurations: UCX's default transports (error handling off);
``UCX_TLS=cuda_ipc,cuda_copy,sm,self`` (the one-node GPU path named explicitly: cuda_ipc moves
the data, shared memory the rendezvous control messages, self the withdrawals); and
``UCX_TLS=cuda_copy,tcp`` (staged through host memory over TCP: what two nodes without
GPUDirect do; skipped with ``--skip-tcp``). The checksum: the child gathers the reserved blocks
on the GPU, copies them to pinned host memory and sends the CRC32 of every 16 MiB chunk
(computed on up to 8 threads: zlib releases the GIL). Baseline, in the same run in this
process: torch ``copy_`` device-to-device of the same total bytes, timed between
``torch.cuda.synchronize()`` calls, median of ``--reps`` after one warm-up; its GB/s counts the
bytes copied once, as the transfer's does (not read + written). No CPU-idle wait on cuda (a 0.25
s busy sample is recorded instead). Bounds: every wait for a transfer has
``--transfer-timeout-s`` (default 20 s on cuda, 60 s on cpu), every other wait for the other
process 60 s, so a hung or dead peer fails its configuration, never the bench; a configuration
that fails (exception, timeout, a dead child) is recorded with its error text and the
measurements it made, and the next one runs; one that runs longer than ``--config-budget-s``
(default 30 s on cuda, none on cpu) starts no further workload (they are listed as skipped).
The report is rewritten to ``--out`` after every configuration, so a run cut short leaves what
it measured. ``--ucx-proto-info`` sets ``UCX_PROTO_INFO=y``: UCX then prints the protocol and
transports it selects (e.g. rendezvous over cuda_ipc) to stdout; use it with ``--out``.
Without a CUDA device, ``--device cuda`` prints why to stderr and the report
``{"skipped": "no CUDA device"}`` to stdout (and ``--out``), with exit status 0.

Running time on cuda with the default 5 repetitions (estimate, a 16-core H100/H200 host;
the 2-core VM spends 2-5 s per cpu configuration, child start included): start and GPU
baseline about 10 s; per configuration a child start (spawn, imports, CUDA and UCX init) of
5-10 s, 6 x 1.75 GiB transferred (well under 1 s over cuda_ipc; about 4-10 s staged over TCP
at 1-3 GB/s) and checked (GPU gather, copy to pinned memory at 10+ GB/s, CRC32 at 1-4 GB/s per
thread on 8 threads: 1-3 s), and 1-3 s of teardown: about 10-15 s per GPU-path configuration
and 15-25 s for the TCP one, 40-60 s in all; the budget caps a configuration that is much
slower than that.

Usage: ``python bench/bench_kv_transfer.py [--device cpu|cuda] [--reps N] [--out [PATH]]
[--skip-tcp] [--workloads NAME ...] [--configs NAME ...]``; prints a table to stderr and the
JSON report to stdout; ``--out`` also writes the report (default
``bench/results/kv-transfer-<date>.json``, ``kv-transfer-cuda-<date>.json`` on cuda).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import ucxx
from kv_transfer_peer import (
    CHECK_CHUNK_BYTES,
    CONTROL_TIMEOUT_S,
    ChildOptions,
    chunk_crc32,
    crc32,
    init_cuda,
    monotonic,
    receiver_main,
    recv_within,
    synchronize,
)
from kv_transfer_report import bandwidth, machine_info, table, write_report
from kv_transfer_workloads import UcxConfig, Workload, ucx_configs, workloads
from timing_stats import Json, machine_busy_fraction, wait_for_quiet

from splitserve.engine.host_memory import empty_huge_pages
from splitserve.transfer.layer_channel import LayerSender
from splitserve.transfer.plan import new_transfer_secret
from splitserve.transfer.staging import ring_depth
from splitserve.transfer.ucx import UcxTransport
from splitserve.transfer.ucx_settings import UcxSettings

DEVICES = ("cpu", "cuda")
TRANSFER_TIMEOUT_S = {"cpu": CONTROL_TIMEOUT_S, "cuda": 20.0}
"""Default bound on one transfer (``LayerSender.finish``, ``LayerReceiver.wait``)."""
CONFIG_BUDGET_S = {"cpu": math.inf, "cuda": 30.0}
"""Default time after which a configuration starts no further workload."""
DEFAULT_REPS = {"cpu": 7, "cuda": 5}
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------- sender (parent)


async def _time_transfers(
    conn: Connection,
    settings: UcxSettings,
    work: Sequence[Workload],
    args: argparse.Namespace,
    results: Json,
) -> None:
    """Run ``1 + reps`` transfers of each workload to the child, into ``results``: seconds per
    timed rep and the reps whose bytes differed, per workload (filled as they are measured,
    so a failure keeps what came before it)."""
    device = args.device
    if device == "cuda":
        init_cuda()  # before ucxx.init
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    measured: Json = {}
    results["workloads"] = measured
    transport: UcxTransport | None = None
    try:
        transport = UcxTransport(settings)
        results["context_transports"] = sorted(ucxx.get_active_transports())
        peer = await asyncio.to_thread(recv_within, conn)
        if not isinstance(peer, bytes):
            raise RuntimeError(f"expected the child's UCX address, got {type(peer).__name__}")
        endpoint = await asyncio.wait_for(transport.connect(peer), CONTROL_TIMEOUT_S)
        transfer_ids = iter(range(1, 1 << 20))
        for workload in work:
            if time.monotonic() - started > args.config_budget_s:
                results.setdefault("skipped_workloads", []).append(workload.name)
                continue
            plan = workload.plan  # in production it comes with the reservation
            # [layers, 2, blocks, half_block_bytes] random bytes, blocks in block-table order
            source = torch.randint(0, 256, workload.source_shape, dtype=torch.uint8, device=device)
            expected = chunk_crc32(source.cpu()) if device == "cuda" else crc32(source)
            # what the engine thread hands the sender: each layer gathered in plan order into
            # a staging buffer allocated as the prefill worker's (kv_io.staging_buffer)
            order = torch.tensor(plan.block_order, device=device)
            ordered = empty_huge_pages(workload.source_shape, torch.uint8, device)
            for layer in range(workload.num_layers):
                torch.index_select(source[layer], 1, order, out=ordered[layer])
            del source
            synchronize(device)  # the staging buffer is written before UCX reads it
            seconds: list[float] = []
            mismatched_reps: list[int] = []
            messages: list[int] = []  # per rep, as the sender counted them
            measured[workload.name] = {
                "seconds": seconds,
                "mismatched_reps": mismatched_reps,
                "messages": messages,
            }
            for rep in range(1 + args.reps):
                transfer_id, secret = next(transfer_ids), new_transfer_secret()
                conn.send((workload, transfer_id, secret))  # in production: the reservation
                ready = await asyncio.to_thread(recv_within, conn)
                if ready != "ready":
                    raise RuntimeError(f"expected 'ready' from the child, got {ready!r}")
                sender = LayerSender(endpoint, transfer_id, secret, workload.num_layers, plan, loop)
                start = monotonic()
                for layer in range(workload.num_layers):
                    sender.offer(layer, ordered[layer])
                await sender.finish(args.transfer_timeout_s)
                messages.append(sender.messages_sent)
                end = await asyncio.to_thread(recv_within, conn)
                if not isinstance(end, float):
                    raise RuntimeError(f"expected the child's end time, got {end!r}")
                if await asyncio.to_thread(recv_within, conn) != expected:
                    mismatched_reps.append(rep)
                    log(f"{workload.name} rep {rep}: received bytes differ from the sent")
                if rep > 0:  # rep 0 warms up endpoints, pages and caches
                    seconds.append(end - start)
            median_s = statistics.median(seconds) if seconds else math.nan
            log(
                f"  {workload.name}: {workload.total_bytes / median_s / 1e9:.2f} GB/s"
                + (f" (bytes differed in reps {mismatched_reps})" if mismatched_reps else "")
            )
    finally:
        with contextlib.suppress(OSError):  # the child may be gone already
            conn.send("stop")
        if transport is not None:
            await transport.close()


def bench_config(config: UcxConfig, work: Sequence[Workload], args: argparse.Namespace) -> Json:
    """Spawn a receiver child with ``config`` and time every workload against it. Returns what
    was measured; a failure adds ``error`` (its text) and keeps the workloads done before."""
    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    options = ChildOptions(args.device, args.threads, args.transfer_timeout_s)
    child = context.Process(
        target=receiver_main,
        args=(child_conn, config, options),
        daemon=True,
    )
    started = time.monotonic()
    results: Json = {"workloads": {}}
    child.start()
    child_conn.close()
    try:
        asyncio.run(_time_transfers(parent_conn, config.settings, work, args, results))
    except Exception as error:  # one broken configuration does not sink the others
        results["error"] = f"{type(error).__name__}: {error}"
        log(f"{config.name} failed: {results['error']}")
    finally:
        child.join(10)
        if child.is_alive():
            child.terminate()
            child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)
        results["child_exitcode"] = child.exitcode
        parent_conn.close()
        try:
            ucxx.reset()  # one context per process: the next configuration inits its own
        except Exception as error:  # objects of a failed run still hold it: init works anyway
            results["ucx_reset_error"] = f"{type(error).__name__}: {error}"
        results["wall_s"] = round(time.monotonic() - started, 1)
    return results


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


def device_copy_seconds(total_bytes: int, reps: int) -> list[float]:
    """torch ``copy_`` of ``total_bytes`` between two buffers on the GPU, each timed between
    ``torch.cuda.synchronize()`` calls, after one warm-up copy."""
    source = torch.randint(0, 256, (total_bytes,), dtype=torch.uint8, device="cuda")
    destination = torch.empty_like(source)
    destination.copy_(source)
    seconds = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        destination.copy_(source)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    if not torch.equal(destination, source):
        raise RuntimeError("device copy baseline did not copy")
    return seconds


# ----------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> Json:
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        init_cuda()
    work = [w for w in workloads(args.device) if not args.workloads or w.name in args.workloads]
    baseline = "device_copy" if cuda else "memcpy"
    report: Json = {"device": args.device, "machine": machine_info(args.device)}
    if cuda:
        report["machine"]["busy_fraction_before"] = machine_busy_fraction(0.25)
    else:
        report["machine"]["busy_fraction_before"] = wait_for_quiet(args.wait_quiet_s)
    report["setup"] = {
        "device": args.device,
        "torch_threads_per_process": args.threads,
        "receive": "LayerReceiver: each message (layers_per_message layers) into a staging ring "
        "of staging_depth messages (per workload), copied into the reserved blocks of a cache "
        "tensor" + (", on the GPU (torch, CUDA, zeros)" if cuda else ""),
        "baseline": baseline,
        baseline: "torch copy_ device to device, timed between torch.cuda.synchronize() calls; "
        "GB/s = bytes copied (once) / s"
        if cuda
        else "libc memcpy, one thread",
        "timing": "sender CLOCK_MONOTONIC before the first offer -> receiver CLOCK_MONOTONIC "
        "when LayerReceiver.wait returns (every layer landed in the cache, size-checked)",
        "byte_check": (
            f"CRC32 of each {CHECK_CHUNK_BYTES >> 20} MiB chunk of the reserved blocks "
            "(gathered on the GPU in block-table order, copied to host) against the source's"
            if cuda
            else "CRC32 of the reserved blocks (block-table order) against the source's"
        )
        + ", every rep (warm-up included), untimed",
        "kv_model": (
            "Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, block 16, bf16"
            if cuda
            else "SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, block 16, bf16"
        ),
        "reps": args.reps,
        "warmup_reps": 1,
        "transfer_timeout_s": args.transfer_timeout_s,
        "config_budget_s": None if math.isinf(args.config_budget_s) else args.config_budget_s,
    }
    report["workloads"] = {
        w.name: {
            "num_layers": w.num_layers,
            "num_blocks": len(w.block_ids),
            "runs": w.plan.num_runs,
            "layers_per_message": w.plan.layers_per_message,
            "messages": w.num_messages,  # planned (rows: the sender's count)
            "message_bytes": w.message_bytes,
            "staging_depth": ring_depth(w.num_messages, w.message_bytes, cuda),
            "total_bytes": w.total_bytes,
        }
        for w in work
    }
    copy_seconds = device_copy_seconds if cuda else memcpy_seconds
    baselines = {
        w.name: bandwidth(w.total_bytes, copy_seconds(w.total_bytes, args.reps)) for w in work
    }
    report[baseline] = baselines
    log(
        f"{baseline}: "
        + ", ".join(f"{name} {row['gbps_median']:.1f} GB/s" for name, row in baselines.items())
    )
    report["transfers"] = {}
    configs = ucx_configs(args.skip_tcp, args.device)
    for config in [c for c in configs if not args.configs or c.name in args.configs]:
        log(f"{config.name} ...")
        entry: Json = {"settings": asdict(config.settings)}
        if cuda:
            entry["busy_fraction_before"] = machine_busy_fraction(0.25)
        else:
            entry["busy_fraction_before"] = wait_for_quiet(args.wait_quiet_s)
        timings = bench_config(config, work, args)
        for key in (
            "error",
            "context_transports",
            "skipped_workloads",
            "child_exitcode",
            "ucx_reset_error",
            "wall_s",
        ):
            if key in timings:
                entry[key] = timings[key]
        for w in work:
            measured = timings["workloads"].get(w.name)
            if not measured or not measured["seconds"]:
                continue  # failed or skipped before its first timed rep
            row = bandwidth(w.total_bytes, measured["seconds"])
            row[f"{baseline}_gbps"] = baselines[w.name]["gbps_median"]
            row[f"vs_{baseline}"] = round(row["gbps_median"] / baselines[w.name]["gbps_median"], 3)
            row["messages_per_transfer"] = _one_count(measured["messages"])
            mismatched = measured["mismatched_reps"]
            row["byte_check"] = f"MISMATCH in reps {mismatched}" if mismatched else "ok"
            entry[w.name] = row
        report["transfers"][config.name] = entry
        if args.out is not None:  # a run cut short still leaves what it measured
            write_report(args.out, report | {"complete": False})
    report["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _one_count(counts: Sequence[int]) -> int | list[int]:
    """The messages every rep sent, or each rep's count where they differed."""
    return counts[0] if len(set(counts)) == 1 else list(counts)


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the KV lives: host memory (cpu) or GPU 0 (cuda); see the module docstring",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions after a warm-up (default 7 on cpu, 5 on cuda)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--skip-tcp",
        action="store_true",
        help="skip the TCP configuration (UCX_TLS=tcp on cpu, cuda_copy,tcp on cuda)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        metavar="NAME",
        help="only these workloads (e.g. prompt-1024 prompt-1024-4runs); default: all",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        metavar="NAME",
        help="only these UCX configurations (e.g. 'ucx error_handling=off'); default: all",
    )
    parser.add_argument(
        "--wait-quiet-s",
        type=float,
        default=15.0,
        help="cpu: wait up to this long for the CPUs to go idle before measuring (0: don't "
        "wait); cuda never waits",
    )
    parser.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=None,
        help="bound on each transfer (default 60 on cpu, 20 on cuda)",
    )
    parser.add_argument(
        "--config-budget-s",
        type=float,
        default=None,
        help="a configuration running longer starts no further workload (default: none on "
        "cpu, 30 on cuda)",
    )
    parser.add_argument(
        "--ucx-proto-info",
        action="store_true",
        help="set UCX_PROTO_INFO=y: UCX prints the protocols it selects to stdout (use --out)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        nargs="?",
        const=True,
        help="also write the report to PATH (no value: bench/results/kv-transfer-<date>.json, "
        "kv-transfer-cuda-<date>.json on cuda)",
    )
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = DEFAULT_REPS[args.device]
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.reps < 5:
        log(f"--reps {args.reps}: medians of fewer than 5 repetitions are noisy")
    if args.transfer_timeout_s is None:
        args.transfer_timeout_s = TRANSFER_TIMEOUT_S[args.device]
    if args.config_budget_s is None:
        args.config_budget_s = CONFIG_BUDGET_S[args.device]
    if args.out is True:
        infix = "-cuda" if args.device == "cuda" else ""
        args.out = RESULTS_DIR / f"kv-transfer{infix}-{datetime.date.today().isoformat()}.json"
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        log("--device cuda: no CUDA device here (torch.cuda.is_available() is False); skipped")
        report: Json = {"skipped": "no CUDA device"}
        print(json.dumps(report))
        if args.out is not None:
            write_report(args.out, report)
        return
    if args.ucx_proto_info:
        os.environ["UCX_PROTO_INFO"] = "y"  # read at ucxx.init, here and in each child
    started = time.perf_counter()
    report = run(args)
    report["bench_wall_s"] = round(time.perf_counter() - started, 1)
    report["complete"] = True
    print(table(report), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))
    if args.out is not None:
        write_report(args.out, report)
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
