"""Many streams on one ``GenerateStreams`` call (``client/stream_mux.py`` and
``proto/streams_server.py``) against the shared ``served_cluster`` (real processes, real
gRPC): what a stream gets over the relay is what its own ``Generate`` call gets (the same
tokens, the same refusals with their ``param``), cancelling or running out its deadline
aborts only that stream's request, and an HTTP client that stops reading the gateway's SSE
(which relays over ``GenerateStreams`` by default) is cut and its request aborted (the
gateway's ``EventStreamResponse`` on its own; end to end, slow).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from starlette.types import Message

from splitserve.client import (
    AsyncClient,
    Chunk,
    ClientError,
    Finish,
    RetryPolicy,
    Sampling,
    stream_mux,
)
from splitserve.client.connection import aio_channel
from splitserve.client.stream_mux import StreamMultiplexer, _merge_chunks
from splitserve.gateway.disconnect import EventStreamResponse
from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2
from splitserve.proto.splitserve.v1.coordinator_pb2 import GenerateResponse
from tests.cluster import (
    Served,
    assert_all_free,
    cluster,
    gateway_completions,
    wait_until_idle,
    worker_loads,
)

pytestmark = pytest.mark.timeout(240)

PROMPTS = [f"Write one sentence about the number {n}." for n in range(8)]
LONG_TOKENS = 4000
STALLED_TOKENS = 8000
"""Past what the stalled SSE client could receive in a minute at this machine's decode speed."""


@pytest.fixture(scope="module")
def served(served_cluster: Served) -> Served:
    return served_cluster


def _busy(address: str) -> bool:
    return any(
        load.num_running_requests or load.num_used_blocks for load in worker_loads(address).values()
    )


async def _texts(client: AsyncClient, prompts: list[str], max_tokens: int) -> list[list[int]]:
    async def one(prompt: str) -> list[int]:
        sampling = Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        tokens: list[int] = []
        async for item in client.stream(prompt, sampling=sampling):
            if isinstance(item, Chunk):
                tokens.extend(item.token_ids)
        return tokens

    return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))


@contextlib.asynccontextmanager
async def _relayed_and_own(served: Served) -> AsyncIterator[tuple[AsyncClient, AsyncClient]]:
    """Two clients on one channel: one relays its streams on a ``GenerateStreams`` call,
    the other makes a ``Generate`` call each."""
    retry = RetryPolicy(retry_overloaded=False)
    channel = aio_channel(served.coordinator, None, retry)
    try:
        relay = StreamMultiplexer(channel, retry)
        yield (
            AsyncClient(served.coordinator, channel=channel, multiplexer=relay),
            AsyncClient(served.coordinator, channel=channel),
        )
    finally:
        await channel.close(None)


def test_streams_on_one_call_equal_their_own_calls(served: Served) -> None:
    """Eight greedy streams at once on one ``GenerateStreams`` call get exactly the tokens
    each gets on its own ``Generate`` call."""

    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        async with _relayed_and_own(served) as (multiplexed, own_calls):
            return await _texts(multiplexed, PROMPTS, 12), await _texts(own_calls, PROMPTS, 12)

    multiplexed, own_calls = asyncio.run(scenario())
    assert all(len(tokens) == 12 for tokens in multiplexed)
    assert multiplexed == own_calls


Streamed = tuple[str, list[int], Finish | None]
"""A stream's text, its token ids and its finish."""


async def _stream_text(client: AsyncClient, prompt: str, sampling: Sampling) -> Streamed:
    text, tokens, finish = "", [], None
    async for item in client.stream(prompt, sampling=sampling):
        if isinstance(item, Chunk):
            text += item.text
            tokens.extend(item.token_ids)
        else:
            finish = item
    return text, tokens, finish


def test_a_stop_string_matched_past_the_first_token_ends_the_relayed_stream(
    served: Served,
) -> None:
    """Past its first token, a ``GenerateStreams`` stream's outputs are handled inline, in
    the decode call's reader (``coordinator/attempt.py:Attempt._take_inline``): a stop
    string matched there ends the stream as on its own call (the same text, the same finish),
    and ends the request on the decode worker (its blocks free long before its 4,000 tokens)."""
    prompt = PROMPTS[3]
    plain = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[str, Streamed, Streamed]:
        async with _relayed_and_own(served) as (multiplexed, own_call):
            whole, _, _ = await _stream_text(multiplexed, prompt, plain)
            # a word first seen in the second half: well past the first token
            half = len(whole) // 2
            stop = next(word for word in whole[half:].split() if whole.find(word) >= half)
            stopped = Sampling(
                max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True, stop=(stop,)
            )
            return (
                whole,
                await _stream_text(multiplexed, prompt, stopped),
                await _stream_text(own_call, prompt, stopped),
            )

    whole, (text, tokens, finish), own = asyncio.run(scenario())
    assert finish is not None and finish.finish_reason == "stop"
    assert isinstance(finish.stop_reason, str) and finish.stop_reason in whole
    assert whole.startswith(text) and len(text) < len(whole)
    assert (text, tokens, finish.finish_reason, finish.stop_reason) == (
        own[0],
        own[1],
        own[2].finish_reason if own[2] else None,
        own[2].stop_reason if own[2] else None,
    )
    assert_all_free(wait_until_idle(served.coordinator, 2), 2)


