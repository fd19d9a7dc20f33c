"""Outside-in: a stranger on the same machine, without the cluster credential, is refused by
every internal port of a real cluster (the shared ``served_cluster``, ``splitserve up``:
coordinator, a prefill and a decode worker as processes, KV over UCX), cannot join it as a
worker, and so never receives a prompt; the public port keeps serving clients, and reflection
is off."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.proto.cluster_auth import ClusterCredential
from splitserve.proto.splitserve.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.cluster import CREDENTIAL, Served, internal_address

STRANGERS = {
    "no credential": None,
    "a wrong token": ClusterCredential.generate().metadata,
    "a malformed header": (("authorization", "Basic c3RyYW5nZXI="),),
}


class _FakeDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """What an attacker runs to harvest prompts: it records every call it gets."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def Generate(self, request, context):  # noqa: ANN001, ANN201
        self.calls.append(f"Generate {request.request_id}")
        yield worker_pb2.WorkerGenerateResponse()


def _registration(address: str) -> coordinator_pb2.RegisterWorkerRequest:
    layout = worker_pb2.KvLayout(model="m", dtype="float32", block_size=16, compat_hash="h")
    info = worker_pb2.WorkerInfo(
        worker_id="evil-decode",
        role=worker_pb2.WORKER_ROLE_DECODE,
        address=address,
        kv_layout=layout,
        num_blocks=1_000_000,  # "idlest" by far: every request would go there
        max_model_len=8192,
    )
    return coordinator_pb2.RegisterWorkerRequest(worker=info)


async def _code_of(call: Callable[[], Awaitable[object]]) -> grpc.StatusCode:
    try:
        await call()
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def _internal_calls(
    internal: str, decode: str, prefill: str, metadata: tuple[tuple[str, str], ...] | None
) -> dict[str, grpc.StatusCode]:
    """The status of one call of every internal RPC, made with ``metadata``."""
    async with (
        grpc.aio.insecure_channel(internal) as coordinator_channel,
        grpc.aio.insecure_channel(decode) as decode_channel,
        grpc.aio.insecure_channel(prefill) as prefill_channel,
    ):
        membership = coordinator_pb2_grpc.MembershipStub(coordinator_channel)
        decode_stub = worker_pb2_grpc.DecodeWorkerStub(decode_channel)
        prefill_stub = worker_pb2_grpc.PrefillWorkerStub(prefill_channel)
        kw = {"timeout": 10, "metadata": metadata}
        generate = worker_pb2.WorkerGenerateRequest(request_id="x", prompt_token_ids=[1, 2, 3])

        async def first_message() -> object:
            return await decode_stub.Generate(generate, **kw).read()

        calls: dict[str, Callable[[], Awaitable[object]]] = {
            # empty: with the credential it is refused as invalid, never registered
            "RegisterWorker": lambda: membership.RegisterWorker(
                coordinator_pb2.RegisterWorkerRequest(), **kw
            ),
            "Heartbeat": lambda: membership.Heartbeat(coordinator_pb2.HeartbeatRequest(), **kw),
            "ListWorkers": lambda: membership.ListWorkers(
                coordinator_pb2.ListWorkersRequest(), **kw
            ),
            "DecodeWorker.Generate": first_message,
            "DecodeWorker.Abort": lambda: decode_stub.Abort(
                worker_pb2.WorkerAbortRequest(request_id="x"), **kw
            ),
            "DecodeWorker.KvHandshake": lambda: decode_stub.KvHandshake(
                worker_pb2.KvHandshakeRequest(), **kw
            ),
            "DecodeWorker.CompleteKv": lambda: decode_stub.CompleteKv(
                worker_pb2.CompleteKvRequest(request_id="x"), **kw
            ),
            "DecodeWorker.PushCachedKv": lambda: decode_stub.PushCachedKv(
                worker_pb2.PushCachedKvRequest(request_id="x"), **kw
            ),
            "PrefillWorker.Prefill": lambda: prefill_stub.Prefill(
                worker_pb2.PrefillRequest(request_id="x"), **kw
            ),
        }
        for name, channel in (
            ("coordinator internal", coordinator_channel),
            ("decode", decode_channel),
            ("prefill", prefill_channel),
        ):
            health = health_pb2_grpc.HealthStub(channel)
            calls[f"{name} health"] = lambda health=health: health.Check(
                health_pb2.HealthCheckRequest(), **kw
            )
        return {name: await _code_of(call) for name, call in calls.items()}


