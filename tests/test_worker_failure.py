"""No request is lost when a worker dies: real processes, one of them SIGKILLed mid-stream.

Coordinator + 1 prefill + 2 decode workers (float32: greedy output is exact and independent
of the batch around it). Reference outputs come from the healthy cluster; then a decode worker
is killed while every request is streaming (its requests resume on the other decode worker
from prompt + streamed tokens), and then the prefill worker is killed (prompts are prefilled on
the decode worker instead). Every request must finish with exactly the reference tokens, and
the survivor must hold no blocks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

from splitserve.client import AsyncClient, Sampling
from tests.cluster import assert_all_free, roles, wait_until_idle, worker_loads
from tests.streaming import ConcurrentStreams

WORKER_FLAGS = ("--dtype=float32", "--num-blocks=400", "--threads=1", "--metrics-port=-1")
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
    address: str, decode_workers: dict[str, subprocess.Popen[str]]
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
        os.kill(decode_workers[victim].pid, signal.SIGKILL)
        results = await streams.results()
    assert [finish for _, finish in results] == ["length"] * len(PROMPTS)
    return [tokens for tokens, _ in results], victim


def test_requests_survive_a_dead_decode_worker_and_a_dead_prefill_worker() -> None:
    processes: list[subprocess.Popen[str]] = []
    workers = [("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")]
    with roles(workers, WORKER_FLAGS, processes) as address:
        prefill, decode_0, decode_1 = processes

        expected = asyncio.run(_reference(address))
        decode_workers = {"decode-0": decode_0, "decode-1": decode_1}
        streamed, killed = asyncio.run(_stream_and_kill(address, decode_workers))
        assert streamed == expected
        (survivor_id,) = set(decode_workers) - {killed}

        served = worker_loads(address, {"prefill-0"})["prefill-0"].num_finished_requests
        assert served > 0  # the prefill worker really prefilled the streams
        prefill.send_signal(signal.SIGKILL)
        prefill.wait()
        assert asyncio.run(_reference(address)) == expected

        assert_all_free(wait_until_idle(address, 1, only={survivor_id}), 1)
