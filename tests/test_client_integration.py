"""``splitserve.client`` against a real cluster: the shared ``served_cluster`` (``splitserve
up`` with one prefill and one decode worker and the default model), over gRPC."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from splitserve.client import AsyncClient, Chunk, Client, ClientError, Finish, Sampling, wire
from splitserve.proto.splitserve.v1 import coordinator_pb2_grpc
from tests.cluster import Served, assert_all_free, wait_until_idle

pytestmark = pytest.mark.timeout(300)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = Sampling(max_tokens=32, temperature=0)
ANSWER = "The capital of France is Paris."
LONG = Sampling(max_tokens=2000, ignore_eos=True)


@pytest.fixture(scope="module")
def address(served_cluster: Served) -> str:
    return served_cluster.coordinator


def test_sync_stream_generate_and_model_info(address: str) -> None:
    with Client(address, timeout_s=60) as client:
        client.wait_ready(timeout_s=30)
        items = list(client.stream(messages=QUESTION, sampling=GREEDY))
        chunks = [item for item in items if isinstance(item, Chunk)]
        finish = items[-1]
        assert isinstance(finish, Finish) and finish.finish_reason == "stop"
        assert len(chunks) == len(items) - 1
        assert "".join(chunk.text for chunk in chunks) == ANSWER
        assert finish.usage.completion_tokens == sum(len(chunk.token_ids) for chunk in chunks)

        generation = client.generate(messages=QUESTION, sampling=GREEDY)
        assert generation.text == ANSWER and generation.finish_reason == "stop"
        assert generation.usage.prompt_tokens == finish.usage.prompt_tokens > 0

        info = client.model_info()
        assert info.max_model_len > 0 and info.vocab_size > 0 and info.eos_token_ids
        assert info.model and info.dtype


def test_bad_request_is_invalid_argument_naming_the_field(address: str) -> None:
    with Client(address, timeout_s=60) as client, pytest.raises(ClientError) as error:
        client.generate("hi", sampling=Sampling(temperature=-1))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.param == "temperature" and error.value.message


def test_async_stream_generate_abort_and_cancel(address: str) -> None:
    asyncio.run(_async_checks(address))
    # the cancelled stream's request ends on every worker
    assert_all_free(wait_until_idle(address, 2), 2)


async def _async_checks(address: str) -> None:
    async with AsyncClient(address, timeout_s=60) as client:
        await client.wait_ready(timeout_s=30)
        items = [item async for item in client.stream(messages=QUESTION, sampling=GREEDY)]
        assert isinstance(items[-1], Finish) and items[-1].finish_reason == "stop"
        assert "".join(item.text for item in items if isinstance(item, Chunk)) == ANSWER
        assert (await client.generate(messages=QUESTION, sampling=GREEDY)).text == ANSWER

        finish = None
        async for item in client.stream("Count to a thousand:", sampling=LONG, request_id="a1"):
            if isinstance(item, Chunk) and finish is None:
                assert await client.abort("a1") is True
                finish = "asked"
            elif isinstance(item, Finish):
                finish = item
        assert isinstance(finish, Finish) and finish.finish_reason == "abort"
        assert finish.usage.completion_tokens < 2000
        assert await client.abort("a1") is False  # gone: idempotent

        received = 0
        async with contextlib.aclosing(client.stream("Count:", sampling=LONG)) as items:
            async for item in items:
                received += len(item.token_ids) if isinstance(item, Chunk) else 0
                if received >= 3:
                    break
        assert received >= 3


CONTINUED_MAX_TOKENS = 36


@pytest.mark.parametrize(
    ("continue_after", "complaint"),
    [([10**6], "token ids must be in"), ([5] * CONTINUED_MAX_TOKENS, "nothing left to generate")],
)
def test_a_bad_continuation_is_invalid_argument(
    address: str, continue_after: list[int], complaint: str
) -> None:
    """A stream's continuation (``wire.continuation``, what a client sends another
    coordinator after its own died) naming tokens out of the vocabulary, or as many as the
    request may generate, is refused naming ``continue_after``."""

    async def body() -> ClientError:
        sampling = Sampling(max_tokens=CONTINUED_MAX_TOKENS)
        request = wire.generate_request("Hello", None, None, sampling, "bad-continuation")
        async with grpc.aio.insecure_channel(address) as channel:
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
