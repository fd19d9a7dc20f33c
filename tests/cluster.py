"""Real serving processes for integration tests: ``splitserve up`` and single roles.

``running(argv, ready_marker)`` starts ``python -m <argv>``, drains its output on a thread
(kept for failure messages), waits for the line containing ``ready_marker`` and yields the
address printed after "ready at"; on exit it sends SIGTERM and fails the test unless the
process stops cleanly (status 0) within 30 s (``up`` reports children it had to kill).
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc

from splitserve.proto.splitserve.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

START_TIMEOUT_S = 240.0
_ANNOUNCEMENT = re.compile(r"(?:\] )?(?P<what>[\w -]+ (?:ready|metrics)) at (?P<where>\S+)$")


class _Output:
    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._process = process
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self.lines.append(line.rstrip())

    def tail(self, count: int = 40) -> str:
        return "\n".join(line for line in self.lines[-count:] if "UCX  WARN" not in line)


@contextlib.contextmanager
def running(
    argv: list[str],
    ready_marker: str = "splitserve ready at",
    ready_lines: dict[str, str] | None = None,
    processes: list[subprocess.Popen[str]] | None = None,
) -> Iterator[str]:
    """See the module docstring; ``ready_lines``, when given, receives every "<what> ready at
    <address>" and "<what> metrics at <url>" line printed before readiness, as {what: address}
    (e.g. "splitserve gateway ready", "decode metrics"). ``processes``, when given, receives
    the process; a test that kills it on purpose is not failed for its exit status."""
    process = subprocess.Popen(
        [sys.executable, "-m", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = _Output(process)
    if processes is not None:
        processes.append(process)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        address = None
        while address is None:
            for line in list(output.lines):
                if ready_marker in line:
                    address = line.rsplit(" ready at ", 1)[1].strip()
                announced = _ANNOUNCEMENT.search(line)
                if ready_lines is not None and announced:
                    ready_lines[announced["what"]] = announced["where"]
            if process.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited early:\n{output.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{argv[0]} not ready:\n{output.tail()}")
            time.sleep(0.1)
        yield address
    finally:
        killed_on_purpose = process.poll() == -signal.SIGKILL
        if not killed_on_purpose:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise AssertionError(
                    f"{argv[0]} did not stop on SIGTERM:\n{output.tail()}"
                ) from None
    if process.returncode != 0 and not killed_on_purpose:
        status = process.returncode
        raise AssertionError(f"{argv[0]} stopped with status {status}:\n{output.tail()}")


def cluster(
    num_prefill: int,
    num_decode: int,
    *worker_flags: str,
    ready_lines: dict[str, str] | None = None,
    up_flags: tuple[str, ...] = (),
) -> contextlib.AbstractContextManager[str]:
    """``splitserve up`` on free ports; yields the coordinator address. The gateway starts
    only when ``ready_lines`` is given (its URL is then ``ready_lines["splitserve gateway"]``;
    metrics URLs are printed as "<role> metrics at <url>")."""
    argv = [
        "splitserve.coordinator.local_cluster",
        "--port=0",
        "--http-port=0",
        "--metrics-port-base=0",
        f"--prefill={num_prefill}",
        f"--decode={num_decode}",
        *up_flags,
    ]
    if ready_lines is None:
        argv.append("--no-gateway")
    return running([*argv, "--", *worker_flags], ready_lines=ready_lines)


def worker_loads(
    coordinator_address: str, only: set[str] | None = None
) -> dict[str, worker_pb2.WorkerLoad]:
    """Each registered worker's own load figures (GetLoad on the worker), by worker id; with
    ``only``, just those workers (e.g. to skip one that was killed)."""
    with grpc.insecure_channel(coordinator_address) as channel:
        listing = coordinator_pb2_grpc.CoordinatorStub(channel).ListWorkers(
            coordinator_pb2.ListWorkersRequest(), timeout=10
        )
    loads = {}
    for status in listing.workers:
        if only is not None and status.worker.worker_id not in only:
            continue
        with grpc.insecure_channel(status.worker.address) as channel:
            if status.worker.role == worker_pb2.WORKER_ROLE_DECODE:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            else:
                stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            loads[status.worker.worker_id] = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
    return loads


def wait_until_idle(
    coordinator_address: str,
    expected_workers: int,
    only: set[str] | None = None,
    timeout_s: float = 30.0,
) -> dict[str, worker_pb2.WorkerLoad]:
    """Worker loads (``worker_loads``) once every worker is idle, or the last ones seen after
    ``timeout_s`` (requests end asynchronously on the workers); check with ``assert_all_free``."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = worker_loads(coordinator_address, only)
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
