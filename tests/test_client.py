"""``splitserve.client`` against a scripted in-process fake coordinator (real gRPC on loopback).

The fake server runs on its own event loop thread; each ``Generate`` call plays the next
script (fail with a status, refuse as overloaded through ``abort_with``, stream then fail,
stream an in-stream error, hang until cancelled, succeed), so the client's retry, error,
deadline and cancellation rules are checked exactly, without a model. The retries are gRPC's
own (the channel's service config), so these tests check what gRPC does with the config the
client builds: the attempts the server sees, their spacing and their deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from splitserve.client import (
    AsyncClient,
    ChatMessage,
    Chunk,
    Client,
    ClientError,
    Finish,
    RetryPolicy,
    Sampling,
)
from splitserve.client.continuation import MAX_CONTINUATIONS
from splitserve.client.retry import service_config
from splitserve.client.wire import COORDINATOR_SERVICE, generate_request
from splitserve.common.errors import InvalidRequestError, OverloadedError
from splitserve.common.sampling_params import SamplingParams
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.status import PARAM_METADATA_KEY, abort_with

pytestmark = pytest.mark.timeout(60)

Script = Callable[
    [coordinator_pb2.GenerateRequest, grpc.aio.ServicerContext],
    AsyncIterator[coordinator_pb2.GenerateResponse],
]
FAST_RETRY = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.05, jitter=0.0)
USAGE = common_pb2.Usage(prompt_tokens=3, completion_tokens=1)


def _chunk(request_id: str, text: str, token: int = 7) -> coordinator_pb2.GenerateResponse:
    return coordinator_pb2.GenerateResponse(
        request_id=request_id,
        chunk=coordinator_pb2.TokenChunk(token_ids=[token], text=text),
        usage=USAGE,
    )


def succeed(*texts: str) -> Script:
    async def script(request, context):
        for index, text in enumerate(texts):
            yield _chunk(request.request_id, text, token=index)
        completion = coordinator_pb2.Completion(
            finish_reason=common_pb2.FINISH_REASON_STOP, stop_token_id=2
        )
        yield coordinator_pb2.GenerateResponse(
            request_id=request.request_id, completion=completion, usage=USAGE
        )

    return script


def fail(code: grpc.StatusCode, *texts: str, metadata: tuple = (), after_s: float = 0.0) -> Script:
    """Stream ``texts`` as chunks, wait ``after_s``, then end the call with ``code``."""

    async def script(request, context):
        for text in texts:
            yield _chunk(request.request_id, text)
        await asyncio.sleep(after_s)
        if metadata:
            context.set_trailing_metadata(metadata)
        await context.abort(code, f"scripted {code.name}")

    return script


def overloaded(retry_after_s: float) -> Script:
    """Refuse admission as the coordinator does: ``abort_with`` an ``OverloadedError``."""

    async def script(request, context):
        await abort_with(context, OverloadedError("too busy", retry_after_s=retry_after_s))
        yield  # unreachable: makes this an async generator like the other scripts

    return script


def error_message(code: grpc.StatusCode, param: str, *texts: str) -> Script:
    """Stream ``texts``, then an in-stream ``Error`` message (as the coordinator does)."""

    async def script(request, context):
        for text in texts:
            yield _chunk(request.request_id, text)
        error = common_pb2.Error(code=code.value[0], message="worker lost", param=param)
        yield coordinator_pb2.GenerateResponse(request_id=request.request_id, error=error)

    return script


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Plays one script per Generate call (the last one again when they run out)."""

    def __init__(self) -> None:
        self.scripts: list[Script] = [succeed("Hi")]
        self.requests: list[coordinator_pb2.GenerateRequest] = []
        self.call_times: list[float] = []
        self.time_remaining: list[float | None] = []
        self.cancelled = threading.Event()
        self.aborted: list[str] = []

    def hang(self, *texts: str) -> Script:
        """Stream ``texts``, then wait until the client cancels (recorded in ``cancelled``)."""

        async def script(request, context):
            for text in texts:
                yield _chunk(request.request_id, text)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise

        return script

    async def Generate(self, request, context):
        self.requests.append(request)
        self.call_times.append(time.monotonic())
        self.time_remaining.append(context.time_remaining())
        script = self.scripts[min(len(self.requests), len(self.scripts)) - 1]
        async for response in script(request, context):
            yield response

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return coordinator_pb2.AbortResponse(aborted=request.request_id == "running")

    async def GetModelInfo(self, request, context):
        return coordinator_pb2.ModelInfo(
            model="fake", max_model_len=2048, vocab_size=100, eos_token_ids=[2], dtype="float32"
        )


