"""``splitserve frontend``: the coordinator and the gateway in one process, the gateway's
streams handed over in process (``proto/local_streams.py``).

- ``LocalStreamsCall`` ends as a gRPC call would: OK when the servicer returns, the abort's
  status, UNKNOWN for a servicer that raised, CANCELLED when cancelled; the batches arrive
  as the objects written, in order, and the caller's metadata reaches the servicer.
- Outside in (real processes: the frontend and a simulated decode worker): streams through
  the in-process gateway (the openai SDK) run whole while the frontend drains on SIGTERM,
  which then exits 0; the gateway's key check holds on the in-process path.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from splitserve.coordinator import INTERNAL_READY, PUBLIC_READY
from splitserve.proto.local_streams import LocalServicerContext, LocalStreamsCall
from splitserve.proto.streams_client import StreamError
from tests.cluster import (
    ProcessSpec,
    internal_address,
    remember_internal,
    routable_members,
    running_together,
)

pytestmark = pytest.mark.timeout(180)

STAND_IN_PROFILE = Path(__file__).resolve().parents[1] / "bench/profiles/relay-stand-in.json"
"""20 ms a decode step whatever the batch: streams long enough to signal mid-way."""
KEY = "frontend-test-key"


async def _requests(*messages: str) -> AsyncIterator[str]:
    for message in messages:
        yield message


async def _read_all(call: LocalStreamsCall) -> list[Any]:
    return [batch async for batch in call]


def test_batches_arrive_as_written_and_the_call_ends_ok() -> None:
    written = [object(), object(), object()]
    seen: dict[str, Any] = {}

    async def method(requests: AsyncIterator[str], context: LocalServicerContext) -> None:
        seen["metadata"] = context.invocation_metadata()
        seen["requests"] = [message async for message in requests]
        for batch in written:
            await context.write(batch)

    async def scenario() -> list[Any]:
        call = LocalStreamsCall(method, _requests("a", "b"), (("authorization", "Bearer k"),))
        return await _read_all(call)

    batches = asyncio.run(scenario())
    assert all(got is sent for got, sent in zip(batches, written, strict=True))
    assert seen == {"metadata": (("authorization", "Bearer k"),), "requests": ["a", "b"]}


def test_an_abort_ends_the_call_with_its_status_after_what_was_written() -> None:
    async def method(requests: AsyncIterator[str], context: LocalServicerContext) -> None:
        await context.write("first")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required")

    async def scenario() -> tuple[list[Any], StreamError]:
        got: list[Any] = []
        with pytest.raises(StreamError) as raised:
            async for batch in LocalStreamsCall(method, _requests(), None):
                got.append(batch)
        return got, raised.value

    got, error = asyncio.run(scenario())
    assert got == ["first"]
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error.details() == "a valid API key is required"


def test_a_servicer_that_raises_ends_the_call_unknown() -> None:
    async def method(requests: AsyncIterator[str], context: LocalServicerContext) -> None:
        raise RuntimeError("boom")

    async def scenario() -> StreamError:
        with pytest.raises(StreamError) as raised:
            await _read_all(LocalStreamsCall(method, _requests(), None))
        return raised.value

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.UNKNOWN
    assert "RuntimeError: boom" in error.details()


def test_cancel_cancels_the_servicer_and_ends_the_call_cancelled() -> None:
    cancelled = asyncio.Event()

    async def method(requests: AsyncIterator[str], context: LocalServicerContext) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def scenario() -> StreamError:
        call = LocalStreamsCall(method, _requests(), None)
        reader = asyncio.ensure_future(_read_all(call))
        await asyncio.sleep(0)
        assert call.cancel()
        with pytest.raises(StreamError) as raised:
            await reader
        return raised.value

    error = asyncio.run(scenario())
    assert cancelled.is_set()
    assert error.code() == grpc.StatusCode.CANCELLED


async def _stream(client: openai.AsyncOpenAI, model: str, index: int, started: Any) -> Any:
    """One streamed completion of 120 tokens (EOS ignored); ``started`` is released once it
    has 3; returns (text pieces, finish reason, usage)."""
    pieces, finish, usage = 0, None, None
    stream = await client.completions.create(
        model=model,
        prompt=f"Stream {index} tells a long story",
        max_tokens=120,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices:
            pieces += bool(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
            if pieces == 3:
                started.release()
        elif chunk.usage is not None:
            usage = chunk.usage
    return pieces, finish, usage


async def _streams_then_terminate(url: str, frontend: subprocess.Popen[str]) -> list[Any]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    async with client:
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="wrong").models.list()
        model = (await client.models.list()).data[0].id
        started = asyncio.Semaphore(0)
        streams = [asyncio.ensure_future(_stream(client, model, i, started)) for i in range(4)]
        for _ in streams:
            await started.acquire()
        frontend.send_signal(signal.SIGTERM)
        return list(await asyncio.gather(*streams))


def test_streams_through_the_in_process_gateway_finish_while_the_frontend_drains() -> None:
    processes: list[subprocess.Popen[str]] = []
    lines: dict[str, str] = {}
    frontend = ProcessSpec(
        ["splitserve.frontend.main", "--port=0", "--internal-port=0", "--http-port=0"]
        + ["--metrics-port=-1", f"--api-key={KEY}"],
        "splitserve gateway ready at",
        ready_lines=lines,
    )
    with running_together([frontend], processes) as (url,):
        coordinator = lines[PUBLIC_READY]
        remember_internal(coordinator, lines[INTERNAL_READY])
        decode = ProcessSpec(
            ["splitserve.decode.main", "--port=0", "--worker-id=decode-0", "--metrics-port=-1"]
            + [f"--coordinator={internal_address(coordinator)}", "--engine=sim"]
            + [f"--sim-profile={STAND_IN_PROFILE}", "--sim-startup-s=0", "--num-blocks=256"],
            "splitserve decode ready at",
        )
        with running_together([decode]):
            while "decode-0" not in routable_members(coordinator):
                time.sleep(0.1)
            results = asyncio.run(_streams_then_terminate(url, processes[0]))
            status = processes[0].wait(timeout=60)
    assert status == 0
    for pieces, finish, usage in results:
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 120
        assert pieces >= 3  # tokens that came together arrive as one chunk
