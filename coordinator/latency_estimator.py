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
from collections.abc import Callable, Iterable, Sequence
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
        play = self.play(outlook)
        *ahead, last = queue
        for needed in ahead:
            play.append(needed)
        return play.start_s(last)

    def play(self, outlook: KvOutlook) -> QueuePlay:
        """A ``QueuePlay`` from ``outlook``, with this estimator's figures as of now."""
        rate = self._drain_tokens_per_s or outlook.prefill_tokens_per_s
        return QueuePlay(outlook, rate, self.run_time_s, max(1.0, self._wait_calibration))


class QueuePlay:
    """``LatencyEstimator.predicted_wait_s``'s queue played forward one demand at a time:
    ``append`` plays a demand (it starts as KV, a decode slot and the prefill backlog allow,
    and its end frees its KV for those after it); ``start_s`` says when one more demand would
    start, without playing it. A play kept while demands join only at its tail predicts each
    newcomer in O(log queue + ends consumed) instead of playing the whole queue again (a
    crowd arriving one by one cost O(crowd^2) so: a tenth of a coordinator's CPU relaying
    1,024 simulated streams). Its figures (the outlook, the rates, the calibration) are those
    it was made with."""

    def __init__(
        self,
        outlook: KvOutlook,
        drain_tokens_per_s: float,
        run_time_s: Callable[[int], float],
        calibration: float,
    ) -> None:
        self._running = outlook.running
        self._next_running = 0
        """The admitted requests' ends not yet consumed start here (``running`` is sorted)."""
        self._ends: list[RunningEnd] = []
        """The played demands' ends not yet consumed (a heap)."""
        self._free = outlook.free_tokens
        self._free_slots = outlook.free_slots
        self._rate = drain_tokens_per_s
        self._prefilled_at = outlook.backlog_tokens / drain_tokens_per_s
        """When the prompts admitted and played so far are computed."""
        self._window_s = outlook.backlog_limit_tokens / drain_tokens_per_s
        self._now = 0.0
        """When the last played demand starts."""
        self._run_time_s = run_time_s
        self._calibration = calibration
        self.length = 0
        """Demands played."""

    def append(self, needed: KvDemand) -> None:
        """Play ``needed`` after those played so far."""
        self._play(needed, keep=True)

    def start_s(self, needed: KvDemand) -> float:
        """Seconds until ``needed`` would start after those played (times the calibration);
        the play is left as it was."""
        return self._play(needed, keep=False) * self._calibration

    def _play(self, needed: KvDemand, keep: bool) -> float:
        """When ``needed`` starts; with ``keep`` the play moves past it, else every end it
        consumed is put back."""
        running, ends = self._running, self._ends
        free, free_slots, now = self._free, self._free_slots, self._now
        next_running = self._next_running
        consumed: list[RunningEnd] = []
        tokens = needed.num_tokens
        while (free < tokens or free_slots < 1) and (ends or next_running < len(running)):
            if next_running < len(running) and (not ends or running[next_running] <= ends[0]):
                end = running[next_running]
                next_running += 1
            else:
                end = heapq.heappop(ends)
                consumed.append(end)
            now = end.ends_in_s
            free += end.num_tokens
            free_slots += 1
        if free < tokens:  # larger than the capacity: it runs once all else ended
            free = max(free, tokens)
        prompt_s = needed.num_prompt_tokens / self._rate
        now = max(now, self._prefilled_at + prompt_s - self._window_s)  # the backlog's bound
        if not keep:
            for end in consumed:
                heapq.heappush(ends, end)
            return now
        self._free, self._free_slots, self._now = free - tokens, free_slots - 1, now
        self._next_running = next_running
        self._prefilled_at = max(self._prefilled_at, now) + prompt_s
        heapq.heappush(ends, RunningEnd(now + self._run_time_s(needed.max_tokens), tokens))
        self.length += 1
        return now
