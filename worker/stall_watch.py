"""Health that means progress: a worker whose engine step has run for longer than
``--stall-timeout`` is not ready (torch-free).

``StallWatch.ready()`` is what the worker reports with its load (the coordinators stop
routing to it: ``coordinator/registry.py:WorkerRegistry.heartbeat``) and, through ``watch``,
its gRPC health (NOT_SERVING while stalled, SERVING again once steps end), so that a
Kubernetes probe or a load balancer sees it too. A step is the only place the engine can
hang (a hook that never returns, a deadlock); a long but finite step (a long prompt on a
slow CPU) is why the timeout is generous.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from splitserve.common.event_wait import wait_event

logger = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT_S = 120.0
CHECK_INTERVAL_S = 1.0


class StallWatch:
    """``step_running_s``: seconds the engine's current step has run (0 between steps)."""

    def __init__(self, step_running_s: Callable[[], float], stall_timeout_s: float) -> None:
        self._step_running_s = step_running_s
        self.stall_timeout_s = stall_timeout_s

    def ready(self) -> bool:
        return self._step_running_s() <= self.stall_timeout_s

    async def watch(
        self,
        set_serving: Callable[[bool], Awaitable[None]],
        stop: asyncio.Event,
        interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        """Until ``stop``: NOT_SERVING when a stall begins, SERVING when it ends (never
        after ``stop``: a draining worker stays NOT_SERVING)."""
        serving = True
        while not stop.is_set():
            if await wait_event(stop, interval_s):
                return
            ready = self.ready()
            if ready != serving:
                serving = ready
                if ready:
                    logger.warning("engine steps again: serving")
                else:
                    logger.error(
                        "engine step running for %.0f s (> --stall-timeout %.0f s): not serving",
                        self._step_running_s(),
                        self.stall_timeout_s,
                    )
                await set_serving(ready)
