"""``splitserve up``: coordinator + prefill + decode workers on localhost, as child processes.

Starts the coordinator, then the workers (registered with it), waits until each printed its
ready line and the coordinator's health is SERVING, starts the OpenAI-compatible gateway
(``--http-port``, default 8000; ``--no-gateway`` leaves it out; ``--gateways N`` starts N
sharing the port, ``gateway/listeners.py``), prints
``splitserve ready at <host:port>``, forwards every child's output with a role prefix, and
stops all children on Ctrl-C / SIGTERM (SIGTERM, then SIGKILL after a grace period; ``up``
exits with status 1 when a child had to be killed because it ignored SIGTERM). Should ``up``
itself die without stopping them (SIGKILL), each child notices within a second that it was
orphaned and drains itself (``common/orphan.py``), so no process outlives it. A child that
exits on its own is restarted with back-off while the others keep serving
(``launch/supervisor.py``); ``--no-restart`` stops everything instead, with status 1. A
child that fails its first start stops ``up`` (status 1).

The cluster credential: ``SPLITSERVE_CLUSTER_TOKEN`` when set (so other processes can join
the cluster), else a fresh random token for this run; children receive it through their
environment, never on a command line. Workers register on the coordinator's internal port
(``--internal-port``); clients and the gateway use its public ``--port``.

TLS: ``--tls-cert``/``--tls-key``/``--tls-ca`` (``proto/tls.py``) go to every child through
its environment: every gRPC port serves TLS, mutual between the roles when a CA is given, and
the gateway serves HTTPS. API keys (``--api-key``, ``--api-keys-file``, ``SPLITSERVE_API_KEYS``;
``common/api_keys.py``) go to the coordinator and the gateway the same way, never on a child's
command line; ``--health-needs-key`` closes the gateway's /health and /metrics too.

Membership: by default workers register with the coordinators over gRPC (nothing else to
run). ``--etcd-endpoints`` (``discovery/flags.py``) puts it in etcd instead: the workers
announce themselves there under ``--cluster-name`` and the coordinators watch it, so workers
and coordinators started elsewhere (another ``up``, or single roles) join the same cluster.

Several models: ``--extra-model DIR`` (repeatable) serves another model beside ``--model``,
on a coordinator of its own (ports after the ``--model`` coordinators') and a dual-role
worker (unpinned); the gateway gets one ``--coordinator`` per model and routes each request
by its ``model``. ``--served-model-name`` names ``--model`` (the coordinators' flag).

Simulated workers (``-- --engine sim``) may share processes: ``--workers-per-process K``
starts each role's workers K to a process (``--host-workers``), unpinned, so a machine
holds hundreds of them for scale tests.

Cores are split evenly among the workers (``--cpu-affinity`` of each) when the machine has at
least one core per worker, so co-located workers do not fight over cores; ``--no-pin`` turns
that off. With ``--core-lending decode``, pinned prefill worker i lends its cores to decode
worker i: the decode worker's engine thread also runs there while the prefill worker's engine
idles, where that measures faster (``engine/step_threads.py``); with ``both``, decode worker i
lends its cores back the same way. The layout sets it unless the flag is given: ``both`` for
``hybrid`` (``auto``'s worker pair), ``off`` otherwise. The busy files live in a directory
under ``/dev/shm`` for the run. With ``--control-cores
prefill`` the coordinators and the gateway are pinned to the prefill workers' cores, so a
decode worker's cores run its steps and nothing else (``control_cores``). Flags after ``--``
go to every worker (e.g. ``-- --dtype float32``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from splitserve.common.api_keys import (
    KEYS_ENV,
    add_api_key_args,
    add_health_needs_key_flag,
    api_keys_or_exit,
)
from splitserve.common.env_flags import env_name
from splitserve.common.membership import hosted_worker_ids, member_id
from splitserve.coordinator import INTERNAL_READY, PUBLIC_READY
from splitserve.discovery.flags import add_membership_args, etcd_endpoints
from splitserve.kernels.cpu_build import kernel_plan_line
from splitserve.launch.child_process import ReadyError
from splitserve.launch.layout import (
    MODELLED,
    LayoutChoice,
    Workload,
    add_layout_args,
    cached_probe,
    choose,
    last_flag,
    load_or_probe,
    probe_cache_path,
    roles_of_layout,
    workload_of,
)
from splitserve.launch.layout_recheck import recheck_layout
from splitserve.launch.members import wait_for_members
from splitserve.launch.supervisor import READY_TIMEOUT_S, Stopped, Supervisor, say
from splitserve.proto.cluster_auth import TOKEN_ENV, ClusterCredential
from splitserve.proto.server import wait_for_health
from splitserve.proto.tls import TlsConfig, add_tls_args, tls_env, tls_or_exit

CORE_LENDING = ("decode", "both", "off")
CONTROL_CORES = ("prefill", "any")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve up", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=50051, help="coordinator's public gRPC port (0: any free)"
    )
    parser.add_argument(
        "--internal-port",
        type=int,
        default=50052,
        help="coordinator's internal gRPC port, for workers (0: any free port)",
    )
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--extra-model",
        action="append",
        default=[],
        help="another model to serve beside --model (a GGUF file or an HF folder; "
        "python -m splitserve.engine.random_checkpoint writes one of random weights), on a "
        "coordinator and a dual-role worker of its own (unpinned); the gateway routes each "
        "request by its model. Repeatable",
    )
    parser.add_argument(
        "--coordinators",
        type=int,
        default=1,
        help="coordinators (ports 2 apart from --port / --internal-port); every worker "
        "registers with all, the gateway balances over them and continues a stream whose "
        "coordinator dies through another",
    )
    add_layout_args(parser)
    parser.add_argument(
        "--prefill", type=int, default=1, help="prefill workers (overrides --layout)"
    )
    parser.add_argument("--decode", type=int, default=1, help="decode workers (overrides --layout)")
    parser.add_argument(
        "--dual",
        type=int,
        default=0,
        help="dual-role workers (prefill and decode on one engine: `splitserve worker`), "
        "started after the others; e.g. --prefill 0 --decode 0 --dual 2 (overrides --layout)",
    )
    parser.add_argument(
        "--workers-per-process",
        type=int,
        default=1,
        help="workers of a role one process hosts (``--host-workers``; above 1 only for "
        "simulated workers, ``-- --engine sim``, whose processes are then not pinned): e.g. "
        "--prefill 16 --decode 112 --workers-per-process 16 runs 128 workers in 8 processes",
    )
    parser.add_argument(
        "--decode-worker-args",
        default="",
        help="flags for the decode workers only, after those after -- (one string, split as "
        "a shell would), e.g. '--no-prefix-caching': decode workers that keep no finished "
        "request's KV, so no conversation's next turn finds its history there",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin workers to cores")
    parser.add_argument(
        "--core-lending",
        choices=CORE_LENDING,
        default=None,
        help="pinned workers lend their cores while their engine idles: 'decode': decode "
        "worker i also runs its steps on prefill worker i's cores while that one waits for "
        "prompts, where that measures faster; 'both': prefill worker i borrows decode worker "
        "i's too; 'off': each keeps to its own. Default: the layout's ('both' for hybrid, "
        "which auto runs for a worker pair; 'off' otherwise)",
    )
    parser.add_argument(
        "--control-cores",
        choices=CONTROL_CORES,
        default="any",
        help="where the coordinators and the gateway run: 'prefill': on the prefill workers' "
        "cores (pinned workers, at least one prefill and one decode worker), leaving the decode "
        "workers' cores to their steps; 'any': unpinned",
    )
    parser.add_argument(
        "--local-prefill-max-tokens", type=int, default=None, help="passed to the coordinator"
    )
    parser.add_argument("--max-inflight", type=int, default=None, help="passed to the coordinator")
    parser.add_argument(
        "--placement",
        default=None,
        help="where prompts are computed (rule, adaptive, remote, local); for the coordinator",
    )
    parser.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI-compatible gateway port (0: any free)"
    )
    parser.add_argument("--no-gateway", action="store_true", help="do not start the gateway")
    parser.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway processes sharing --http-port (SO_REUSEPORT: the kernel spreads "
        "connections over them; each also serves its own /metrics on a port it prints)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds each child may drain on SIGTERM (passed to coordinator and workers)",
    )
    parser.add_argument(
        "--no-restart",
        action="store_true",
        help="stop everything when a child dies (default: restart it with back-off)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="names --model is served under (comma-separated; the coordinators' flag)",
    )
    parser.add_argument(
        "--metrics-port-base",
        type=int,
        default=9400,
        help="Prometheus /metrics ports: coordinator i at base + i, worker i after them "
        "(0: any free port each, printed at start; -1: no metrics)",
    )
    add_membership_args(parser)
    add_tls_args(parser)
    add_api_key_args(parser)
    add_health_needs_key_flag(parser, "the gateway's /health and /metrics")
    return parser


def layout_summary(args: argparse.Namespace, lending: bool = True) -> str:
    """What runs, for the startup line: roles, where prompts are computed, membership, core
    lending (unless ``lending`` is False: ``up`` found no place for the busy files)."""
    coordinators = f"{args.coordinators} coordinator{'s' if args.coordinators > 1 else ''}"
    choice: LayoutChoice | None = getattr(args, "layout_choice", None)
    if choice is not None:
        coordinators = f"layout {choice.layout} ({choice.summary}), {coordinators}"
    workers = (
        f"{args.prefill} prefill + {args.decode} decode worker{'s' if args.decode > 1 else ''}"
    )
    if args.dual:
        workers += f" + {args.dual} dual-role (prefill,decode) worker{'s' if args.dual > 1 else ''}"
    if args.workers_per_process > 1:
        workers += f" (up to {args.workers_per_process} a process)"
    placement = args.placement or os.environ.get(env_name("--placement"), "rule")
    membership = "etcd" if membership_flags(args) else "registration with the coordinators"
    summary = f"{coordinators}, {workers}, prompts placed by {placement}, membership: {membership}"
    if args.extra_model:
        count = len(args.extra_model)
        summary += (
            f", {count} more model{'s' if count > 1 else ''} on a coordinator and a dual-role "
            "worker each"
        )
    if args.gateways > 1 and not args.no_gateway:
        summary += f", {args.gateways} gateways sharing the HTTP port"
    if control_cores(args) is not None:
        summary += ", coordinator and gateway on the prefill workers' cores"
    if lending and lending_pairs(args, worker_cores(args)):
        borrowers = (
            "decode and prefill workers" if args.core_lending == "both" else "decode workers"
        )
        summary += f", {borrowers} borrow their partner's cores while it idles"
    return summary


def worker_cores(args: argparse.Namespace) -> list[str | None]:
    """Each worker's ``--cpu-affinity`` in start order (prefill, decode, dual-role workers);
    None each with ``--no-pin``, with several workers a process (simulated: nothing to pin)
    or too few cores (``worker_core_sets``)."""
    num_processes = len(worker_processes(args))
    if args.no_pin or args.workers_per_process > 1:
        return [None] * num_processes
    return worker_core_sets(num_processes, sorted(os.sched_getaffinity(0)))


def worker_processes(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(role, workers it hosts) of each worker process in start order: prefill, decode,
    dual-role; each role's workers in groups of ``--workers-per-process``."""
    per = args.workers_per_process
    processes = []
    for role, count in (("prefill", args.prefill), ("decode", args.decode), ("dual", args.dual)):
        processes += [(role, min(per, count - first)) for first in range(0, count, per)]
    return processes


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


