"""What an engine publishes about itself: immutable reports, built on the engine thread.

``AsyncEngine`` builds an ``EngineReport`` on its engine thread after every step, every batch
of commands and every serving of its reservation queue, and swaps it in as
``AsyncEngine.latest_report`` (one reference assignment: a reader on any thread gets a whole
report, never a half-updated one); then it hands the report to its report listeners and only
then posts that round's outputs to their callers' event loops. So whoever saw a request's
output finds its effect in the latest report, and nothing outside the engine thread reads the
live scheduler: the metrics thread and the load reporter read reports only.

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.common.load import EngineLoad
from splitserve.common.step_cost import StepShape


@dataclass(frozen=True)
class StepTiming:
    """One step's wall time and what the step-time model predicted for it beforehand."""

    seconds: float
    predicted_s: float
    """0 where the model had not yet seen enough steps of this step's kinds."""
    shape: StepShape = StepShape(0, 0, 0)
    """What the step computed (the step-cost model's features)."""
    ran_ahead: bool = False
    """The step was launched before the step before it was read (``EngineCore.steps_ahead``)."""


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's counters, monotonically increasing. Immutable: the scheduler replaces
    its ``stats`` with a new object as it counts, so a report can hold one as it is."""

    num_preemptions: int = 0
    num_finished_requests: int = 0
    """Requests that ended (any reason, aborts included)."""
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_prompt_tokens_computed: int = 0
    """Prompt tokens run through the model (cached and remote-prefilled ones excluded)."""
    num_generation_tokens: int = 0
    """Tokens sampled on this engine."""
    num_draft_tokens: int = 0
    """Speculated tokens verified (``engine/scheduler.py``)."""
    num_accepted_draft_tokens: int = 0
    """Of those, the ones the model chose too (kept as output)."""


@dataclass(frozen=True)
class RequestPhases:
    """When a request that ended on this engine passed each point (``time.monotonic``)."""

    request_id: str
    arrival_time: float
    first_scheduled_time: float | None
    """When it first left the waiting queue; None: it never ran (aborted while waiting)."""
    first_token_time: float | None
    """When its first output token was sampled (end of prefill); None: none was."""
    finished_time: float


@dataclass(frozen=True)
class EngineReport:
    """One engine's state as of the end of a step or command batch (the defaults: an engine
    at rest that has run nothing)."""

    load: EngineLoad = field(default_factory=EngineLoad)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    finished: tuple[RequestPhases, ...] = ()
    """Requests that ended since the previous report, in the order they ended: each ended
    request is in exactly one report."""
    step: StepTiming | None = None
    """The engine step this report follows (each step that ran is in exactly one report);
    None after a command batch or a reservation grant."""
    lora_requests: tuple[AdapterRequests, ...] = ()
    """Per LoRA adapter served or still taken by a request: its requests running and
    waiting (``EngineCore.lora_requests``), by name."""


@dataclass(frozen=True)
class AdapterRequests:
    """One LoRA adapter's requests on an engine: ``running`` in the batch, ``waiting`` for a
    place (queued, or parked with their KV while ``--max-loras`` leaves their adapter no
    room: ``engine/scheduler.py``)."""

    adapter: str
    running: int
    waiting: int