class FakeServer:
    """A ``grpc.aio`` server with the fake coordinator and health, on a background loop."""

    def __init__(self) -> None:
        self.coordinator = FakeCoordinator()
        self.health = HealthServicer()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self.run(self._start())

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    async def _start(self) -> int:
        self._server = grpc.aio.server()
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self.coordinator, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else 2  # NOT_SERVING
        self.run(self.health.set(COORDINATOR_SERVICE, status))

    def stop(self) -> None:
        self.run(self._server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    yield fake
    fake.stop()


def _async_client(server: FakeServer, **kwargs: object) -> AsyncClient:
    kwargs.setdefault("retry", FAST_RETRY)
    return AsyncClient(f"127.0.0.1:{server.port}", **kwargs)  # type: ignore[arg-type]


def _client(server: FakeServer, **kwargs: object) -> Client:
    kwargs.setdefault("retry", FAST_RETRY)
    return Client(f"127.0.0.1:{server.port}", **kwargs)  # type: ignore[arg-type]


async def _collect(client: AsyncClient, **kwargs: object) -> list[Chunk | Finish]:
    return [item async for item in client.stream("hi", **kwargs)]  # type: ignore[arg-type]


# -- retries -------------------------------------------------------------------------------


def test_unavailable_before_first_chunk_is_retried_with_the_same_request_id(server) -> None:
    server.coordinator.scripts = [
        fail(grpc.StatusCode.UNAVAILABLE),
        fail(grpc.StatusCode.UNAVAILABLE),
        succeed("Hello", " world"),
    ]

    async def run() -> None:
        async with _async_client(server) as client:
            generation = await client.generate("hi", sampling=Sampling(max_tokens=4))
        assert generation.text == "Hello world"
        assert generation.token_ids == (0, 1)
        assert generation.finish_reason == "stop" and generation.stop_reason == 2
        assert generation.usage.prompt_tokens == 3

    asyncio.run(run())
    ids = {request.request_id for request in server.coordinator.requests}
    assert len(server.coordinator.requests) == 3 and len(ids) == 1
    assert len(ids.pop()) == 32  # uuid4 hex, generated by the client
    assert server.coordinator.requests[0].sampling.max_tokens == 4


def test_unavailable_waits_the_backoff_between_attempts(server) -> None:
    server.coordinator.scripts = [fail(grpc.StatusCode.UNAVAILABLE)] * 2 + [succeed("ok")]
    retry = RetryPolicy(initial_backoff_s=0.2, max_backoff_s=0.2)
    with _client(server, retry=retry) as client:
        assert client.generate("hi").text == "ok"
    times = server.coordinator.call_times
    waits = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    assert len(waits) == 2 and all(0.15 <= wait < 1.0 for wait in waits)  # 0.2 s x [0.8, 1.2]


def test_a_stream_broken_after_a_chunk_continues_after_what_it_delivered(server) -> None:
    """Its coordinator died (UNAVAILABLE after a chunk): the same request goes again with
    ``continue_after`` = the tokens delivered, and the consumer sees one stream."""
    server.coordinator.scripts = [fail(grpc.StatusCode.UNAVAILABLE, "Hel"), succeed("lo")]

    async def run() -> list[Chunk | Finish]:
        async with _async_client(server) as client:
            return [item async for item in client.stream("hi", request_id="r1")]

    received = asyncio.run(run())
    assert [getattr(item, "text", None) for item in received] == ["Hel", "lo", None]
    assert isinstance(received[-1], Finish) and received[-1].finish_reason == "stop"
    first, second = server.coordinator.requests
    assert list(first.continue_after.ids) == []
    assert list(second.continue_after.ids) == [7]  # the token of "Hel"
    assert second.request_id == first.request_id == "r1" and second.text == first.text


def test_the_sync_client_continues_a_broken_stream_too(server) -> None:
    server.coordinator.scripts = [fail(grpc.StatusCode.CANCELLED, "Hel"), succeed("lo")]
    with Client(f"127.0.0.1:{server.port}", retry=FAST_RETRY) as client:
        generation = client.generate("hi", request_id="r2")
    assert generation.text == "Hello"
    assert list(server.coordinator.requests[1].continue_after.ids) == [7]


def test_continuations_are_bounded_and_only_for_a_lost_coordinator(server) -> None:
    server.coordinator.scripts = [fail(grpc.StatusCode.UNAVAILABLE, "x")]  # every call

    async def run(code: grpc.StatusCode) -> ClientError:
        async with _async_client(server) as client:
            with pytest.raises(ClientError) as error:
                async for _ in client.stream("hi", request_id="r3"):
                    pass
        return error.value

    assert asyncio.run(run(grpc.StatusCode.UNAVAILABLE)).code == grpc.StatusCode.UNAVAILABLE
    assert len(server.coordinator.requests) == 1 + MAX_CONTINUATIONS
    streamed = [list(r.continue_after.ids) for r in server.coordinator.requests]
    assert streamed == [[], [7], [7, 7], [7, 7, 7]]  # each call went on after all before

    server.coordinator.requests.clear()
    server.coordinator.scripts = [fail(grpc.StatusCode.INVALID_ARGUMENT, "x")]
    assert asyncio.run(run(grpc.StatusCode.INVALID_ARGUMENT)).code == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert len(server.coordinator.requests) == 1  # the request's own error: no continuation


def test_resource_exhausted_waits_the_servers_retry_after_hint(server) -> None:
    server.coordinator.scripts = [overloaded(retry_after_s=0.4), succeed("ok")]

    async def run() -> None:
        async with _async_client(server) as client:
            assert (await client.generate("hi")).text == "ok"

    asyncio.run(run())
    first, second = server.coordinator.call_times
    assert 0.35 <= second - first < 3.0


def test_resource_exhausted_is_raised_when_overload_retries_are_off(server) -> None:
    server.coordinator.scripts = [overloaded(retry_after_s=1.5)]
    retry = RetryPolicy(retry_overloaded=False)

    async def run() -> ClientError:
        async with _async_client(server, retry=retry) as client:
            with pytest.raises(ClientError) as error:
                await client.generate("hi")
        return error.value

    error = asyncio.run(run())
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.retry_after_s == pytest.approx(1.5)
    assert len(server.coordinator.requests) == 1


def test_invalid_argument_carries_param_and_is_not_retried(server) -> None:
    param = ((PARAM_METADATA_KEY, "temperature"),)
    server.coordinator.scripts = [fail(grpc.StatusCode.INVALID_ARGUMENT, metadata=param)]

    async def run() -> ClientError:
        async with _async_client(server) as client:
            with pytest.raises(ClientError) as error:
                await client.generate("hi", sampling=Sampling(temperature=-1))
        return error.value

    error = asyncio.run(run())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.param == "temperature" and error.retry_after_s is None
    assert "scripted INVALID_ARGUMENT" in str(error) and "param: temperature" in str(error)
    assert len(server.coordinator.requests) == 1


def test_retries_stop_after_max_attempts(server) -> None:
    server.coordinator.scripts = [fail(grpc.StatusCode.UNAVAILABLE)]
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, jitter=0.0)

    async def run() -> None:
        async with _async_client(server, retry=retry) as client:
            with pytest.raises(ClientError) as error:
                await client.generate("hi")
        assert error.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())
    assert len(server.coordinator.requests) == 3


