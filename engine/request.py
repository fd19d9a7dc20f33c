"""A generation request as the scheduler sees it, and its lifecycle.

Lifecycle (``RequestStatus``)::

    WAITING --schedule--> RUNNING --finish--> FINISHED_STOPPED | FINISHED_LENGTH
       ^                     |                FINISHED_ABORTED (from any state)
       +----- PREEMPTED <----+   (blocks ran out: KV freed, recomputed from prompt + output)

A request whose prompt KV another worker computes (disaggregated prefill) instead starts in
WAITING_FOR_REMOTE_KV holding reserved blocks, and joins RUNNING when its KV has landed, or
first WAITING_FOR_ADAPTER (KV held) while the running requests take as many LoRA adapters as
``SchedulerConfig.max_loras`` allows and not its own.

Queues: the scheduler keeps ``waiting`` (WAITING and PREEMPTED, preempted ones in front),
``running`` (RUNNING, oldest first) and ``parked`` (WAITING_FOR_ADAPTER, in arrival order). A
finished request is in none and holds no block.

Invariant: ``all_token_ids == prompt_token_ids + output_token_ids`` and
``0 <= num_computed_tokens <= len(all_token_ids)``; the KV of the first
``num_computed_tokens`` tokens is in the request's blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitserve.common.blocks import BlockHash, prefix_root
from splitserve.common.request_update import FinishReason
from splitserve.common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    WAITING_FOR_ADAPTER = "waiting_for_adapter"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self)


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(eq=False)
class Request:
    """Mutable scheduler-side state of one request (owned by one scheduler)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    adapter_digest: str = ""
    """The digest of ``params.adapter``'s files as the engine served them when the request
    came (``common/adapter_id.py``); "" for the base model. Its steps take that adapter's
    terms, and its prefix hashes start from it, even should the name be loaded again with
    other files while it runs."""
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_token_id: int | None = None
    """The eos/stop token that ended the request, if any."""
    first_scheduled_time: float | None = None
    """When the request first left the waiting queue (``time.monotonic``); queue-time metric."""
    first_token_time: float | None = None
    """When its first output token was sampled (end of prefill)."""
    finished_time: float | None = None
    hash_root: BlockHash | None = field(init=False)
    """Where its blocks' prefix hashes start: ``prefix_root`` of ``params.cache_salt`` and
    ``adapter_digest``."""

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.hash_root = prefix_root(self.params.cache_salt, self.adapter_digest)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