def membership_flags(args: argparse.Namespace) -> list[str]:
    """The etcd membership flags every coordinator and worker gets; none by default."""
    endpoints = etcd_endpoints(args)
    if not endpoints:
        return []
    return [f"--etcd-endpoints={','.join(endpoints)}", f"--cluster-name={args.cluster_name}"]


def _metrics_port(base: int, index: int) -> int:
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


def coordinator_argv(args: argparse.Namespace, index: int = 0) -> list[str]:
    """Module and flags of coordinator ``index`` of ``--model``: ports ``2 * index`` above
    the base ones (any free ones when those are 0)."""
    argv = _coordinator_argv(args, index, args.model, _metrics_port(args.metrics_port_base, index))
    if args.served_model_name:
        argv.append(f"--served-model-name={args.served_model_name}")
    return argv


def _coordinator_argv(
    args: argparse.Namespace, slot: int, model: str, metrics_port: int
) -> list[str]:
    """A coordinator of ``model`` on the ports of ``slot`` (``2 * slot`` above the base ones,
    any free ones when those are 0)."""
    port, internal_port = (p + 2 * slot if p else 0 for p in (args.port, args.internal_port))
    argv = ["splitserve.coordinator.main", f"--host={args.host}", f"--port={port}"]
    argv += [f"--internal-port={internal_port}", f"--drain-timeout={args.drain_timeout}"]
    argv += [f"--model={model}", f"--metrics-port={metrics_port}", *membership_flags(args)]
    if args.max_inflight is not None:
        argv.append(f"--max-inflight={args.max_inflight}")
    if args.local_prefill_max_tokens is not None:
        argv.append(f"--local-prefill-max-tokens={args.local_prefill_max_tokens}")
    if args.placement is not None:
        argv.append(f"--placement={args.placement}")
    return argv + _control_affinity(args)


