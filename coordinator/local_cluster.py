"""``splitserve up``: coordinator + prefill + decode workers on localhost, as child processes.

Starts the coordinator, then the workers (registered with it), waits until each printed its
ready line and the coordinator's health is SERVING, starts the OpenAI-compatible gateway
(``--http-port``, default 8000; ``--no-gateway`` leaves it out), prints
``splitserve ready at <host:port>``, forwards every child's output with a role prefix, and
stops all children on Ctrl-C / SIGTERM (SIGTERM, then SIGKILL after a grace period). If any
child exits on its own, the others are stopped and ``up`` exits with status 1; so it does
when a child had to be killed because it ignored SIGTERM.

Cores are split evenly among the workers (``--cpu-affinity`` of each) when the machine has at
least one core per worker, so co-located workers do not fight over cores; ``--no-pin`` turns
that off. Flags after ``--`` go to every worker (e.g. ``-- --dtype float32``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.proto.server import wait_for_health

GRACE_S = 10.0
READY_TIMEOUT_S = 300.0


@dataclass
class _Child:
    name: str
    process: asyncio.subprocess.Process
    ready: asyncio.Event
    address: str = ""
    """host:port from the child's ready line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve up", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=50051, help="coordinator gRPC port (0: any free port)"
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--no-pin", action="store_true", help="do not pin workers to cores")
    parser.add_argument(
        "--local-prefill-max-tokens", type=int, default=None, help="passed to the coordinator"
    )
    parser.add_argument("--max-inflight", type=int, default=None, help="passed to the coordinator")
    parser.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI-compatible gateway port (0: any free)"
    )
    parser.add_argument("--no-gateway", action="store_true", help="do not start the gateway")
    parser.add_argument(
        "--served-model-name", default=None, help="model names the gateway answers to (comma-sep.)"
    )
    parser.add_argument(
        "--metrics-port-base",
        type=int,
        default=9400,
        help="Prometheus /metrics ports: coordinator at the base, worker i at base + 1 + i "
        "(0: any free port each, printed at start)",
    )
    return parser


def _metrics_port(base: int, index: int) -> int:
    return 0 if base == 0 else base + index


def worker_core_sets(num_workers: int, cpus: Sequence[int]) -> list[str | None]:
    """Disjoint core lists, one per worker, or None each when cores are too few."""
    if num_workers == 0 or len(cpus) < num_workers:
        return [None] * num_workers
    share = len(cpus) // num_workers
    return [",".join(str(c) for c in cpus[i * share : (i + 1) * share]) for i in range(num_workers)]


async def _spawn(name: str, argv: list[str]) -> _Child:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
    )
    child = _Child(name, process, asyncio.Event())
    asyncio.create_task(_forward(child))
    return child


async def _forward(child: _Child) -> None:
    assert child.process.stdout is not None
    async for raw in child.process.stdout:
        line = raw.decode(errors="replace").rstrip()
        if " ready at " in line and not child.ready.is_set():
            child.address = line.rsplit(" ready at ", 1)[1].strip()
            child.ready.set()
        print(f"[{child.name}] {line}", flush=True)


async def _stop_all(children: list[_Child]) -> bool:
    """SIGTERM every child, SIGKILL those still running after the grace period; False when
    some child had to be killed."""
    for child in reversed(children):
        if child.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
    clean = True
    for child in reversed(children):
        try:
            await asyncio.wait_for(child.process.wait(), GRACE_S)
        except TimeoutError:
            print(f"splitserve up: {child.name} ignored SIGTERM; killing it", flush=True)
            clean = False
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
            await child.process.wait()
    return clean


async def _run(args: argparse.Namespace, worker_args: list[str]) -> int:
    coordinator_argv = [
        "splitserve.coordinator.main",
        f"--host={args.host}",
        f"--port={args.port}",
        f"--model={args.model}",
    ]
    coordinator_argv.append(f"--metrics-port={_metrics_port(args.metrics_port_base, 0)}")
    if args.max_inflight is not None:
        coordinator_argv.append(f"--max-inflight={args.max_inflight}")
    if args.local_prefill_max_tokens is not None:
        coordinator_argv.append(f"--local-prefill-max-tokens={args.local_prefill_max_tokens}")
    children = [await _spawn("coordinator", coordinator_argv)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await _wait_ready(children[0], stop)
        address = children[0].address  # the real port when --port 0
        roles = ["prefill"] * args.prefill + ["decode"] * args.decode
        cpus = sorted(os.sched_getaffinity(0))
        cores = [None] * len(roles) if args.no_pin else worker_core_sets(len(roles), cpus)
        for index, (role, core_list) in enumerate(zip(roles, cores, strict=True)):
            argv = [f"splitserve.{role}.main", f"--coordinator={address}", f"--model={args.model}"]
            argv += [f"--host={args.host}", f"--worker-id={role}-{index}"]
            argv.append(f"--metrics-port={_metrics_port(args.metrics_port_base, 1 + index)}")
            if core_list is not None:
                argv.append(f"--cpu-affinity={core_list}")
            children.append(await _spawn(f"{role}-{index}", argv + worker_args))
        for child in children[1:]:
            await _wait_ready(child, stop)
        await wait_for_health(address, READY_TIMEOUT_S)
        if not args.no_gateway:
            gateway_argv = [
                "splitserve.gateway.main",
                f"--coordinator={address}",
                f"--host={args.host}",
                f"--port={args.http_port}",
            ]
            if args.served_model_name:
                gateway_argv.append(f"--served-model-name={args.served_model_name}")
            children.append(await _spawn("gateway", gateway_argv))
            await _wait_ready(children[-1], stop)
        print(f"splitserve ready at {address}", flush=True)
        exited = [asyncio.create_task(c.process.wait()) for c in children]
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([stopped, *exited], return_when=asyncio.FIRST_COMPLETED)
        status = 0 if stop.is_set() else 1
    except _Stopped:
        status = 0
    except (TimeoutError, _ChildDied) as error:
        print(f"splitserve up: {error}", file=sys.stderr, flush=True)
        status = 1
    if not await _stop_all(children):
        status = status or 1
    return status


class _Stopped(Exception):
    pass


class _ChildDied(Exception):
    pass


async def _wait_ready(child: _Child, stop: asyncio.Event) -> None:
    ready = asyncio.create_task(child.ready.wait())
    died = asyncio.create_task(child.process.wait())
    stopped = asyncio.create_task(stop.wait())
    done, pending = await asyncio.wait(
        [ready, died, stopped], timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
    )
    for task in pending:
        task.cancel()
    if stopped in done:
        raise _Stopped()
    if ready in done:
        return
    if died in done:
        raise _ChildDied(f"{child.name} exited with status {child.process.returncode}")
    raise TimeoutError(f"{child.name} was not ready within {READY_TIMEOUT_S:.0f}s")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    worker_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, worker_args = argv[:split], argv[split + 1 :]
    args = build_parser().parse_args(argv)
    return asyncio.run(_run(args, worker_args))


if __name__ == "__main__":
    sys.exit(main())
