"""Health means progress: a worker whose engine step runs past ``--stall-timeout`` says it is
not ready, to the coordinators (with its load: they stop routing to it) and on its gRPC health
(NOT_SERVING), and says ready again once its steps end.

The unit tests drive ``StallWatch`` with a step clock they set; the outside-in test uses a
real decode worker with a tiny ``--stall-timeout`` (0.2 s) and a float32 prompt of 800
tokens computed in one step, which takes longer than that on a CPU: while that step runs the
worker is NOT_SERVING and unready in the coordinator's registry, then both come back, and
the request finishes normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import Client, Sampling
from splitserve.common.load import EngineLoad
from splitserve.common.membership import Role
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry
from splitserve.worker.stall_watch import StallWatch
from tests.cluster import CREDENTIAL, internal_address, running, worker_loads

pytestmark = pytest.mark.timeout(300)


class _StepClock:
    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def test_ready_follows_the_running_step() -> None:
    clock = _StepClock()
    watch = StallWatch(clock, stall_timeout_s=5.0)
    assert watch.ready()
    clock.seconds = 5.1
    assert not watch.ready()
    clock.seconds = 0.0  # the step ended
    assert watch.ready()


def test_watch_flips_health_on_transitions_only_and_never_after_stop() -> None:
    async def body() -> list[bool]:
        clock = _StepClock()
        watch = StallWatch(clock, stall_timeout_s=1.0)
        calls: list[bool] = []

        async def set_serving(serving: bool) -> None:
            calls.append(serving)

        stop = asyncio.Event()
        task = asyncio.create_task(watch.watch(set_serving, stop, interval_s=0.01))
        await asyncio.sleep(0.05)
        clock.seconds = 2.0
        await asyncio.sleep(0.05)
        clock.seconds = 0.0
        await asyncio.sleep(0.05)
        clock.seconds = 3.0
        await asyncio.sleep(0.05)
        stop.set()
        clock.seconds = 0.0  # a recovery after stop must not make a draining worker serve
        await task
        await asyncio.sleep(0.03)
        return calls

    assert asyncio.run(body()) == [False, True, False]


def test_a_worker_reported_unready_is_not_routed_until_ready_again() -> None:
    registry = WorkerRegistry(expiry_s=10.0)
    registry.register(WorkerRecord("d", Role.DECODE, "d:1", "h", 16, "float32", 100, 4096))
    load = EngineLoad(num_total_blocks=100)
    assert registry.heartbeat("d", load, ready=False)
    assert registry.workers(Role.DECODE) == []
    assert registry.heartbeat("d", load, ready=True)
    assert [w.worker_id for w in registry.workers(Role.DECODE)] == ["d"]


@pytest.mark.slow  # 10 s; the watch's transitions and the registry's routing are unit-tested
# above, and a frozen real worker is caught in the default suite (test_stream_stalls)
def test_a_long_step_makes_a_real_worker_unready_then_ready() -> None:
    coordinator_argv = ["splitserve.coordinator.main", "--port=0", "--internal-port=0"]
    coordinator_argv.append("--metrics-port=-1")
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(running(coordinator_argv, "splitserve coordinator ready at"))
        worker_argv = ["splitserve.decode.main", "--port=0", "--worker-id=decode-0"]
        worker_argv += [f"--coordinator={internal_address(address)}", "--dtype=float32"]
        worker_argv += ["--threads=1", "--num-blocks=300", "--metrics-port=-1"]
        worker_argv += ["--max-num-batched-tokens=4096", "--stall-timeout=0.2"]
        worker = stack.enter_context(running(worker_argv, "splitserve decode ready at"))
        deadline = time.monotonic() + 120
        while "decode-0" not in worker_loads(address):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with grpc.insecure_channel(worker) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                reply = health.Check(
                    health_pb2.HealthCheckRequest(), timeout=5, metadata=CREDENTIAL.metadata
                )
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            assert serving() and worker_loads(address)["decode-0"].ready
            result: list[int] = []
            prompt = [1000 + (7 * i) % 30000 for i in range(800)]

            def generate() -> None:
                with Client(address) as client:
                    sampling = Sampling(max_tokens=4, temperature=0.0, ignore_eos=True)
                    result.extend(client.generate(token_ids=prompt, sampling=sampling).token_ids)

            thread = threading.Thread(target=generate)
            thread.start()
            seen_not_serving = seen_unready = False
            while thread.is_alive():
                seen_not_serving |= not serving()
                seen_unready |= not worker_loads(address)["decode-0"].ready
                time.sleep(0.05)
            thread.join()
            assert len(result) == 4
            assert seen_not_serving and seen_unready
            deadline = time.monotonic() + 30
            while not (serving() and worker_loads(address)["decode-0"].ready):
                assert time.monotonic() < deadline, "the worker did not become ready again"
                time.sleep(0.1)
