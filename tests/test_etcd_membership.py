"""Outside-in: membership on a real etcd, no single coordinator holding it. Real processes
through the role entry points (the shared ``ha_cluster`` of ``tests/fault_cluster.py``): etcd,
two coordinators (``--etcd-endpoints``), 2 prefill and 2 decode workers that announce
themselves in etcd (no ``--coordinator``: they know no coordinator), float32, KV over UCX.

- Both coordinators learn every worker from etcd and serve, with outputs equal between them
  (greedy float32), load figures streaming from the workers (``WorkerMonitor.WatchLoad``).
- etcd stopped for ``OUTAGE_S`` (6 s): both coordinators keep the last membership and go on
  serving; etcd back: still serving, nobody lost.
- Workers drained with SIGTERM revoke their leases: both coordinators drop them at once, long
  before a lease would expire. (``FaultCluster.heal`` starts them again afterwards.)
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from splitserve.client import AsyncClient, Sampling
from tests.cluster import worker_loads
from tests.fault_cluster import FaultCluster

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The three primary colours are", "A haiku about autumn:", "def fibonacci(n):"]
SAMPLING = Sampling(max_tokens=12, temperature=0.0, ignore_eos=True)
OUTAGE_S = 6.0


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


@pytest.mark.slow
def test_membership_on_etcd_survives_an_outage_and_a_drain(ha_cluster: FaultCluster) -> None:
    coordinators = ha_cluster.coordinator_addresses
    prefill_workers = [w for w in ha_cluster.workers if w.name.startswith("prefill")]
    every_worker = sorted(ha_cluster.worker_ids)
    for address in coordinators:
        assert sorted(worker_loads(address)) == every_worker  # learnt from etcd alone

    expected = asyncio.run(_generate(coordinators[0]))
    assert asyncio.run(_generate(coordinators[1])) == expected
    loads = worker_loads(coordinators[0])
    assert sum(loads[w.name].num_finished_requests for w in prefill_workers) > 0

    ha_cluster.etcd.stop()
    outage_ends = time.monotonic() + OUTAGE_S
    while time.monotonic() < outage_ends:
        for address in coordinators:
            assert asyncio.run(_generate(address)) == expected
    ha_cluster.etcd.start()
    for address in coordinators:
        assert asyncio.run(_generate(address)) == expected
        assert sorted(worker_loads(address)) == every_worker

    for prefill in prefill_workers:
        prefill.send(signal.SIGTERM)
    names = {w.name for w in prefill_workers}
    dropped_s = max(
        _wait_for(lambda a=address: not names & set(worker_loads(a)), "the prefill workers gone")
        for address in coordinators
    )
    assert [prefill.wait_exit(60) for prefill in prefill_workers] == [0] * len(prefill_workers)
    assert dropped_s < 5.0  # the leases were revoked, not left to expire (10 s)
    for address in coordinators:  # prompts now prefilled on the decode workers
        assert asyncio.run(_generate(address)) == expected