def _control_affinity(args: argparse.Namespace) -> list[str]:
    """``--cpu-affinity`` for a coordinator or the gateway, where ``control_cores`` pins."""
    cores = control_cores(args)
    return [] if cores is None else [f"--cpu-affinity={cores}"]


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
    lending = _lending_flags(args, cores, busy_dir) if busy_dir else [[] for _ in processes]
    workers = []
    first_worker = 0  # the global index of the process's first worker (metrics ports)
    for index, ((role, hosted), core_list) in enumerate(zip(processes, cores, strict=True)):
        if role == "dual":
            argv = [
                "splitserve.launch.dual_worker",
                "--roles=prefill,decode",
                f"--model={args.model}",
            ]
        else:
            argv = [f"splitserve.{role}.main", f"--model={args.model}"]
        if not membership_flags(args):  # on etcd a worker knows no coordinator
            argv.append(f"--coordinator={coordinator}")
        argv += [f"--host={args.host}", f"--worker-id={role}-{index}"]
        argv += [f"--drain-timeout={args.drain_timeout}", *membership_flags(args)]
        metrics_port = _metrics_port(args.metrics_port_base, args.coordinators + first_worker)
        argv.append(f"--metrics-port={metrics_port}")  # a hosted worker i: this + i
        first_worker += hosted
        if core_list is not None:
            argv.append(f"--cpu-affinity={core_list}")
        if hosted > 1:
            argv.append(f"--host-workers={hosted}")
        own = shlex.split(args.decode_worker_args) if role == "decode" else []
        workers.append((f"{role}-{index}", argv + lending[index] + list(worker_args) + own))
    return workers


