"""A discrete-event simulation of a splitserve fleet serving a workload: the model behind
``splitserve plan`` (``launch/plan.py``).

Pure Python, no processes, no clock: deterministic in the workload, the configuration and the
seed. An event heap moves time from one decision to the next (an arrival, a step's end, a KV
transfer's end, a scaling check); nothing ticks. The fleet (``FleetConfig``) is ``prefill``
prefill, ``decode`` decode and ``dual`` dual-role workers (``launch/fleet_engine.py``: each an
engine stepping by the profile's step-time model, ``engine/sim_profile.py:SimProfile``, with
``FleetParams.kv_tokens_per_worker`` tokens of KV).

The coordinator, as the system's:
- admission by KV (``coordinator/admission.py``, simplified): a request's demand is its
  prompt plus its output (``coordinator/kv_demand.py:KvDemand``); it is admitted at once when
  nobody waits and the demand fits the serving decode workers' free KV and the prefill backlog
  bound (``AdmissionConfig.prefill_backlog_s`` of the cluster's prefill rate, one prompt per
  prompt-computing worker always); else it waits in arrival order, refused at once when the
  queue is full or its predicted wait (the prompt tokens queued ahead over the prefill rate)
  passes ``max_queue_wait_s``, and refused after ``WAIT_BACKSTOP_FACTOR`` x that. A waiter
  that can no longer meet its TTFT target lets those that still can go first.
- routing: the decode worker that decoded the session's previous turn while it has room and
  no prompt waits there, else ``Router.pick_decode``'s score; then
  ``coordinator/placement.py:place`` itself, with its views built from the simulated engines,
  decides local or which prefill worker (``FleetConfig.mode``, ``local_prefill_max_tokens``).
  A prefill worker pulls what the decode worker holds of the prompt beyond its own cache (the
  pull's transfer is added to the push).

Scaling (``FleetConfig.autoscale``): the deployed autoscaler over the coordinator's own
sizing figure (``launch/fleet_scaler.py``).

Measured per request (``RequestOutcome``): queue wait, TTFT from arrival (queue included),
mean inter-token time over its output (aiperf's ITL); per run (``SimResult``): requests within
both targets, goodput, worker-seconds over the workload's duration and so the cost. What the
simulation leaves out: ``SIMPLIFICATIONS``.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.common.load import DEFAULT_PREFILL_CHUNK_TOKENS
from splitserve.common.step_cost import StepCost
from splitserve.coordinator.admission import (
    WAIT_BACKSTOP_FACTOR,
    AdmissionConfig,
    AdmissionSnapshot,
)
from splitserve.coordinator.admitted_requests import context_of
from splitserve.coordinator.capacity import CapacityTargets
from splitserve.coordinator.kv_demand import KvDemand
from splitserve.coordinator.placement import (
    DecodeView,
    PlacementConfig,
    PlacementMode,
    PrefillView,
    RunningRequest,
    place,
)
from splitserve.coordinator.router import CACHED_BLOCK_WEIGHT
from splitserve.engine.sim_profile import SimProfile
from splitserve.launch.fleet_engine import Engine, Flight, Job
from splitserve.launch.fleet_results import RequestOutcome, SimResult
from splitserve.launch.fleet_scaler import ROLES, Scaler
from splitserve.launch.fleet_workload import SimRequest, WorkloadSpec, requests
from splitserve.launch.scale_policy import ScalerSettings

SIMPLIFICATIONS = (
    "admission's predicted wait is the prompt tokens queued ahead over the prefill rate (the "
    "real one plays the admitted requests' ends forward); no tenants, priorities or fair "
    "queuing: one tenant, arrival order",
    "routing: a session goes back to the worker that decoded its last turn (the real router's "
    "rendezvous home); KV is never fragmented or evicted (a prefix stays cached while its "
    "worker lives); a worker's KV admits past its share when no worker has room",
    "a request generates exactly its drawn output length (no early stop, no speculative "
    "decoding); ITL is each request's mean inter-token time",
    "a KV transfer starts when its prompt's last chunk ends (the real push overlaps the "
    "layers' compute) and never contends with another on the link",
    "step times are the profile's fitted means (no spread, no interference); the "
    "coordinator, gateway and network add nothing",
    "no failures; the autoscaler is modelled on its settings (polling, stabilization, one pod "
    "down a minute), not run; dual-role workers do not scale",
)
"""What the simulation leaves out of the real system (``splitserve plan --explain``)."""

DEFAULT_KV_BYTES_PER_TOKEN = 23_040
"""The default model's KV per token (30 layers x 3 KV heads x 64 x K and V x bf16)."""
DEFAULT_TRANSFER_GBPS = 64.0
"""Gbit/s of a KV push where the profile measured none (8 GB/s: ``bench/README.md``'s
4k-token push over UCX)."""
DEFAULT_TRANSFER_LATENCY_S = 0.003
DEFAULT_STARTUP_S = 30.0
"""From asking for a worker to its first token, where the profile measured none."""
KV_BYTES_PER_WORKER = 1 << 30
"""A worker's KV cache (the engine's default ``--kv-cache-gib 1``)."""


