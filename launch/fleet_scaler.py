"""The deployed autoscaler, modelled for the fleet simulation (``launch/fleet_sim.py``, a
``FleetConfig`` with ``autoscale``): what scales a fleet while its rate changes.

As deployed (``deploy/base/autoscaling.yaml``; the moves are ``launch/scale_policy.py``'s,
which ``splitserve up --autoscale`` makes too): the configuration's counts are each scaled
role's most (``maxReplicaCount``; dual-role workers do not scale, the deployment has no
autoscaler for them). Every ``ScalerSettings.check_interval_s`` the coordinator's own figure,
``coordinator/capacity.py:desired_workers`` (demand measured at the input: the
``DemandMeter`` over every arrival, refused ones included, and the prompt tokens waiting in
admission and the prefill backlog over the wait budget; at ``FleetConfig.scale_utilization``
of a worker's capacity), sets each role to its ceiling, at least one: up at once (at most
``scale_up_pods`` workers or doubling in one check), down to the most it asked for over
``stabilization_s``, one worker per ``scale_down_period_s`` (a scale-down to N - 1 only once
the figure says N - 1 carry the load). A worker asked for serves ``FleetParams.startup_s``
later and is paid from the ask; a retired one drains what it holds before it leaves. The
fleet starts at one worker of each scaled role (``minReplicaCount``), serving, and grows from
the first check. So the configuration's counts only cap the fleet: a run that never reached
its caps is the run of any larger caps too (``launch/plan.py:Evaluator`` reuses it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from splitserve.coordinator.admission import AdmissionSnapshot
from splitserve.coordinator.capacity import (
    CapacityTargets,
    DemandMeter,
    WorkerView,
    desired_workers,
)
from splitserve.launch.fleet_engine import Engine
from splitserve.launch.fleet_workload import SimRequest, WorkloadSpec
from splitserve.launch.scale_policy import ScalePolicy

if TYPE_CHECKING:
    from splitserve.launch.fleet_sim import FleetConfig, FleetParams

ROLES = ("prefill", "decode", "dual")
SCALED_ROLES = ("prefill", "decode")


class ScalerHost(Protocol):
    """What the scaler reads of and does to the simulation it runs in."""

    now: float
    config: FleetConfig
    params: FleetParams
    workload: WorkloadSpec
    engines: list[Engine]
    average_context_tokens: float

    def at(self, when: float, action: Callable[..., None], *args: Any) -> None: ...

    def add_engine(self, role: str, ready_s: float) -> Engine: ...

    def retire(self, engine: Engine) -> None: ...

    def admission_snapshot(self) -> AdmissionSnapshot: ...


class Scaler:
    """The deployed autoscaler over a ``_Run`` of a scaled config (module docstring)."""

    def __init__(self, run: ScalerHost) -> None:
        self.run = run
        self.settings = run.params.scaler
        self.meter = DemandMeter(clock=lambda: run.now)
        self.targets = CapacityTargets(
            tpot_s=run.workload.slo.tpot_s,
            wait_budget_s=self.settings.wait_budget_s,
            utilization=run.config.scale_utilization,
        )
        self.policies = {
            role: ScalePolicy(self.settings, most=max(1, run.config.count(role)))
            for role in SCALED_ROLES
        }

    def begin(self) -> None:
        """Start at one worker of each scaled role (``minReplicaCount``) and every dual-role
        one, serving at once; check from then on."""
        for role in ROLES:
            most = self.run.config.count(role)
            for _ in range(min(most, 1) if role in SCALED_ROLES else most):
                self.run.add_engine(role, ready_s=0.0)
        self.run.at(self.settings.check_interval_s, self.check)

    def arrived(self, request: SimRequest) -> None:
        self.meter.arrived(request.prompt_tokens)

    def check(self) -> None:
        """The coordinator's figure (``desired_workers``) per role, and the autoscaler's move."""
        run = self.run
        if run.now < run.workload.duration_s:
            run.at(run.now + self.settings.check_interval_s, self.check)
        view = WorkerView(run.params.cost, run.params.kv_tokens_per_worker)
        live = [e for e in run.engines if e.left_s is None]
        desired = desired_workers(
            self.meter.rates(),
            run.admission_snapshot(),
            run.average_context_tokens,
            [view for e in live if e.computes_for_others],  # prefill-role members
            [view for e in live if e.decodes],  # decode-role members
            self.targets,
        )
        for role, need in (("prefill", desired.prefill), ("decode", desired.decode)):
            if run.config.count(role):
                self._resize(role, need)

    def _resize(self, role: str, need: float) -> None:
        run = self.run
        live = [e for e in run.engines if e.role == role and e.left_s is None]
        active = [e for e in live if not e.draining]
        move = self.policies[role].move(run.now, need, len(active))
        for _ in range(max(move, 0)):
            draining = [e for e in live if e.draining]
            if draining:  # take one back before asking for a new one
                draining[0].draining = False
                draining[0].start()
            else:
                run.add_engine(role, ready_s=run.now + run.params.startup_s)
        if move < 0:
            self._retire_one(active)

    def _retire_one(self, active: list[Engine]) -> None:
        """Drain the least loaded worker (one still starting first)."""
        run = self.run
        engine = min(active, key=lambda e: (e.ready_s <= run.now, e.holds, e.batch))
        engine.draining = True
        if engine.ready_s > run.now or not (engine.holds or engine.stepping):
            run.retire(engine)
