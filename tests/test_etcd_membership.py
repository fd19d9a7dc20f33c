"""Outside-in: membership on a real etcd, no single coordinator holding it. Real processes
through the role entry points: etcd, two coordinators (``--etcd-endpoints``), a prefill and a
decode worker that announce themselves in etcd (no ``--coordinator``: they know no
coordinator), float32, KV over UCX.

- Both coordinators learn both workers from etcd and serve, with outputs equal between them
  (greedy float32), load figures streaming from the workers (``WorkerMonitor.WatchLoad``).
- etcd stopped for 10 s: both coordinators keep the last membership and go on serving; etcd
  back: still serving, nobody lost.
- A worker drained with SIGTERM revokes its lease: both coordinators drop it at once, long
  before a lease would expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time

import pytest

from splitserve.client import AsyncClient, Sampling
from tests.cluster import running, worker_loads
from tests.etcd import EtcdServer

pytestmark = pytest.mark.timeout(600)

WORKER_FLAGS = ("--dtype=float32", "--num-blocks=300", "--threads=1", "--metrics-port=-1")
PROMPTS = ["The three primary colours are", "A haiku about autumn:", "def fibonacci(n):"]
SAMPLING = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)
OUTAGE_S = 10.0


async def _generate(address: str) -> list[tuple[int, ...]]:
    async with AsyncClient(address) as client:
        results = await asyncio.gather(*(client.generate(p, sampling=SAMPLING) for p in PROMPTS))
    return [r.token_ids for r in results]


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> float:  # noqa: ANN001
    """Seconds until ``predicate()`` holds; fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_membership_on_etcd_survives_an_outage_and_a_drain(etcd: EtcdServer) -> None:
    membership = (f"--etcd-endpoints={etcd.endpoint}", "--cluster-name=test-cluster")
    processes: list[subprocess.Popen[str]] = []
    coordinator_argv = ["splitserve.coordinator.main", "--port=0", "--internal-port=0"]
    coordinator_argv += ["--metrics-port=-1", *membership]
    with contextlib.ExitStack() as stack:
        coordinators = [
            stack.enter_context(running(coordinator_argv, "splitserve coordinator ready at"))
            for _ in range(2)
        ]
        for role, name in (("prefill", "prefill-0"), ("decode", "decode-0")):
            argv = [f"splitserve.{role}.main", "--port=0", f"--worker-id={name}"]
            argv += [*membership, *WORKER_FLAGS]
            stack.enter_context(running(argv, f"splitserve {role} ready at", None, processes))
        for address in coordinators:
            _wait_for(lambda a=address: len(worker_loads(a)) == 2, "both workers")

        expected = asyncio.run(_generate(coordinators[0]))
        assert asyncio.run(_generate(coordinators[1])) == expected
        assert worker_loads(coordinators[0])["prefill-0"].num_finished_requests > 0

        etcd.stop()
        outage_ends = time.monotonic() + OUTAGE_S
        while time.monotonic() < outage_ends:
            for address in coordinators:
                assert asyncio.run(_generate(address)) == expected
        etcd.start()
        for address in coordinators:
            assert asyncio.run(_generate(address)) == expected
            assert sorted(worker_loads(address)) == ["decode-0", "prefill-0"]

        prefill = processes[0]
        prefill.send_signal(signal.SIGTERM)
        dropped_s = max(
            _wait_for(lambda a=address: "prefill-0" not in worker_loads(a), "prefill-0 gone")
            for address in coordinators
        )
        assert prefill.wait(timeout=60) == 0
        assert dropped_s < 5.0  # the lease was revoked, not left to expire (10 s)
        for address in coordinators:  # prompts now prefilled on the decode worker
            assert asyncio.run(_generate(address)) == expected
