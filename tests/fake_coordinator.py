"""A scripted fake coordinator for the client's tests (``test_client.py``): real gRPC on
loopback, no model.

``FakeServer`` runs a ``grpc.aio`` server with ``FakeCoordinator`` and a health servicer on its
own event loop thread. Each ``Generate`` call plays the next script of
``FakeCoordinator.scripts`` (the last one again when they run out): ``succeed``, ``fail`` with
a status (after streaming some chunks or not), refuse as ``overloaded`` through
``abort_with``, stream an in-stream ``error_message``, or ``hang`` until cancelled. The fake
records every request, when it came and the deadline it had left.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from splitserve.client.wire import COORDINATOR_SERVICE
from splitserve.common.errors import OverloadedError
from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.status import abort_with

Script = Callable[
    [coordinator_pb2.GenerateRequest, grpc.aio.ServicerContext],
    AsyncIterator[coordinator_pb2.GenerateResponse],
]
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
