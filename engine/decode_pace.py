"""When a decode worker holds its next step back, so that the prefill worker beside it computes
prompts on its core meanwhile (``--pace-decode-ms``; ``splitserve up`` sets it for the pairs
of its ``hybrid`` layout).

A decode step of a few requests takes a fraction of the time between tokens the requests may
take (on the 2-core AMD EPYC, 8-10 ms for one or two requests against an ITL target of 50 ms).
Stepping again at once, the decode worker keeps its core busy all the time while prompts
queue on the prefill worker's one core; the prefill worker borrows the decode core only
while the decode engine idles (``engine/step_threads.py``), which under load it never does.
Held back to one step per ``interval_s``, the decode batch grows (more requests a step, each
row cheaper than a step's fixed part), its steps take the same core time for the tokens, and
the rest of each interval is an idle spell the prefill worker's prompt layers fill.

Contract (``hold_s``, the engine thread, before each step):
- Holds only a step of generated tokens alone: while any prompt is waiting or part-computed
  on this worker, steps follow at once.
- Holds only while the partner (the worker whose cores this one borrows, which borrows this
  one's back) reads busy: nobody else would use the spell.
- At most until ``interval_s`` after the previous step began: a request's tokens come at
  least every ``interval_s`` (plus whatever a step itself takes past it). A remote prompt's
  first token never waits for a step (the prefill worker sampled it).
- The engine publishes the spell's end with its busy flag (``StepThreads.idle(until)``), and
  a command (a new request, a landed prompt, an abort) ends the wait early; the step then
  follows as these rules say.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.step_threads import LenderState


@dataclass(frozen=True)
class DecodePace:
    """Hold decode-only steps to one per ``interval_s`` while ``partner`` is busy."""

    interval_s: float
    partner: LenderState

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be positive, not {self.interval_s}")

    def hold_s(self, now: float, last_step_started: float | None, prompt_work: bool) -> float:
        """Seconds to hold the next step from ``now`` (``time.monotonic()``); 0.0: step now.
        ``last_step_started``: when the previous step began (None: none yet);
        ``prompt_work``: a prompt waits or is part-computed on this engine."""
        if prompt_work or last_step_started is None or not self.partner.is_busy():
            return 0.0
        return max(0.0, last_step_started + self.interval_s - now)