@dataclass(frozen=True)
class FleetConfig:
    """What is simulated: worker counts (with ``autoscale``: the most of each scaled role)
    and where prompts are computed (``coordinator/placement.py``'s mode and rule threshold);
    a scaled fleet's coordinator sizes each role to ``scale_utilization`` of a worker's
    capacity (its ``--scale-utilization``)."""

    prefill: int
    decode: int
    dual: int = 0
    mode: PlacementMode = PlacementMode.RULE
    local_prefill_max_tokens: int = 0
    autoscale: bool = False
    scale_utilization: float = CapacityTargets.utilization

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.dual) < 0 or self.decode + self.dual < 1:
            raise ValueError(f"a fleet needs a worker that decodes: {self}")
        if not 0 < self.scale_utilization <= 1:
            raise ValueError(f"scale_utilization must be in (0, 1]: {self}")

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.dual

    def count(self, role: str) -> int:
        return {"prefill": self.prefill, "decode": self.decode, "dual": self.dual}[role]

    @property
    def places(self) -> bool:
        """Whether placement has a choice: some decode worker has a prefill candidate."""
        return self.prefill > 0 or (self.dual > 0 and self.decode + self.dual > 1)

    def describe(self) -> str:
        counts = f"{self.prefill}P+{self.decode}D" + (f"+{self.dual}X" if self.dual else "")
        placement = (
            f"{self.mode.value}<={self.local_prefill_max_tokens}" if self.places else "all local"
        )
        scaled = f" scaled@{self.scale_utilization:g}" if self.autoscale else ""
        return f"{counts} {placement}{scaled}"


@dataclass(frozen=True)
class FleetParams:
    """The machine side: step times, KV, transfers, start-up, the coordinator's settings."""

    cost: StepCost
    kv_tokens_per_worker: int = KV_BYTES_PER_WORKER // DEFAULT_KV_BYTES_PER_TOKEN
    chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    block_size: int = 16
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    transfer_gbps: float = DEFAULT_TRANSFER_GBPS
    transfer_latency_s: float = DEFAULT_TRANSFER_LATENCY_S
    startup_s: float = DEFAULT_STARTUP_S
    admission: AdmissionConfig = AdmissionConfig()
    scaler: ScalerSettings = ScalerSettings()

    @classmethod
    def from_profile(cls, profile: SimProfile, **overrides: Any) -> FleetParams:
        """The profile's step times, and its KV, link and start-up figures where it has them
        (a profile written before they were recorded reads 0 or lacks them: the defaults)."""
        kv_bytes = getattr(profile, "kv_bytes_per_token", 0) or DEFAULT_KV_BYTES_PER_TOKEN
        values: dict[str, Any] = {
            "cost": profile.step_cost,
            "kv_bytes_per_token": kv_bytes,
            "kv_tokens_per_worker": KV_BYTES_PER_WORKER // kv_bytes,
            "transfer_gbps": getattr(profile, "transfer_gbps", 0.0) or DEFAULT_TRANSFER_GBPS,
            "transfer_latency_s": getattr(profile, "transfer_latency_s", 0.0)
            or DEFAULT_TRANSFER_LATENCY_S,
            "startup_s": getattr(profile, "startup_s", 0.0) or DEFAULT_STARTUP_S,
        }
        values.update(overrides)
        return cls(**values)

    def transfer_s(self, num_tokens: int) -> float:
        """One prompt's KV over the link: latency plus bytes over bandwidth."""
        bits = num_tokens * self.kv_bytes_per_token * 8
        return self.transfer_latency_s + bits / (self.transfer_gbps * 1e9)

    @property
    def prefill_tokens_per_s(self) -> float:
        """One worker's prompt rate at a full chunk (as admission reads a worker's)."""
        return self.cost.prefill_tokens_per_s(self.chunk_tokens)


