"""The command lines ``splitserve up`` starts its children with, each made from the child role's
settings object (``coordinator/settings.py``, ``worker/settings.py``, ``gateway/settings.py``:
the same classes the children's parsers are generated from), so a flag is declared once.

Every command is a module and its flags: ``settings_argv`` gives the values that differ from
the role's defaults, and the ones ``up`` always pins (ports, hosts, metrics ports, drain
times: a child's environment twin must not move them). What the user put after ``--`` and
``--decode-worker-args`` follows a worker's own flags (the last of a flag wins, as in
argparse). Pure functions of ``up``'s parsed flags (``args``) and the machine's cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
from collections.abc import Callable, Sequence

from splitserve.common.env_flags import comma_separated
from splitserve.common.membership import hosted_worker_ids, member_id
from splitserve.common.settings import settings_argv
from splitserve.coordinator.placement import PlacementMode
from splitserve.coordinator.settings import CoordinatorSettings
from splitserve.discovery.flags import MembershipSettings, membership_settings
from splitserve.engine.cli_args import EngineSettings
from splitserve.frontend.settings import FrontendSettings, HttpSettings
from splitserve.gateway.settings import GatewaySettings, ResponseStoreSettings
from splitserve.launch.layout import last_flag
from splitserve.worker.settings import WorkerSettings

COORDINATOR_MODULE = "splitserve.coordinator.main"
FRONTEND_MODULE = "splitserve.frontend.main"
GATEWAY_MODULE = "splitserve.gateway.main"
DUAL_WORKER = ["splitserve.launch.dual_worker", "--roles=prefill,decode"]
PINNED = ("--host", "--port", "--internal-port", "--drain-timeout", "--metrics-port")
"""Flags ``up`` always passes, default or not."""
WORKER_PINNED = (*PINNED, "--model", "--worker-id", "--coordinator")
COORDINATOR_PINNED = (*PINNED, "--model")


def membership_of(args: argparse.Namespace) -> MembershipSettings:
    """The etcd membership every coordinator and worker gets (none by default): ``up``'s
    membership flags, files as absolute paths. The etcd password is no flag: the children
    inherit ``SPLITSERVE_ETCD_PASSWORD`` from ``up``'s environment, or read the file."""
    if not comma_separated(args.etcd_endpoints or ""):
        return MembershipSettings()
    return membership_settings(args).for_child()


def membership_flags(args: argparse.Namespace) -> list[str]:
    """The etcd membership flags every coordinator and worker gets; none by default."""
    membership = membership_of(args)
    if membership.etcd_endpoints is None:
        return []
    return settings_argv(membership, ("--etcd-endpoints", "--cluster-name"))


def response_store_of(
    args: argparse.Namespace, shared_dir: str | None = None
) -> ResponseStoreSettings:
    """Where ``up``'s gateways keep stored responses: ``up``'s ``--response-store``, except
    that several gateway processes, which answer any connection, do not each keep their own
    in memory: they share etcd where membership is on etcd, else a SQLite file in
    ``shared_dir`` (``up``'s, for its lifetime: ``launch/up.py:_responses_dir``)."""
    chosen = ResponseStoreSettings(
        args.response_store, args.response_store_ttl, args.response_store_bytes
    )
    if not _several_in_memory(args):
        return chosen
    if not shares_response_file(args):  # membership is on etcd
        return dataclasses.replace(chosen, response_store="etcd")
    assert shared_dir is not None  # up made one for several gateways (shares_response_file)
    return dataclasses.replace(chosen, response_store=f"sqlite:{shared_dir}/responses.db")


def _several_in_memory(args: argparse.Namespace) -> bool:
    """Whether ``up`` starts several gateways and is asked for the one-process store."""
    return args.gateways > 1 and not args.no_gateway and args.response_store == "memory"


def shares_response_file(args: argparse.Namespace) -> bool:
    """Whether ``up``'s gateways share a SQLite file of stored responses
    (``response_store_of``): several, with no etcd to share."""
    return _several_in_memory(args) and membership_of(args).etcd_endpoints is None


