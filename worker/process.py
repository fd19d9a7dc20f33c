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
from splitserve.common.env_flags import add_env_flag, comma_separated, env_default
from splitserve.common.env_flags import truthy as _truthy
from splitserve.common.tracing import add_tracing_args
from splitserve.discovery.flags import add_membership_args
from splitserve.engine.cli_args import add_engine_args
from splitserve.proto.cluster_access import add_cluster_access_args
from splitserve.proto.server import add_reflection_flag
from splitserve.transfer.ucx import UcxSettings
from splitserve.worker.stall_watch import DEFAULT_STALL_TIMEOUT_S
from splitserve.worker.transfer_settings import DEFAULT_PULL_MIN_BLOCKS, TransferSettings


def add_worker_args(parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ) -> None:
    """Flags every worker role takes, besides the engine's."""
    group = parser.add_argument_group("worker")

    def flag(name: str, default: object, convert: type, help_text: str) -> None:
        add_env_flag(group, name, default, convert, help_text, env)

    flag("--host", "127.0.0.1", str, "address the gRPC server binds")
    flag("--port", 0, int, "gRPC port; 0 picks a free one (printed when ready)")
    flag("--advertise-host", None, str, "host the coordinator and peers should dial")
    flag(
        "--coordinator",
        None,
        str,
        "the coordinators' internal host:port (their --internal-port), comma-separated: the "
        "worker registers with each and takes work from all",
    )
    flag("--worker-id", None, str, "unique worker name (default: role-host-pid)")
    flag("--cpu-affinity", None, str, "pin the process to these cores, e.g. '0' or '0-3'")
    flag(
        "--busy-file",
        None,
        str,
        "publish in this file (node-local, e.g. under /dev/shm) whether this worker's engine "
        "has work, so a co-located worker may borrow its cores while it idles",
    )
    flag(
        "--borrow-cores",
        None,
        str,
        "cores of a co-located worker this one may also run its steps on while that worker "
        "idles (with --borrow-while-idle; needs --cpu-affinity)",
    )
    flag("--borrow-while-idle", None, str, "the --busy-file of the worker owning --borrow-cores")
    flag("--ucx-tls", None, str, "UCX transports (UCX_TLS), e.g. 'sm,self' or 'tcp'")
    group.add_argument(
        "--ucx-error-handling",
        action="store_true",
        default=env_default("--ucx-error-handling", False, _truthy, env),
        help="UCX peer-failure detection (forces TCP on one host; env "
        "SPLITSERVE_UCX_ERROR_HANDLING=1)",
    )
    flag("--transfer-timeout", 30.0, float, "seconds a KV transfer may take before it fails")
    flag(
        "--pull-cached-kv-min-blocks",
        DEFAULT_PULL_MIN_BLOCKS,
        int,
        "a prefill worker receives a prompt's leading KV from the decode worker that holds "
        "it (a conversation's history) when it would get at least this many blocks so, and "
        "computes only the rest; 0: never",
    )
    flag(
        "--drain-timeout",
        30.0,
        float,
        "on SIGTERM, seconds running requests may take to finish before they are handed over",
    )
    flag(
        "--stall-timeout",
        DEFAULT_STALL_TIMEOUT_S,
        float,
        "seconds one engine step may run before the worker reports itself not ready",
    )
    flag("--metrics-port", 0, int, "Prometheus /metrics port (0: any free port, -1: off)")
    flag(
        "--host-workers",
        1,
        int,
        "workers this process hosts, each with its own port and membership record "
        "(<worker id>-<i>; --port and --metrics-port count up from the given ones); above 1 "
        "only with --engine sim, for scale tests",
    )
    add_reflection_flag(group, env)
    add_cluster_access_args(group, env)
    add_membership_args(group, env)
    add_tracing_args(group)
    add_engine_args(parser, env)


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
    return TransferSettings(args.transfer_timeout, args.pull_cached_kv_min_blocks)


def ucx_settings_of(args: argparse.Namespace) -> UcxSettings:
    return UcxSettings(tls=args.ucx_tls, error_handling=args.ucx_error_handling)
