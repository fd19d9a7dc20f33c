"""Real serving processes for integration tests: ``splitserve up`` and single roles.

``running(argv, ready_marker)`` starts ``python -m <argv>`` as a ``ChildProcess`` (its output
drained on a thread, the tail kept for failure messages), waits for the ready line containing
``ready_marker`` and yields the address printed after "ready at"; on exit it sends SIGTERM and
fails the test unless the process stops cleanly (status 0) within 30 s (``up`` reports
children it had to kill). ``running_together`` does the same for several processes started
at once, so they load side by side.

Every process started here shares ``CREDENTIAL`` (``SPLITSERVE_CLUSTER_TOKEN`` in its
environment), so the tests can call internal ports; a coordinator's internal address is
``internal_address(<its public address>)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve.coordinator import INTERNAL_READY
from splitserve.launch.child_process import ChildProcess, python_module_argv
from splitserve.proto.cluster_auth import TOKEN_ENV, ClusterCredential
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2

CREDENTIAL = ClusterCredential.generate()
"""The cluster credential of every process the tests start."""
START_TIMEOUT_S = 240.0
STOP_GRACE_S = 60.0
"""More than ``up``'s own stop grace (drain timeout 30 s + 10 s)."""
_internal_of: dict[str, str] = {}
"""Public coordinator address -> its internal one, as the processes announced them."""
FRESH_LOAD_TIMEOUT_S = 10.0
"""How long ``worker_loads`` waits for every worker's next heartbeat (sent every 0.5 s)."""


@dataclass(frozen=True)
class ProcessSpec:
    """One process for ``running_together``: what ``running`` takes."""

    argv: list[str]
    ready_marker: str = "splitserve ready at"
    ready_lines: dict[str, str] | None = None
    env: dict[str, str] | None = None