def metrics_port(base: int, index: int) -> int:
    """Child ``index``'s metrics port: any free one for base 0, none (-1) for a negative base."""
    if base < 0:
        return -1
    return 0 if base == 0 else base + index


def worker_core_sets(num_workers: int, cpus: Sequence[int]) -> list[str | None]:
    """Disjoint core lists, one per worker, or None each when cores are too few."""
    if num_workers == 0 or len(cpus) < num_workers:
        return [None] * num_workers
    share = len(cpus) // num_workers
    return [",".join(str(c) for c in cpus[i * share : (i + 1) * share]) for i in range(num_workers)]


def worker_processes(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(role, workers it hosts) of each worker process in start order: prefill, decode,
    dual-role; each role's workers in groups of ``--workers-per-process``."""
    per = args.workers_per_process
    processes = []
    for role, count in (("prefill", args.prefill), ("decode", args.decode), ("dual", args.dual)):
        processes += [(role, min(per, count - first)) for first in range(0, count, per)]
    return processes


def worker_cores(args: argparse.Namespace) -> list[str | None]:
    """Each worker's ``--cpu-affinity`` in start order (prefill, decode, dual-role workers);
    None each with ``--no-pin``, ``--autoscale`` (the count changes), with several workers a
    process (simulated: nothing to pin) or too few cores (``worker_core_sets``)."""
    num_processes = len(worker_processes(args))
    if args.no_pin or args.workers_per_process > 1 or args.autoscale:
        return [None] * num_processes
    return worker_core_sets(num_processes, sorted(os.sched_getaffinity(0)))


def control_cores(args: argparse.Namespace) -> str | None:
    """The ``--cpu-affinity`` of the coordinators and the gateway: with ``--control-cores
    prefill``, the prefill workers' cores, where every worker is pinned and there are prefill
    and decode workers (the decode workers' cores then run only their steps: a step's
    OpenMP loop stalls whenever another process takes its core); None (unpinned) else."""
    if args.control_cores == "any" or not args.prefill or not args.decode:
        return None
    cores = worker_cores(args)
    if any(core_list is None for core_list in cores):
        return None
    return ",".join(core_list for core_list in cores[: args.prefill] if core_list)


def lending_pairs(args: argparse.Namespace, cores: Sequence[str | None]) -> int:
    """How many (prefill worker i, decode worker i) pairs lend cores, given each worker's
    pinned cores (``worker_cores``): none with ``--core-lending off`` (or unset) or unpinned
    workers."""
    if args.core_lending in (None, "off") or any(core_list is None for core_list in cores):
        return 0
    return min(args.prefill, args.decode)


def merged_frontend(args: argparse.Namespace) -> bool:
    """Whether the gateway runs inside the coordinator's process (``splitserve frontend``):
    one coordinator, one gateway, one model, and not ``--apart``."""
    one_each = args.coordinators == 1 and args.gateways == 1 and not args.extra_model
    return one_each and not args.no_gateway and not args.apart


def coordinator_argv(args: argparse.Namespace, index: int = 0) -> list[str]:
    """Module and flags of coordinator ``index`` of ``--model``: ports ``2 * index`` above
    the base ones (any free ones when those are 0); with ``merged_frontend``, the
    ``splitserve frontend`` serving the gateway on ``--http-port`` too."""
    port = metrics_port(args.metrics_port_base, index)
    names = args.served_model_name or ""
    settings, always = _coordinator_settings(args, index, args.model, port, names)
    if not merged_frontend(args):
        return [COORDINATOR_MODULE, *settings_argv(settings, always)]
    frontend = FrontendSettings(
        settings, HttpSettings(http_port=args.http_port), response_store_of(args)
    )
    return [FRONTEND_MODULE, *settings_argv(frontend, (*always, "--http-port"))]


def _coordinator_argv(
    args: argparse.Namespace, slot: int, model: str, metrics: int, served_names: str = ""
) -> list[str]:
    """A coordinator of ``model`` on the ports of ``slot`` (``_coordinator_settings``)."""
    settings, always = _coordinator_settings(args, slot, model, metrics, served_names)
    return [COORDINATOR_MODULE, *settings_argv(settings, always)]


def _coordinator_settings(
    args: argparse.Namespace, slot: int, model: str, metrics: int, served_names: str = ""
) -> tuple[CoordinatorSettings, tuple[str, ...]]:
    """A coordinator of ``model`` on the ports of ``slot`` (``2 * slot`` above the base ones,
    any free ones when those are 0); ``up``'s coordinator flags where given; and the flags
    it is always passed."""
    port, internal_port = (p + 2 * slot if p else 0 for p in (args.port, args.internal_port))
    given = {
        "max_inflight": args.max_inflight,
        "local_prefill_max_tokens": args.local_prefill_max_tokens,
        "placement": None if args.placement is None else PlacementMode(args.placement),
    }
    settings = CoordinatorSettings(
        host=args.host,
        port=port,
        internal_port=internal_port,
        model=model,
        served_model_name=served_names,
        cpu_affinity=control_cores(args),
        metrics_port=metrics,
        drain_timeout=args.drain_timeout,
        membership=membership_of(args),
        **{name: value for name, value in given.items() if value is not None},
    )
    always = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None]
    return settings, (*COORDINATOR_PINNED, *always)


