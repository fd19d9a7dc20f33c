"""A worker that registers over gRPC is routed to only once the coordinator dialled it back
(``coordinator/dial_check.py``), over real gRPC: the coordinator's ``Membership`` service and
a worker's ``WatchLoad`` served by a real ``MonitorServicer``, both on the internal plane with
the cluster credential.

A registration whose advertised address answers becomes routable within a moment; one whose
address does not (a closed port: a wrong advertise host) stays registered, heartbeating and
unroutable, with one warning naming the address, and becomes routable as soon as something
answers there.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from splitserve.common.kv_layout import KvLayout
from splitserve.common.load import EngineLoad, LoadReport
from splitserve.common.membership import Role, WorkerInfo
from splitserve.coordinator.dial_check import DialCheck
from splitserve.coordinator.membership_servicer import MembershipServicer
from splitserve.coordinator.registry import WorkerRegistry
from splitserve.proto import convert
from splitserve.proto.cluster_access import ClusterAccess
from splitserve.proto.cluster_auth import ClusterCredential
from splitserve.proto.server import RoleServer, start_server
from splitserve.proto.splitserve.v1 import coordinator_pb2, coordinator_pb2_grpc
from splitserve.proto.worker_clients import WorkerChannels
from splitserve.worker.monitor_servicer import MonitorServicer
from tests.etcd import free_port

CREDENTIAL = ClusterCredential.generate()
LAYOUT = KvLayout(
    model="m", dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8
)


async def worker_monitor(port: int = 0) -> RoleServer:
    """A worker's internal server answering ``WatchLoad`` (an idle, ready worker)."""
    monitor = MonitorServicer()

    async def load() -> LoadReport:
        return LoadReport(EngineLoad(num_total_blocks=64), ready=True)

    monitor.bind(load)
    server = await start_server(
        "127.0.0.1", port, lambda s: [monitor.add_to(s)], credential=CREDENTIAL, tls=None
    )
    await server.set_serving(True)
    return server


async def register(membership: coordinator_pb2_grpc.MembershipStub, worker_id: str, port: int):
    info = WorkerInfo(worker_id, Role.DECODE, f"127.0.0.1:{port}", LAYOUT, 64, 512)
    await membership.RegisterWorker(
        coordinator_pb2.RegisterWorkerRequest(worker=convert.worker_info_to_proto(info)),
        metadata=CREDENTIAL.metadata,
    )


async def routable_within(registry: WorkerRegistry, worker_id: str, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if any(w.worker_id == worker_id for w in registry.workers(Role.DECODE)):
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.timeout(60)
def test_only_workers_dialled_back_are_routed_to(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="splitserve.coordinator.dial_check")

    async def scenario() -> None:
        registry = WorkerRegistry()
        channels = WorkerChannels(ClusterAccess(CREDENTIAL))
        dial_check = DialCheck(registry, channels)
        servicer = MembershipServicer(registry, dial_check=dial_check)
        coordinator = await start_server(
            "127.0.0.1",
            0,
            lambda s: (coordinator_pb2_grpc.add_MembershipServicer_to_server(servicer, s), [])[1],
            credential=CREDENTIAL,
            tls=None,
        )
        good = await worker_monitor()
        closed_port = free_port()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            membership = coordinator_pb2_grpc.MembershipStub(channel)
            await register(membership, "good", good.port)
            await register(membership, "unreachable", closed_port)
            assert await routable_within(registry, "good", 10.0)
            assert not await routable_within(registry, "unreachable", 4.0)
            assert registry.get("unreachable") is not None  # registered, just not routed to
            warnings = [r.getMessage() for r in caplog.records]
            assert len(warnings) == 1 and f"127.0.0.1:{closed_port}" in warnings[0]

            late = await worker_monitor(closed_port)  # something answers there now
            assert await routable_within(registry, "unreachable", 10.0)
        await dial_check.close()
        await channels.close()
        for server in (late, good, coordinator):
            await server.server.stop(None)

    asyncio.run(scenario())
