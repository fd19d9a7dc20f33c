"""Outside-in: streams survive the death of their coordinator.

The shared ``ha_cluster`` (``tests/fault_cluster.py``: etcd, two coordinators that both learn
every worker from it, 2 prefill + 2 decode workers, float32, KV over UCX, the gateway
balancing over both coordinators). 12 greedy streams through the ``openai`` SDK; once every
stream has text, one coordinator is SIGKILLed. The streams it carried go on through the other
coordinator from the tokens already streamed (``continue_after``): every stream finishes with
exactly the text and token count of its uninterrupted reference, none fails. The same through
the Python client with both addresses. Seeded sampling (temperature 0.8) streams survive a
coordinator and then a decode worker dying, each equal to its uninterrupted run with the same
seed: the worker that takes a moved request goes on with its random stream and penalties
(``prior_output_token_ids``). What died is started again (``FaultCluster.heal``, as a
supervisor would), and no KV block is left held.
"""

from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest

from splitserve.client import AsyncClient, Sampling
from tests.cluster import assert_all_free, wait_until_idle
from tests.fault_cluster import FaultCluster, RoleProcess
from tests.streaming import ConcurrentStreams, Streamed

pytestmark = pytest.mark.timeout(600)

PROMPTS = [f"Write a long letter to a friend about the number {n}:" for n in range(12)]
MAX_TOKENS = 36
"""The seeded test kills after 4 and 20 tokens: both land mid-stream."""


@pytest.fixture(scope="module")
def served(ha_cluster: FaultCluster) -> FaultCluster:
    return ha_cluster


def _both(cluster: FaultCluster) -> str:
    """Both coordinators' public addresses, comma-separated (a client's target)."""
    return ",".join(cluster.coordinator_addresses)


def _restarted(cluster: FaultCluster, *victims: RoleProcess) -> None:
    """Each victim exited from SIGKILL; start everything again and wait until whole."""
    for victim in victims:
        assert victim.wait_exit(60) == -signal.SIGKILL, victim.tail()
    cluster.heal()


async def _sdk_streams(url: str, kill: RoleProcess | None) -> list[tuple[str, int]]:
    """(text, completion tokens) of every prompt streamed at once through the gateway; with
    ``kill``, that process is SIGKILLed once every stream has text."""
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    texts = [""] * len(PROMPTS)
    counts = [-1] * len(PROMPTS)

    async def one(index: int) -> None:
        stream = await sdk.completions.create(
            model=(await sdk.models.list()).data[0].id,
            prompt=PROMPTS[index],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices:
                texts[index] += chunk.choices[0].text
            if chunk.usage is not None:
                counts[index] = chunk.usage.completion_tokens

    tasks = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
    if kill is not None:
        deadline = time.monotonic() + 120
        while not all(texts):
            assert time.monotonic() < deadline, "streams did not start"
            assert not any(task.done() for task in tasks), "a stream ended early"
            await asyncio.sleep(0.02)
        kill.send(signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    await sdk.close()
    return list(zip(texts, counts, strict=True))


async def _client_streams(target: str, kill: RoleProcess | None) -> list[Streamed]:
    """(token ids, finish reason) of every prompt streamed at once by one ``AsyncClient``
    given both coordinators; ``kill`` as in ``_sdk_streams``."""
    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncClient(target) as client:
        streams = ConcurrentStreams(client, PROMPTS, lambda _: sampling)
        if kill is not None:
            await streams.each_has(1)
            kill.send(signal.SIGKILL)
        return await streams.results()


def _seeded(index: int) -> Sampling:
    return Sampling(
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        top_p=0.95,
        seed=1000 + index,
        frequency_penalty=0.5,
        ignore_eos=True,
    )


async def _seeded_streams(target: str, kills: list[tuple[RoleProcess, int]]) -> list[Streamed]:
    """(token ids, finish reason) of seeded sampled streams, one ``AsyncClient`` given both
    coordinators; ``kills``: (process, after how many tokens in every stream) SIGKILLed in
    turn."""
    async with AsyncClient(target) as client:
        streams = ConcurrentStreams(client, PROMPTS, _seeded)
        for process, after in kills:
            await streams.each_has(after)
            assert max(len(t) for t in streams.tokens) < MAX_TOKENS  # mid-stream
            process.send(signal.SIGKILL)
        return await streams.results()


@pytest.mark.slow  # tests/test_fault_matrix.py kills a coordinator under the gateway by default
def test_gateway_streams_continue_when_a_coordinator_dies(served: FaultCluster) -> None:
    expected = asyncio.run(_sdk_streams(served.gateway.address, None))
    assert all(count == MAX_TOKENS for _, count in expected)
    victim = served.named("coordinator-0")
    assert asyncio.run(_sdk_streams(served.gateway.address, victim)) == expected
    _restarted(served, victim)


@pytest.mark.slow  # the gateway's test and the seeded one cover the client's continuation
def test_client_streams_continue_when_a_coordinator_dies(served: FaultCluster) -> None:
    expected = asyncio.run(_client_streams(_both(served), None))
    assert all(len(t) == MAX_TOKENS and f == "length" for t, f in expected)
    victim = served.named("coordinator-1")
    assert asyncio.run(_client_streams(_both(served), victim)) == expected
    _restarted(served, victim)
    workers = len(served.workers)
    assert_all_free(wait_until_idle(served.coordinator_addresses[0], workers), workers)


# the fault matrix kills a coordinator under load by default; a seeded request resumed
# exactly is test_resume_exact's
@pytest.mark.slow
def test_seeded_streams_survive_their_coordinator_then_their_decode_worker(
    served: FaultCluster,
) -> None:
    expected = asyncio.run(_seeded_streams(_both(served), []))
    assert all(len(t) == MAX_TOKENS and f == "length" for t, f in expected)
    coordinator, decode = served.named("coordinator-0"), served.named("decode-1")
    kills = [(coordinator, 4), (decode, 20)]
    assert asyncio.run(_seeded_streams(_both(served), kills)) == expected
    _restarted(served, coordinator, decode)
    workers = len(served.workers)  # the restarted ones included
    for address in served.coordinator_addresses:
        assert_all_free(wait_until_idle(address, workers), workers)