def _worker_argv(
    args: argparse.Namespace, model: str, worker_id: str, coordinator: str, **own: object
) -> list[str]:
    """The flags of one worker of ``model`` named ``worker_id``: registered with the
    ``coordinator`` addresses, unless membership is on etcd (a worker then knows none);
    ``own``: its other ``WorkerSettings`` fields."""
    membership = membership_of(args)
    settings = WorkerSettings(
        host=args.host,
        coordinator=coordinator if membership.etcd_endpoints is None else None,
        worker_id=worker_id,
        drain_timeout=args.drain_timeout,
        membership=membership,
        engine=EngineSettings(model=model),
        **own,  # type: ignore[arg-type]
    )
    return settings_argv(settings, WORKER_PINNED)


def worker_argvs(
    args: argparse.Namespace,
    coordinator: str,
    worker_args: Sequence[str],
    busy_dir: str | None = None,
) -> list[tuple[str, list[str]]]:
    """(name, module and flags) of each worker in start order: prefill ones, decode ones,
    then dual-role ones (named ``dual-<index>``); ``coordinator``: the coordinators' internal
    addresses, comma-separated; ``busy_dir``: a node-local directory for the lending pairs'
    busy files (``lending_pairs``; no lending without one)."""
    processes = worker_processes(args)
    cores = worker_cores(args)
    lending = _lending(args, cores, busy_dir) if busy_dir else [{} for _ in processes]
    workers = []
    first_worker = 0  # the global index of the process's first worker (metrics ports)
    for index, ((role, hosted), core_list) in enumerate(zip(processes, cores, strict=True)):
        module = DUAL_WORKER if role == "dual" else [f"splitserve.{role}.main"]
        metrics = metrics_port(args.metrics_port_base, args.coordinators + first_worker)
        first_worker += hosted  # a hosted worker i: metrics port + i
        flags = _worker_argv(
            args,
            args.model,
            f"{role}-{index}",
            coordinator,
            metrics_port=metrics,
            cpu_affinity=core_list,
            host_workers=hosted,
            **lending[index],
        )
        own = shlex.split(args.decode_worker_args) if role == "decode" else []
        workers.append((f"{role}-{index}", [*module, *flags, *worker_args, *own]))
    return workers


def scaled_worker_argv(
    args: argparse.Namespace,
    role: str,
    serial: int,
    coordinator: str,
    worker_args: Sequence[str],
) -> tuple[str, list[str]]:
    """(name, module and flags) of a worker ``splitserve up --autoscale`` adds to ``role``
    (prefill or decode) beyond those it started with: named ``<role>-<serial>`` (``serial``
    past every start-up worker's index), unpinned (``worker_cores``), its metrics on any free
    port (printed; none with a negative ``--metrics-port-base``)."""
    name = f"{role}-{serial}"
    metrics = -1 if args.metrics_port_base < 0 else 0
    flags = _worker_argv(args, args.model, name, coordinator, metrics_port=metrics)
    own = shlex.split(args.decode_worker_args) if role == "decode" else []
    return name, [f"splitserve.{role}.main", *flags, *worker_args, *own]


