"""One simulated worker of ``launch/fleet_sim.py``: its engine's steps, batch and prompt queue.

An engine steps as the real scheduler does, in outline: each step decodes one token of every
request in its batch (``common/step_cost.py:StepCost.decode_step_s`` of the batch and its
context) and computes up to ``chunk_tokens`` prompt tokens of its queue, first in first out
(``StepCost.prefill_s`` of them); a prefill worker's steps are prompt chunks only, a decode
worker's prompts are the ones placement computes there (local), a dual-role worker's both. A
prompt computed where it decodes has its first token at the end of the step that computed its
last chunk; one computed elsewhere has its KV pushed (``FleetParams.transfer_s``) and its
first token from the decode worker's first step with it. Between changes a decode batch's
steps are summed in closed form (the context grows by the batch size each step), so a run of
steps up to the next request's end is one event (a segment), cut at the end of the step in
progress when anything joins.

What the coordinator does to an engine (``enqueue`` a prompt, ``receive`` a pushed prompt's
KV) takes effect at its next step boundary; what an engine tells the coordinator (a first
token, a request's end) goes through its ``EngineHost``. Each engine keeps its prefix cache
as session -> tokens held (a decode worker: a conversation's last prompt and reply once its
turn ended there; a prefill worker: the prompts it computed), and the share of its recent
time spent on prompts (``prefill_share``, decaying over ``SHARE_WINDOW_S``), which placement
reads.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from splitserve.coordinator.kv_demand import KvDemand
from splitserve.coordinator.placement import RunningRequest
from splitserve.launch.fleet_workload import SimRequest

if TYPE_CHECKING:
    from splitserve.launch.fleet_sim import FleetParams

SHARE_WINDOW_S = 10.0
"""The decay time of an engine's prompt share (``common/busy_share.py``'s window)."""


class EngineHost(Protocol):
    """What an engine needs of the simulation it runs in."""

    now: float
    params: FleetParams

    def at(self, when: float, action: Callable[..., None], *args: Any) -> None:
        """Call ``action(*args)`` at simulated time ``when``."""

    def first_token(self, flight: Flight) -> None:
        """``flight``'s first token came now."""

    def finished(self, flight: Flight) -> None:
        """``flight``'s last token came now (its decode worker released it)."""

    def retire(self, engine: Engine) -> None:
        """A draining engine holds nothing any more: it leaves now."""


class Flight:
    """One request in flight (mutable; the run reads its outcome off it at the end)."""

    __slots__ = (
        "request",
        "demand",
        "admitted_s",
        "first_token_s",
        "finished_s",
        "refused",
        "placed",
        "decode",
        "join_step",
        "finish_step",
        "context0",
        "late",
    )

    def __init__(self, request: SimRequest, demand: KvDemand) -> None:
        self.request = request
        self.demand = demand
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.refused = ""
        self.placed = ""
        self.decode: Engine | None = None
        self.join_step = 0
        self.finish_step = 0
        self.context0 = 0
        self.late = False


@dataclass
class Job:
    """Prompt tokens an engine is to compute for ``flight``, decoded on ``destination``."""

    flight: Flight
    tokens_left: int
    destination: Engine
    extra_transfer_s: float = 0.0


