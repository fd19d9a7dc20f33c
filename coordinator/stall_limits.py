"""How long an attempt waits for a worker before calling it stalled (``attempt.py``).

Limits come from the worker's learned step times (``common/step_cost.py``) as its latest
load report shows them, times ``AttemptTimeouts.stall_factor``, never below
``stall_floor_s``; silence is measured without the time this process's own event loop ran
late (``common/loop_lag.py``). Pure functions of what they are given.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common import loop_lag
from splitserve.coordinator.registry import WorkerRecord


@dataclass(frozen=True)
class AttemptTimeouts:
    prefill_s: float = 300.0
    request_s: float = 3600.0
    stop_s: float = 2.0
    stall_factor: float = 10.0
    """A decoding stream silent for this many times its worker's expected step time is
    stalled (``stall_limit_s``); 0 turns the watch off."""
    stall_floor_s: float = 2.0
    """... and never before this many seconds (GC pauses, a long prompt chunk)."""


DEFAULT_STEP_S = 0.1
"""A decode worker's expected step time before its step-cost model is known."""


def stall_limit_s(worker: WorkerRecord, timeouts: AttemptTimeouts) -> float:
    """How long a decoding stream on ``worker`` may go without a message: ``stall_factor``
    times the step its latest load report predicts (a decode step of its running requests
    and their tokens, plus a prompt chunk while prompts wait there), at least
    ``stall_floor_s``."""
    load = worker.load
    cost = load.step_cost
    expected = DEFAULT_STEP_S
    if cost.knows_decode:
        running = max(1, load.num_running_requests)
        expected = cost.decode_step_s(running, load.num_running_tokens)
    if load.num_pending_prefill_tokens and cost.knows_prefill:
        chunk = min(load.num_pending_prefill_tokens, load.prefill_chunk_tokens)
        expected += cost.prefill_s(chunk)
    return max(timeouts.stall_floor_s, timeouts.stall_factor * expected)


TIMER_SLACK_S = 0.05
"""A loop timer may fire this much early; a stall check then still counts it due."""
PER_STREAM_STALL_FACTOR = 10.0
"""A request silent this many times its limit stalls even while its worker is heard from
(heartbeats, other streams' messages): one request stuck on a live worker."""
DEFAULT_PREFILL_TOKEN_S = 0.002
"""A prefill worker's expected seconds a prompt token before its step-cost model is known."""


def prefill_stall_limit_s(
    worker: WorkerRecord, prompt_tokens: int, timeouts: AttemptTimeouts, queued_tokens: int = 0
) -> float:
    """How long a prompt pushed to ``worker`` may take to bring its first token:
    ``stall_factor`` times what its step-time model predicts for the prompt tokens queued
    there (its latest load report, or ``queued_tokens``, what routing counted ahead of this
    prompt, whichever is more: a crowd's prompts arrive faster than reports) plus this
    one's, at least ``stall_floor_s``."""
    load, cost = worker.load, worker.load.step_cost
    tokens = max(load.num_pending_prefill_tokens, queued_tokens) + prompt_tokens
    if cost.knows_prefill:
        chunk = max(1, load.prefill_chunk_tokens or tokens)
        steps = -(-tokens // chunk)
        expected = steps * cost.prefill_base_s + tokens * cost.per_prefill_token_s
    else:
        expected = DEFAULT_STEP_S + tokens * DEFAULT_PREFILL_TOKEN_S
    return max(timeouts.stall_floor_s, timeouts.stall_factor * expected)


def silence_s(since: float, now: float) -> float:
    """Seconds from ``since`` to ``now``, less what this process's event loop ran late."""
    return now - since - loop_lag.lag_since(since)
