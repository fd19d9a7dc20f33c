"""Outside-in: a worker drains on SIGTERM. Real processes (coordinator, 1 prefill and 2 decode
workers, float32, KV over UCX); a decode worker holding streams gets SIGTERM mid-stream.

- It leaves membership at once (the coordinator stops listing it while it still runs, so
  nothing new is routed there), finishes its running streams itself when
  ``--drain-timeout`` allows, and exits 0.
- With a drain timeout too short for them, it hands them over: they resume on the other
  decode worker. It still exits 0.

Either way no request fails and every stream equals its uninterrupted reference.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess

import pytest

from splitserve.client import AsyncClient, Sampling
from tests.cluster import roles, worker_loads
from tests.streaming import ConcurrentStreams

pytestmark = pytest.mark.timeout(600)

WORKER_FLAGS = ("--dtype=float32", "--num-blocks=300", "--threads=1", "--metrics-port=-1")
PROMPTS = [f"Tell me a long story about a lighthouse keeper named {n}:" for n in range(6)]
SAMPLING = Sampling(max_tokens=64, temperature=0.0, ignore_eos=True)  # none ends in the drain


async def _reference(address: str) -> list[tuple[int, ...]]:
    async with AsyncClient(address) as client:
        results = await asyncio.gather(*(client.generate(p, sampling=SAMPLING) for p in PROMPTS))
    return [r.token_ids for r in results]


def _listed(address: str) -> set[str]:
    return set(worker_loads(address))


async def _stream_and_terminate(
    address: str, decode: dict[str, subprocess.Popen[str]]
) -> tuple[list[tuple[int, ...]], str, int, bool]:
    """Stream every prompt; once each has a few tokens, SIGTERM the decode worker running the
    most. Returns the streams' tokens, the victim, how many streams it ran, and whether the
    coordinator stopped listing it while its process still ran."""
    async with AsyncClient(address) as client:
        streams = ConcurrentStreams(client, PROMPTS, lambda _: SAMPLING)
        await streams.each_has(3)
        loads = worker_loads(address, set(decode))
        victim = max(loads, key=lambda name: loads[name].num_running_requests)
        held = loads[victim].num_running_requests
        decode[victim].send_signal(signal.SIGTERM)
        left_while_running = False
        while decode[victim].poll() is None and not left_while_running:
            left_while_running = victim not in await asyncio.to_thread(_listed, address)
            await asyncio.sleep(0.05)
        results = await streams.results()
    assert [finish for _, finish in results] == ["length"] * len(PROMPTS)
    return [tokens for tokens, _ in results], victim, held, left_while_running


@pytest.mark.parametrize(
    ("drain_timeout", "hands_over"),
    [
        # slow: the same walk as the hand-over case up to the timeout; the fault matrix's
        # SIGTERM of a decode worker (slow too) drains within the default timeout as well
        pytest.param(120.0, False, marks=pytest.mark.slow),
        # slow too (31 s, to keep the default suite within 10 minutes): the default suite
        # drains a frontend under load (tests/test_frontend.py); the fault matrix's SIGTERMs
        # of a coordinator and a prefill worker (slow) drain with streams in flight
        pytest.param(0.05, True, marks=pytest.mark.slow),  # within one stream's remaining tokens
    ],
)
def test_a_terminated_decode_worker_drains_and_exits_0(
    drain_timeout: float, hands_over: bool
) -> None:
    processes: list[subprocess.Popen[str]] = []
    workers = [("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")]
    flags = (*WORKER_FLAGS, f"--drain-timeout={drain_timeout}")
    with roles(workers, flags, processes) as address:
        decode = {"decode-0": processes[1], "decode-1": processes[2]}

        expected = asyncio.run(_reference(address))
        finished_before = {n: s.num_finished_requests for n, s in worker_loads(address).items()}
        streamed, victim, held, left_while_running = asyncio.run(
            _stream_and_terminate(address, decode)
        )
        assert streamed == expected
        assert held > 0 and left_while_running
        assert decode[victim].wait(timeout=60) == 0
        (survivor,) = set(decode) - {victim}
        finished = worker_loads(address, {survivor})[survivor].num_finished_requests
        on_survivor = finished - finished_before[survivor]
        # Each stream finished once on a decode worker: the survivor finished its own, plus
        # the victim's when they were handed over.
        own = len(PROMPTS) - held
        assert on_survivor == (len(PROMPTS) if hands_over else own)
