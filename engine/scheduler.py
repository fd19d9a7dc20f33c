"""Token-budget scheduler: one per worker, no separate prefill and decode phases.

Torch-free. Each ``schedule()`` call fills one step's token budget:

1. Running requests, oldest first, each get the tokens they still miss (1 for a decoding
   request, the next chunk of the prompt for a request still prefilling), capped by the
   remaining budget. When the KV pool cannot cover a running request, the newest running
   request is preempted (blocks freed, put back at the front of the waiting queue, recomputed
   later from prompt + output) until the request fits or is itself preempted.
2. If nothing was preempted, waiting requests (FCFS) are admitted while budget, sequence slots
   and blocks last, starting from their longest cached prefix (none for a request that asked
   for ``prompt_logprobs`` and has no token yet: each prompt row's logits are needed). Long
   prompts are chunked.

LoRA adapters (``SchedulerConfig.max_loras``, 0: no bound): the running requests take at most
that many distinct adapters, so a step multiplies by no more adapters' factors
(``engine/lora.py``). A waiting request of another adapter is passed over (it keeps its place;
the base model's and the running adapters' requests behind it go ahead); a remote prefill
completed for one is parked with its KV (``parked``) and joins the running batch, oldest
first, at the first schedule where its adapter fits: once every running request of some
adapter has ended. Running requests are never held back for it.

``update()`` applies the runner's sampled tokens, advances the computed-token counts, registers
full blocks in the prefix cache and finishes requests that hit a stop condition; every
finished request has freed all its blocks before ``update`` returns.

Speculative decoding (``SpeculativeConfig``, off by default): a decoding request that may
speculate (``_speculates``) gets up to ``num_tokens`` draft tokens from its own context
(``engine/ngram_proposer.py``: it sits out steps after drafts were all rejected) while the
step's decode rows stay within ``max_step_rows``. Once the engine's step-time model knows
decode steps (``step_cost``, set by the engine after each step), a draft is proposed only
while its chance of being kept beats what its row costs the batch: ``row cost x decoding
requests / decode step time``, the tokens a step would lose to the row's time at the batch's
rate (each request's chance from its own acceptance, ``Drafter.continuation``). Its chunk then
computes its last token and the drafts (``draft_token_ids``), and the runner returns the
token sampled after each of them (``verified_token_ids``). ``update`` keeps the drafts up to
the first that differs from what the model chose there, plus the model's token after the last
kept one: exactly the tokens plain decoding would have produced one step at a time, since
each row's logits are computed as a plain decode step's are (one decode row per token,
``engine/model_runner.py``). Rejected drafts leave KV in slots past the request's context,
which the next steps overwrite; their blocks stay with the request until it ends.

Steps ahead (``schedule_ahead``, used by ``EngineCore.step`` where decode steps replay CUDA
graphs): the decode step after a launched one is planned before the launched step's tokens are
known, for the requests whose next token the device decides alone (``decided_on_device``) and
that cannot end by length with it; their chunks' token ids are placeholders the runner replaces
with the launched step's choices on the device. Requests that joined the batch meanwhile
(remote prefills completed) come after them with their own last token. A request that ends,
or is preempted, while such a step may still write its KV (``launched`` .. ``settle``) gives up
its table at once but its blocks only once that step has run (``KVCacheManager.detach``), so
no block another request or a KV transfer may take is written by a step still on the device.
(``EngineCore.step`` calls ``schedule`` only once no step is in flight; the preemption case
holds all the same.)
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from splitserve.common.errors import (
    CapacityError,
    ContextLengthExceededError,
    InvalidRequestError,
)
from splitserve.common.request_update import RequestUpdate
from splitserve.common.sampling_params import SamplingParams, decided_on_device
from splitserve.common.step_cost import StepCost, StepShape
from splitserve.engine.config import SchedulerConfig, SpeculativeConfig
from splitserve.engine.engine_report import RequestPhases, SchedulerStats
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.ngram_proposer import Drafter
from splitserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: compute these tokens, maybe sample the next one."""

    request_id: str
    token_ids: Sequence[int]
    """Tokens whose KV is computed this step (positions ``start_position`` onwards)."""
    start_position: int
    """Position of ``token_ids[0]``; equals the tokens already in the KV cache."""
    block_table: Sequence[int]
    """The request's blocks, covering at least ``start_position + len(token_ids)`` slots."""
    samples: bool
    """True when this chunk reaches the end of the known tokens: sample one new token."""
    completes_prompt: bool
    """True when this chunk computes the prompt's last token: once a layer is written, that
    layer's KV of the whole prompt is in ``block_table`` (the signal a KV push waits for)."""
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """Generated so far (read-only view for penalties)."""
    eos_token_ids: frozenset[int]
    draft_token_ids: tuple[int, ...] = ()
    """Speculated tokens, the tail of ``token_ids`` after the request's last known token:
    the runner samples after each of ``token_ids`` (module docstring)."""
    adapter: str = ""
    """The digest of the LoRA adapter whose terms its rows take (``Request.adapter_digest``;
    "" for the base model)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_length(self) -> int:
        """Tokens in the KV cache once this chunk is written."""
        return self.start_position + len(self.token_ids)

    def kept_drafts(self, verdicts: Sequence[int]) -> int:
        """How many leading drafts the verdicts (the token sampled after each of
        ``token_ids``) chose too: the drafts kept."""
        kept = 0
        while kept < len(self.draft_token_ids) and verdicts[kept] == self.draft_token_ids[kept]:
            kept += 1
        return kept

    @property
    def num_prompt_logprobs(self) -> int:
        """Rows of this chunk whose logits give a prompt token's logprob (``prompt_logprobs``,
        asked and not yet delivered: no output token yet): every row whose next token is a
        prompt token. Row ``i``'s describes prompt token ``start_position + i + 1``."""
        if self.params.prompt_logprobs is None or self.output_token_ids:
            return 0
        return max(
            0, min(self.context_length, len(self.prompt_token_ids) - 1) - self.start_position
        )

    @property
    def is_decode(self) -> bool:
        """Output tokens only, one decode row each: a request's last sampled token and its
        drafts, if any (a plain decode chunk has one token)."""
        return len(self.token_ids) == 1 + len(self.draft_token_ids) and self.start_position >= len(
            self.prompt_token_ids
        )