# ---- the run ----------------------------------------------------------------------------------


class _Run:
    """One simulation: the event heap, the coordinator (admission, routing, placement) and the
    scaler, over the engines."""

    def __init__(
        self,
        config: FleetConfig,
        params: FleetParams,
        workload: WorkloadSpec,
        stream: Sequence[SimRequest],
    ) -> None:
        self.config = config
        self.params = params
        self.workload = workload
        self.stream = stream
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._sequence = itertools.count()
        self.engines: list[Engine] = []
        self._ids = collections.Counter[str]()
        self.flights = [
            Flight(r, KvDemand.of(r.prompt_tokens, r.output_tokens, params.block_size))
            for r in stream
        ]
        self._home: dict[int, Engine] = {}
        """Session -> the engine that decoded its last turn."""
        self._admitted_kv = 0
        self._admitted = 0
        self._context_sum = 0.0
        """Of the admitted requests: their number and ``context_of`` sum."""
        self._backlog_tokens = 0
        self._backlog_prompts = 0
        self._on_time: collections.deque[Flight] = collections.deque()
        self._late: collections.deque[Flight] = collections.deque()
        self.waiting_tokens = 0
        self._scaler = Scaler(self) if config.autoscale else None

    # ---- events ----

    def at(self, when: float, action: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (when, next(self._sequence), action, args))

    def run(self) -> None:
        if self._scaler is not None:
            self._scaler.begin()
        else:
            for role in ROLES:
                for _ in range(self.config.count(role)):
                    self.add_engine(role, ready_s=0.0)
        if self.flights:
            self.at(self.flights[0].request.arrival_s, self._arrive, 0)
        events = self._events
        while events:
            when, _, action, args = heapq.heappop(events)
            self.now = when
            action(*args)

    def add_engine(self, role: str, ready_s: float) -> Engine:
        worker_id = f"{role[0]}{self._ids[role]}"
        self._ids[role] += 1
        engine = Engine(self, worker_id, role, self.now, ready_s)
        self.engines.append(engine)
        self.at(ready_s, self._ready, engine)
        return engine

    def _ready(self, engine: Engine) -> None:
        engine.start()
        self._serve()

    def retire(self, engine: Engine) -> None:
        """A draining engine that holds nothing leaves (its cache with it)."""
        if engine.left_s is None:
            engine.left_s = self.now
            for session in [s for s, e in self._home.items() if e is engine]:
                del self._home[session]

    # ---- admission ----

    def _arrive(self, index: int) -> None:
        if index + 1 < len(self.flights):
            self.at(self.flights[index + 1].request.arrival_s, self._arrive, index + 1)
        flight = self.flights[index]
        if self._scaler is not None:
            self._scaler.arrived(flight.request)
        if not self._on_time and not self._late and self._fits(flight):
            self._admit(flight)
            return
        admission = self.params.admission
        queued = len(self._on_time) + len(self._late)
        wait_s = (
            self.waiting_tokens + self._backlog_tokens + flight.request.prompt_tokens
        ) / self._prefill_rate()
        if queued >= admission.max_queued_requests:
            flight.refused = "queue_full"
        elif wait_s > admission.max_queue_wait_s:
            flight.refused = "predicted_wait"
        if flight.refused:
            return
        self._on_time.append(flight)
        self.waiting_tokens += flight.request.prompt_tokens
        backstop = admission.max_queue_wait_s * WAIT_BACKSTOP_FACTOR
        self.at(self.now + backstop, self._waited_out, flight)

    def _waited_out(self, flight: Flight) -> None:
        if flight.admitted_s is not None:
            return
        (self._late if flight.late else self._on_time).remove(flight)
        self.waiting_tokens -= flight.request.prompt_tokens
        flight.refused = "waited_out"

    def _decoders(self) -> list[Engine]:
        return [e for e in self.engines if e.decodes and e.serving]

    def _prompt_workers(self) -> int:
        """Workers that may compute prompts (admission's prefill rate adds theirs up)."""
        config = self.config
        decode_computes = (
            not config.prefill
            or config.mode is not PlacementMode.RULE
            or config.local_prefill_max_tokens > 0
        )
        return sum(
            1
            for e in self.engines
            if e.serving and (e.computes_for_others or (decode_computes and e.decodes))
        )

    def _prefill_rate(self) -> float:
        return max(1, self._prompt_workers()) * self.params.prefill_tokens_per_s

    def _fits(self, flight: Flight) -> bool:
        """Room in the serving decode workers' KV and in the prefill backlog (alone: yes)."""
        if not self._decoders():
            return False
        if self._admitted_kv == 0 and self._backlog_prompts == 0:
            return True
        capacity = len(self._decoders()) * self.params.kv_tokens_per_worker
        if self._admitted_kv + flight.demand.num_tokens > capacity:
            return False
        limit = self.params.admission.prefill_backlog_s * self._prefill_rate()
        return (
            self._backlog_prompts < max(1, self._prompt_workers())
            or self._backlog_tokens + flight.request.prompt_tokens <= limit
        )

    def _serve(self) -> None:
        """Admit waiters in order while the next fits; a late head yields to those on time."""
        yields = self.params.admission.late_waiters_yield
        while self._on_time or self._late:
            if yields:
                self._move_late_heads()
            flight = self._on_time[0] if self._on_time else self._late[0]
            if not self._fits(flight):
                return
            (self._on_time if self._on_time else self._late).popleft()
            self.waiting_tokens -= flight.request.prompt_tokens
            self._admit(flight)

    def _move_late_heads(self) -> None:
        rate = self._prefill_rate()
        ttft_s = self.workload.slo.ttft_s
        while self._on_time:
            head = self._on_time[0]
            if self.now + head.request.prompt_tokens / rate <= head.request.arrival_s + ttft_s:
                return
            head.late = True
            self._late.append(self._on_time.popleft())

    def _admit(self, flight: Flight) -> None:
        flight.admitted_s = self.now
        self._admitted_kv += flight.demand.num_tokens
        self._admitted += 1
        self._context_sum += context_of(flight.demand)
        self._backlog_tokens += flight.request.prompt_tokens
        self._backlog_prompts += 1
        self._route(flight)

    def first_token(self, flight: Flight) -> None:
        flight.first_token_s = self.now
        self._backlog_tokens -= flight.request.prompt_tokens
        self._backlog_prompts -= 1
        self._serve()

    def finished(self, flight: Flight) -> None:
        flight.finished_s = self.now
        self._admitted_kv -= flight.demand.num_tokens
        self._admitted -= 1
        self._context_sum -= context_of(flight.demand)
        decode = flight.decode
        assert decode is not None
        decode.kv_used -= flight.demand.num_tokens
        if flight.request.session >= 0:
            self._home[flight.request.session] = decode
        self._serve()

    def admission_snapshot(self) -> AdmissionSnapshot:
        """Admission's figures as the coordinator's sizing reads them."""
        slo = self.workload.slo
        return AdmissionSnapshot(
            capacity_tokens=len(self._decoders()) * self.params.kv_tokens_per_worker,
            admitted_tokens=self._admitted_kv,
            num_admitted=self._admitted,
            num_queued=len(self._on_time) + len(self._late),
            queued_prompt_tokens=self.waiting_tokens,
            tpot_s=slo.tpot_s,
            ttft_s=slo.ttft_s,
            prefill_backlog_tokens=self._backlog_tokens,
            prefill_drain_tokens_per_s=None,
        )

    @property
    def average_context_tokens(self) -> float:
        return self._context_sum / self._admitted if self._admitted else 0.0

    # ---- routing and placement ----

    def _route(self, flight: Flight) -> None:
        request = flight.request
        decode = self._pick_decode(flight)
        flight.decode = decode
        decode.kv_used += flight.demand.num_tokens
        decode.holds += 1
        candidates = [e for e in self.engines if e.computes_for_others and e.serving]
        candidates = [e for e in candidates if e is not decode]
        decode_cached = decode.cached_tokens(request)
        views = [self._prefill_view(e, request, decode_cached) for e in candidates]
        slo = self.workload.slo
        config = self.config
        placement = place(
            request.prompt_tokens,
            request.output_tokens,
            DecodeView(
                cost=self.params.cost,
                running_requests=decode.batch,
                running_tokens=decode.context,
                queued_tokens=decode.queued_tokens,
                prefill_share=decode.prefill_share,
                chunk_tokens=self.params.chunk_tokens,
                running=_Lazy(lambda: decode.running(self.now, slo.tpot_s)),
                cached_tokens=decode_cached,
            ),
            views,
            slo,
            config.mode,
            PlacementConfig(config.local_prefill_max_tokens),
            self.now - request.arrival_s,
        )
        flight.placed = placement.where
        if placement.prefill_worker_id is None:
            decode.enqueue(Job(flight, max(1, request.prompt_tokens - decode_cached), decode))
            return
        index = next(i for i, v in enumerate(views) if v.worker_id == placement.prefill_worker_id)
        view, prefill = views[index], candidates[index]
        pull_s = self.params.transfer_s(view.pulled_tokens) if view.pulled_tokens else 0.0
        tokens = max(1, request.prompt_tokens - view.cached_tokens)
        prefill.enqueue(Job(flight, tokens, decode, pull_s))

    def _prefill_view(self, engine: Engine, request: SimRequest, decode_cached: int) -> PrefillView:
        own = engine.cached_tokens(request)
        block = self.params.block_size
        pulled = decode_cached - own if decode_cached - own >= block else 0
        return PrefillView(
            worker_id=engine.id,
            cost=self.params.cost,
            queued_tokens=engine.queued_tokens,
            cached_tokens=own + pulled,
            pulled_tokens=pulled,
            batch_requests=engine.batch if engine.decodes else 0,
            batch_tokens=engine.context if engine.decodes else 0,
            chunk_tokens=self.params.chunk_tokens,
            prefill_share=engine.prefill_share,
        )

    def _pick_decode(self, flight: Flight) -> Engine:
        """The session's last decode worker while it has room and no prompt waits there,
        else ``Router.pick_decode``'s score (free blocks after this request, less the running
        batch's, less 4 per waiting prompt, plus ``CACHED_BLOCK_WEIGHT`` per cached block)."""
        request = flight.request
        candidates = self._decoders()
        need = flight.demand.num_tokens
        capacity = self.params.kv_tokens_per_worker
        home = self._home.get(request.session)
        if (
            home is not None
            and home in candidates
            and home.kv_used + need <= capacity
            and not home.queue
        ):
            return home
        block = self.params.block_size

        def score(engine: Engine) -> float:
            free_blocks = (capacity - engine.kv_used - need) / block
            cached_blocks = engine.cached_tokens(request) / block
            return (
                free_blocks
                - engine.context / block
                - 4 * len(engine.queue)
                + CACHED_BLOCK_WEIGHT * cached_blocks
            )

        return max(candidates, key=score)


