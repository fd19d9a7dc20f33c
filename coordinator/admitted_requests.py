"""The requests admission let in, with the running sums its decisions read in O(1).

Each admitted request holds its KV demand (``kv_demand.py``) until it ends; until its first
tokens its prompt is in the prefill backlog. ``KvAdmission`` (``admission.py``) asks here
what is admitted (KV tokens, the decode batch's average context, the backlog) and tells
what happened (``add``, ``first_tokens``, ``remove``). Single event loop; no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from splitserve.coordinator.kv_demand import KvDemand


@dataclass
class AdmittedRequest:
    """One admitted request, as admission follows it."""

    demand: KvDemand
    tenant: str
    tokens_left: int
    """Output tokens it may still generate (its tenant's budget gets them back at its end)."""
    admitted_at: float
    last_token_at: float | None = None
    """None until its first tokens: until then its prompt counts in the prefill backlog."""


def context_of(demand: KvDemand) -> float:
    """A request's average context over its life, as the decode batch bound reads it: its
    prompt plus half its ``max_tokens``."""
    return demand.num_prompt_tokens + demand.max_tokens / 2


class AdmittedRequests:
    """The admitted requests by id.

    Invariants: ``kv_tokens`` is the sum of their demands, ``context_sum`` the sum of their
    ``context_of``, ``backlog_tokens`` the prompt tokens of those without a first token and
    ``backlog_prompts`` their number."""

    def __init__(self) -> None:
        self._by_id: dict[str, AdmittedRequest] = {}
        self.kv_tokens = 0
        self.context_sum = 0.0
        self.backlog_tokens = 0
        self.backlog_prompts = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: str) -> AdmittedRequest | None:
        return self._by_id.get(request_id)

    def all(self) -> Iterable[AdmittedRequest]:
        return self._by_id.values()

    def add(self, request_id: str, demand: KvDemand, tenant: str, now: float) -> None:
        """``request_id`` is admitted now: its KV counts, its prompt joins the backlog."""
        self._by_id[request_id] = AdmittedRequest(demand, tenant, demand.max_tokens, now)
        self.kv_tokens += demand.num_tokens
        self.context_sum += context_of(demand)
        self.backlog_prompts += 1
        self.backlog_tokens += demand.num_prompt_tokens

    def first_tokens(self, admitted: AdmittedRequest) -> None:
        """``admitted`` had its first tokens: its prompt leaves the backlog."""
        self.backlog_prompts -= 1
        self.backlog_tokens -= admitted.demand.num_prompt_tokens

    def remove(self, request_id: str) -> AdmittedRequest | None:
        """The request ended: none of it counts any more; None when it was not admitted."""
        admitted = self._by_id.pop(request_id, None)
        if admitted is None:
            return None
        self.kv_tokens -= admitted.demand.num_tokens
        self.context_sum -= context_of(admitted.demand)
        if admitted.last_token_at is None:  # ended before its first token
            self.first_tokens(admitted)
        return admitted

    def average_context_with(self, demand: KvDemand) -> float:
        """The average ``context_of`` of the admitted requests and ``demand`` together."""
        return (self.context_sum + context_of(demand)) / (len(self._by_id) + 1)