@dataclass(frozen=True)
class SchedulerOutput:
    """What the runner executes in one step."""

    chunks: tuple[ScheduledChunk, ...]
    finished_request_ids: frozenset[str] = frozenset()
    """Requests finished since the previous step: the runner drops their per-request state."""

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    def shape(self) -> StepShape:
        """The step-cost model's view of the step: each token of a decode chunk
        (``ScheduledChunk.is_decode``: a request's last token and its drafts) is a decode row
        over its own context; every other chunk computes prompt tokens."""
        decode = [c for c in self.chunks if c.is_decode]
        rows = sum(c.num_tokens for c in decode)
        return StepShape(
            decode_seqs=rows,
            prefill_tokens=self.num_tokens - rows,
            context_tokens=sum(
                c.start_position * c.num_tokens + c.num_tokens * (c.num_tokens + 1) // 2
                for c in decode
            ),
        )


class Scheduler:
    """Owns the waiting/running queues and the KV cache manager of one worker."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.speculative = speculative or SpeculativeConfig()
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: deque[Request] = deque()
        """Remote prefills completed whose adapter the running requests leave no room for
        (``SchedulerConfig.max_loras``; module docstring)."""
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        """Counters for metrics; immutable, replaced as they count (``_count``)."""
        self.on_request_finished: Callable[[RequestPhases], None] | None = None
        """Called with each request that ended, as it ends (``AsyncEngine`` collects them for
        its reports); must not raise."""
        self._finished_since_last_step: set[str] = set()
        self._in_flight: dict[int, frozenset[str]] = {}
        """Steps launched and not yet settled (by serial): the requests each may write."""
        self._deferred_tables: list[tuple[int, list[int]]] = []
        """Tables of ended requests whose blocks wait for the step of that serial to settle."""
        self._drafters: dict[str, Drafter] = {}
        """Each speculating request's proposer (module docstring)."""
        self.step_cost: StepCost | None = None
        """The engine's learned step times (set after each step); drafts are weighed
        against them once they know decode steps (module docstring)."""

    # ---- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ``InvalidRequestError`` if it can never run here."""
        self.check_new(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_new(self, request: Request) -> None:
        """Raise if ``request`` can never be taken here: its id is known, or it never fits."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}", "request_id")
        self.check_fits(request.num_prompt_tokens, request.params)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise if a prompt of this length can never be served by this worker."""
        if num_prompt_tokens == 0:
            raise InvalidRequestError("prompt must contain at least one token", "prompt")
        if num_prompt_tokens >= self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt has {num_prompt_tokens} tokens; the model's context is "
                f"{self.max_model_len} tokens, leaving no room to generate",
                "prompt",
            )
        max_len = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        if self.kv_cache.blocks_needed(max_len) > self.kv_cache.num_blocks:
            raise ContextLengthExceededError(
                f"request needs up to {max_len} tokens of KV cache; this worker holds "
                f"{self.kv_cache.num_blocks * self.kv_cache.block_size}",
                "max_tokens",
            )

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks; None if it is unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a request from outside (e.g. a stop string matched in detokenization)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, status)

    @property
    def has_unfinished(self) -> bool:
        """True while some request has work to schedule (reserved ones wait for their KV)."""
        return bool(self.waiting or self.running or self.parked)

    # ---- remote prefill (disaggregation) ----------------------------------------------------

    def reserve_for_remote_prefill(self, request: Request) -> Sequence[int]:
        """Hold blocks for a prompt whose KV another worker computes; returns the block table.

        The table starts with the longest cached prefix of the prompt this engine holds
        (``KVCacheManager.find_cached_prefix``: full blocks, never the last token), counted as
        computed (``request.num_computed_tokens``); only the blocks after it are new, and only
        they receive KV. The request is never scheduled until ``complete_remote_prefill``;
        aborting it frees the blocks. Raises ``CapacityError`` (nothing held) when the pool
        cannot take the prompt now.
        """
        self.check_new(request)
        cached = self.kv_cache.find_cached_prefix(request.prompt_token_ids, request.hash_root)
        # few runs of consecutive blocks: the transfer sends one message per run and layer
        if not self.kv_cache.allocate(
            request.request_id, request.num_prompt_tokens, cached_blocks=cached, contiguous=True
        ):
            raise CapacityError(
                f"no room for {request.num_prompt_tokens} prompt tokens of KV "
                f"({self.kv_cache.num_free_blocks} blocks free)"
            )
        request.num_computed_tokens = len(cached) * self.kv_cache.block_size
        self._count(
            prefix_query_tokens=request.num_prompt_tokens,
            prefix_hit_tokens=request.num_computed_tokens,
        )
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        return self.kv_cache.block_table(request.request_id)

    def complete_remote_prefill(
        self, request_id: str, first_token_id: int, num_cached_tokens: int = 0
    ) -> RequestUpdate:
        """The prompt's KV landed in the reserved blocks and ``first_token_id`` was sampled
        (by a worker that served ``num_cached_tokens`` of the prompt from its prefix cache).

        The request joins the running batch (or finishes at once if that token ends it), or
        is parked with its KV until its LoRA adapter fits (``SchedulerConfig.max_loras``).
        """
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise InvalidRequestError(f"request {request_id!r} is not waiting for remote KV")
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = num_cached_tokens
        request.first_scheduled_time = time.monotonic()
        self.kv_cache.cache_full_blocks(
            request_id, request.all_token_ids, request.num_tokens, request.hash_root
        )
        request.append_output_token(first_token_id)
        status = self._stop_status(request, first_token_id)
        if status is not None:
            self._finish(request, status)
        elif self.parked or not self._adapter_fits(request):
            request.status = RequestStatus.WAITING_FOR_ADAPTER
            self.parked.append(request)
        else:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return self._update_of(request, (first_token_id,))

    # ---- schedule --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step within the token budget (see the module docstring)."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preemptions_before = self.stats.num_preemptions
        draft_rows, min_chance = 0, 0.0
        if self.speculative.num_tokens:
            decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
            draft_rows = self.speculative.max_step_rows - len(decoding)
            min_chance = self._draft_bar(decoding)
        if self.parked:
            self._unpark()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts: tuple[int, ...] = ()
            if num_new == 1 and draft_rows > 0 and budget > 1:
                drafts = self._drafts(request, min(draft_rows, budget - 1), min_chance)
            if not self._allocate_or_preempt(request, num_new + len(drafts)):
                break
            chunks.append(self._chunk(request, num_new, drafts))
            budget -= num_new + len(drafts)
            draft_rows -= len(drafts)
            index += 1
        if self.stats.num_preemptions == preemptions_before:
            self._admit_waiting(budget, chunks)
        finished = frozenset(self._finished_since_last_step)
        self._finished_since_last_step.clear()
        return SchedulerOutput(tuple(chunks), finished)

    def _allocate_or_preempt(self, request: Request, num_new: int) -> bool:
        """Make room for ``request``; False if it had to preempt itself."""
        needed = request.num_computed_tokens + num_new
        while not self.kv_cache.allocate(request.request_id, needed):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _running_adapters(self) -> set[str]:
        """The distinct LoRA adapters (digests) the running requests take."""
        return {r.adapter_digest for r in self.running if r.adapter_digest}

    def _adapter_fits(self, request: Request, adapters: set[str] | None = None) -> bool:
        """Whether ``request`` may run beside requests taking ``adapters`` (None: the running
        requests', read only where a bound applies) (``SchedulerConfig.max_loras``)."""
        limit = self.config.max_loras
        digest = request.adapter_digest
        if not limit or not digest:
            return True
        if adapters is None:
            adapters = self._running_adapters()
        return digest in adapters or len(adapters) < limit

    def _unpark(self) -> None:
        """Parked requests whose adapter fits now join the running batch, oldest first."""
        adapters = self._running_adapters()
        kept: deque[Request] = deque()
        for request in self.parked:
            if self._adapter_fits(request, adapters):
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                adapters.add(request.adapter_digest)
            else:
                kept.append(request)
        self.parked = kept

    def _admit_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> None:
        adapters = self._running_adapters() if self.config.max_loras else set()
        passed: list[Request] = []  # of adapters with no room: they keep their places
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._adapter_fits(request, adapters):
                passed.append(self.waiting.popleft())
                continue
            cached: Sequence[int] = []
            if not _computes_prompt_logprobs(request):
                cached = self.kv_cache.find_cached_prefix(request.all_token_ids, request.hash_root)
            num_computed = len(cached) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if not self.kv_cache.allocate(request.request_id, num_computed + num_new, cached):
                break
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_computed
                self._count(prefix_query_tokens=request.num_tokens, prefix_hit_tokens=num_computed)
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
            if request.adapter_digest:
                adapters.add(request.adapter_digest)
        self.waiting.extendleft(reversed(passed))

    def _speculates(self, request: Request) -> bool:
        """Whether a draft's verdict is the token plain decoding would sample there: every
        row's penalties and ``min_tokens`` see the outputs plain decoding would have seen, and
        a sampling request's row ``j`` draws the noise plain decoding would have drawn for its
        ``j``-th next token (``ModelRunner._sampling_rows``, ``ModelRunner._rewind``: seeded,
        the same tokens; unseeded, the same distribution); so anything but what is read per
        token beside the token itself (logprobs; stop strings, matched in text after the
        step; a grammar, whose mask for row ``j`` is its state after the drafts before it)."""
        params = request.params
        return params.logprobs is None and not params.stop and params.grammar is None

    def _draft_bar(self, decoding: Sequence[Request]) -> float:
        """The chance of being kept a draft must have to pay for its row (module docstring);
        0 while the step-time model does not know decode steps."""
        cost = self.step_cost
        if cost is None or not cost.knows_decode or not decoding:
            return 0.0
        context = sum(request.num_tokens for request in decoding)
        step_s = cost.decode_step_s(len(decoding), context)
        return cost.per_decode_seq_s * len(decoding) / step_s if step_s > 0 else 0.0

    def _drafts(self, request: Request, limit: int, min_chance: float = 0.0) -> tuple[int, ...]:
        """Up to ``limit`` (and ``num_tokens``) draft tokens for a decoding request, none that
        could take it past ``max_tokens`` or the context window, none whose chance of being
        kept is below ``min_chance``."""
        if not self._speculates(request):
            return ()
        limit = min(
            limit,
            self.speculative.num_tokens,
            request.params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if limit <= 0:
            return ()
        drafter = self._drafters.get(request.request_id)
        if drafter is None:
            drafter = Drafter(self.speculative.ngram_min, self.speculative.ngram_max)
            self._drafters[request.request_id] = drafter
        drafts = drafter.propose(request.all_token_ids, limit)
        return tuple(drafter.worth_proposing(drafts, min_chance))

    def _chunk(
        self, request: Request, num_new: int, drafts: tuple[int, ...] = ()
    ) -> ScheduledChunk:
        start = request.num_computed_tokens
        token_ids = request.all_token_ids[start : start + num_new]
        if drafts:
            token_ids = (*token_ids, *drafts)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            block_table=self.kv_cache.block_table(request.request_id),
            samples=start + num_new == request.num_tokens,
            completes_prompt=start < request.num_prompt_tokens <= start + num_new,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
            draft_token_ids=drafts,
            adapter=request.adapter_digest,
        )

    def _preempt(self, request: Request) -> None:
        self._free_blocks_of(request.request_id)  # held while a launched step may write them
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._count(num_preemptions=1)
        self.waiting.appendleft(request)

    # ---- steps ahead (module docstring) -----------------------------------------------------

    def schedule_ahead(self, step: SchedulerOutput, placeholder: int = 0) -> SchedulerOutput | None:
        """The decode step after ``step`` (launched; its tokens not yet applied by ``update``),
        planned now. First one chunk per request of ``step`` that still runs and does not end
        by length with ``step``'s token (``_ends_by_length``), in ``step``'s order: its token
        ``placeholder`` (the runner feeds it the token ``step`` chooses), one position
        further. Then one per request that joined the running batch since ``step`` was
        planned (a remote prefill completed): its last token, known here, as any decode step
        would take it. Blocks allocated for each. None (nothing changed but blocks allocated,
        which the next steps need anyway) unless: no request waits for admission, no draft is
        ever proposed, ``step``'s requests are plain decode chunks, every joined request has
        just its last token to compute, every next token is chosen on the device alone
        (``decided_on_device``), the pool holds every next block, and some request is left."""
        if self.waiting or self.parked or self.speculative.num_tokens or not step.chunks:
            return None
        running = {request.request_id: request for request in self.running}
        fed = []  # requests of ``step``: their token is ``step``'s choice
        for chunk in step.chunks:
            request = running.get(chunk.request_id)
            if request is None:
                continue  # ended with the step before ``step``
            if not chunk.is_decode or chunk.draft_token_ids or not chunk.samples:
                return None
            if self._ends_by_length(request, new_tokens=1):
                continue  # ends by length with ``step``'s token
            if not decided_on_device(request.params):
                return None
            fed.append(request)
        in_step = {chunk.request_id for chunk in step.chunks}
        joined = [request for request in self.running if request.request_id not in in_step]
        for request in joined:
            if request.num_tokens - request.num_computed_tokens != 1:
                return None
            if not decided_on_device(request.params):
                return None
        for request in fed:
            if not self.kv_cache.allocate(request.request_id, request.num_computed_tokens + 2):
                return None
        for request in joined:
            if not self.kv_cache.allocate(request.request_id, request.num_computed_tokens + 1):
                return None
        chunks = [
            self._decode_chunk(request, request.num_computed_tokens + 1, placeholder)
            for request in fed
        ]
        chunks += [
            self._decode_chunk(request, request.num_computed_tokens, request.all_token_ids[-1])
            for request in joined
        ]
        return SchedulerOutput(tuple(chunks)) if chunks else None

    def _decode_chunk(self, request: Request, position: int, token_id: int) -> ScheduledChunk:
        """A one-token decode chunk of ``request``: ``token_id`` at ``position``."""
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=(token_id,),
            start_position=position,
            block_table=self.kv_cache.block_table(request.request_id),
            samples=True,
            completes_prompt=False,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
            adapter=request.adapter_digest,
        )

    def launched(self, serial: int, step: SchedulerOutput) -> None:
        """``step`` was launched as step ``serial``: until ``settle(serial)`` the device may
        still write its requests' KV."""
        self._in_flight[serial] = frozenset(chunk.request_id for chunk in step.chunks)

    def settle(self, serial: int) -> None:
        """Step ``serial`` (and every step before it) has run on the device: the blocks that
        waited for it go back to the pool."""
        for done in [s for s in self._in_flight if s <= serial]:
            del self._in_flight[done]
        waiting = []
        for waits_for, table in self._deferred_tables:
            if waits_for <= serial:
                self.kv_cache.free_blocks(table)
            else:
                waiting.append((waits_for, table))
        self._deferred_tables = waiting

    def _free_blocks_of(self, request_id: str) -> None:
        """Free the request's blocks, or, while a launched step may write them, its table
        at once and its blocks when that step settles."""
        waits_for = max(
            (serial for serial, ids in self._in_flight.items() if request_id in ids), default=None
        )
        if waits_for is None:
            self.kv_cache.free(request_id)
        else:
            self._deferred_tables.append((waits_for, self.kv_cache.detach(request_id)))

    # ---- update ----------------------------------------------------------------------------

    def update(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Mapping[str, int],
        verified_token_ids: Mapping[str, Sequence[int]] | None = None,
    ) -> list[RequestUpdate]:
        """Apply one executed step; returns an update for each request that sampled.

        ``verified_token_ids``: for each chunk with drafts, the token sampled after each of
        its tokens (``num_tokens`` of them; module docstring)."""
        updates: list[RequestUpdate] = []
        prompt_tokens = generation_tokens = 0
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if chunk.draft_token_ids:
                assert verified_token_ids is not None, "a chunk with drafts needs its verdicts"
                update = self._accept(request, chunk, verified_token_ids[chunk.request_id])
                generation_tokens += len(update.new_token_ids)
                updates.append(update)
                continue
            prompt_left = max(0, request.num_prompt_tokens - request.num_computed_tokens)
            prompt_tokens += min(prompt_left, chunk.num_tokens)
            request.num_computed_tokens += chunk.num_tokens
            self.kv_cache.cache_full_blocks(
                request.request_id,
                request.all_token_ids,
                request.num_computed_tokens,
                request.hash_root,
            )
            if not chunk.samples:
                continue
            token_id = sampled_token_ids[chunk.request_id]
            request.append_output_token(token_id)
            generation_tokens += 1
            status = self._stop_status(request, token_id)
            if status is not None:
                self._finish(request, status)
            updates.append(self._update_of(request, (token_id,)))
        self._count(
            num_prompt_tokens_computed=prompt_tokens, num_generation_tokens=generation_tokens
        )
        return updates

    def _accept(
        self, request: Request, chunk: ScheduledChunk, verified: Sequence[int]
    ) -> RequestUpdate:
        """Keep a speculative chunk's drafts up to the first the model did not choose, then
        the model's next token; stops where plain decoding would have stopped."""
        proposed, accepted = len(chunk.draft_token_ids), chunk.kept_drafts(verified)
        self._count(num_draft_tokens=proposed, num_accepted_draft_tokens=accepted)
        self._drafters[request.request_id].record(proposed, accepted)
        request.num_computed_tokens += 1 + accepted  # the last known token and the kept drafts
        new_tokens: list[int] = []
        status = None
        for token_id in verified[: accepted + 1]:
            request.append_output_token(token_id)
            new_tokens.append(token_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                break
        # The blocks this step filled are cached, also before a finished request frees them
        # (as plain decoding's last step caches them): a stop on a kept draft leaves every
        # token of the sequence with its KV, and kept drafts past it are not the sequence.
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        self.kv_cache.cache_full_blocks(
            request.request_id, request.all_token_ids, computed, request.hash_root
        )
        if status is not None:
            self._finish(request, status)
        return self._update_of(request, tuple(new_tokens))

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            is_eos = token_id in request.eos_token_ids and not params.ignore_eos
            if is_eos or token_id in params.stop_token_ids:
                request.stop_token_id = token_id
                return RequestStatus.FINISHED_STOPPED
        if self._ends_by_length(request):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _ends_by_length(self, request: Request, new_tokens: int = 0) -> bool:
        """Whether ``request`` has reached its ``max_tokens`` or the model's length once
        ``new_tokens`` more tokens are appended to it."""
        return (
            request.num_output_tokens + new_tokens >= request.params.max_tokens
            or request.num_tokens + new_tokens >= self.max_model_len
        )

    @staticmethod
    def _update_of(request: Request, new_token_ids: tuple[int, ...]) -> RequestUpdate:
        return RequestUpdate(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            stop_token_id=request.stop_token_id,
        )

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_ADAPTER:
            self.parked.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._free_blocks_of(request.request_id)
        del self.requests[request.request_id]
        self._drafters.pop(request.request_id, None)
        self._finished_since_last_step.add(request.request_id)
        self._count(num_finished_requests=1)
        request.finished_time = now = time.monotonic()
        if self.on_request_finished is not None:
            self.on_request_finished(
                RequestPhases(
                    request.request_id,
                    request.arrival_time,
                    request.first_scheduled_time,
                    request.first_token_time,
                    now,
                )
            )

    def _count(self, **added: int) -> None:
        """Add to the named counters: a new ``SchedulerStats`` replaces the old one (which
        a published report may hold)."""
        stats = self.stats
        self.stats = dataclasses.replace(
            stats, **{name: getattr(stats, name) + value for name, value in added.items()}
        )


def _computes_prompt_logprobs(request: Request) -> bool:
    """Whether ``request`` must compute its whole prompt for its ``prompt_logprobs``: asked,
    and not yet delivered with a first token (a cached prefix's logits were never kept)."""
    return request.params.prompt_logprobs is not None and not request.output_token_ids