def test_in_stream_error_message_is_raised_as_client_error(server) -> None:
    server.coordinator.scripts = [error_message(grpc.StatusCode.UNAVAILABLE, "model", "A")]

    async def run() -> list[Chunk | Finish]:
        received: list[Chunk | Finish] = []
        async with _async_client(server) as client:
            with pytest.raises(ClientError) as error:
                async for item in client.stream("hi"):
                    received.append(item)
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        assert error.value.message == "worker lost" and error.value.param == "model"
        return received

    assert len(asyncio.run(run())) == 1
    assert len(server.coordinator.requests) == 1  # a chunk was delivered: no retry


def test_retry_policy_becomes_the_channels_service_config() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.3, jitter=0.0)
    assert service_config(policy) == {
        "methodConfig": [
            {
                "name": [{"service": COORDINATOR_SERVICE}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.100s",
                    "maxBackoff": "0.300s",
                    "backoffMultiplier": 2.0,
                    "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
                },
            }
        ],
        "loadBalancingConfig": [{"round_robin": {}}],  # over every coordinator of the target
    }
    several = service_config(policy, health_checked=True)
    assert several["healthCheckConfig"] == {"serviceName": COORDINATOR_SERVICE}  # SERVING ones
    no_overload = service_config(RetryPolicy(retry_overloaded=False, initial_backoff_s=0))
    retry_policy = no_overload["methodConfig"][0]["retryPolicy"]  # type: ignore[index]
    assert retry_policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert retry_policy["initialBackoff"] == "0.001s"  # gRPC needs > 0, at 1 ms resolution
    assert "retryPolicy" not in service_config(RetryPolicy.never())["methodConfig"][0]  # type: ignore[index]
    for attempts in (0, 6):  # gRPC would clamp 6 to 5 without a word
        with pytest.raises(ValueError):
            RetryPolicy(max_attempts=attempts)