def extra_model_argvs(
    args: argparse.Namespace, index: int, worker_args: Sequence[str]
) -> tuple[list[str], Callable[[str], tuple[str, list[str]]]]:
    """The coordinator's module and flags for ``--extra-model`` number ``index``, and, given
    that coordinator's internal address, its dual-role worker's (name, module and flags).
    Ports after the ``--model`` coordinators'; metrics ports after every ``--model`` worker."""
    model = args.extra_model[index]
    first = args.coordinators + args.prefill + args.decode + args.dual + 2 * index
    coordinator = _coordinator_argv(
        args, args.coordinators + index, model, _metrics_port(args.metrics_port_base, first)
    )
    name = f"model{index + 1}-dual-0"

    def worker(internal: str) -> tuple[str, list[str]]:
        argv = ["splitserve.launch.dual_worker", "--roles=prefill,decode", f"--model={model}"]
        if not membership_flags(args):  # on etcd a worker knows no coordinator
            argv.append(f"--coordinator={internal}")
        argv += [f"--host={args.host}", f"--worker-id={name}"]
        argv += [f"--drain-timeout={args.drain_timeout}", *membership_flags(args)]
        argv.append(f"--metrics-port={_metrics_port(args.metrics_port_base, first + 1)}")
        return name, argv + list(worker_args)

    return coordinator, worker


