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
decode worker's cores run its steps and nothing else (``control_cores``). Workers run at
``--worker-nice`` (default 10), below the coordinators and gateways (``launch/cpu_priority.py``).
Flags after ``--`` go to every worker (e.g. ``-- --dtype float32``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence

from splitserve.common.api_keys import (
    KEYS_ENV,
    api_keys_or_exit,
)
from splitserve.common.env_flags import env_name
from splitserve.common.settings import add_settings_args, settings_or_exit
from splitserve.coordinator import COORDINATOR_METRICS, INTERNAL_READY, PUBLIC_READY
from splitserve.gateway import GATEWAY_READY
from splitserve.kernels.cpu_build import kernel_plan_line
from splitserve.launch.child_process import ReadyError
from splitserve.launch.commands import (
    control_cores,
    coordinator_argv,
    extra_model_argvs,
    gateway_argv,
    lending_pairs,
    member_ids,
    membership_flags,
    merged_frontend,
    scaled_worker_argv,
    shares_response_file,
    worker_argvs,
    worker_cores,
    worker_processes,
)
from splitserve.launch.layout import (
    MODELLED,
    LayoutChoice,
    Workload,
    cached_probe,
    choose,
    last_flag,
    load_or_probe,
    probe_cache_path,
    roles_of_layout,
    workload_of,
)
from splitserve.launch.layout_recheck import recheck_layout
from splitserve.launch.local_autoscaler import AutoscaleTargets, LocalAutoscaler, scaled_children
from splitserve.launch.members import wait_for_members
from splitserve.launch.scale_policy import ScalerSettings
from splitserve.launch.supervisor import READY_TIMEOUT_S, Stopped, Supervisor, say
from splitserve.launch.up_settings import UpSettings
from splitserve.proto.cluster_auth import TOKEN_ENV, ClusterCredential
from splitserve.proto.server import wait_for_health
from splitserve.proto.tls import TlsConfig, tls_env, tls_or_exit


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``UpSettings`` (``up_settings.py``: every flag is declared there)."""
    parser = argparse.ArgumentParser(prog="splitserve up", description=__doc__.splitlines()[0])
    add_settings_args(parser, UpSettings)
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
    if args.worker_nice:
        summary += f", workers at nice {args.worker_nice}"
    if lending and lending_pairs(args, worker_cores(args)):
        borrowers = (
            "decode and prefill workers" if args.core_lending == "both" else "decode workers"
        )
        summary += f", {borrowers} borrow their partner's cores while it idles"
    return summary


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
    responses_dir: str | None,
) -> tuple[str, list[str]]:
    """Start every child in order, each once the previous ones are ready; the coordinators'
    public addresses, comma-separated, once every coordinator routes to every worker
    (``launch/members.py``), and their internal addresses. Ports asked for as 0 are pinned to
    those the first run got, for restarts."""
    publics, internals = [], []
    merged = merged_frontend(args)
    for index in range(args.coordinators):
        name = "coordinator" if args.coordinators == 1 else f"coordinator-{index}"
        coordinator = children.start("frontend" if merged else name, coordinator_argv(args, index))
        # the real ports when 0; the internal one is announced first
        publics.append(await children.wait_ready(coordinator, stop, PUBLIC_READY))
        internals.append(coordinator.process.announcements()[INTERNAL_READY])
        coordinator.pin("--port", _port_of(publics[-1]))
        coordinator.pin("--internal-port", _port_of(internals[-1]))
    internal = ",".join(internals)
    worker_specs = worker_argvs(args, internal, worker_args, busy_dir)
    workers = [children.start(name, argv, engine=True) for name, argv in worker_specs]
    for worker in workers:
        await children.wait_ready(worker, stop)
    for public in publics:
        await wait_for_health(public, READY_TIMEOUT_S, tls=tls)
    members = member_ids([argv for _, argv in worker_specs])
    await children.guard(
        wait_for_members(internals, members, READY_TIMEOUT_S, credential, tls), stop
    )
    address = ",".join(publics)
    extra_publics = [
        await _start_extra_model(children, args, index, worker_args, stop, credential, tls)
        for index in range(len(args.extra_model))
    ]
    if merged:  # the gateway is the coordinator's (it served as soon as the coordinator did)
        port = _port_of(await children.wait_ready(coordinator, stop, GATEWAY_READY))
        coordinator.pin("--http-port", port)
    elif not args.no_gateway:
        port: int | str = args.http_port
        for index in range(args.gateways):  # the first binds the port (0: any), the rest share it
            name = "gateway" if args.gateways == 1 else f"gateway-{index}"
            argv = gateway_argv(args, address, port, extra_publics, responses_dir)
            gateway = children.start(name, argv)
            port = _port_of(await children.wait_ready(gateway, stop))
            gateway.pin("--port", port)
    return address, internals


async def _start_extra_model(
    children: Supervisor,
    args: argparse.Namespace,
    index: int,
    worker_args: list[str],
    stop: asyncio.Event,
    credential: ClusterCredential,
    tls: TlsConfig | None,
) -> str:
    """Start ``--extra-model`` number ``index``'s coordinator and dual-role worker, each once
    the previous is ready; its coordinator's public address once it routes to the worker."""
    coordinator_args, worker_of = extra_model_argvs(args, index, worker_args)
    coordinator = children.start(f"model{index + 1}-coordinator", coordinator_args)
    public = await children.wait_ready(coordinator, stop, PUBLIC_READY)
    internal = coordinator.process.announcements()[INTERNAL_READY]
    coordinator.pin("--port", _port_of(public))
    coordinator.pin("--internal-port", _port_of(internal))
    name, argv = worker_of(internal)
    await children.wait_ready(children.start(name, argv, engine=True), stop)
    await wait_for_health(public, READY_TIMEOUT_S, tls=tls)
    members = member_ids([argv])
    await children.guard(
        wait_for_members([internal], members, READY_TIMEOUT_S, credential, tls), stop
    )
    say(f"splitserve up: model {index + 1} is {args.extra_model[index]}")
    say(f"splitserve model {index + 1} internal ready at {internal}")
    say(f"splitserve model {index + 1} ready at {public}")  # its coordinator
    return public


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
        loop,
        env,
        restart=not args.no_restart,
        drain_timeout_s=args.drain_timeout,
        engine_nice=args.worker_nice,
    )
    with _busy_dir(args) as busy_dir, _responses_dir(args) as responses_dir:
        try:
            address, internals = await _start_all(
                children, args, worker_args, stop, credential, tls, busy_dir, responses_dir
            )
            say(f"splitserve up: {layout_summary(args, lending=busy_dir is not None)}")
            say(f"splitserve up: {kernel_plan_line()}")
            say(f"splitserve ready at {address}")
            async with (
                _layout_recheck(args, internals[0], credential, tls),
                _autoscaling(args, children, internals, worker_args, stop),
            ):
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


