"""When an autoscaler adds or drains a worker of one role, given the coordinators' figure.

The one policy behind every autoscaler splitserve runs or models, the HPA's behaviour as
``deploy/base/autoscaling.yaml`` configures it:

- ``splitserve up --autoscale`` (``launch/local_autoscaler.py``) moves real local workers;
- the fleet simulation (``launch/fleet_scaler.py``) moves simulated ones;
- KEDA and the HPA move pods in a cluster (the YAML's settings are ``ScalerSettings``'
  defaults).

The figure is ``splitserve_desired_workers{role}`` summed over coordinators
(``coordinator/capacity.py``), in worker units. Each check wants its ceiling, clamped to
``[least, most]``:

- up at once: to the ceiling, at most ``scale_up_pods`` workers or doubling in one check;
- down one worker per ``scale_down_period_s``, and only below the most the figure wanted over
  the last ``stabilization_s`` (a dip shorter than the window moves nothing: the hysteresis
  that keeps a swinging load from flapping). A scale-down from N to N - 1 happens only once
  the figure says N - 1 workers carry the load: the survivors' added load is in it.

Pure: the caller passes the time; single-threaded.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from splitserve.coordinator.capacity import CapacityTargets


@dataclass(frozen=True)
class ScalerSettings:
    """The autoscaler's settings (``deploy/base/autoscaling.yaml``'s by default) and the
    coordinator's wait budget (``--scale-wait-budget-s``)."""

    check_interval_s: float = 15.0
    """KEDA's ``pollingInterval`` (the HPA syncs as often)."""
    stabilization_s: float = 300.0
    """The HPA's scale-down ``stabilizationWindowSeconds``."""
    scale_down_period_s: float = 60.0
    """One worker down per this (the scale-down policy's ``periodSeconds``)."""
    scale_up_pods: int = 4
    """The HPA's default scale-up: this many workers or doubling, whichever is more."""
    wait_budget_s: float = CapacityTargets.wait_budget_s

    def __post_init__(self) -> None:
        if self.check_interval_s <= 0 or self.stabilization_s < 0:
            raise ValueError("the check interval must be positive, the window not negative")
        if self.scale_down_period_s < 0 or self.scale_up_pods < 1:
            raise ValueError("the scale-down period must not be negative, scale-up at least 1")


class ScalePolicy:
    """One role's moves (module docstring): ``move`` once per check."""

    def __init__(self, settings: ScalerSettings, most: int, least: int = 1) -> None:
        if not 0 <= least <= most:
            raise ValueError(f"a role scales between {least} and {most} workers: not a range")
        self.settings = settings
        self.most = most
        self.least = least
        self._wanted: collections.deque[tuple[float, int]] = collections.deque()
        """(when, workers) each check wanted, over the stabilization window."""
        self._last_down = -math.inf

    def wanted(self, need: float) -> int:
        """The workers a figure of ``need`` asks for, clamped to ``[least, most]``."""
        return max(self.least, min(self.most, math.ceil(need - 1e-9)))

    def move(self, now: float, need: float, active: int) -> int:
        """Workers to add (positive), to drain (-1) or 0, with ``active`` workers of the role
        serving or starting (not those draining) and the coordinators' figure ``need``."""
        wanted = self.wanted(need)
        window = self._wanted
        window.append((now, wanted))
        while window[0][0] < now - self.settings.stabilization_s:
            window.popleft()
        if wanted > active:
            return min(wanted - active, max(self.settings.scale_up_pods, active))
        stabilized = max(count for _, count in window)
        if stabilized < active and now - self._last_down >= self.settings.scale_down_period_s:
            self._last_down = now
            return -1
        return 0
