"""Outside-in: ``splitserve up --prefill 1 --decode 2`` keeps serving when a worker dies.

Under load (12 concurrent float32 greedy streams), a decode worker is SIGKILLed mid-stream:
no request fails and every stream equals its uninterrupted reference (the dead worker's
requests resume on the other decode worker), ``up`` restarts the worker, which registers
again within 30 s of the kill, and the cluster serves on it. Then the same for a prefill
worker. Nothing is left running after ``up`` stops (``tests/cluster.py`` checks its status).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest

from splitserve.client import AsyncClient, Sampling
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.cluster import (
    CREDENTIAL,
    assert_all_free,
    child_pid,
    cluster,
    internal_address,
    internal_channel,
    wait_until_idle,
)
from tests.streaming import ConcurrentStreams

pytestmark = pytest.mark.timeout(600)

WORKER_FLAGS = ("--dtype=float32", "--num-blocks=300", "--threads=1", "--metrics-port=-1")
PROMPTS = [f"Write a short story about the number {n}, starting with" for n in range(12)]
SAMPLING = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)
BACK_WITHIN_S = 30.0


async def _streams(address: str, kill: int | None) -> list[tuple[int, ...]]:
    """Every prompt streamed at once; with ``kill``, that pid is SIGKILLed once every stream
    has a few tokens. Every stream must finish by length."""
    async with AsyncClient(address) as client:
        streams = ConcurrentStreams(client, PROMPTS, lambda _: SAMPLING)
        if kill is not None:
            await streams.each_has(2)
            assert max(len(t) for t in streams.tokens) < SAMPLING.max_tokens  # mid-stream
            os.kill(kill, signal.SIGKILL)
        results = await streams.results()
    assert [finish for _, finish in results] == ["length"] * len(PROMPTS)
    return [tokens for tokens, _ in results]


@pytest.mark.slow  # 23 s a victim; the default suite's kill -9 is the fault matrix's coordinator
@pytest.mark.parametrize("victim", ["decode-2", "prefill-0"])
def test_a_killed_worker_loses_no_request_and_comes_back(victim: str) -> None:
    processes: list[subprocess.Popen[str]] = []
    with cluster(1, 2, *WORKER_FLAGS, processes=processes) as address:
        (up,) = processes
        expected = asyncio.run(_streams(address, None))
        pid = child_pid(up.pid, f"--worker-id={victim}")
        old_address = _address_of(address, victim)
        assert old_address is not None
        killed_at = time.monotonic()
        assert asyncio.run(_streams(address, pid)) == expected
        new_pid = _wait_for_new_pid(up.pid, victim, pid, killed_at)
        assert new_pid != pid
        back_s = _registered_seconds(address, victim, old_address, killed_at)
        print(f"{victim}: killed, restarted as pid {new_pid}, registered after {back_s:.1f} s")
        assert back_s <= BACK_WITHIN_S
        assert asyncio.run(_streams(address, None)) == expected  # served with it back
        assert_all_free(wait_until_idle(address, 3), 3)


def _wait_for_new_pid(parent: int, worker_id: str, old_pid: int, since: float) -> int:
    while time.monotonic() - since < 120:
        try:
            pid = child_pid(parent, f"--worker-id={worker_id}")
        except LookupError:
            pid = old_pid
        if pid != old_pid:
            return pid
        time.sleep(0.1)
    raise AssertionError(f"{worker_id} was not restarted")


def _address_of(address: str, worker_id: str) -> str | None:
    """The address the coordinator has for ``worker_id`` (None when it lists none)."""
    with internal_channel(internal_address(address)) as channel:
        listing = coordinator_pb2_grpc.MembershipStub(channel).ListWorkers(
            coordinator_pb2.ListWorkersRequest(), timeout=10, metadata=CREDENTIAL.metadata
        )
    by_id = {status.worker.worker_id: status.worker.address for status in listing.workers}
    return by_id.get(worker_id)


def _registered_seconds(address: str, worker_id: str, old_address: str, since: float) -> float:
    """Seconds from ``since`` until the coordinator lists ``worker_id`` at a new address (its
    restarted process registered)."""
    while time.monotonic() - since < 120:
        listed = _address_of(address, worker_id)
        if listed is not None and listed != old_address:
            return time.monotonic() - since
        time.sleep(0.1)
    raise AssertionError(f"{worker_id} did not register again")


@pytest.mark.slow  # the default suite's kills of single processes are the fault matrix's
@pytest.mark.parametrize(
    ("up_flags", "roles"),
    [((), 2), (("--apart",), 3)],
    ids=["frontend", "apart"],
)
def test_children_stop_when_up_itself_is_killed(up_flags: tuple[str, ...], roles: int) -> None:
    """``up`` SIGKILLed (it cannot stop anyone): each child notices it was orphaned and
    drains itself (``common/orphan.py``); no process is left. With the gateway, every kind of
    child: the merged frontend and a decode worker, or apart a coordinator, a decode worker
    and a gateway."""
    processes: list[subprocess.Popen[str]] = []
    lines: dict[str, str] = {}
    with cluster(0, 1, *WORKER_FLAGS, ready_lines=lines, processes=processes, up_flags=up_flags):
        up = processes[0]
        children = [int(pid) for pid in _children_of(up.pid)]
        assert len(children) == roles
        up.send_signal(signal.SIGKILL)
        up.wait(timeout=10)
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in children):
            assert time.monotonic() < deadline, [p for p in children if _alive(p)]
            time.sleep(0.2)


def _children_of(pid: int) -> list[str]:
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        return listing.read().split()


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie no longer counts: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
