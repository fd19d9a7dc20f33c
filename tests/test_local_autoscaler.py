"""``splitserve up --autoscale``'s loop (``launch/local_autoscaler.py``) over real parts: the
coordinator's metrics families served over HTTP by prometheus_client, real child processes
under a ``Supervisor``, drained with SIGTERM. The whole ``up --autoscale`` with simulated
workers under a ramp: ``test_autoscale_cluster.py`` (slow)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import start_http_server

from splitserve.coordinator.capacity import DesiredWorkers
from splitserve.coordinator.metrics import CoordinatorMetrics
from splitserve.coordinator.registry import WorkerRegistry
from splitserve.launch.local_autoscaler import (
    AutoscaleTargets,
    LocalAutoscaler,
    ScrapeError,
    desired_of,
)
from splitserve.launch.scale_policy import ScalerSettings
from splitserve.launch.supervisor import Supervisor

CHILD = ["tests.draining_child"]


class Figure:
    """What the coordinator's ``desired`` callback returns, changed by the test."""

    def __init__(self) -> None:
        self.value = DesiredWorkers(1.0, 1.0)

    def __call__(self) -> DesiredWorkers:
        return self.value


def _registry(figure: Figure) -> CollectorRegistry:
    registry = CollectorRegistry()
    CoordinatorMetrics(registry, "model", WorkerRegistry(), desired=figure)
    return registry


def test_the_figure_is_read_from_a_coordinators_metrics_page() -> None:
    figure = Figure()
    figure.value = DesiredWorkers(prefill=2.5, decode=0.75)
    text = generate_latest(_registry(figure)).decode()
    assert desired_of(text) == {"prefill": 2.5, "decode": 0.75}
    with pytest.raises(ScrapeError, match="no splitserve_desired_workers"):
        desired_of(generate_latest(CollectorRegistry()).decode())


@pytest.fixture()
def served_figure() -> Iterator[tuple[Figure, str]]:
    figure = Figure()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=_registry(figure))
    try:
        yield figure, f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        thread.join(5)


def test_workers_are_added_and_drained_as_the_figure_asks(
    served_figure: tuple[Figure, str],
) -> None:
    figure, url = served_figure
    said: list[str] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        children = Supervisor(loop, {}, drain_timeout_s=5.0)
        stop = asyncio.Event()
        started = {
            role: [children.start(f"{role}-{i}", CHILD)]
            for i, role in enumerate(("prefill", "decode"))
        }
        settings = ScalerSettings(check_interval_s=60, stabilization_s=0, scale_down_period_s=0)
        autoscaler = LocalAutoscaler(
            children,
            started,
            lambda role, serial: (f"{role}-{serial}", CHILD),
            AutoscaleTargets((url, url), settings, most=3),
            said.append,
            first_serial=2,
        )
        supervising = asyncio.ensure_future(children.supervise(stop))
        try:
            figure.value = DesiredWorkers(prefill=1.2, decode=0.4)  # x2 coordinators: 2.4, 0.8
            await autoscaler.check(stop)
            assert [c.name for c in autoscaler.workers["prefill"]] == [
                "prefill-0",
                "prefill-2",
                "prefill-3",
            ]
            assert [c.name for c in autoscaler.workers["decode"]] == ["decode-1"]
            for child in autoscaler.workers["prefill"]:
                await children.wait_ready(child, stop)
            figure.value = DesiredWorkers(prefill=0.9, decode=0.4)  # 1.8: one worker too many
            await autoscaler.check(stop)
            drained = next(c for c in children.children if c.name == "prefill-3")
            status = await asyncio.wait_for(asyncio.to_thread(drained.process.popen.wait), 10)
            assert status == 0  # it finished its drain: SIGTERM, not SIGKILL
            await asyncio.sleep(1.5)  # past the supervisor's first restart back-off
            names = [c.name for c in children.children]
            assert "prefill-3" not in names  # forgotten, never restarted
            assert children.restarts == 0
            assert [c.name for c in autoscaler.workers["prefill"]] == ["prefill-0", "prefill-2"]
        finally:
            stop.set()
            await supervising
            assert await children.stop_all()

    asyncio.run(asyncio.wait_for(run(), 60))
    assert said[0] == "splitserve up: autoscale prefill 1 -> 3 workers (desired 2.40)"
    assert "splitserve up: autoscale prefill 3 -> 2 workers (desired 1.80)" in said
    assert any(
        line.startswith("splitserve up: autoscale drained prefill-3 (status 0)") for line in said
    )


def test_a_check_that_cannot_read_a_figure_moves_nothing(served_figure: tuple[Figure, str]) -> None:
    _, url = served_figure
    said: list[str] = []

    async def run() -> int:
        children = Supervisor(asyncio.get_running_loop(), {})
        settings = ScalerSettings(stabilization_s=0, scale_down_period_s=0)
        autoscaler = LocalAutoscaler(
            children,
            {},
            lambda role, serial: (f"{role}-{serial}", CHILD),
            AutoscaleTargets((url, "http://127.0.0.1:9/metrics"), settings, most=3),
            said.append,
            first_serial=0,
        )
        await autoscaler.check(asyncio.Event())
        return len(children.children)

    assert asyncio.run(run()) == 0
    assert said and said[0].startswith(
        "splitserve up: autoscale skipped a check: http://127.0.0.1:9"
    )
