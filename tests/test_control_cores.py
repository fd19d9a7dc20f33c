"""Where ``up`` runs the coordinators and the gateway (``--control-cores``): on the prefill
workers' cores when asked and every worker is pinned, else unpinned; and the two launch
scripts pinning themselves for real (``--cpu-affinity``), or refusing cores they lack with a
usage error before anything starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from splitserve.common.cpu_affinity import parse_cpu_list
from splitserve.launch import up
from splitserve.launch.up import build_parser, coordinator_argv, gateway_argv, worker_argvs


def _argvs(
    monkeypatch: pytest.MonkeyPatch, cpus: int, *flags: str
) -> tuple[list[str], list[str], list[list[str]], str]:
    """Coordinator, gateway and worker command lines, and the startup line, on ``cpus``."""
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: set(range(cpus)))
    args = build_parser().parse_args(list(flags))
    workers = [argv for _, argv in worker_argvs(args, "127.0.0.1:50052", [])]
    return (
        coordinator_argv(args),
        gateway_argv(args, "127.0.0.1:50051"),
        workers,
        up.layout_summary(args),
    )


def _affinity(argv: list[str]) -> str | None:
    values = [flag.split("=", 1)[1] for flag in argv if flag.startswith("--cpu-affinity=")]
    assert len(values) <= 1, argv
    return values[0] if values else None


def test_with_control_cores_prefill_the_control_plane_shares_the_prefill_workers_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    coordinator, gateway, workers, summary = _argvs(
        monkeypatch, 4, "--prefill=2", "--decode=2", "--control-cores=prefill"
    )
    assert [_affinity(argv) for argv in workers] == ["0", "1", "2", "3"]
    assert _affinity(coordinator) == _affinity(gateway) == "0,1"  # not the decode workers'
    assert "coordinator and gateway on the prefill workers' cores" in summary


@pytest.mark.parametrize(
    ("cpus", "flags"),
    [
        (4, ("--control-cores=any",)),
        (4, ("--control-cores=prefill", "--no-pin")),  # unpinned workers
        (1, ("--control-cores=prefill",)),  # fewer cores than workers: nobody pinned
        (4, ("--control-cores=prefill", "--prefill=0", "--decode=0", "--dual=2")),
        (4, ("--control-cores=prefill", "--prefill=0")),  # no prefill worker's cores to share
        (4, ("--control-cores=prefill", "--decode=0")),  # no decode worker to keep clear
    ],
    ids=["any", "no-pin", "too-few-cores", "dual-only", "no-prefill", "no-decode"],
)
def test_otherwise_the_control_plane_is_not_pinned(
    monkeypatch: pytest.MonkeyPatch, cpus: int, flags: tuple[str, ...]
) -> None:
    coordinator, gateway, _, summary = _argvs(monkeypatch, cpus, *flags)
    assert _affinity(coordinator) is None and _affinity(gateway) is None
    assert "coordinator and gateway" not in summary


def _allowed_cpus(pid: int) -> set[int]:
    with open(f"/proc/{pid}/status") as status:
        match = re.search(r"^Cpus_allowed_list:\s*(\S+)$", status.read(), re.MULTILINE)
    assert match, "no Cpus_allowed_list in /proc"
    return parse_cpu_list(match.group(1))


def test_the_gateway_pins_itself_and_every_thread_it_starts() -> None:
    core = min(os.sched_getaffinity(0))
    gateway = subprocess.Popen(
        [sys.executable, "-m", "splitserve.gateway.main", "--port=0", f"--cpu-affinity={core}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert gateway.stdout is not None
        line = gateway.stdout.readline()
        assert "splitserve gateway ready" in line, line
        threads = os.listdir(f"/proc/{gateway.pid}/task")
        assert threads and all(
            _allowed_cpus(int(thread)) == {core} for thread in threads if thread.isdigit()
        )
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)


@pytest.mark.parametrize("module", ["splitserve.coordinator.main", "splitserve.gateway.main"])
def test_a_core_the_process_lacks_is_a_usage_error(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--port=0", "--cpu-affinity=4096"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--cpu-affinity: cores 4096" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