def test_a_refusal_on_the_relay_is_the_calls_refusal(served: Served) -> None:
    """A request the coordinator refuses ends its stream with the status and ``param`` its
    own call would have ended with, and the call's other stream is served."""

    async def scenario() -> tuple[ClientError, list[list[int]]]:
        retry = RetryPolicy(retry_overloaded=False)
        channel = aio_channel(served.coordinator, None, retry)
        try:
            client = AsyncClient(
                served.coordinator, channel=channel, multiplexer=StreamMultiplexer(channel, retry)
            )
            bad = client.stream(token_ids=[10**7], sampling=Sampling(max_tokens=4))
            with pytest.raises(ClientError) as refused:
                async for _ in bad:
                    pass
            return refused.value, await _texts(client, PROMPTS[:1], 4)
        finally:
            await channel.close(None)

    error, served_after = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.param == "prompt"
    assert len(served_after[0]) == 4


def test_cancel_and_deadline_abort_only_their_own_stream(served: Served) -> None:
    """On one call: a long stream closed after its first chunk and another whose deadline
    runs out both end, their requests aborted on every worker (all blocks free again long
    before 4,000 tokens could be generated), while a third stream on the same call completes."""

    async def scenario() -> tuple[grpc.StatusCode, Finish, float]:
        retry = RetryPolicy(retry_overloaded=False)
        channel = aio_channel(served.coordinator, None, retry)
        try:
            client = AsyncClient(
                served.coordinator, channel=channel, multiplexer=StreamMultiplexer(channel, retry)
            )
            long = Sampling(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)
            cancelled = client.stream("Count to a million:", sampling=long)
            await anext(cancelled)
            timed = client.stream("Count to a billion:", sampling=long, timeout_s=1.5)
            normal = client.stream("Hello", sampling=Sampling(max_tokens=8, temperature=0.0))
            await cancelled.aclose()
            code = grpc.StatusCode.OK
            try:
                async for _ in timed:
                    pass
            except ClientError as error:
                code = error.code
            finish = None
            async for item in normal:
                if isinstance(item, Finish):
                    finish = item
            assert finish is not None
            started = time.monotonic()
            while _busy(served.coordinator):
                assert time.monotonic() - started < 30, "an ended stream kept generating"
                await asyncio.sleep(0.25)
            return code, finish, time.monotonic() - started
        finally:
            await channel.close(None)

    code, finish, _ = asyncio.run(scenario())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert finish.usage.completion_tokens == 8
    assert_all_free(wait_until_idle(served.coordinator, 2), 2)


def test_an_event_stream_whose_client_reads_nothing_ends() -> None:
    """``EventStreamResponse``: a frame the client's connection does not take within the
    send timeout ends the response, and the frames' generator is closed (which cancels the
    stream's relay call, so the coordinator aborts the request)."""
    closed = asyncio.Event()

    async def frames() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: {}\n\n"
        finally:
            closed.set()

    async def stalled_send(message: Message) -> None:
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the client's socket buffers are full: never taken

    async def no_disconnect() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def scenario() -> float:
        response = EventStreamResponse(frames(), {}, send_timeout_s=0.3)
        started = time.monotonic()
        await asyncio.wait_for(response({"type": "http"}, no_disconnect, stalled_send), 5)
        assert closed.is_set()
        return time.monotonic() - started

    assert 0.3 <= asyncio.run(scenario()) < 2


@pytest.mark.slow
def test_an_sse_client_that_stops_reading_is_cut(served: Served) -> None:
    """A client of the gateway asks for an 8,000-token chat stream with 20 top logprobs a
    token (about 2 KB an event) over a socket with a tiny receive buffer and reads nothing
    after the response's first bytes: once the kernel's send buffer (up to 4 MB on loopback)
    and the transport's are full the gateway's SSE write waits, and after the stall timeout
    (2 s here) the stream ends and its request is aborted on every worker, long before its
    tokens could all be generated."""
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {
            "model": _model(served),
            "messages": [{"role": "user", "content": "Count from one to ten thousand."}],
            "max_tokens": STALLED_TOKENS,
            "logprobs": True,
            "top_logprobs": 20,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        client.connect((host, int(port)))
        client.sendall(request)
        assert client.recv(64).startswith(b"HTTP/1.1 200")  # then nothing more is read
        started = time.monotonic()
        time.sleep(1.0)
        while _busy(served.coordinator):
            assert time.monotonic() - started < 60, "the stalled stream kept generating"
            time.sleep(0.5)
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_RDWR)
    assert_all_free(wait_until_idle(served.coordinator, 2), 2)