def extra_model_argvs(
    args: argparse.Namespace, index: int, worker_args: Sequence[str]
) -> tuple[list[str], Callable[[str], tuple[str, list[str]]]]:
    """The coordinator's module and flags for ``--extra-model`` number ``index``, and, given
    that coordinator's internal address, its dual-role worker's (name, module and flags).
    Ports after the ``--model`` coordinators'; metrics ports after every ``--model`` worker."""
    model = args.extra_model[index]
    first = args.coordinators + args.prefill + args.decode + args.dual + 2 * index
    metrics = metrics_port(args.metrics_port_base, first)
    coordinator = _coordinator_argv(args, args.coordinators + index, model, metrics)
    name = f"model{index + 1}-dual-0"

    def worker(internal: str) -> tuple[str, list[str]]:
        worker_metrics = metrics_port(args.metrics_port_base, first + 1)
        flags = _worker_argv(args, model, name, internal, metrics_port=worker_metrics)
        return name, [*DUAL_WORKER, *flags, *worker_args]

    return coordinator, worker


def _lending(
    args: argparse.Namespace, cores: Sequence[str | None], busy_dir: str
) -> list[dict[str, str]]:
    """Each worker's lending settings (by start index): prefill worker i publishes its busy
    file and decode worker i borrows its cores (and, with ``--core-lending both``, the
    reverse), for each of the ``lending_pairs``."""
    settings: list[dict[str, str]] = [{} for _ in cores]
    for pair in range(lending_pairs(args, cores)):
        prefill, decode = pair, args.prefill + pair
        directions = [(prefill, decode)]
        if args.core_lending == "both":
            directions.append((decode, prefill))
        for lender, borrower in directions:  # a worker lends at most once
            busy_file = os.path.join(busy_dir, f"worker-{lender}.busy")
            settings[lender]["busy_file"] = busy_file
            settings[borrower]["borrow_cores"] = cores[lender] or ""
            settings[borrower]["borrow_while_idle"] = busy_file
    return settings


def member_ids(worker_argvs: Sequence[Sequence[str]]) -> list[str]:
    """The membership ids the workers of these command lines (``worker_argvs``' module and
    flags, user flags included: the last ``--worker-id`` / ``--roles`` wins, as in argparse)
    register under (``common/membership.py:member_id``)."""
    ids = []
    for argv in worker_argvs:
        worker_id = last_flag(argv, "--worker-id")
        roles_value = last_flag(argv, "--roles") or argv[0].split(".")[1]  # splitserve.<role>.main
        roles = [role.strip() for role in roles_value.split(",")]
        if worker_id is None:
            raise ValueError(f"a worker started without --worker-id: {argv}")
        hosted = int(last_flag(argv, "--host-workers") or 1)
        ids += [
            member_id(one, role, len(roles))
            for one in hosted_worker_ids(worker_id, hosted)
            for role in roles
        ]
    return ids


def gateway_argv(
    args: argparse.Namespace,
    coordinator: str,
    port: int | str | None = None,
    extra_models: Sequence[str] = (),
    shared_dir: str | None = None,
) -> list[str]:
    """Module and flags of a gateway listening on ``port`` (default ``--http-port``; shared
    by every gateway when there are several: ``--reuse-port``) in front of ``--model``'s
    ``coordinator`` (addresses) and the ``extra_models``' coordinators (one address each);
    its stored responses as ``response_store_of`` says (``shared_dir``: its file's folder)."""
    responses = response_store_of(args, shared_dir)
    settings = GatewaySettings(
        host=args.host,
        port=int(args.http_port if port is None else port),
        reuse_port=args.gateways > 1,
        coordinator=(coordinator, *extra_models),
        drain_timeout=args.drain_timeout,
        health_needs_key=args.health_needs_key,
        cpu_affinity=control_cores(args),
        responses=responses,
        etcd=membership_of(args) if responses.response_store == "etcd" else MembershipSettings(),
    )
    return [GATEWAY_MODULE, *settings_argv(settings, ("--host", "--port", "--drain-timeout"))]
