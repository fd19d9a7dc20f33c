"""No request is lost when a worker dies: real processes, one of them SIGKILLed mid-stream.

The shared ``ha_cluster`` (``tests/fault_cluster.py``: etcd, 2 coordinators, 2 prefill + 2
decode workers, float32: greedy output is exact and independent of the batch around it).
Reference outputs come from the healthy cluster; then a decode worker is killed while every
request is streaming (its requests resume on the other decode worker from prompt + streamed
tokens), and then every prefill worker is killed (prompts are prefilled on the decode worker
instead). Every request must finish with exactly the reference tokens, and the survivor must
hold no blocks. What died is started again afterwards (``FaultCluster.heal``).
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from splitserve.client import AsyncClient, Sampling
from tests.cluster import assert_all_free, wait_until_idle, worker_loads
from tests.fault_cluster import FaultCluster, RoleProcess
from tests.streaming import ConcurrentStreams

# slow: a decode worker killed mid-stream is test_coordinator_failover's seeded test (after a
# coordinator), prompts prefilled on the decode workers once every prefill worker is gone is
# test_etcd_membership's (drained) and the fault matrix's kill -9 of a prefill worker (slow)
pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the Roman Empire begins with",
    "A recipe for bread: first, take",
    "def quicksort(items):",
    "The three laws of motion are",
]
SAMPLING = Sampling(max_tokens=96, temperature=0.0, ignore_eos=True)
"""Long enough that no stream can finish before the last one has started, even on slow CI."""


async def _reference(address: str) -> list[tuple[int, ...]]:
    async with AsyncClient(address) as client:  # float32 output is batch invariant
        results = await asyncio.gather(*(client.generate(p, sampling=SAMPLING) for p in PROMPTS))
    return [r.token_ids for r in results]


async def _stream_and_kill(
    address: str, decode_workers: dict[str, RoleProcess]
) -> tuple[list[tuple[int, ...]], str]:
    """Stream every prompt; once each stream has a few tokens, SIGKILL the decode worker that
    runs the most of them. Returns the streams' tokens and the killed worker's id."""
    async with AsyncClient(address) as client:
        streams = ConcurrentStreams(client, PROMPTS, lambda _: SAMPLING)
        await streams.each_has(4)
        assert max(len(t) for t in streams.tokens) < SAMPLING.max_tokens  # killed mid-stream
        loads = worker_loads(address, set(decode_workers))
        victim = max(loads, key=lambda name: loads[name].num_running_requests)
        assert loads[victim].num_running_requests > 0  # it really holds some of the streams
        decode_workers[victim].send(signal.SIGKILL)
        results = await streams.results()
    assert [finish for _, finish in results] == ["length"] * len(PROMPTS)
    return [tokens for tokens, _ in results], victim


def test_requests_survive_a_dead_decode_worker_and_a_dead_prefill_worker(
    ha_cluster: FaultCluster,
) -> None:
    address = ha_cluster.coordinator_addresses[0]
    decode_workers = {w.name: w for w in ha_cluster.workers if w.name.startswith("decode")}
    prefill_workers = [w for w in ha_cluster.workers if w.name.startswith("prefill")]

    expected = asyncio.run(_reference(address))
    streamed, killed = asyncio.run(_stream_and_kill(address, decode_workers))
    assert streamed == expected
    (survivor_id,) = set(decode_workers) - {killed}
    assert decode_workers[killed].wait_exit(60) == -signal.SIGKILL

    prefill_ids = {w.name for w in prefill_workers}
    served = sum(load.num_finished_requests for load in worker_loads(address, prefill_ids).values())
    assert served > 0  # the prefill workers really prefilled the streams
    for prefill in prefill_workers:
        prefill.send(signal.SIGKILL)
        assert prefill.wait_exit(60) == -signal.SIGKILL
    assert asyncio.run(_reference(address)) == expected

    assert_all_free(wait_until_idle(address, 1, only={survivor_id}), 1)