def _lending_flags(
    args: argparse.Namespace, cores: Sequence[str | None], busy_dir: str
) -> list[list[str]]:
    """Each worker's lending flags (by start index): prefill worker i publishes its busy
    file and decode worker i borrows its cores (and, with ``--core-lending both``, the
    reverse), for each of the ``lending_pairs``."""
    flags: list[list[str]] = [[] for _ in cores]
    for pair in range(lending_pairs(args, cores)):
        prefill, decode = pair, args.prefill + pair
        directions = [(prefill, decode)]
        if args.core_lending == "both":
            directions.append((decode, prefill))
        for lender, borrower in directions:  # a worker lends at most once
            busy_file = os.path.join(busy_dir, f"worker-{lender}.busy")
            flags[lender].append(f"--busy-file={busy_file}")
            flags[borrower] += [f"--borrow-cores={cores[lender]}"]
            flags[borrower] += [f"--borrow-while-idle={busy_file}"]
    return flags


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
) -> list[str]:
    """Module and flags of a gateway listening on ``port`` (default ``--http-port``; shared
    by every gateway when there are several: ``--reuse-port``) in front of ``--model``'s
    ``coordinator`` (addresses) and the ``extra_models``' coordinators (one address each)."""
    argv = ["splitserve.gateway.main", f"--coordinator={coordinator}", f"--host={args.host}"]
    argv += [f"--coordinator={address}" for address in extra_models]
    port = args.http_port if port is None else port
    argv += [f"--port={port}", f"--drain-timeout={args.drain_timeout}"]
    if args.gateways > 1:
        argv.append("--reuse-port")
    if args.health_needs_key:
        argv.append("--health-needs-key")
    return argv + _control_affinity(args)


def children_env(
    args: argparse.Namespace,
    credential: ClusterCredential,
    tls: TlsConfig | None,
    env: dict[str, str],
) -> dict[str, str]:
    """What every child's environment gets on top of ``up``'s own ``env``: the credential,
    the TLS files and the API keys (keys given as flags join ``SPLITSERVE_API_KEYS``; a keys
    file is passed by path). Workers ignore the keys."""
    extra = {TOKEN_ENV: credential.token}
    if tls is not None:
        extra |= tls_env(tls.files)
    if args.api_key:
        extra[KEYS_ENV] = "\n".join([env.get(KEYS_ENV, ""), *args.api_key]).strip("\n")
    if args.api_keys_file is not None:
        extra[env_name("--api-keys-file")] = str(args.api_keys_file.resolve())
    return extra


async def _start_all(
    children: Supervisor,
    args: argparse.Namespace,
    worker_args: list[str],
    stop: asyncio.Event,
    credential: ClusterCredential,
    tls: TlsConfig | None,
    busy_dir: str,
) -> tuple[str, str]:
    """Start every child in order, each once the previous ones are ready; the coordinators'
    public addresses, comma-separated, once every coordinator routes to every worker
    (``launch/members.py``), and the first coordinator's internal address. Ports asked for as 0
    are pinned to those the first run got, for restarts."""
    publics, internals = [], []
    for index in range(args.coordinators):
        name = "coordinator" if args.coordinators == 1 else f"coordinator-{index}"
        coordinator = children.start(name, coordinator_argv(args, index))
        # the real ports when 0; the internal one is announced first
        publics.append(await children.wait_ready(coordinator, stop, PUBLIC_READY))
        internals.append(coordinator.process.announcements()[INTERNAL_READY])
        coordinator.pin("--port", _port_of(publics[-1]))
        coordinator.pin("--internal-port", _port_of(internals[-1]))
    internal = ",".join(internals)
    worker_specs = worker_argvs(args, internal, worker_args, busy_dir)
    workers = [children.start(name, argv) for name, argv in worker_specs]
    for worker in workers:
        await children.wait_ready(worker, stop)
    for public in publics:
        await wait_for_health(public, READY_TIMEOUT_S, tls=tls)
    members = member_ids([argv for _, argv in worker_specs])
    await children.guard(
        wait_for_members(internals, members, READY_TIMEOUT_S, credential, tls), stop
    )
    address = ",".join(publics)
    extra_publics = []
    for index, model in enumerate(args.extra_model):
        coordinator_args, worker_of = extra_model_argvs(args, index, worker_args)
        coordinator = children.start(f"model{index + 1}-coordinator", coordinator_args)
        extra_publics.append(await children.wait_ready(coordinator, stop, PUBLIC_READY))
        extra_internal = coordinator.process.announcements()[INTERNAL_READY]
        coordinator.pin("--port", _port_of(extra_publics[-1]))
        coordinator.pin("--internal-port", _port_of(extra_internal))
        name, argv = worker_of(extra_internal)
        await children.wait_ready(children.start(name, argv), stop)
        await wait_for_health(extra_publics[-1], READY_TIMEOUT_S, tls=tls)
        await children.guard(
            wait_for_members(
                [extra_internal], member_ids([argv]), READY_TIMEOUT_S, credential, tls
            ),
            stop,
        )
        say(f"splitserve up: model {index + 1} is {model}")
        say(f"splitserve model {index + 1} internal ready at {extra_internal}")
        say(f"splitserve model {index + 1} ready at {extra_publics[-1]}")  # its coordinator
    if not args.no_gateway:
        port: int | str = args.http_port
        for index in range(args.gateways):  # the first binds the port (0: any), the rest share it
            name = "gateway" if args.gateways == 1 else f"gateway-{index}"
            gateway = children.start(name, gateway_argv(args, address, port, extra_publics))
            port = _port_of(await children.wait_ready(gateway, stop))
            gateway.pin("--port", port)
    return address, internals[0]