class Engine:
    """One worker's engine: a FIFO of prompt chunks and (decode roles) a decode batch.

    Invariants: ``batch`` requests run, attending over ``context`` tokens in all; ``finishes``
    holds each running request's last step (``step`` counts this engine's steps);
    ``awaiting`` are running requests whose first token is the next step's; ``queued_tokens``
    is the prompt tokens queued or in the step in progress; ``holds`` counts the requests
    routed here and not ended and the jobs not computed (a retired worker leaves at 0)."""

    def __init__(self, sim: EngineHost, worker_id: str, role: str, asked_s: float, ready_s: float):
        self.sim = sim
        self.id = worker_id
        self.role = role
        self.decodes = role != "prefill"
        self.computes_for_others = role != "decode"
        self.asked_s = asked_s
        self.ready_s = ready_s
        self.left_s: float | None = None
        self.draining = False
        self.queue: collections.deque[Job] = collections.deque()
        self.queued_tokens = 0
        self.batch = 0
        self.context = 0
        self.finishes: list[tuple[int, int, Flight]] = []
        self.awaiting: list[Flight] = []
        self.joining: list[Flight] = []
        self.step = 0
        self.version = 0
        self.stepping = False
        self.segment: tuple[float, int, int, int] | None = None
        """(start, steps, batch, context) of a run of decode-only steps in progress."""
        self.kv_used = 0
        self.holds = 0
        self.cached: dict[int, int] = {}
        """Session -> tokens of its context this engine holds in its prefix cache."""
        self._share_prompt_s = 0.0
        self._share_wall_s = 0.0
        self._share_at = ready_s

    # ---- what placement and routing read ----

    @property
    def serving(self) -> bool:
        return self.left_s is None and not self.draining and self.sim.now >= self.ready_s

    @property
    def prefill_share(self) -> float:
        return self._share_prompt_s / self._share_wall_s if self._share_wall_s > 0 else 0.0

    def cached_tokens(self, request: SimRequest) -> int:
        """Of ``request``'s prompt, the leading tokens this engine holds (whole blocks, never
        its last token)."""
        if request.session < 0:
            return 0
        held = min(self.cached.get(request.session, 0), request.prompt_tokens - 1)
        block = self.sim.params.block_size
        return held // block * block

    def steps_done(self, now: float) -> int:
        """This engine's step count at ``now`` (within a segment: the steps ended by then)."""
        if self.segment is None:
            return self.step
        start, steps, batch, context = self.segment
        return self.step + min(steps, self._steps_within(now - start, batch, context))

    def running(self, now: float, tpot_s: float) -> Iterator[RunningRequest]:
        """The requests decoding here past their first token, as placement's guard sees them."""
        step = self.steps_done(now)
        for finish_step, _, flight in self.finishes:
            if flight.first_token_s is None or flight.request.output_tokens < 2:
                continue
            spare = tpot_s * (flight.request.output_tokens - 1) - (now - flight.first_token_s)
            yield RunningRequest(max(0, finish_step - step), spare)

    # ---- what the coordinator does to it ----

    def enqueue(self, job: Job) -> None:
        self.queue.append(job)
        self.queued_tokens += job.tokens_left
        self.holds += 1
        self._wake()

    def receive(self, flight: Flight) -> None:
        """``flight``'s KV arrived: it joins the batch at the next step boundary."""
        self.joining.append(flight)
        self._wake()

    def start(self) -> None:
        """The worker is ready (or undrained): pick up what waits."""
        self._wake()

    # ---- stepping ----

    def _wake(self) -> None:
        if self.sim.now < self.ready_s:
            return
        if self.segment is not None:
            self._cut_segment()
        elif not self.stepping:
            self._next()

    def _cut_segment(self) -> None:
        """End the segment in progress at the end of its current step."""
        assert self.segment is not None
        start, steps, batch, context = self.segment
        boundary = self._steps_within(self.sim.now - start, batch, context) + 1
        if boundary < steps:
            self.version += 1
            self.segment = (start, boundary, batch, context)
            end = start + self._segment_s(boundary, batch, context)
            self.sim.at(end, self._end_step, self.version, boundary, ())

    def _segment_s(self, steps: int, batch: int, context: int) -> float:
        """Seconds of ``steps`` decode-only steps of ``batch`` requests from ``context``."""
        cost = self.sim.params.cost
        first = cost.decode_step_s(batch, context)
        return steps * first + cost.per_context_token_s * batch * steps * (steps - 1) / 2

    def _steps_within(self, elapsed_s: float, batch: int, context: int) -> int:
        """The most steps of a segment that end within ``elapsed_s``."""
        cost = self.sim.params.cost
        a = cost.per_context_token_s * batch / 2
        b = cost.decode_step_s(batch, context) - a
        if a > 0:
            steps = int((-b + math.sqrt(b * b + 4 * a * max(elapsed_s, 0.0))) / (2 * a))
        else:
            steps = int(elapsed_s / b) if b > 0 else 0
        while self._segment_s(steps + 1, batch, context) <= elapsed_s:
            steps += 1
        while steps > 0 and self._segment_s(steps, batch, context) > elapsed_s:
            steps -= 1
        return steps

    def _next(self) -> None:
        """At a step boundary: let the arrived KV join, then start the next step (one that
        computes prompt tokens or gives joined requests their first token) or segment."""
        now = self.sim.now
        for flight in self.joining:  # first token from the next step
            self._join(flight, flight.request.prompt_tokens, flight.request.output_tokens)
            self.awaiting.append(flight)
        self.joining.clear()
        cost = self.sim.params.cost
        decode_s = cost.decode_step_s(self.batch, self.context)
        if self.queue:
            chunk = self._take_chunk()
            prompt_s = cost.prefill_s(sum(taken for _, taken in chunk))
            self._schedule(now + decode_s + prompt_s, 1, chunk)
        elif self.awaiting:
            self._schedule(now + decode_s, 1, ())
        elif self.batch:
            steps = self.finishes[0][0] - self.step
            self.segment = (now, steps, self.batch, self.context)
            self._schedule(now + self._segment_s(steps, self.batch, self.context), steps, ())
        elif self.draining and not self.holds:
            self.sim.retire(self)

    def _schedule(self, end_s: float, steps: int, chunk: tuple[tuple[Job, int], ...]) -> None:
        self.stepping = True
        self.sim.at(end_s, self._end_step, self.version, steps, chunk)

    def _take_chunk(self) -> tuple[tuple[Job, int], ...]:
        """Prompt tokens for one step, FIFO, up to the chunk budget (a job may span steps)."""
        budget = self.sim.params.chunk_tokens
        chunk = []
        for job in self.queue:
            if budget <= 0:
                break
            taken = min(budget, job.tokens_left)
            chunk.append((job, taken))
            budget -= taken
        return tuple(chunk)

    def _join(self, flight: Flight, context: int, steps: int) -> None:
        flight.join_step = self.step
        flight.finish_step = self.step + steps
        flight.context0 = context
        self.batch += 1
        self.context += context
        heapq.heappush(self.finishes, (flight.finish_step, flight.request.index, flight))

    def _end_step(self, version: int, steps: int, chunk: tuple[tuple[Job, int], ...]) -> None:
        if version != self.version:
            return
        now = self.sim.now
        cost = self.sim.params.cost
        prompt_tokens = sum(taken for _, taken in chunk)
        self._account(now, cost.prefill_s(prompt_tokens))
        self.step += steps
        self.context += self.batch * steps
        self.segment = None  # still stepping: what the coordinator does now waits for _next
        for flight in self.awaiting:
            self.sim.first_token(flight)
        self.awaiting.clear()
        while self.finishes and self.finishes[0][0] <= self.step:
            _, _, flight = heapq.heappop(self.finishes)
            self.batch -= 1
            self.context -= flight.context0 + (self.step - flight.join_step)
            request = flight.request
            if request.session >= 0:
                self.cached[request.session] = request.prompt_tokens + request.output_tokens
            self.holds -= 1
            self.sim.finished(flight)
        for job, taken in chunk:
            job.tokens_left -= taken
            self.queued_tokens -= taken
            if job.tokens_left == 0:
                self._prompt_done(job)
        self.stepping = False
        self._next()

    def _prompt_done(self, job: Job) -> None:
        self.queue.popleft()  # a finished job is always the queue's head
        self.holds -= 1
        flight = job.flight
        request = flight.request
        if request.session >= 0:
            self.cached[request.session] = max(
                self.cached.get(request.session, 0), request.prompt_tokens
            )
        if job.destination is self:  # local: this step sampled its first token
            self.sim.first_token(flight)
            if request.output_tokens <= 1:
                self.holds -= 1
                self.sim.finished(flight)
            else:
                self._join(flight, request.prompt_tokens + 1, request.output_tokens - 1)
            return
        transfer_s = self.sim.params.transfer_s(request.prompt_tokens) + job.extra_transfer_s
        self.sim.at(self.sim.now + transfer_s, job.destination.receive, flight)

    def _account(self, now: float, prompt_s: float) -> None:
        """The prompt share: prompt seconds over wall seconds, decaying over
        ``SHARE_WINDOW_S``."""
        keep = math.exp(-(now - self._share_at) / SHARE_WINDOW_S)
        self._share_prompt_s = self._share_prompt_s * keep + prompt_s
        self._share_wall_s = self._share_wall_s * keep + (now - self._share_at)
        self._share_at = now


# ---- the run --------------------------------------------------------------------------------