def _model(served: Served) -> str:
    return httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.slow
def test_the_per_stream_relay_serves_what_the_multiplexed_one_does() -> None:
    """Two simulated clusters (deterministic tokens), one relaying every hop per stream
    (``SPLITSERVE_RELAY=per-stream``: the gateway's ``Generate`` calls and the coordinator's
    decode ``Generate`` calls) and one multiplexed (the default): the same eight streams
    through each gateway get the same texts."""

    def texts(env: dict[str, str]) -> list[str]:
        lines: dict[str, str] = {}
        with cluster(1, 1, "--engine=sim", ready_lines=lines, env=env):
            url = lines["splitserve gateway ready"]
            return asyncio.run(gateway_completions(url, PROMPTS, 12))

    per_stream = texts({"SPLITSERVE_RELAY": "per-stream"})
    assert per_stream == texts({})
    assert all(per_stream)


def test_chunks_that_queued_up_reach_a_late_reader_as_one() -> None:
    """A reader that fell behind gets the queued token chunks folded into one (tokens, text
    and logprobs in order, the last usage); a completion stays its own response."""

    def chunk(tokens: list[int], text: str, completion_tokens: int) -> GenerateResponse:
        logprobs = [common_pb2.TokenLogprob(token_id=t, logprob=-0.5) for t in tokens]
        return GenerateResponse(
            request_id="r",
            chunk=coordinator_pb2.TokenChunk(token_ids=tokens, text=text, logprobs=logprobs),
            usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=completion_tokens),
        )

    done = GenerateResponse(
        request_id="r",
        completion=coordinator_pb2.Completion(finish_reason=common_pb2.FINISH_REASON_LENGTH),
    )
    queued = collections.deque([chunk([1], "a", 1), chunk([2, 3], "bc", 3), done])
    merged = _merge_chunks(queued)
    assert list(merged.chunk.token_ids) == [1, 2, 3]
    assert merged.chunk.text == "abc"
    assert [lp.token_id for lp in merged.chunk.logprobs] == [1, 2, 3]
    assert merged.usage.completion_tokens == 3
    assert list(queued) == [done]
    assert _merge_chunks(queued) is done


def test_a_call_idle_past_its_time_is_closed_and_replaced(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``GenerateStreams`` call that carried no stream for ``IDLE_CLOSE_S`` is half-closed
    at the next sweep (every API key would otherwise keep its calls open for good), and the
    next stream opens a fresh call and is served."""
    monkeypatch.setattr(stream_mux, "IDLE_CLOSE_S", 0.0)
    monkeypatch.setattr(stream_mux, "IDLE_SWEEP_S", 0.0)

    async def scenario() -> tuple[bool, bool, list[list[int]]]:
        retry = RetryPolicy(retry_overloaded=False)
        channel = aio_channel(served.coordinator, None, retry)
        try:
            relay = StreamMultiplexer(channel, retry)
            client = AsyncClient(served.coordinator, channel=channel, multiplexer=relay)
            first = await _texts(client, PROMPTS[:1], 4)
            old_call = relay.call_for(None)
            await asyncio.sleep(0.05)
            second = await _texts(client, PROMPTS[1:2], 4)
            return old_call.accepting, relay.call_for(None) is old_call, first + second
        finally:
            await channel.close(None)

    old_accepting, reused, texts = asyncio.run(scenario())
    assert not old_accepting and not reused
    assert all(len(tokens) == 4 for tokens in texts)


def test_the_coordinator_counts_its_relay_batches(served: Served) -> None:
    """Every message a ``GenerateStreams`` call writes is observed with its item count
    (``splitserve_relay_batch_items``): four streams of 6 tokens on one call add at least one
    message and at least 4 x 3 items (a stream's chunks, at least one however its tokens
    were merged, its completion and its end)."""

    def figures() -> tuple[float, float]:
        text = httpx.get(served.metrics_urls["coordinator"], timeout=10).text
        values = dict(
            line.rsplit(" ", 1)
            for line in text.splitlines()
            if line.startswith(
                ("splitserve_relay_batch_items_count", "splitserve_relay_batch_items_sum")
            )
        )
        return (
            float(values.get("splitserve_relay_batch_items_count", 0)),
            float(values.get("splitserve_relay_batch_items_sum", 0)),
        )

    async def scenario() -> None:
        retry = RetryPolicy(retry_overloaded=False)
        channel = aio_channel(served.coordinator, None, retry)
        try:
            relay = StreamMultiplexer(channel, retry)
            client = AsyncClient(served.coordinator, channel=channel, multiplexer=relay)
            await _texts(client, PROMPTS[:4], 6)
        finally:
            await channel.close(None)

    count_before, items_before = figures()
    asyncio.run(scenario())
    count_after, items_after = figures()
    assert count_after > count_before
    assert items_after - items_before >= 4 * 3
