"""gRPC channels to workers, one per address, created on first use and closed on shutdown."""

from __future__ import annotations

import grpc

from splitserve.proto.server import insecure_channel
from splitserve.proto.splitserve.v1 import worker_pb2_grpc


class WorkerClients:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = insecure_channel(address)
        return channel

    def decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self._channel(address))

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self._channel(address))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