class _Lazy:
    """An iterable built afresh on each iteration (placement reads the running requests only
    where its guard needs them)."""

    def __init__(self, build: Callable[[], Iterator[RunningRequest]]) -> None:
        self._build = build

    def __iter__(self) -> Iterator[RunningRequest]:
        return self._build()


# ---- the entry point ----------------------------------------------------------------------------


def simulate(
    config: FleetConfig,
    params: FleetParams,
    workload: WorkloadSpec,
    seed: int = 0,
    stream: Sequence[SimRequest] | None = None,
) -> SimResult:
    """Serve ``workload``'s requests (drawn with ``seed``, or ``stream`` when given) with the
    fleet ``config`` on ``params``' machines; every request ends (served or refused) before
    it returns."""
    began = time.perf_counter()
    drawn = requests(workload, seed) if stream is None else stream
    run = _Run(config, params, workload, drawn)
    run.run()
    horizon = workload.duration_s
    worker_seconds = sum(
        max(0.0, min(e.left_s if e.left_s is not None else horizon, horizon) - e.asked_s)
        for e in run.engines
    )
    return SimResult(
        config=config,
        workload=workload.name,
        seed=seed,
        duration_s=horizon,
        ttft_slo_s=workload.slo.ttft_s,
        itl_slo_s=workload.slo.tpot_s,
        outcomes=tuple(_outcome(f) for f in run.flights),
        worker_seconds=worker_seconds,
        peak_workers=_peak_workers(run.engines),
        peak_by_role=tuple(
            (role, _peak_workers([e for e in run.engines if e.role == role]))
            for role in ROLES
            if config.count(role)
        ),
        wall_s=time.perf_counter() - began,
    )


def _outcome(flight: Flight) -> RequestOutcome:
    request = flight.request
    return RequestOutcome(
        request.arrival_s,
        request.prompt_tokens,
        request.output_tokens,
        flight.admitted_s,
        flight.first_token_s,
        flight.finished_s,
        flight.refused,
        flight.placed,
    )


def _peak_workers(engines: Sequence[Engine]) -> int:
    """The most workers paid for at once."""
    changes = sorted(
        [(e.asked_s, 1) for e in engines]
        + [(e.left_s, -1) for e in engines if e.left_s is not None],
        key=lambda change: (change[0], change[1]),
    )
    most = live = 0
    for _, delta in changes:
        live += delta
        most = max(most, live)
    return most