@contextlib.asynccontextmanager
async def _autoscaling(
    args: argparse.Namespace,
    children: Supervisor,
    internals: list[str],
    worker_args: list[str],
    stop: asyncio.Event,
) -> AsyncIterator[None]:
    """With ``--autoscale``, moves the prefill and decode workers while the body runs
    (``launch/local_autoscaler.py``)."""
    if not args.autoscale:
        yield
        return
    urls = tuple(
        child.process.announcements()[COORDINATOR_METRICS]
        for child in children.children
        if child.name == "coordinator" or child.name.startswith("coordinator-")
    )
    settings = ScalerSettings(
        check_interval_s=args.autoscale_interval_s,
        stabilization_s=args.scale_down_window_s,
        scale_down_period_s=args.scale_down_period_s,
    )
    internal = ",".join(internals)
    autoscaler = LocalAutoscaler(
        children,
        scaled_children(children.children),
        lambda role, serial: scaled_worker_argv(args, role, serial, internal, worker_args),
        AutoscaleTargets(urls, settings, args.max_workers),
        say,
        first_serial=len(worker_processes(args)),
    )
    task = asyncio.ensure_future(autoscaler.run(stop))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


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


@contextlib.contextmanager
def _responses_dir(args: argparse.Namespace) -> Iterator[str | None]:
    """The folder of the SQLite file several gateways share their stored responses in while
    ``up`` runs (removed after; ``launch/commands.py:response_store_of``); None where they
    need none."""
    if not shares_response_file(args):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="splitserve-responses-") as path:
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
    settings_or_exit(parser, args, UpSettings)  # checks what no single flag can
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
