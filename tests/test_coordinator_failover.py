"""Outside-in: streams survive the death of their coordinator.

``splitserve up --coordinators 2`` (two coordinators, every worker registered with both; 1
prefill + 2 decode workers, float32, KV over UCX; the gateway balancing over both
coordinators). 12 greedy streams through the ``openai`` SDK; once every stream has text, one
coordinator is SIGKILLed. The streams it carried go on through the other coordinator from the
tokens already streamed (``continue_after``): every stream finishes with exactly the text and
token count of its uninterrupted reference, none fails. The same through the Python client
with both addresses. Seeded sampling (temperature 0.8) streams survive a coordinator and then
a decode worker dying, each equal to its uninterrupted run with the same seed: the worker that
takes a moved request goes on with its random stream and penalties (``prior_output_token_ids``).
``up`` restarts what died, and no KV block is left held.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest

from splitserve.client import AsyncClient, ClientError, Sampling, wire
from splitserve.proto.splitserve.v1 import coordinator_pb2_grpc
from tests.cluster import assert_all_free, child_pid, cluster, wait_until_idle
from tests.streaming import ConcurrentStreams, Streamed

pytestmark = pytest.mark.timeout(600)

WORKER_FLAGS = ("--dtype=float32", "--num-blocks=400", "--threads=1", "--metrics-port=-1")
PROMPTS = [f"Write a long letter to a friend about the number {n}:" for n in range(12)]
MAX_TOKENS = 64


@dataclass(frozen=True)
class Served:
    coordinators: str
    """Both public addresses, comma-separated."""
    gateway_url: str
    up: subprocess.Popen[str]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    lines: dict[str, str] = {}
    processes: list[subprocess.Popen[str]] = []
    base = _free_port_run(4)
    flags = ("--coordinators=2", f"--port={base}", f"--internal-port={base + 1}")
    with cluster(1, 2, *WORKER_FLAGS, ready_lines=lines, up_flags=flags, processes=processes) as (
        address
    ):
        yield Served(address, lines["splitserve gateway ready"], processes[0])


def _free_port_run(count: int) -> int:
    """A port p with p .. p + count - 1 all free now (the coordinators' ports are fixed so
    that each one's command line names its public port)."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no run of free ports")


def _coordinator_pid(up_pid: int, public_address: str) -> int:
    """The pid of ``up``'s coordinator serving ``public_address``."""
    port = public_address.rsplit(":", 1)[1]
    return child_pid(up_pid, "splitserve.coordinator.main", f"--port={port}")


async def _sdk_streams(url: str, kill: int | None) -> list[tuple[str, int]]:
    """(text, completion tokens) of every prompt streamed at once through the gateway; with
    ``kill``, that pid is SIGKILLed once every stream has text."""
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
        os.kill(kill, signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    await sdk.close()
    return list(zip(texts, counts, strict=True))


async def _client_streams(target: str, kill: int | None) -> list[Streamed]:
    """(token ids, finish reason) of every prompt streamed at once by one ``AsyncClient``
    given both coordinators; ``kill`` as in ``_sdk_streams``."""
    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncClient(target) as client:
        streams = ConcurrentStreams(client, PROMPTS, lambda _: sampling)
        if kill is not None:
            await streams.each_has(1)
            os.kill(kill, signal.SIGKILL)
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


async def _seeded_streams(target: str, kills: list[tuple[int, int]]) -> list[Streamed]:
    """(token ids, finish reason) of seeded sampled streams, one ``AsyncClient`` given both
    coordinators; ``kills``: (pid, after how many tokens in every stream) SIGKILLed in turn."""
    async with AsyncClient(target) as client:
        streams = ConcurrentStreams(client, PROMPTS, _seeded)
        for pid, after in kills:
            await streams.each_has(after)
            assert max(len(t) for t in streams.tokens) < MAX_TOKENS  # mid-stream
            os.kill(pid, signal.SIGKILL)
        return await streams.results()


def _wait_restarted(up_pid: int, public: str, old_pid: int) -> None:
    """Until ``up`` restarted the coordinator at ``public`` and it serves again (a decode
    worker registered with it)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(LookupError):
            if _coordinator_pid(up_pid, public) != old_pid:
                break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the coordinator at {public} was not restarted")
    asyncio.run(_wait_serving(public, deadline - time.monotonic()))


async def _wait_serving(address: str, timeout_s: float) -> None:
    async with AsyncClient(address) as client:
        await client.wait_ready(max(timeout_s, 1.0))


@pytest.mark.slow  # tests/test_fault_matrix.py kills a coordinator under the gateway by default
def test_gateway_streams_continue_when_a_coordinator_dies(served: Served) -> None:
    expected = asyncio.run(_sdk_streams(served.gateway_url, None))
    assert all(count == MAX_TOKENS for _, count in expected)
    first = served.coordinators.split(",")[0]
    victim = _coordinator_pid(served.up.pid, first)
    assert asyncio.run(_sdk_streams(served.gateway_url, victim)) == expected
    _wait_restarted(served.up.pid, first, victim)


@pytest.mark.slow  # the gateway's test and the seeded one cover the client's continuation
def test_client_streams_continue_when_a_coordinator_dies(served: Served) -> None:
    expected = asyncio.run(_client_streams(served.coordinators, None))
    assert all(len(t) == MAX_TOKENS and f == "length" for t, f in expected)
    second = served.coordinators.split(",")[1]
    victim = _coordinator_pid(served.up.pid, second)
    assert asyncio.run(_client_streams(served.coordinators, victim)) == expected
    _wait_restarted(served.up.pid, second, victim)
    assert_all_free(wait_until_idle(served.coordinators, 3), 3)


def test_seeded_streams_survive_their_coordinator_then_their_decode_worker(
    served: Served,
) -> None:
    expected = asyncio.run(_seeded_streams(served.coordinators, []))
    assert all(len(t) == MAX_TOKENS and f == "length" for t, f in expected)
    first = served.coordinators.split(",")[0]
    coordinator = _coordinator_pid(served.up.pid, first)
    decode = child_pid(served.up.pid, "--worker-id=decode-1")
    kills = [(coordinator, 4), (decode, 20)]
    assert asyncio.run(_seeded_streams(served.coordinators, kills)) == expected
    _wait_restarted(served.up.pid, first, coordinator)
    assert_all_free(wait_until_idle(served.coordinators, 3), 3)  # the restarted one included


@pytest.mark.parametrize(
    ("continue_after", "complaint"),
    [([10**6], "token ids must be in"), ([5] * MAX_TOKENS, "nothing left to generate")],
)
def test_a_bad_continuation_is_invalid_argument(
    served: Served, continue_after: list[int], complaint: str
) -> None:
    async def body() -> ClientError:
        first = served.coordinators.split(",")[0]
        sampling = Sampling(max_tokens=MAX_TOKENS)
        request = wire.generate_request("Hello", None, None, sampling, "bad-continuation")
        async with AsyncClient(first) as client:
            await client.wait_ready(60)  # it may have been restarted by an earlier test
        async with grpc.aio.insecure_channel(first) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            try:
                async for _ in stub.Generate(wire.continuation(request, continue_after)):
                    pass
            except grpc.aio.AioRpcError as error:
                return ClientError.from_call(error)
        raise AssertionError("the continuation was accepted")

    error = asyncio.run(body())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert complaint in error.message and error.param == "continue_after"
