"""Routing (torch-free): which decode worker runs a request, which prefill worker (if any)
computes its prompt.

Decode: among healthy decode workers whose context fits the request, the one with the most
free KV blocks after the request, penalised by the tokens it already decodes per step (its
running batch's KV read) and by the requests this coordinator has running there.

Prefill: only workers whose KV layout hash equals the decode worker's; the one with the
fewest pending prefill tokens after subtracting the prompt tokens it likely has cached (a
bounded record of the chained block hashes of prompts routed to it). Prompts whose uncached
part is at most ``local_prefill_max_tokens`` stay on the decode worker (conditional
disaggregation), as do all prompts when no compatible prefill worker exists.

Load has two sources: what each worker reports (the registry's ``load``, the shared truth
when several coordinators dispatch to the same workers) and what this coordinator dispatched
and has not seen finish (``Pending``, owned here: attempts wrap their worker calls in
``decoding`` / ``prefilling``), so that a burst of requests does not all land on the worker
that looked idlest at its last report.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from splitserve.common.blocks import BlockHash, prompt_block_hashes
from splitserve.common.membership import Role
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry


@dataclass(frozen=True)
class RoutingConfig:
    local_prefill_max_tokens: int = 0
    """Prompts with at most this many uncached tokens are prefilled on the decode worker."""
    prefix_memory_blocks: int = 100_000
    """Block hashes remembered per prefill worker for the prefix-overlap estimate."""


@dataclass(frozen=True)
class Route:
    decode: WorkerRecord
    prefill: WorkerRecord | None
    """None: the decode worker prefills the prompt itself."""


@dataclass
class Pending:
    """Work this coordinator sent to one worker that has not finished yet."""

    num_requests: int = 0
    """Requests decoding there (attempts open on its decode stream)."""
    num_prefill_tokens: int = 0
    """Prompt tokens sent there for prefill and not yet answered."""


class PrefixMemory:
    """A bounded LRU set of block hashes, one per prefill worker."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: collections.OrderedDict[BlockHash, None] = collections.OrderedDict()

    def overlap_blocks(self, hashes: Sequence[BlockHash]) -> int:
        count = 0
        for block_hash in hashes:
            if block_hash not in self._hashes:
                break
            count += 1
        return count

    def remember(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class Router:
    def __init__(self, registry: WorkerRegistry, config: RoutingConfig) -> None:
        self.registry = registry
        self.config = config
        self._prefix: dict[str, PrefixMemory] = {}
        self._pending: dict[str, Pending] = collections.defaultdict(Pending)

    @contextlib.contextmanager
    def decoding(self, worker: WorkerRecord) -> Iterator[None]:
        """Count one request as running on ``worker`` while the block runs."""
        pending = self._pending[worker.worker_id]
        pending.num_requests += 1
        try:
            yield
        finally:
            pending.num_requests -= 1

    @contextlib.contextmanager
    def prefilling(self, worker: WorkerRecord, num_tokens: int) -> Iterator[None]:
        """Count ``num_tokens`` prompt tokens as queued on ``worker`` while the block runs."""
        pending = self._pending[worker.worker_id]
        pending.num_prefill_tokens += num_tokens
        try:
            yield
        finally:
            pending.num_prefill_tokens -= num_tokens

    def forget(self, worker_id: str) -> None:
        """A worker left the registry: drop what this router remembers of it (its prefix
        memory; its pending counts once no work of this coordinator runs there)."""
        self._prefix.pop(worker_id, None)
        pending = self._pending.get(worker_id)
        if pending is not None and pending == Pending():
            del self._pending[worker_id]

    def report_failure(self, worker: WorkerRecord) -> None:
        """A call to ``worker`` failed as if it were gone: route around it until it reports."""
        self.registry.mark_failed(worker.worker_id)

    def route(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        exclude: Sequence[str] = (),
        with_prefill: bool = True,
    ) -> Route | None:
        """A route for the request, or None when no decode worker can take it.
        ``with_prefill=False``: the decode worker computes the prompt (fallback, resume)."""
        decode = self.pick_decode(len(prompt_token_ids) + max_tokens, exclude)
        if decode is None:
            return None
        prefill = self.pick_prefill(decode, prompt_token_ids) if with_prefill else None
        return Route(decode, prefill)

    def pick_decode(self, num_tokens: int, exclude: Sequence[str] = ()) -> WorkerRecord | None:
        candidates = [
            w
            for w in self.registry.workers(Role.DECODE)
            if w.worker_id not in exclude and w.max_model_len >= num_tokens
        ]
        if not candidates:
            return None

        def score(worker: WorkerRecord) -> float:
            load = worker.load
            blocks_needed = -(-num_tokens // max(worker.block_size, 1))
            pending = self._pending[worker.worker_id].num_requests
            free_after = load.num_free_blocks - blocks_needed * (1 + pending)
            busy = load.num_running_tokens / max(worker.block_size, 1)
            return free_after - busy - 4 * load.num_waiting_requests

        return max(candidates, key=score)

    def pick_prefill(
        self, decode: WorkerRecord, prompt_token_ids: Sequence[int]
    ) -> WorkerRecord | None:
        candidates = [
            w
            for w in self.registry.workers(Role.PREFILL)
            if w.compat_hash == decode.compat_hash and w.max_model_len >= len(prompt_token_ids)
        ]
        if not candidates or len(prompt_token_ids) <= self.config.local_prefill_max_tokens:
            return None
        hashes = prompt_block_hashes(prompt_token_ids, decode.block_size)

        def cost(worker: WorkerRecord) -> float:
            memory = self._memory(worker.worker_id)
            cached_tokens = memory.overlap_blocks(hashes) * worker.block_size
            queued = self._pending[worker.worker_id].num_prefill_tokens
            pending = worker.load.num_pending_prefill_tokens + queued
            return pending + len(prompt_token_ids) - cached_tokens

        best = min(candidates, key=cost)
        cached = self._memory(best.worker_id).overlap_blocks(hashes) * best.block_size
        if len(prompt_token_ids) - cached <= self.config.local_prefill_max_tokens:
            return None
        self._memory(best.worker_id).remember(hashes)
        return best

    def _memory(self, worker_id: str) -> PrefixMemory:
        memory = self._prefix.get(worker_id)
        if memory is None:
            memory = self._prefix[worker_id] = PrefixMemory(self.config.prefix_memory_blocks)
        return memory
