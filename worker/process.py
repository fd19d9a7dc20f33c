"""Worker process set-up: flags (with ``SPLITSERVE_*`` twins), CPU affinity, engine loading.

Two workers can share a machine without fighting: ``--cpu-affinity`` pins the process to
cores before torch starts its thread pool, and the torch thread count defaults to the number
of cores the process may use. ``--borrow-cores`` lets the engine thread alone also use a
neighbour's cores while that neighbour idles (``engine/step_threads.py``).
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping

from splitserve.common.cpu_affinity import check_cores, parse_cpu_list
from splitserve.common.env_flags import comma_separated
from splitserve.common.settings import add_settings_args
from splitserve.transfer.ucx_settings import UcxSettings
from splitserve.worker.settings import WorkerSettings
from splitserve.worker.transfer_settings import TransferSettings


def add_worker_args(parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ) -> None:
    """The flags of ``WorkerSettings``: the worker's, then the engine's group."""
    add_settings_args(parser, WorkerSettings, env)


def apply_cpu_affinity(args: argparse.Namespace) -> None:
    """Pin the process to ``--cpu-affinity``'s cores (call before torch creates its threads)
    and size torch's pool to them. ``--borrow-cores`` stay out of the process's mask: only
    the engine thread may run there (``engine/step_threads.py:StepThreads.start``).
    ValueError for a malformed list or cores this process may not use."""
    if not args.cpu_affinity:
        borrowed_cpus(args)  # refuses borrowing without pinning
        return
    cpus = parse_cpu_list(args.cpu_affinity)
    check_cores(cpus | borrowed_cpus(args))
    os.sched_setaffinity(0, cpus)
    if args.threads is None:
        args.threads = len(cpus)


def borrowed_cpus(args: argparse.Namespace) -> set[int]:
    """``--borrow-cores``' cores not already the worker's own; ValueError for a borrowing
    set up by halves (cores without the owner's file, or either without --cpu-affinity) or
    one that adds no core."""
    if not args.borrow_cores and not args.borrow_while_idle:
        return set()
    if not (args.borrow_cores and args.borrow_while_idle and args.cpu_affinity):
        raise ValueError("--borrow-cores needs --borrow-while-idle and --cpu-affinity")
    borrowed = parse_cpu_list(args.borrow_cores) - parse_cpu_list(args.cpu_affinity)
    if not borrowed:
        raise ValueError("--borrow-cores names no core besides --cpu-affinity's")
    return borrowed


def coordinator_addresses(flag: str) -> list[str]:
    """The addresses of ``--coordinator`` ("host:port[,host:port...]")."""
    return comma_separated(flag)


def worker_id_of(args: argparse.Namespace, role: str) -> str:
    return args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"


def advertised_address(args: argparse.Namespace, port: int) -> str:
    return f"{args.advertise_host or args.host}:{port}"


def transfer_settings_of(args: argparse.Namespace) -> TransferSettings:
    """The KV transfer flags; ValueError for values out of range."""
    return TransferSettings(
        args.transfer_timeout, args.pull_cached_kv_min_blocks, args.kv_message_bytes
    )


def ucx_settings_of(args: argparse.Namespace) -> UcxSettings:
    return UcxSettings(
        tls=args.ucx_tls, error_handling=args.ucx_error_handling, progress_mode=args.ucx_progress
    )
