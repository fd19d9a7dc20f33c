"""A worker's load figures (torch-free): what an engine reports and the coordinator routes on,
with what the worker's prefill role learned of its KV pushes."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.common.adapter_id import AdapterId
from splitserve.common.kv_events import KvEvents
from splitserve.common.kv_push_cost import NO_PUSH_COSTS, KvPushCosts
from splitserve.common.step_cost import StepCost

DEFAULT_PREFILL_CHUNK_TOKENS = 2048
"""An engine's prompt tokens per step unless configured (``SchedulerConfig``), and what a
coordinator assumes for a worker whose load does not report its own (an older worker)."""


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of one engine's load (taken on the engine thread), as the worker reports it
    (``kv_push`` is its prefill role's, added to the engine's snapshot by the report)."""

    num_total_blocks: int = 0
    num_used_blocks: int = 0
    """Blocks held by requests; idle prefix-cache blocks count as free."""
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_reserved_requests: int = 0
    """Requests holding blocks for KV that another worker is computing."""
    num_running_tokens: int = 0
    num_pending_prefill_tokens: int = 0
    num_finished_requests: int = 0
    """Cumulative count of requests that ended on this engine."""
    step_cost: StepCost = field(default_factory=StepCost)
    """The engine's step-time model, learned from its own steps (``common/step_cost.py``)."""
    prefill_share: float = 0.0
    """Of the last ten seconds or so of wall time before its last command or step, the
    fraction its steps spent on prompt tokens (``common/busy_share.py``)."""
    prefill_chunk_tokens: int = 0
    """Prompt tokens it computes per step at most (its ``--max-num-batched-tokens``); 0:
    not reported."""
    kv_push: KvPushCosts = NO_PUSH_COSTS
    """The exposed KV transfer its prefill role learned from its pushes, per decode worker
    (``common/kv_push_cost.py``); empty in the engine's own snapshot and for a worker that
    pushes nothing."""

    @property
    def chunk_tokens(self) -> int:
        """``prefill_chunk_tokens``, or the default where the worker reported none."""
        return self.prefill_chunk_tokens or DEFAULT_PREFILL_CHUNK_TOKENS

    @property
    def num_free_blocks(self) -> int:
        return self.num_total_blocks - self.num_used_blocks


@dataclass(frozen=True)
class LoadReport:
    """A worker's load as it reports it: its figures, and whether it makes progress (not
    ready: its engine is stuck in a step; ``worker/stall_watch.py``)."""

    load: EngineLoad
    ready: bool = True
    kv_events: KvEvents | None = None
    """The prefix cache's changes since the previous report of the same stream (a load
    stream's; None: not sent)."""
    adapters: tuple[AdapterId, ...] | None = None
    """The LoRA adapters the worker serves now (runtime loads and unloads included); None:
    not reported (the coordinator keeps what it knew)."""