def test_only_unavailable_and_overload_are_retried(server) -> None:
    final = (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
    )

    async def run() -> None:
        async with _async_client(server) as client:
            for code in final:
                server.coordinator.requests.clear()
                server.coordinator.scripts = [fail(code), succeed("no")]
                with pytest.raises(ClientError) as error:
                    await client.generate("hi")
                assert error.value.code == code
                assert len(server.coordinator.requests) == 1

    asyncio.run(run())


def test_never_retry_makes_one_attempt(server) -> None:
    server.coordinator.scripts = [fail(grpc.StatusCode.UNAVAILABLE), succeed("no")]

    async def run() -> None:
        async with _async_client(server, retry=RetryPolicy.never()) as client:
            with pytest.raises(ClientError) as error:
                await client.generate("hi")
        assert error.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())
    assert len(server.coordinator.requests) == 1


def test_an_overload_hint_beyond_the_deadline_is_raised_at_once(server) -> None:
    server.coordinator.scripts = [overloaded(retry_after_s=5.0), succeed("no")]

    async def run() -> ClientError:
        async with _async_client(server) as client:
            started = time.monotonic()
            with pytest.raises(ClientError) as error:
                await client.generate("hi", timeout_s=1.0)
            assert time.monotonic() - started < 0.9  # not waiting for the deadline
        return error.value

    error = asyncio.run(run())
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.retry_after_s == pytest.approx(5.0)
    assert len(server.coordinator.requests) == 1


def test_the_deadline_covers_all_attempts(server) -> None:
    server.coordinator.scripts = [
        fail(grpc.StatusCode.UNAVAILABLE, after_s=0.4),
        server.coordinator.hang(),
    ]

    async def run() -> float:
        async with _async_client(server) as client:
            started = time.monotonic()
            with pytest.raises(ClientError) as error:
                await client.generate("hi", timeout_s=0.6)
            assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            return time.monotonic() - started

    elapsed = asyncio.run(run())
    assert elapsed >= 0.55  # the deadline, not the first failure, ended it
    first, second = server.coordinator.time_remaining
    # One 0.6 s deadline, not 0.4 s + a fresh 0.6 s: the retry got what the first left.
    assert first is not None and second is not None and second < first - 0.35


def test_a_long_prompt_is_retried_like_a_short_one(server) -> None:
    prompt = "x" * (1 << 20)  # beyond gRPC's default 256 KiB retry buffer
    server.coordinator.scripts = [fail(grpc.StatusCode.UNAVAILABLE), succeed("ok")]
    with _client(server) as client:
        assert client.generate(prompt).text == "ok"
    assert [len(request.text) for request in server.coordinator.requests] == [1 << 20] * 2


# -- deadlines and cancellation ------------------------------------------------------------


def test_deadline_exceeded_surfaces_as_client_error(server) -> None:
    server.coordinator.scripts = [server.coordinator.hang()]

    async def run() -> None:
        async with _async_client(server) as client:
            started = time.monotonic()
            with pytest.raises(ClientError) as error:
                await client.generate("hi", timeout_s=0.3)
            assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - started < 3.0

    asyncio.run(run())


def test_closing_the_async_stream_cancels_the_call(server) -> None:
    server.coordinator.scripts = [server.coordinator.hang("A")]

    async def run() -> None:
        async with _async_client(server) as client:
            async with contextlib.aclosing(client.stream("hi")) as items:
                async for item in items:
                    assert isinstance(item, Chunk)
                    break
            assert await asyncio.to_thread(server.coordinator.cancelled.wait, 10)

    asyncio.run(run())


