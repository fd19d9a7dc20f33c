"""``splitserve up --autoscale``: add and drain local prefill and decode workers as the
coordinators ask.

Every ``--autoscale-interval-s`` the autoscaler reads each coordinator's
``splitserve_desired_workers{role}`` from its /metrics (the figure KEDA scales pods on in a
cluster: ``coordinator/capacity.py``), sums it over coordinators, and moves each role as
``launch/scale_policy.py:ScalePolicy`` says:

- **add**: ``Supervisor.start`` a worker (``commands.py:scaled_worker_argv``) that registers
  with the coordinators like the others; it counts as the role's from its start (a worker
  asked for is paid for while it starts), so a slow start is not asked for twice;
- **drain**: ``Supervisor.retire`` one worker (SIGTERM: it leaves the membership, so nothing
  new is routed to it, finishes every request it holds within ``--drain-timeout``, and
  exits; it is never restarted). A worker still starting goes first, else the newest.

A check whose figures cannot all be read (a coordinator restarting) moves nothing. Each move
is said in one line: ``splitserve up: autoscale <role> <before> -> <after> workers (desired
<figure>)``. Single event loop; the scrapes run on threads.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.event_wait import wait_event
from splitserve.launch.child_process import ReadyError
from splitserve.launch.scale_policy import ScalePolicy, ScalerSettings
from splitserve.launch.supervisor import Child, Stopped, Supervisor

SCALED_ROLES = ("prefill", "decode")
DESIRED_METRIC = "splitserve_desired_workers"
SCRAPE_TIMEOUT_S = 2.0


class ScrapeError(Exception):
    """A coordinator's figure could not be read."""


def desired_of(metrics_text: str) -> dict[str, float]:
    """``splitserve_desired_workers`` by role from a /metrics page (Prometheus text format);
    ``ScrapeError`` when the page has no such figure for a scaled role."""
    desired: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == DESIRED_METRIC:
            for sample in family.samples:
                desired[sample.labels.get("role", "")] = sample.value
    missing = [role for role in SCALED_ROLES if role not in desired]
    if missing:
        raise ScrapeError(f"no {DESIRED_METRIC} for {', '.join(missing)}")
    return desired


def scrape_desired(url: str) -> dict[str, float]:
    """One coordinator's figure, read from its metrics ``url``; ``ScrapeError`` otherwise."""
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:  # noqa: S310
            return desired_of(response.read().decode("utf-8"))
    except (OSError, urllib.error.URLError, ValueError) as error:
        raise ScrapeError(f"{url}: {error}") from error


@dataclass(frozen=True)
class AutoscaleTargets:
    """What the local autoscaler works with."""

    metrics_urls: tuple[str, ...]
    """Each coordinator's /metrics."""
    settings: ScalerSettings
    most: int
    """The most workers of each scaled role (``--max-workers``)."""


class LocalAutoscaler:
    """Moves ``up``'s own workers (module docstring)."""

    def __init__(
        self,
        children: Supervisor,
        workers: dict[str, list[Child]],
        new_worker: Callable[[str, int], tuple[str, list[str]]],
        targets: AutoscaleTargets,
        say: Callable[[str], None],
        first_serial: int,
    ) -> None:
        """``workers``: each scaled role's children ``up`` started (kept current here);
        ``new_worker(role, serial)``: (name, module and flags) of one more."""
        self._children = children
        self.workers = {role: list(workers.get(role, [])) for role in SCALED_ROLES}
        self._new_worker = new_worker
        self._targets = targets
        self._say = say
        self._serial = first_serial
        self._policies = {
            role: ScalePolicy(targets.settings, most=targets.most) for role in SCALED_ROLES
        }
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Check every interval until ``stop``; then wait for the drains under way."""
        targets = self._targets
        self._say(
            f"splitserve up: autoscaling prefill and decode workers between 1 and "
            f"{targets.most} each, on splitserve_desired_workers of "
            f"{', '.join(targets.metrics_urls)} every {targets.settings.check_interval_s:g} s"
        )
        try:
            while not await wait_event(stop, self._targets.settings.check_interval_s):
                try:
                    await self.check(stop)
                except Exception as error:  # noqa: BLE001 - said, and the next check runs
                    self._say(f"splitserve up: autoscale check failed: {error!r}")
        finally:
            for task in list(self._tasks):
                task.cancel()

    async def check(self, stop: asyncio.Event) -> None:
        """One check: read every coordinator's figure and move each role."""
        try:
            figures = await asyncio.gather(
                *(asyncio.to_thread(scrape_desired, url) for url in self._targets.metrics_urls)
            )
        except ScrapeError as error:
            self._say(f"splitserve up: autoscale skipped a check: {error}")
            return
        now = time.monotonic()
        for role in SCALED_ROLES:
            need = sum(figure[role] for figure in figures)
            active = self.workers[role]
            move = self._policies[role].move(now, need, len(active))
            if move:
                after = len(active) + move
                self._say(
                    f"splitserve up: autoscale {role} {len(active)} -> {after} workers "
                    f"(desired {need:.2f})"
                )
            for _ in range(max(move, 0)):
                self._add(role, stop)
            if move < 0:
                self._drain_one(role)

    def _add(self, role: str, stop: asyncio.Event) -> None:
        name, argv = self._new_worker(role, self._serial)
        self._serial += 1
        child = self._children.start(name, argv, engine=True)
        self.workers[role].append(child)
        self._spawn(self._announce_ready(child, stop))

    async def _announce_ready(self, child: Child, stop: asyncio.Event) -> None:
        try:
            address = await self._children.wait_ready(child, stop)
        except (Stopped, ReadyError):  # a failed start is the supervisor's to restart
            return
        self._say(f"splitserve up: autoscale added {child.name}, ready at {address}")

    def _drain_one(self, role: str) -> None:
        """Retire a worker still starting, else the newest (``Supervisor.retire`` drains)."""
        workers = self.workers[role]
        starting = [child for child in workers if not _announced_ready(child)]
        child = (starting or workers)[-1]
        workers.remove(child)
        self._spawn(self._retire(child))

    async def _retire(self, child: Child) -> None:
        result = await self._children.retire(child)
        how = "killed after its drain timeout" if result.killed else f"status {result.status}"
        self._say(f"splitserve up: autoscale drained {child.name} ({how})")

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _announced_ready(child: Child) -> bool:
    return any(what.endswith(" ready") for what in child.process.announcements())


def scaled_children(children: Sequence[Child]) -> dict[str, list[Child]]:
    """``up``'s start-up workers by scaled role, from their names (``<role>-<index>``)."""
    return {
        role: [child for child in children if child.name.startswith(f"{role}-")]
        for role in SCALED_ROLES
    }
