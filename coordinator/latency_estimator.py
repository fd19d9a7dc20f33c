"""How long admitted requests take, and how long a queued one will wait: admission's measured
averages and the wait prediction that plays the queue forward.

Measured (exponential averages, each new figure weighing ``SMOOTHING``): the time from
admission to first token (TTFT), the time per output token (TPOT), the rate at which prompt
tokens leave the prefill backlog while it is loaded, and how far actual waits exceeded
predicted ones (the calibration). Before any measurement: the configured priors, and the
workers' compute rate for the drain rate.

The drain rate is a throughput, measured over windows of several prompts
(``DRAIN_WINDOW_PROMPTS``, ``DRAIN_WINDOW_MIN_S``): the prompt tokens that left the backlog
over the time they took, counting only time while the backlog held at least
``LOADED_PROMPTS`` prompts (one being computed and another waiting behind it). A lone prompt's
time to its first token is latency, not drain: a fresh cluster's first prompt can take seconds
(cold paths, a crowd arriving) while the workers then drain thousands of tokens a second, and
learning the rate from it once refused a whole crowd on a wait predicted at 30 s. Prompts
leave the backlog in bursts (a prefill step finishes several), so a window sums tokens and
time rather than averaging per-prompt rates.

The predicted wait (``predicted_wait_s``) plays the queue forward from a ``KvOutlook``:
admitted requests end after what is left of their TTFT, then their output tokens left x the
TPOT; queued ones start in order as KV (and decode slots) come back and the prefill backlog
(drained at the measured rate) has room, and take the TTFT plus ``max_tokens`` x the TPOT.
Requests that stop early only make it shorter: it is an upper bound, the right side to err on
for a retry hint. Scaled by the calibration when waits ran longer than predicted.

No clock: callers pass the times. Single event loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.coordinator.kv_demand import KvDemand

SMOOTHING = 0.1
"""Weight of a new measurement in the running estimates (exponential average)."""
CALIBRATION_MIN_WAIT_S = 0.5
"""Waits predicted shorter than this do not calibrate (noise dominates them)."""
LOADED_PROMPTS = 2
"""The backlog drains at its throughput (not one prompt's latency) while it holds this many
prompts."""
DRAIN_WINDOW_PROMPTS = 4
"""Prompts a drain-rate measurement spans at least."""
DRAIN_WINDOW_MIN_S = 0.1
"""Loaded time a drain-rate measurement spans at least."""


@dataclass
class _DrainWindow:
    """Prompt tokens that left the loaded backlog, and the loaded time it took them."""

    tokens: int = 0
    prompts: int = 0
    seconds: float = 0.0


class RunningEnd(NamedTuple):
    """An admitted request's predicted end, seconds from now, and the KV it then frees."""

    ends_in_s: float
    num_tokens: int


@dataclass(frozen=True)
class KvOutlook:
    """What admission holds now, for the wait prediction to play forward."""

    free_tokens: int
    """KV tokens not admitted (negative while a request larger than the capacity runs)."""
    free_slots: float
    """Requests that may still join the decode batch (``math.inf``: no bound known)."""
    running: Sequence[RunningEnd]
    """Every admitted request, sorted by ``ends_in_s`` (the prediction reads it in order,
    without copying it)."""
    backlog_tokens: int
    """Prompt tokens admitted without a first token yet."""
    backlog_limit_tokens: int
    """Prompt tokens the prefill backlog may hold."""
    prefill_tokens_per_s: float
    """The workers' prefill rate (learned or assumed): the drain rate until one is measured."""


class LatencyEstimator:
    """The measured averages (module docstring) and the predictions made from them."""

    def __init__(self, prior_ttft_s: float, prior_tpot_s: float) -> None:
        self._ttft_s = prior_ttft_s
        self._tpot_s = prior_tpot_s
        self._drain_tokens_per_s: float | None = None
        """Measured: prompt tokens per second leaving the backlog while it is loaded."""
        self._loaded_since: float | None = None
        """When the backlog's current loaded stretch began: it became loaded, or a prompt left
        it still loaded (None: not loaded)."""
        self._window = _DrainWindow()
        self._wait_calibration = 1.0
        """Measured waits over predicted ones (smoothed); predictions are scaled by it when
        above 1, so that a model that runs optimistic refuses at once rather than after a
        request waited out its limit."""

    @property
    def ttft_s(self) -> float:
        """Time from admission to first token."""
        return self._ttft_s

    @property
    def tpot_s(self) -> float:
        """Time per output token."""
        return self._tpot_s

    # ---- measurements ------------------------------------------------------------------

    def first_token(self, ttft_s: float) -> None:
        """A request had its first tokens ``ttft_s`` after its admission."""
        self._ttft_s += SMOOTHING * (ttft_s - self._ttft_s)

    def output_tokens(self, num_tokens: int, elapsed_s: float) -> None:
        """``num_tokens`` (> 0) more output tokens came ``elapsed_s`` after the previous ones."""
        per_token = elapsed_s / num_tokens
        self._tpot_s += SMOOTHING * (per_token - self._tpot_s)

    @property
    def drain_tokens_per_s(self) -> float | None:
        """The prefill backlog's measured drain rate (None: not measured yet)."""
        return self._drain_tokens_per_s

    def backlog_changed(self, now: float, backlog_prompts: int) -> None:
        """A prompt joined the backlog, or left it with no first token (its request ended):
        it holds ``backlog_prompts`` now: a loaded stretch begins when it reaches
        ``LOADED_PROMPTS`` and ends, unmeasured, when it falls below."""
        loaded = backlog_prompts >= LOADED_PROMPTS
        if not loaded:
            self._loaded_since = None
        elif self._loaded_since is None:
            self._loaded_since = now

    def prompt_prefilled(self, num_prompt_tokens: int, now: float, backlog_prompts: int) -> None:
        """A prompt left the backlog (its first token came), ``backlog_prompts`` remain: the
        stretch since the previous event counts toward the drain rate if the backlog was
        loaded through it (module docstring)."""
        loaded_since = self._loaded_since
        if loaded_since is not None:
            window = self._window
            window.tokens += num_prompt_tokens
            window.prompts += 1
            window.seconds += now - loaded_since
            if window.prompts >= DRAIN_WINDOW_PROMPTS and window.seconds >= DRAIN_WINDOW_MIN_S:
                rate = window.tokens / window.seconds
                previous = self._drain_tokens_per_s
                self._drain_tokens_per_s = (
                    rate if previous is None else previous + SMOOTHING * (rate - previous)
                )
                self._window = _DrainWindow()
        self._loaded_since = now if backlog_prompts >= LOADED_PROMPTS else None

    def waited(self, waited_s: float, predicted_s: float) -> None:
        """A queued request waited ``waited_s`` where ``predicted_s`` was predicted: learn how
        far predictions fall short (short predictions are too noisy to count)."""
        if predicted_s < CALIBRATION_MIN_WAIT_S:
            return
        ratio = waited_s / predicted_s
        self._wait_calibration += SMOOTHING * (ratio - self._wait_calibration)

    # ---- predictions -------------------------------------------------------------------

    def run_time_s(self, max_tokens: int) -> float:
        """How long a request admitted now takes: the TTFT, then ``max_tokens`` x the TPOT."""
        return self._ttft_s + max_tokens * self._tpot_s

    def time_left_s(self, tokens_left: int, waited_s: float | None) -> float:
        """When an admitted request is predicted to end: its output tokens left x the TPOT,
        after what is left of its TTFT if it has no first token yet (``waited_s``: the time
        since its admission then; None once it has its first tokens)."""
        decode_s = tokens_left * self._tpot_s
        if waited_s is None:
            return decode_s
        return max(0.0, self._ttft_s - waited_s) + decode_s

    def predicted_wait_s(self, outlook: KvOutlook, queue: Iterable[KvDemand]) -> float:
        """Seconds until the last of ``queue`` (those ahead of it first, in admission order)
        could start; 0 when it fits now (module docstring).

        A demand larger than the whole capacity starts once all before it ended.

        O(queue x log queue + ends consumed): the admitted requests' ends are read in their
        sorted order, only as far as the queue needs; the queue's own ends go into a heap."""
        running = outlook.running
        next_running = 0
        ends: list[RunningEnd] = []  # the queued demands' ends, once they start

        def pop_end() -> RunningEnd:
            nonlocal next_running
            if next_running < len(running) and (not ends or running[next_running] <= ends[0]):
                next_running += 1
                return running[next_running - 1]
            return heapq.heappop(ends)

        free = outlook.free_tokens
        free_slots = outlook.free_slots
        # the backlog drains as fast as it was seen to (compute rate until measured)
        rate = self._drain_tokens_per_s or outlook.prefill_tokens_per_s
        prefilled_at = outlook.backlog_tokens / rate  # when the admitted prompts are done
        window_s = outlook.backlog_limit_tokens / rate
        now = 0.0
        for needed in queue:
            tokens = needed.num_tokens
            while (free < tokens or free_slots < 1) and (ends or next_running < len(running)):
                now, freed = pop_end()
                free += freed
                free_slots += 1
            if free < tokens:  # larger than the capacity: it runs once all else ended
                free = max(free, tokens)
            free -= tokens
            free_slots -= 1
            prompt_s = needed.num_prompt_tokens / rate
            now = max(now, prefilled_at + prompt_s - window_s)  # the backlog keeps its bound
            prefilled_at = max(prefilled_at, now) + prompt_s
            heapq.heappush(ends, RunningEnd(now + self.run_time_s(needed.max_tokens), tokens))
        return now * max(1.0, self._wait_calibration)