def _port_of(address: str) -> str:
    """The port of "host:port" or "scheme://host:port"."""
    return address.rsplit(":", 1)[1]


async def _run(
    args: argparse.Namespace,
    worker_args: list[str],
    env: dict[str, str],
    credential: ClusterCredential,
    tls: TlsConfig | None,
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    children = Supervisor(
        loop, env, restart=not args.no_restart, drain_timeout_s=args.drain_timeout
    )
    with _busy_dir(args) as busy_dir:
        try:
            address, internal = await _start_all(
                children, args, worker_args, stop, credential, tls, busy_dir
            )
            say(f"splitserve up: {layout_summary(args, lending=busy_dir is not None)}")
            say(f"splitserve up: {kernel_plan_line()}")
            say(f"splitserve ready at {address}")
            async with _layout_recheck(args, internal, credential, tls):
                await children.supervise(stop)
            status = 0 if stop.is_set() else 1
        except Stopped:
            status = 0
        except ReadyError as error:  # a first start failed: nothing to supervise
            say(f"splitserve up: {error.summary}", file=sys.stderr)
            status = 1
        except TimeoutError as error:  # the coordinator's health or its members
            say(f"splitserve up: {error}", file=sys.stderr)
            status = 1
        if not await children.stop_all():
            status = status or 1
    return status


@contextlib.asynccontextmanager
async def _layout_recheck(
    args: argparse.Namespace, internal: str, credential: ClusterCredential, tls: TlsConfig | None
) -> AsyncIterator[None]:
    """Re-checks the layout from served steps while the body runs (``launch/layout_recheck.py``,
    every ``--layout-recheck-s``; where a layout the model knows runs with a probe at hand)."""
    choice: LayoutChoice | None = getattr(args, "layout_choice", None)
    if choice is None or choice.probe is None or args.layout_recheck_s <= 0:
        yield
        return
    workload = workload_of(args.layout_workload)
    task = asyncio.ensure_future(
        recheck_layout(internal, credential, tls, choice, workload, args.layout_recheck_s, say)
    )
    try:
        yield
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception as error:  # an advisory loop that failed must not fail the shutdown
            say(f"splitserve up: the layout re-check had stopped: {error!r}", file=sys.stderr)


@contextlib.contextmanager
def _busy_dir(args: argparse.Namespace) -> Iterator[str | None]:
    """A directory for the lending pairs' busy files while ``up`` runs (removed after): under
    ``/dev/shm`` (memory, never written to disk) where it is writable, else the temporary
    directory; None without lending pairs, or (with a warning) where it cannot be made: the
    workers then keep to their own cores. A SIGKILLed ``up`` leaves it behind."""
    if not lending_pairs(args, worker_cores(args)):
        yield None
        return
    shm = "/dev/shm"
    parent = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    try:
        directory = tempfile.TemporaryDirectory(prefix="splitserve-busy-", dir=parent)
    except OSError as error:
        say(f"splitserve up: no core lending (no directory for busy files: {error})")
        yield None
        return
    with directory as path:
        yield path


def roles_given(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (``up``'s own flags) names --prefill, --decode or --dual."""
    parser = build_parser()
    parser.set_defaults(prefill=None, decode=None, dual=None)
    args, _ = parser.parse_known_args(argv)
    return any(count is not None for count in (args.prefill, args.decode, args.dual))


def apply_layout(args: argparse.Namespace, worker_args: Sequence[str], roles: bool) -> None:
    """Set ``args``' worker counts and (unless ``--core-lending`` was given) ``core_lending``
    from the layout ``choose_layout`` picks, kept as ``args.layout_choice`` for the startup
    line. Raises ``ValueError`` for a malformed ``--layout-workload``."""
    workload = workload_of(args.layout_workload)
    args.layout_choice = choose_layout(args, worker_args, roles, workload)
    if args.layout_choice.layout == "explicit":
        args.core_lending = args.core_lending or "off"
        return
    args.prefill, args.decode, args.dual, lending = roles_of_layout(args.layout_choice.layout)
    args.core_lending = args.core_lending or lending


def choose_layout(
    args: argparse.Namespace, worker_args: Sequence[str], roles: bool, workload: Workload
) -> LayoutChoice:
    """The layout to run (``launch/layout.py``): "explicit" where ``roles`` were given, the
    named one, or ``auto``'s choice. ``auto`` runs ``split`` without probing for simulated
    workers, a device other than the CPU, or a single core; and where the probe fails (with
    a warning)."""
    if roles:
        return LayoutChoice("explicit", "--prefill/--decode/--dual given")
    if args.layout != "auto":
        path = probe_cache_path(worker_args, workload)
        probe = cached_probe(path) if args.layout in MODELLED else None
        return LayoutChoice(args.layout, f"--layout {args.layout}", probe=probe, probe_path=path)
    engine = last_flag(worker_args, "--engine") or os.environ.get(env_name("--engine"))
    device = last_flag(worker_args, "--device") or os.environ.get(env_name("--device"))
    if engine == "sim" or args.workers_per_process > 1:
        return LayoutChoice("split", "auto: simulated workers")
    if device not in (None, "cpu"):
        return LayoutChoice("split", f"auto: device {device}")
    if len(os.sched_getaffinity(0)) < 2:
        return LayoutChoice("split", "auto: one core")
    try:
        probe, cached = load_or_probe(worker_args, workload, say)
    except RuntimeError as error:
        say(f"splitserve up: warning: {error}; running the split layout", file=sys.stderr)
        return LayoutChoice("split", "auto: the probe failed")
    choice = dataclasses.replace(
        choose(probe, workload), probe=probe, probe_path=probe_cache_path(worker_args, workload)
    )
    measured = "cached" if cached else "measured now"
    say(f"splitserve up: layout {choice.layout}: {choice.reason}")
    say(f"splitserve up: probe ({measured}): {probe.describe()}")
    return choice


def cluster_credential() -> ClusterCredential:
    """``SPLITSERVE_CLUSTER_TOKEN`` when set, else a fresh token for this run."""
    token = os.environ.get(TOKEN_ENV)
    return ClusterCredential(token) if token else ClusterCredential.generate()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    worker_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, worker_args = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers_per_process < 1:
        parser.error("--workers-per-process must be at least 1")
    if args.gateways < 1:
        parser.error("--gateways must be at least 1 (--no-gateway starts none)")
    try:
        credential = cluster_credential()
    except ValueError as error:
        parser.error(f"{TOKEN_ENV}: {error}")  # exits with status 2
    tls = tls_or_exit(parser, args)
    api_keys_or_exit(parser, args)  # a bad key or file stops up before any child starts
    try:
        apply_layout(args, worker_args, roles_given(argv))
    except ValueError as error:
        parser.error(str(error))
    env = children_env(args, credential, tls, dict(os.environ))
    return asyncio.run(_run(args, worker_args, env, credential, tls))


if __name__ == "__main__":
    sys.exit(main())