async def _public_generate(address: str, count: int) -> list[int]:
    """Tokens streamed for ``count`` requests through the public API, no credential."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        async def one(index: int) -> int:
            request = coordinator_pb2.GenerateRequest(
                request_id=f"public-{index}",
                text=f"Tell me about the number {index}.",
                sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True),
            )
            tokens = 0
            async for response in stub.Generate(request, timeout=120):
                tokens += len(response.chunk.token_ids)
            return tokens

        return list(await asyncio.gather(*(one(i) for i in range(count))))


async def _workers(internal: str) -> dict[int, str]:
    async with grpc.aio.insecure_channel(internal) as channel:
        listing = await coordinator_pb2_grpc.MembershipStub(channel).ListWorkers(
            coordinator_pb2.ListWorkersRequest(), timeout=10, metadata=CREDENTIAL.metadata
        )
    return {status.worker.role: status.worker.address for status in listing.workers}


REFLECTION_METHODS = (
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
)


async def _reflection_call(address: str, method: str) -> tuple[grpc.StatusCode, str, bytes]:
    """(status, details, reply) of one request listing the services, sent as a unary call:
    its message, half-close and status travel in one batch, where the reflection method's own
    bidi shape races a message write against the server's early status (a loaded machine
    answered INTERNAL "Internal error from Core" for that). A server that serves reflection
    answers such a call with its one reply and OK."""
    from grpc_reflection.v1alpha import reflection_pb2

    request = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(method)
        try:
            reply = await call(request, timeout=30)
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details() or "", b""
        return grpc.StatusCode.OK, "", reply


@pytest.fixture(scope="module")
def served(served_cluster: Served) -> str:
    return served_cluster.coordinator


@pytest.mark.parametrize("stranger", sorted(STRANGERS))
def test_every_internal_port_refuses_a_caller_without_the_credential(
    served: str, stranger: str
) -> None:
    internal = internal_address(served)
    workers = asyncio.run(_workers(internal))
    decode = workers[worker_pb2.WORKER_ROLE_DECODE]
    prefill = workers[worker_pb2.WORKER_ROLE_PREFILL]
    codes = asyncio.run(_internal_calls(internal, decode, prefill, STRANGERS[stranger]))
    assert len(codes) == 12
    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes


def test_the_credential_is_what_opens_them(served: str) -> None:
    """The control case: the same calls with the cluster's credential get past the check."""
    internal = internal_address(served)
    workers = asyncio.run(_workers(internal))
    decode = workers[worker_pb2.WORKER_ROLE_DECODE]
    prefill = workers[worker_pb2.WORKER_ROLE_PREFILL]
    codes = asyncio.run(_internal_calls(internal, decode, prefill, CREDENTIAL.metadata))
    assert grpc.StatusCode.UNAUTHENTICATED not in codes.values(), codes
    assert codes["ListWorkers"] == codes["decode health"] == grpc.StatusCode.OK
    assert codes["RegisterWorker"] == grpc.StatusCode.INVALID_ARGUMENT


def test_a_fake_worker_with_a_wrong_token_never_receives_a_prompt(served: str) -> None:
    async def body() -> tuple[grpc.StatusCode, list[int], list[str], dict[int, str]]:
        fake = _FakeDecodeWorker()
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            internal = internal_address(served)
            async with grpc.aio.insecure_channel(internal) as channel:
                membership = coordinator_pb2_grpc.MembershipStub(channel)
                wrong = ClusterCredential.generate().metadata
                code = await _code_of(
                    lambda: membership.RegisterWorker(
                        _registration(f"127.0.0.1:{port}"), timeout=10, metadata=wrong
                    )
                )
            tokens = await _public_generate(served, 6)  # the public port needs no credential
            return code, tokens, fake.calls, await _workers(internal)
        finally:
            await server.stop(None)

    code, tokens, calls, workers = asyncio.run(body())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert tokens == [8] * 6  # every request was served, by the real workers
    assert calls == []  # not one prompt reached the fake worker
    assert sorted(workers) == [worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE]


def test_reflection_is_off_by_default(served: str) -> None:
    for method in REFLECTION_METHODS:
        code, details, reply = asyncio.run(_reflection_call(served, method))
        assert (code, reply) == (grpc.StatusCode.UNIMPLEMENTED, b""), (method, code, details)
