"""A request as the coordinator carries it: what the caller asked (``RequestAsk``, parsed at the
edge) and, once checked against the model and the cluster, the one record every later step
reads (``RequestRecord``).

``Coordinator.generate`` turns an ask into a record once (``service.py``): the prompt
tokenized, ``max_tokens`` settled (``max_tokens.py``), the sampling params made and checked
(vocabulary, grammar), the ids scoped by tenant, the latency targets resolved against the
coordinator's defaults. Admission, routing, placement and every attempt read the record; none
of them re-derives what it holds (the output tokens left after a resume, the TTFT deadline,
the KV demand are its methods). A per-request field is added here, where the edge parses it
(``servicer.py:ask_from_proto``) and where its one consumer reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.common.api_keys import ANONYMOUS, Caller
from splitserve.common.prompt import Prompt
from splitserve.common.sampling_params import AskedSampling, SamplingParams
from splitserve.coordinator.kv_demand import KvDemand
from splitserve.coordinator.placement import NO_TARGETS, LatencyTargets, Slo


@dataclass(frozen=True)
class RequestAsk:
    """What a caller asked for, as the edge parsed it; nothing here is checked against the
    model or the cluster yet (``Coordinator.generate`` does that, once)."""

    prompt: Prompt
    sampling: AskedSampling
    """As the caller sent it: ``max_tokens`` unsettled, params not made."""
    add_special_tokens: bool | None = None
    """Whether the prompt's text is tokenized with the tokenizer's special tokens (None:
    ``common/prompt.py:encode_prompt``'s default, yes for text, no for chat)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last this many tokens (``common/prompt.py:truncated``)."""
    request_id: str = ""
    """The caller's own id ("": the coordinator picks one); scoped by tenant later."""
    model: str = ""
    """The model it names: the served model, an alias, or a LoRA adapter its workers serve
    ("": the served model)."""
    continue_after: tuple[int, ...] = ()
    """Completion tokens another coordinator already streamed to the client
    (``RequestFlow.replay``)."""
    priority: int = 0
    """Admission order (``admission.py``); bounded by the tenant's ``max_priority``."""
    targets: LatencyTargets = NO_TARGETS
    """The request's own latency targets (the coordinator's where it gives none)."""
    traceparent: str = ""
    """The caller's span, which the coordinator's joins (``common/tracing.py``)."""
    session_id: str = ""
    """Its session's, as the caller named it ("": none); scoped by tenant later."""
    max_queue_wait_s: float | None = None
    """The longest it may wait for admission (None: the coordinator's)."""


@dataclass(frozen=True)
class RequestRecord:
    """One admitted-or-waiting request, immutable from the moment the coordinator made it.

    Invariants: ``params.max_tokens`` is settled and ``prompt_token_ids`` plus it fit the
    context; ``params`` passed every check (vocabulary, grammar); ``request_id`` and
    ``session_id`` are scoped by the caller's tenant; ``slo`` is the request's own targets
    resolved against the coordinator's; ``arrived_at`` is ``time.monotonic()`` at arrival."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrived_at: float
    slo: Slo
    caller: Caller = ANONYMOUS
    """Who asked: its tenant's limits apply, and only it may abort the request."""
    priority: int = 0
    session_id: str = ""
    traceparent: str = ""
    """The request's span here, which every worker span of its attempts joins."""
    continue_after: tuple[int, ...] = ()
    max_queue_wait_s: float | None = None
    """The longest it may wait for admission (None: the coordinator's ``max_queue_wait_s``);
    read by admission only (``admission.py``)."""

    @property
    def tenant(self) -> str:
        return self.caller.tenant

    @property
    def ttft_deadline(self) -> float:
        """When (``time.monotonic``) its first token is due."""
        return self.arrived_at + self.slo.ttft_s

    def tokens_left(self, num_streamed: int) -> int:
        """Output tokens it may still generate after ``num_streamed`` were streamed."""
        return self.params.max_tokens - num_streamed

    def kv_demand(self, block_size: int) -> KvDemand:
        """What it may hold in a decode worker's KV of ``block_size`` blocks at its end."""
        return KvDemand.of(len(self.prompt_token_ids), self.params.max_tokens, block_size)

    def context_after(self, streamed: Sequence[int]) -> list[int]:
        """The prompt followed by ``streamed`` output tokens: what an attempt after them
        starts from."""
        return [*self.prompt_token_ids, *streamed]