@contextlib.contextmanager
def running(
    argv: list[str],
    ready_marker: str = "splitserve ready at",
    ready_lines: dict[str, str] | None = None,
    processes: list[subprocess.Popen[str]] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """See the module docstring; ``ready_lines``, when given, receives every "<what> ready at
    <address>" and "<what> metrics at <url>" line printed before readiness, as {what: address}
    (e.g. "splitserve gateway ready", "decode metrics"). ``processes``, when given, receives
    the process; a test that kills it on purpose is not failed for its exit status. ``env``:
    more environment for the process (and its children)."""
    spec = ProcessSpec(argv, ready_marker, ready_lines, env)
    with running_together([spec], processes) as (address,):
        yield address


@contextlib.contextmanager
def running_together(
    specs: Sequence[ProcessSpec], processes: list[subprocess.Popen[str]] | None = None
) -> Iterator[list[str]]:
    """``running`` for several processes started at once (they load side by side): yields
    their addresses in order once every one is ready; on exit stops each (last first) and
    fails the test unless every one stopped cleanly, as ``running`` does."""
    children: list[tuple[ProcessSpec, ChildProcess]] = []
    try:
        for spec in specs:
            child = ChildProcess(
                python_module_argv(*spec.argv),
                name=spec.argv[0],
                env={TOKEN_ENV: CREDENTIAL.token, **(spec.env or {})},
                tail_excludes=("UCX  WARN",),
            )
            children.append((spec, child))
            if processes is not None:
                processes.append(child.popen)
        addresses = []
        for spec, child in children:
            address = child.wait_ready(spec.ready_marker, START_TIMEOUT_S)
            announced = child.announcements()
            if INTERNAL_READY in announced:
                remember_internal(address, announced[INTERNAL_READY])
            if spec.ready_lines is not None:
                spec.ready_lines.update(announced)
            addresses.append(address)
        yield addresses
    finally:
        failures = []
        for spec, child in reversed(children):
            killed_on_purpose = child.returncode == -signal.SIGKILL
            stopped = child.stop(STOP_GRACE_S)
            if stopped.killed:
                failures.append(f"{spec.argv[0]} did not stop on SIGTERM:\n{child.tail()}")
            elif stopped.status != 0 and not killed_on_purpose:
                failures.append(
                    f"{spec.argv[0]} stopped with status {stopped.status}:\n{child.tail()}"
                )
        if failures:
            raise AssertionError("\n".join(failures))


def cluster(
    num_prefill: int,
    num_decode: int,
    *worker_flags: str,
    ready_lines: dict[str, str] | None = None,
    up_flags: tuple[str, ...] = (),
    processes: list[subprocess.Popen[str]] | None = None,
    env: dict[str, str] | None = None,
    gateway: bool | None = None,
) -> contextlib.AbstractContextManager[str]:
    """``splitserve up`` on free ports; yields the coordinator address. ``ready_lines``
    receives what the processes announce (metrics URLs as "<role> metrics at <url>", the
    gateway's URL as ``ready_lines["splitserve gateway"]``); the gateway starts when
    ``gateway`` says so, by default when ``ready_lines`` is given. ``processes`` receives
    ``up``'s process; ``env``: more environment for ``up`` and its children."""
    argv = [
        "splitserve.launch.up",
        "--port=0",
        "--internal-port=0",
        "--http-port=0",
        "--metrics-port-base=0",
        f"--prefill={num_prefill}",
        f"--decode={num_decode}",
        *up_flags,
    ]
    if not (ready_lines is not None if gateway is None else gateway):
        argv.append("--no-gateway")
    return running(
        [*argv, "--", *worker_flags], ready_lines=ready_lines, processes=processes, env=env
    )


SERVED_MAX_INFLIGHT = 12
"""``up --max-inflight`` of the shared ``served`` cluster: more concurrent requests get 429."""
SERVED_STALL_TIMEOUT_S = 2.0
"""The shared cluster's coordinator cuts a stream whose client read nothing for this long."""
SERVED_WORKER_FLAGS = ("--num-blocks=512", "--threads=1", "--max-model-len=8192")
"""bf16 (the default dtype), 8,192 tokens of KV: one 4,000-token stream fits beside others."""


@dataclass(frozen=True)
class Served:
    """A running ``served_cluster``: what its processes announced."""

    coordinator: str
    """The coordinator's public gRPC address."""
    url: str
    """The gateway's base URL (``http://host:port``)."""
    metrics_urls: dict[str, str]
    """Role ("coordinator", "prefill", "decode") -> its /metrics URL."""


@contextlib.contextmanager
def served_cluster() -> Iterator[Served]:
    """The cluster most outside-in tests share (``tests/shared.py``): ``splitserve up`` with a
    coordinator, 1 prefill + 1 decode worker (``SERVED_WORKER_FLAGS``) and the gateway, at
    most ``SERVED_MAX_INFLIGHT`` requests in flight, streams cut after
    ``SERVED_STALL_TIMEOUT_S`` of a client reading nothing."""
    lines: dict[str, str] = {}
    up_flags = (f"--max-inflight={SERVED_MAX_INFLIGHT}",)
    env = {
        "SPLITSERVE_CLIENT_STALL_TIMEOUT": str(SERVED_STALL_TIMEOUT_S),
        # every generated row through the row kernel, whatever the step's size: the tests here
        # compare requests across batchings (n > 1 against single requests of the same seeds),
        # which holds bit for bit only so. Under the default "auto", a CPU where the probe finds
        # the kernel slower past a few rows (the AMX Xeon 6/207: past 2) sends larger steps'
        # rows through oneDNN, an ulp apart, and a seeded sample can differ
        # (engine/linear.py's module docstring).
        "SPLITSERVE_DECODE_GEMV": "1",
    }
    with cluster(
        1, 1, *SERVED_WORKER_FLAGS, ready_lines=lines, up_flags=up_flags, env=env
    ) as coordinator:
        metrics = {what.split()[0]: url for what, url in lines.items() if "metrics" in what}
        yield Served(coordinator, lines["splitserve gateway ready"], metrics)


@contextlib.contextmanager
def roles(
    workers: Sequence[tuple[str, str]],
    worker_flags: Sequence[str],
    processes: list[subprocess.Popen[str]],
) -> Iterator[str]:
    """A coordinator and each (role, worker id) of ``workers`` as processes of their own
    (not through ``up``, so a test can signal each), every worker routable; yields the
    coordinator's public address. ``processes`` receives the workers' processes in order."""
    coordinator_argv = ["splitserve.coordinator.main", "--port=0", "--internal-port=0"]
    coordinator_argv.append("--metrics-port=-1")
    with running(coordinator_argv, "splitserve coordinator ready at") as address:
        specs = [
            ProcessSpec(
                [f"splitserve.{role}.main", "--port=0", f"--worker-id={name}"]
                + [f"--coordinator={internal_address(address)}", *worker_flags],
                f"splitserve {role} ready at",
            )
            for role, name in workers
        ]
        with running_together(specs, processes):
            yield _routable(address, workers)


def _routable(address: str, workers: Sequence[tuple[str, str]]) -> str:
    """``address`` once its coordinator routes to every one of ``workers``."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not {name for _, name in workers} <= routable_members(address):
        assert time.monotonic() < deadline, "the coordinator does not route to every worker"
        time.sleep(0.2)
    return address


def child_pid(parent: int, *args: str) -> int:
    """The pid of the child of ``parent`` (``up``) whose command line holds every one of
    ``args`` (e.g. ``--worker-id=decode-1``), from /proc; ``LookupError`` when none does."""
    for pid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if all(arg.encode() in argv for arg in args):
            return int(pid)
    raise LookupError(f"no child of {parent} with {args}")


def remember_internal(coordinator_address: str, internal: str) -> None:
    """Record the internal address a coordinator announced next to its public one."""
    _internal_of[coordinator_address] = internal


def internal_address(coordinator_address: str) -> str:
    """The internal port of the coordinator (or ``up`` cluster) serving at this public one."""
    return _internal_of[coordinator_address]


def internal_channel(address: str, tls: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A blocking channel to an internal port (TLS with ``tls``, for a cluster that has it)."""
    return grpc.insecure_channel(address) if tls is None else grpc.secure_channel(address, tls)


def worker_loads(
    coordinator_address: str,
    only: set[str] | None = None,
    tls: grpc.ChannelCredentials | None = None,
) -> dict[str, worker_pb2.WorkerLoad]:
    """Each registered worker's load figures by worker id, as its last heartbeat brought them
    to the coordinator (``ListWorkers``); with ``only``, just those workers (e.g. to skip one
    that was killed); ``tls``: for a cluster serving TLS. Waits until each of them has
    heartbeated since the call began, so no figure predates the call; ``TimeoutError`` after
    ``FRESH_LOAD_TIMEOUT_S``."""
    asked = time.monotonic()
    with internal_channel(internal_address(coordinator_address), tls) as channel:
        stub = coordinator_pb2_grpc.MembershipStub(channel)
        while True:
            listing = stub.ListWorkers(
                coordinator_pb2.ListWorkersRequest(), timeout=10, metadata=CREDENTIAL.metadata
            )
            waited_ms = (time.monotonic() - asked) * 1000
            statuses = [s for s in listing.workers if only is None or s.worker.worker_id in only]
            stale = [s.worker.worker_id for s in statuses if s.ms_since_heartbeat > waited_ms]
            if not stale:
                return {s.worker.worker_id: s.load for s in statuses}
            if waited_ms > FRESH_LOAD_TIMEOUT_S * 1000:
                raise TimeoutError(f"no heartbeat from {stale} in {FRESH_LOAD_TIMEOUT_S}s")
            time.sleep(0.05)


def served_adapters(coordinator_address: str) -> dict[str, set[str]]:
    """The names of the LoRA adapters each registered worker serves as the coordinator knows
    them now (``ListWorkers``: what it routes by), by worker id."""
    with internal_channel(internal_address(coordinator_address), None) as channel:
        listing = coordinator_pb2_grpc.MembershipStub(channel).ListWorkers(
            coordinator_pb2.ListWorkersRequest(), timeout=10, metadata=CREDENTIAL.metadata
        )
    return {
        status.worker.worker_id: {adapter.name for adapter in status.worker.adapters}
        for status in listing.workers
    }


def routable_members(
    coordinator_address: str, tls: grpc.ChannelCredentials | None = None
) -> set[str]:
    """The ids of the workers the coordinator routes requests to now (``ListWorkers``'
    ``routable``: registered, dialled back, healthy, circuit closed)."""
    with internal_channel(internal_address(coordinator_address), tls) as channel:
        listing = coordinator_pb2_grpc.MembershipStub(channel).ListWorkers(
            coordinator_pb2.ListWorkersRequest(), timeout=10, metadata=CREDENTIAL.metadata
        )
    return {status.worker.worker_id for status in listing.workers if status.routable}


def wait_until_idle(
    coordinator_address: str,
    expected_workers: int,
    only: set[str] | None = None,
    timeout_s: float = 30.0,
    tls: grpc.ChannelCredentials | None = None,
) -> dict[str, worker_pb2.WorkerLoad]:
    """Worker loads (``worker_loads``) once every worker is idle, or the last ones seen after
    ``timeout_s`` (requests end asynchronously on the workers); check with ``assert_all_free``."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = worker_loads(coordinator_address, only, tls)
        idle = all(
            load.num_used_blocks == 0
            and load.num_running_requests == 0
            and load.num_waiting_requests == 0
            and load.num_reserved_requests == 0
            for load in loads.values()
        )
        if (idle and len(loads) == expected_workers) or time.monotonic() > deadline:
            return loads
        time.sleep(0.2)


def assert_all_free(loads: dict[str, worker_pb2.WorkerLoad], expected_workers: int) -> None:
    """Every worker reports all its blocks free and no request running, waiting or reserved."""
    assert len(loads) == expected_workers, sorted(loads)
    for worker_id, load in loads.items():
        assert load.num_total_blocks > 0, worker_id
        assert load.num_used_blocks == 0, (worker_id, load)
        assert load.num_reserved_requests == 0, (worker_id, load)
        assert load.num_running_requests == load.num_waiting_requests == 0, (worker_id, load)


@dataclass(frozen=True)
class TransferFigures:
    """The decode worker's receive-side transfer metrics at one moment."""

    completed: float
    landed_bytes: float
    failures: float
    reused_blocks: float = 0.0
    """Blocks of pushed prompts a decode worker already held (not sent)."""
    pulled_blocks: float = 0.0
    """Blocks a prefill worker received from a decode worker's cache (not computed)."""


def metric_total(metrics_url: str, name: str) -> float:
    """The sum of every sample named ``name`` (all label sets) on the /metrics page at
    ``metrics_url``."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def transfer_figures(metrics_url: str, direction: str = "receive") -> TransferFigures:
    """A worker's KV transfer figures from its /metrics: a decode worker's receives, or with
    ``direction="send"`` a prefill worker's sends (``landed_bytes``: the bytes sent)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    figures = dict.fromkeys(
        ("completed", "landed_bytes", "failures", "reused_blocks", "pulled_blocks"), 0.0
    )
    names = {
        "splitserve_kv_transfer_seconds_count": "completed",
        "splitserve_kv_transfer_bytes_total": "landed_bytes",
        "splitserve_kv_transfer_failures_total": "failures",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and sample.labels.get("direction") == direction:
                figures[names[sample.name]] += sample.value
            elif sample.name == "splitserve_kv_reused_blocks_total":
                figures["reused_blocks"] += sample.value
            elif sample.name == "splitserve_kv_pulled_blocks_total":
                figures["pulled_blocks"] += sample.value
    return TransferFigures(**figures)


async def gateway_completions(url: str, prompts: Sequence[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy completion text from the gateway at ``url``, all sent at once
    (non-streamed ``/v1/completions``, the first served model); raises on any non-200."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt: str) -> str:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))
