"""``splitserve up --autoscale`` as a user runs it (real coordinator, local autoscaler, real
child processes; simulated workers with a 2 s start-up): a burst of long prompts makes the
coordinator ask for a second prefill worker, ``up`` starts it, and once the burst has passed
drains it (SIGTERM, status 0); every request of the burst is served whole."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import time

import pytest

from splitserve.client import AsyncClient, Sampling
from splitserve.launch.child_process import children_by_role
from tests.cluster import cluster

pytestmark = pytest.mark.slow

SIM = ("--engine=sim", "--sim-startup-s=2", "--speculative-tokens=0", "--num-blocks=2048")
SCALING = (
    "--autoscale",
    "--max-workers=2",
    "--autoscale-interval-s=1",
    "--scale-down-window-s=4",
    "--scale-down-period-s=1",
)
BURST, PROMPT_WORDS, OUTPUT_TOKENS = 24, 1000, 32


def _workers(up_pid: int, role: str) -> int:
    """``up``'s live worker processes of ``role``."""
    return children_by_role(up_pid)[role]


async def _burst(address: str) -> list[int]:
    sampling = Sampling(max_tokens=OUTPUT_TOKENS, min_tokens=OUTPUT_TOKENS, ignore_eos=True)
    async with AsyncClient(address, timeout_s=300) as client:
        prompts = [" ".join(f"w{i}x{j}" for j in range(PROMPT_WORDS)) for i in range(BURST)]
        done = await asyncio.gather(*(client.generate(p, sampling=sampling) for p in prompts))
    return [len(g.token_ids) for g in done]


def _wait_for(up: subprocess.Popen[str], role: str, count: int, timeout_s: float) -> list[int]:
    """The role's worker counts seen every 0.5 s until it has ``count`` (or the timeout)."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen.append(_workers(up.pid, role))
        if seen[-1] == count:
            break
        time.sleep(0.5)
    return seen


def test_a_burst_adds_a_prefill_worker_that_is_drained_after_it() -> None:
    processes: list[subprocess.Popen[str]] = []
    with cluster(1, 1, *SIM, up_flags=SCALING, processes=processes) as address:
        up = processes[0]
        assert _workers(up.pid, "prefill") == 1
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            burst = pool.submit(asyncio.run, _burst(address))
            grown = []
            while not burst.done():
                grown.append(_workers(up.pid, "prefill"))
                time.sleep(0.5)
            lengths = burst.result()
        assert lengths == [OUTPUT_TOKENS] * BURST  # every stream whole
        grown += _wait_for(up, "prefill", 2, 10)
        assert 2 in grown, f"no second prefill worker: {grown}"
        shrunk = _wait_for(up, "prefill", 1, 120)  # the burst's demand decays (30 s half-life)
        assert shrunk[-1] == 1, f"the added prefill worker was not drained: {shrunk}"
        assert _workers(up.pid, "decode") >= 1
