"""``python bench/full_coordinator.py --port P --refuses-all-ms MS``: a coordinator stand-in
whose admission queue is always full, for measuring what the gateway alone spends on a crowd's
refusals (``bench_gateway_refusals.py``). Not a coordinator: it answers ``GetModelInfo``, the
health check (SERVING) and every stream or ``Generate`` call with the refusal a full queue
gives (RESOURCE_EXHAUSTED, a 3 s retry hint, and ``refuses_all_ms`` as the real coordinator's
``coordinator/admission.py:REFUSES_ALL_S`` says it), through the real ``StreamsCall``. Prints
``full coordinator ready at <host:port>``, then every 2 s how many streams it was asked.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.common.errors import OverloadedError
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.status import abort_with
from splitserve.proto.streams_server import StreamsCall

RETRY_AFTER_S = 3.0


class FullCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, refuses_all_s: float) -> None:
        self.asked = 0
        self._refuses_all_s = refuses_all_s

    def _refusal(self) -> OverloadedError:
        self.asked += 1
        return OverloadedError(
            "256 requests already wait for KV (limit 256)", RETRY_AFTER_S, self._refuses_all_s
        )

    async def GetModelInfo(  # noqa: N802
        self, request: coordinator_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ModelInfo:
        return coordinator_pb2.ModelInfo(
            model="full", max_model_len=8192, vocab_size=49152, eos_token_ids=[2]
        )

    async def Generate(  # noqa: N802
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await abort_with(context, self._refusal())

    async def GenerateStreams(  # noqa: N802
        self,
        request_iterator: AsyncIterator[coordinator_pb2.StreamsRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        async def run(request: object, send: Callable[[object], Awaitable[None]]) -> None:
            raise self._refusal()

        streams = StreamsCall(
            run, lambda: False, coordinator_pb2.StreamsResponse, coordinator_pb2.GenerateResponse
        )
        await streams.serve(request_iterator, context, 30.0)


async def serve(port: int, refuses_all_ms: int) -> None:
    coordinator = FullCoordinator(refuses_all_ms / 1000.0)
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
    checks = health.HealthServicer()
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"full coordinator ready at 127.0.0.1:{bound}", flush=True)
    while True:
        await asyncio.sleep(2.0)
        print(f"asked {coordinator.asked}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--refuses-all-ms", type=int, default=100)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.refuses_all_ms))


if __name__ == "__main__":
    main()