def test_cancelling_the_consuming_task_cancels_the_call(server) -> None:
    server.coordinator.scripts = [server.coordinator.hang("A")]

    async def run() -> None:
        first_chunk = asyncio.Event()

        async def consume(client: AsyncClient) -> None:
            async for _ in client.stream("hi"):
                first_chunk.set()

        async with _async_client(server) as client:
            task = asyncio.create_task(consume(client))
            await asyncio.wait_for(first_chunk.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(server.coordinator.cancelled.wait, 10)

    asyncio.run(run())


def test_dropping_the_sync_stream_cancels_the_call(server) -> None:
    server.coordinator.scripts = [server.coordinator.hang("A")]
    with _client(server) as client:
        items = client.stream("hi")
        assert isinstance(next(items), Chunk)
        del items  # garbage: the generator closes, its call is cancelled
        assert server.coordinator.cancelled.wait(10)


# -- the sync client -----------------------------------------------------------------------


def test_sync_client_retries_streams_and_raises_like_the_async_one(server) -> None:
    server.coordinator.scripts = [fail(grpc.StatusCode.UNAVAILABLE), succeed("Hello", "!")]
    with _client(server) as client:
        items = list(client.stream(messages=[{"role": "user", "content": "hi"}]))
        assert [type(item) for item in items] == [Chunk, Chunk, Finish]
        assert len(server.coordinator.requests) == 2
        assert server.coordinator.requests[1].chat.messages[0].content == "hi"

        server.coordinator.requests.clear()
        param = ((PARAM_METADATA_KEY, "max_tokens"),)
        server.coordinator.scripts = [fail(grpc.StatusCode.INVALID_ARGUMENT, metadata=param)]
        with pytest.raises(ClientError) as error:
            client.generate(token_ids=[1, 2, 3])
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.param == "max_tokens"
        assert len(server.coordinator.requests) == 1

        server.coordinator.scripts = [server.coordinator.hang()]
        with pytest.raises(ClientError) as error:
            client.generate("hi", timeout_s=0.3)
        assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

        server.coordinator.requests.clear()
        server.coordinator.scripts = [fail(grpc.StatusCode.INTERNAL, "Hel"), succeed("no")]
        received = []
        with pytest.raises(ClientError) as error:
            for item in client.stream("hi"):
                received.append(item)
        assert error.value.code == grpc.StatusCode.INTERNAL
        assert [type(item) for item in received] == [Chunk]
        assert len(server.coordinator.requests) == 1  # a chunk was delivered: no retry


def test_unary_calls_and_wait_ready(server) -> None:
    with _client(server) as client:
        with pytest.raises(ClientError) as error:
            client.wait_ready(timeout_s=0.3)
        assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        server.set_serving(True)
        client.wait_ready(timeout_s=5)
        info = client.model_info()
        assert (info.model, info.max_model_len, info.eos_token_ids) == ("fake", 2048, (2,))
        assert client.abort("running") is True and client.abort("gone") is False

    async def run() -> None:
        async with _async_client(server) as client:
            await client.wait_ready(timeout_s=5)
            assert (await client.model_info()).dtype == "float32"
            assert await client.abort("running") is True

    asyncio.run(run())


# -- requests ------------------------------------------------------------------------------


def test_sampling_to_proto_sets_only_given_fields() -> None:
    message = Sampling(max_tokens=5, temperature=0.0, stop=("\n",), seed=3).to_proto()
    assert message.HasField("max_tokens") and message.HasField("temperature")
    assert not message.HasField("top_p") and not message.HasField("logprobs")
    assert list(message.stop) == ["\n"] and message.seed == 3
    with pytest.raises(ClientError) as error:
        Sampling(max_tokens=-1).to_proto()
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.param == "max_tokens"


def test_logit_bias_crosses_the_wire_and_is_validated_on_arrival() -> None:
    message = Sampling(logit_bias={7: 2.5, 3: -100}).to_proto()
    assert dict(message.logit_bias) == {7: 2.5, 3: -100.0}
    params = convert.sampling_from_proto(message)
    assert params.logit_bias == ((3, -100.0), (7, 2.5))
    assert dict(convert.sampling_to_proto(params).logit_bias) == {3: -100.0, 7: 2.5}
    params.check_vocab(8)
    with pytest.raises(InvalidRequestError, match="vocabulary") as beyond:
        params.check_vocab(7)
    assert beyond.value.param == "logit_bias"
    for bad in ({1: 101.0}, {1: float("nan")}, {-1: 1.0}, [(1, 1.0), (1, 2.0)], [(1,)], 5):
        with pytest.raises(InvalidRequestError) as error:
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]
        assert error.value.param == "logit_bias", bad


def test_generate_request_takes_exactly_one_prompt() -> None:
    chat = [ChatMessage("system", "be brief"), {"role": "user", "content": "hi"}]
    request = generate_request(None, chat, None, None, "r")
    assert request.WhichOneof("prompt") == "chat" and len(request.chat.messages) == 2
    assert generate_request(None, None, [1, 2], None, "r").token_ids.ids == [1, 2]
    with pytest.raises(ValueError):
        generate_request("a", chat, None, None, "r")
    with pytest.raises(ValueError):
        generate_request(None, None, None, None, "r")
    with pytest.raises(TypeError):
        generate_request(None, [{"content": "no role"}], None, None, "r")
