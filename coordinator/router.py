"""Routing (torch-free): which decode worker runs a request, which prefill worker (if any)
computes its prompt.

Decode: among healthy decode workers whose context fits the request, the one with the most
free KV blocks after the request, penalised by the tokens it already decodes per step (its
running batch's KV read) and by the requests this coordinator has running there, and favoured
by the prompt's blocks it likely holds in its prefix cache (``CACHED_BLOCK_WEIGHT`` each): a
conversation's next turn goes back to the worker that decoded the last one (its reply's KV
is there, in no other cache) unless another is that much less loaded. What a worker holds
comes from its KV events where it sends them (``KnownPrefix``: every heartbeat carries its
prefix cache's changes, ``common/kv_events.py``; a worker followed through etcd sends them on
its load stream), so it is exact and the same for every coordinator, also for turns another
coordinator routed; otherwise (a worker that sends none) it is this coordinator's guess
(``PrefixMemory``,
bounded, least recently used first out) of the prompts it routed there and of every request
that finished there, prompt and output. A wrong guess costs time, never a token (the
worker's own cache decides what is reused).
A request with a session id (a conversation's, agent's or user's: ``GenerateRequest.
session_id``, the gateway's ``x-session-id`` header) goes to its session's home worker: of the
candidates, the one whose (session id, worker id) hash is highest (rendezvous hashing,
``session_home``), which every coordinator computes the same way without sharing state, and
which moves only the sessions of a worker that leaves or joins. Load overrides it: a home
worker that lacks free blocks for the request, or has requests waiting, is saturated
(``session_saturated``), and the request is scored as any other.

Prefill: only workers whose KV layout hash equals the decode worker's are candidates, each
seen with its queued prompt tokens and the prompt tokens it likely has cached (a bounded record
of the chained block hashes of prompts routed to it); ``coordinator/placement.py:place``
decides between them and the decode worker itself (local prefill), by ``RoutingConfig.mode``
and the request's latency targets.

Load has two sources: what each worker reports (the registry's ``load``, the shared truth
when several coordinators dispatch to the same workers) and what this coordinator dispatched
and has not seen finish (``Pending``, owned here: attempts wrap their worker calls in
``decoding`` / ``prefilling``), so that a burst of requests does not all land on the worker
that looked idlest at its last report. Each request it streams from a decode worker is kept
with its progress (``DecodeProgress``: tokens streamed, first token's time, TPOT target), so
that placement does not compute a prompt on that worker that would push one of them past its
target.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Callable, Collection, Container, Iterator, Sequence
from dataclasses import dataclass

from splitserve.common.adapter_id import AdapterId
from splitserve.common.blocks import BlockHash, prefix_root, prompt_block_hashes
from splitserve.common.kv_events import KvEvents
from splitserve.common.membership import Role
from splitserve.coordinator.placement import (
    AT_RISK,
    DecodeView,
    Placement,
    PlacementConfig,
    PlacementMode,
    PrefillView,
    RunningRequest,
    Slo,
    place,
)
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry
from splitserve.coordinator.request_record import RequestRecord

DEFAULT_SLO = Slo(ttft_s=2.0, tpot_s=0.05)


def _adapter_id(worker: WorkerRecord, name: str) -> AdapterId | None:
    """``worker``'s LoRA adapter of that name, None where it serves none."""
    return next((adapter for adapter in worker.adapters if adapter.name == name), None)


def session_home(session_id: str, candidates: Sequence[WorkerRecord]) -> WorkerRecord:
    """The session's home among ``candidates`` (not empty): the highest (session id,
    worker id) hash, the same on every coordinator that sees the same workers."""
    return max(candidates, key=lambda worker: _session_weight(session_id, worker.worker_id))


def _session_weight(session_id: str, worker_id: str) -> int:
    digest = hashlib.blake2b(
        f"{session_id}\0{worker_id}".encode(), digest_size=8, person=b"splitserve-sess"
    )
    return int.from_bytes(digest.digest(), "big")


def session_saturated(home: WorkerRecord, free_blocks_after: int) -> bool:
    """Whether a session's home is too loaded to take its request: it would lack free KV
    blocks for it (``free_blocks_after`` < 0), or requests already wait there."""
    return free_blocks_after < 0 or home.load.num_waiting_requests > 0


CACHED_BLOCK_WEIGHT = 4
"""What one cached block of the prompt is worth in a decode worker's score, in free blocks:
it needs no new block, and its KV is neither computed nor sent again."""


@dataclass(frozen=True)
class RoutingConfig:
    local_prefill_max_tokens: int = 0
    """Prompts of at most this many tokens are prefilled on the decode worker."""
    prefix_memory_blocks: int = 100_000
    """Block hashes remembered per prefill worker for the prefix-overlap estimate."""
    mode: PlacementMode = PlacementMode.RULE
    slo: Slo = DEFAULT_SLO
    """Latency targets of requests that set none."""
    ttft_at_risk: float = AT_RISK
    """Adaptive placement: the fraction of the TTFT target above which a remote TTFT is at risk."""


@dataclass(frozen=True)
class Route:
    decode: WorkerRecord
    prefill: WorkerRecord | None
    """None: the decode worker prefills the prompt itself."""
    placement: Placement | None = None
    """Why the prompt runs where it does; None for a route without prefill choice (a
    fallback or a resume)."""
    slo: Slo = DEFAULT_SLO
    """The request's latency targets, as placement read them."""
    queued_prefill_tokens: int = 0
    """Prompt tokens queued ahead of this one on ``prefill`` when it was chosen, as routing
    counted them (``Router._queued_prefill_tokens``: the worker's report or what this
    coordinator sent there unanswered, whichever is more)."""


@dataclass(eq=False)
class DecodeProgress:
    """One attempt's request on its decode worker, as the attempt streams it (it counts
    the tokens as they come): what placement's guard of running requests reads. Compared by
    identity: two attempts with equal figures are still two requests."""

    max_tokens: int
    """Tokens this attempt may generate (the request's budget less earlier attempts')."""
    tpot_s: float
    """The request's target mean inter-token time."""
    num_tokens: int = 0
    """Tokens streamed by this attempt so far."""
    first_token_at: float | None = None
    """``time.monotonic()`` of this attempt's first token; None before it."""

    def running(self, now: float) -> RunningRequest | None:
        """As placement sees it at ``now``; None before its first token (a prompt computed
        meanwhile delays its first token, which its TTFT target covers)."""
        if self.first_token_at is None:
            return None
        budget_s = self.tpot_s * max(self.max_tokens - 1, 0)
        return RunningRequest(
            remaining_tokens=max(self.max_tokens - self.num_tokens, 0),
            spare_s=budget_s - (now - self.first_token_at),
        )


@dataclass(frozen=True)
class RunningView:
    """The requests this coordinator streams from one decode worker, as placement's guard
    of running requests sees them at ``now``: built on each iteration (O(running)), never
    when placement does not consult the guard."""

    decoding: Collection[DecodeProgress]
    now: float

    def __iter__(self) -> Iterator[RunningRequest]:
        for progress in self.decoding:
            running = progress.running(self.now)
            if running is not None:
                yield running


@dataclass
class Pending:
    """Work this coordinator sent to one worker that has not finished yet."""

    decoding: dict[DecodeProgress, None] = dataclasses.field(default_factory=dict)
    """Requests decoding there (attempts open on its decode stream), in arrival order; a
    dict for O(1) removal (``DecodeProgress`` hashes by identity). (Prompt tokens sent
    there are counted per address: ``Router._prefill_sent``.)"""


def leading_held(hashes: Sequence[BlockHash], held: Container[BlockHash]) -> int:
    """How many of a prompt's block ``hashes``, from the first, are in ``held``."""
    count = 0
    for block_hash in hashes:
        if block_hash not in held:
            break
        count += 1
    return count


class PrefixMemory:
    """A bounded LRU set of block hashes, one per prefill worker."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: collections.OrderedDict[BlockHash, None] = collections.OrderedDict()

    def overlap_blocks(self, hashes: Sequence[BlockHash]) -> int:
        return leading_held(hashes, self._hashes)

    def remember(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class KnownPrefix:
    """A worker's prefix cache as its KV events tell it (``common/kv_events.py``): exact as
    of its last heartbeat, where ``PrefixMemory`` is this coordinator's guess."""

    def __init__(self) -> None:
        self._hashes: set[BlockHash] = set()

    def apply(self, events: KvEvents) -> None:
        if events.reset:
            self._hashes = set(events.stored)
            return
        self._hashes.difference_update(events.evicted)
        self._hashes.update(events.stored)

    def overlap_blocks(self, hashes: Sequence[BlockHash]) -> int:
        return leading_held(hashes, self._hashes)


HashesOf = Callable[[int], Sequence[BlockHash]]
"""A prompt's chained block hashes at a block size."""


def hashes_by_block_size(
    token_ids: Sequence[int], cache_salt: str = "", adapter_digest: str = ""
) -> HashesOf:
    """``token_ids``' block hashes at any block size (under ``cache_salt`` and the LoRA
    adapter of ``adapter_digest``, as the workers key them), each size computed once."""
    computed: dict[int, list[BlockHash]] = {}
    root = prefix_root(cache_salt, adapter_digest)

    def hashes_of(block_size: int) -> Sequence[BlockHash]:
        if block_size not in computed:
            computed[block_size] = prompt_block_hashes(token_ids, block_size, root)
        return computed[block_size]

    return hashes_of


class Router:
    def __init__(self, registry: WorkerRegistry, config: RoutingConfig) -> None:
        self.registry = registry
        self.config = config
        self._prefix: dict[str, PrefixMemory] = {}
        """Per prefill worker: the prompts routed there."""
        self._decode_prefix: dict[str, PrefixMemory] = {}
        """Per decode worker: the prompts routed there and the finished sequences."""
        self._known: dict[str, KnownPrefix] = {}
        """What workers that send KV events hold (exact); they are not guessed for."""
        self._pending: dict[str, Pending] = collections.defaultdict(Pending)
        self._prefill_sent: collections.Counter[str] = collections.Counter()
        """Per worker address: prompt tokens this coordinator sent there to compute and not
        yet answered (to a prefill worker until its Prefill call returns, to a decode worker
        computing them itself until the first token), over every member at the address (a
        dual-role worker's prefill and decode members share one engine); kept as
        ``prefilling`` blocks enter and leave, so reading it is O(1)."""

    @contextlib.contextmanager
    def decoding(self, worker: WorkerRecord, progress: DecodeProgress) -> Iterator[None]:
        """Count one request as running on ``worker`` while the block runs; ``progress``
        (the caller updates it) is what placement sees of it."""
        pending = self._pending[worker.worker_id]
        pending.decoding[progress] = None
        try:
            yield
        finally:
            del pending.decoding[progress]

    @contextlib.contextmanager
    def prefilling(self, worker: WorkerRecord, num_tokens: int) -> Iterator[None]:
        """Count ``num_tokens`` prompt tokens as queued on ``worker`` while the block runs."""
        self._prefill_sent[worker.address] += num_tokens
        try:
            yield
        finally:
            self._prefill_sent[worker.address] -= num_tokens
            if self._prefill_sent[worker.address] <= 0:
                del self._prefill_sent[worker.address]

    def kv_events(self, worker_id: str, events: KvEvents) -> None:
        """A worker's prefix-cache changes (its heartbeat's): from then on its cached prefix
        is read from them, not guessed (its guesses are dropped)."""
        if worker_id not in self._known:
            self._prefix.pop(worker_id, None)
            self._decode_prefix.pop(worker_id, None)
        self._known.setdefault(worker_id, KnownPrefix()).apply(events)

    def forget(self, worker_id: str) -> None:
        """A worker left the registry: drop what this router remembers of it (its prefix
        memory and KV events; its decoding requests once none of this coordinator's runs
        there)."""
        self._prefix.pop(worker_id, None)
        self._decode_prefix.pop(worker_id, None)
        self._known.pop(worker_id, None)
        pending = self._pending.get(worker_id)
        if pending is not None and pending == Pending():
            del self._pending[worker_id]

    def report_failure(self, worker: WorkerRecord) -> None:
        """A call to ``worker`` failed as if it were gone: route around it until it reports
        (and, after several in a row, until its circuit breaker's back-off passed)."""
        self.registry.mark_failed(worker.worker_id)

    def report_success(self, worker: WorkerRecord) -> None:
        """A call to ``worker`` did its work (a token came, a prompt was pushed)."""
        self.registry.mark_succeeded(worker.worker_id)

    def route(
        self,
        request: RequestRecord,
        streamed: Sequence[int] = (),
        exclude: Sequence[str] = (),
        with_prefill: bool = True,
    ) -> Route | None:
        """A route for ``request`` after ``streamed`` output tokens (a resume goes on after
        them), or None when no decode worker can take it. ``with_prefill=False``: the decode
        worker computes the prompt (fallback, resume). Its targets (``request.slo``) place the
        prompt, counted from its arrival; its session picks the decode worker (module
        docstring)."""
        prompt_token_ids = request.context_after(streamed) if streamed else request.prompt_token_ids
        adapter = self.served_adapter(request.params.adapter)
        if request.params.adapter and adapter is None:
            return None  # no routable decode worker serves it (now)
        hashes_of = hashes_by_block_size(
            prompt_token_ids, request.params.cache_salt, adapter.digest if adapter else ""
        )
        decode = self.pick_decode(
            len(prompt_token_ids) + request.tokens_left(len(streamed)),
            exclude,
            hashes_of,
            request.session_id,
            adapter,
        )
        if decode is None:
            return None
        hashes = hashes_of(decode.block_size)
        if not with_prefill:
            self._guess_held(decode, hashes)
            return Route(decode, None, slo=request.slo)
        candidates = self._prefill_candidates(decode, len(prompt_token_ids), adapter)
        placement = self.place_prompt(decode, candidates, hashes, request)
        self._guess_held(decode, hashes)  # its blocks land there
        if placement.prefill_worker_id is None:
            return Route(decode, None, placement, request.slo)
        prefill = self.registry.get(placement.prefill_worker_id)
        assert prefill is not None  # a candidate a moment ago, on this event loop
        if prefill.worker_id not in self._known:
            self._memory(prefill.worker_id).remember(hashes)
        return Route(decode, prefill, placement, request.slo, self._queued_prefill_tokens(prefill))

    def prompt_rates(self, probe_tokens: int) -> list[float]:
        """Prompt tokens per second (read at a prompt of ``probe_tokens``) of each worker that
        may compute prompts: the prefill workers, and the decode workers too where placement
        may compute a prompt there (adaptive or local placement, a rule with
        ``local_prefill_max_tokens``, or no prefill worker at all). A decode worker that
        never prefilled counts at the prefill workers' mean learned rate, as placement
        assumes; a worker with no learned rate (and none to borrow) is left out, and a
        dual-role worker counts once."""

        def rate(worker: WorkerRecord) -> float | None:
            cost = worker.load.step_cost
            return cost.prefill_tokens_per_s(probe_tokens) if cost.knows_prefill else None

        prefill_workers = self.registry.workers(Role.PREFILL)
        prefill_rates = [r for r in map(rate, prefill_workers) if r is not None]
        mode = self.config.mode
        decode_computes_prompts = (
            not prefill_workers
            or mode in (PlacementMode.ADAPTIVE, PlacementMode.LOCAL)
            or (mode is PlacementMode.RULE and self.config.local_prefill_max_tokens > 0)
        )
        if not decode_computes_prompts:
            return prefill_rates
        borrowed = sum(prefill_rates) / len(prefill_rates) if prefill_rates else None
        prefilling_at = {w.address for w in prefill_workers}
        decode_rates = [
            rate(w) or borrowed
            for w in self.registry.workers(Role.DECODE)
            if w.address not in prefilling_at
        ]
        return prefill_rates + [r for r in decode_rates if r is not None]

    def finished(
        self,
        decode: WorkerRecord,
        token_ids: Sequence[int],
        cache_salt: str = "",
        adapter: str = "",
    ) -> None:
        """A request finished on ``decode`` with ``token_ids`` (prompt and output) under
        ``cache_salt`` and ``adapter``: the KV of all but the last is in its prefix cache now, for a
        conversation's next turn (a worker that sends KV events says so itself: nothing to
        hash)."""
        if decode.worker_id not in self._known:
            served = _adapter_id(decode, adapter) if adapter else None
            root = prefix_root(cache_salt, served.digest if served else "")
            self._guess_held(decode, prompt_block_hashes(token_ids[:-1], decode.block_size, root))

    def pick_decode(
        self,
        num_tokens: int,
        exclude: Sequence[str] = (),
        hashes_of: HashesOf | None = None,
        session_id: str = "",
        adapter: AdapterId | None = None,
    ) -> WorkerRecord | None:
        """The decode worker for a request of ``num_tokens`` (prompt and ``max_tokens``)
        whose prompt's block hashes ``hashes_of`` gives, of session ``session_id`` ("" for
        none), of LoRA ``adapter`` (None for none: only workers serving it, with its files)
        (module docstring)."""
        candidates = [
            w
            for w in self.registry.workers(Role.DECODE)
            if w.worker_id not in exclude
            and w.max_model_len >= num_tokens
            and (adapter is None or adapter in w.adapters)
        ]
        if not candidates:
            return None

        def free_after(worker: WorkerRecord) -> tuple[int, int]:
            """(free blocks once this request and this coordinator's pending ones have
            theirs, prompt blocks the worker likely holds)."""
            cached = 0
            if hashes_of is not None:
                cached = self.decode_cached_blocks(worker, hashes_of(worker.block_size))
            blocks_needed = -(-num_tokens // max(worker.block_size, 1)) - cached
            pending = len(self._pending[worker.worker_id].decoding)
            return worker.load.num_free_blocks - blocks_needed * (1 + pending), cached

        if session_id:
            home = session_home(session_id, candidates)
            if not session_saturated(home, free_after(home)[0]):
                return home

        def score(worker: WorkerRecord) -> float:
            load = worker.load
            free, cached = free_after(worker)
            busy = load.num_running_tokens / max(worker.block_size, 1)
            affinity = CACHED_BLOCK_WEIGHT * cached
            return free - busy - 4 * load.num_waiting_requests + affinity

        return max(candidates, key=score)

    def decode_cached_blocks(self, worker: WorkerRecord, hashes: Sequence[BlockHash]) -> int:
        """Of a prompt's block ``hashes`` (at ``worker``'s block size), how many ``worker``
        likely holds (leading ones)."""
        return self._held_blocks(worker.worker_id, hashes, self._decode_prefix)

    def _prefill_candidates(
        self, decode: WorkerRecord, num_tokens: int, adapter: AdapterId | None = None
    ) -> list[WorkerRecord]:
        """Prefill workers that may push a prompt of ``num_tokens`` of LoRA ``adapter`` (None:
        none) to ``decode``: serving the adapter with the same files (its digest); never the
        prefill role of ``decode``'s own process (a dual-role worker): computing the prompt
        there is local prefill, with no transfer."""
        return [
            w
            for w in self.registry.workers(Role.PREFILL)
            if w.compat_hash == decode.compat_hash
            and w.max_model_len >= num_tokens
            and w.address != decode.address
            and (adapter is None or adapter in w.adapters)
        ]

    def served_adapter(self, name: str) -> AdapterId | None:
        """The LoRA adapter requests naming ``name`` are routed to ("": none, None): of the
        digests routable decode workers serve under that name (one, but for the moment a
        runtime load or unload reaches the workers one after the other), the one most of
        them serve (ties: the smallest digest). None also where no routable worker serves it
        (no route then)."""
        if not name:
            return None
        counts = collections.Counter(
            adapter
            for worker in self.registry.workers(Role.DECODE)
            for adapter in worker.adapters
            if adapter.name == name
        )
        if not counts:
            return None
        return min(counts, key=lambda adapter: (-counts[adapter], adapter.digest))

    def place_prompt(
        self,
        decode: WorkerRecord,
        candidates: Sequence[WorkerRecord],
        hashes: Sequence[BlockHash],
        request: RequestRecord,
    ) -> Placement:
        """Where ``request``'s prompt (its block ``hashes``; a first attempt's: nothing
        streamed yet) runs for it decoding on ``decode``, among the prefill ``candidates``
        and ``decode`` itself (``place``), against its targets counted from its arrival. A
        candidate that decodes too (a dual-role worker: a decode member at its address) is
        seen with its decode batch."""
        num_prompt_tokens = len(request.prompt_token_ids)
        decode_cached = self._decode_cached_tokens(decode, hashes, num_prompt_tokens)
        prefills = self._prefill_views(candidates, hashes, decode, decode_cached)
        decoding = self._pending[decode.worker_id].decoding
        if self.config.mode is not PlacementMode.ADAPTIVE:  # only adaptive guards them
            decoding = {}
        view = DecodeView(
            cost=decode.load.step_cost,
            running_requests=decode.load.num_running_requests,
            running_tokens=decode.load.num_running_tokens,
            queued_tokens=self._queued_prefill_tokens(decode),
            prefill_share=decode.load.prefill_share,
            chunk_tokens=decode.load.chunk_tokens,
            running=RunningView(decoding, time.monotonic()),
            cached_tokens=decode_cached,
        )
        config = PlacementConfig(self.config.local_prefill_max_tokens, self.config.ttft_at_risk)
        waited_s = time.monotonic() - request.arrived_at
        return place(
            num_prompt_tokens,
            request.params.max_tokens,
            view,
            prefills,
            request.slo,
            self.config.mode,
            config,
            waited_s,
        )

    def _prefill_views(
        self,
        candidates: Sequence[WorkerRecord],
        hashes: Sequence[BlockHash],
        decode: WorkerRecord,
        decode_cached: int,
    ) -> list[PrefillView]:
        """Each prefill candidate as placement sees it: its queue, what of the prompt it
        holds or would pull from the ``decode`` worker (which holds ``decode_cached``
        tokens), what its KV push to that worker exposes (its reported figure for the link,
        ``KvPushCosts.to``), and, for one that decodes too, its decode batch."""
        decoding_at = (
            {w.address for w in self.registry.workers(Role.DECODE)} if candidates else set()
        )
        prefills = []
        for w in candidates:
            own = self._held_blocks(w.worker_id, hashes, self._prefix) * w.block_size
            pulled = self._pulled_tokens(w, own, decode_cached)
            prefills.append(
                PrefillView(
                    worker_id=w.worker_id,
                    cost=w.load.step_cost,
                    queued_tokens=self._queued_prefill_tokens(w),
                    cached_tokens=own + pulled,
                    pulled_tokens=pulled,
                    batch_requests=w.load.num_running_requests if w.address in decoding_at else 0,
                    batch_tokens=w.load.num_running_tokens if w.address in decoding_at else 0,
                    chunk_tokens=w.load.chunk_tokens,
                    prefill_share=w.load.prefill_share,
                    push_cost=w.load.kv_push.to(decode.address),
                )
            )
        return prefills

    @staticmethod
    def _pulled_tokens(prefill: WorkerRecord, own_cached: int, decode_cached: int) -> int:
        """Of a prompt, the tokens ``prefill`` would pull from the decode worker's cache
        (which holds ``decode_cached`` of them) beyond the ``own_cached`` it holds, and so
        need not compute: all the decode worker holds more, where it pulls and that is
        enough more (the reverse transfer, ``prefill/worker.py``), else 0."""
        pulls = prefill.pulls_cached_kv_min_blocks
        if pulls and decode_cached - own_cached >= pulls * prefill.block_size:
            return decode_cached - own_cached
        return 0

    def _decode_cached_tokens(
        self, decode: WorkerRecord, hashes: Sequence[BlockHash], num_prompt_tokens: int
    ) -> int:
        """Of a prompt, the tokens ``decode`` likely serves from its prefix cache: its cached
        leading blocks, never the prompt's last token (``KVCacheManager.find_cached_prefix``)."""
        blocks = self.decode_cached_blocks(decode, hashes)
        return min(blocks, (num_prompt_tokens - 1) // decode.block_size) * decode.block_size

    def _queued_prefill_tokens(self, worker: WorkerRecord) -> int:
        """Prompt tokens queued on ``worker``: what it reported, or what this coordinator has
        sent there and not seen answered, whichever is more. (Not their sum: a prompt the
        worker has taken is in both until it is answered, and counting it twice made a
        prefill worker look twice as far behind as it was.) What this coordinator sent
        counts over every member at the worker's address: a dual-role worker's prefill and
        decode members share one engine. With several coordinators, prompts sent since the
        worker's last report are missed when its report is the larger figure. O(1): read
        per candidate of every request."""
        return max(worker.load.num_pending_prefill_tokens, self._prefill_sent[worker.address])

    def _held_blocks(
        self, worker_id: str, hashes: Sequence[BlockHash], guesses: dict[str, PrefixMemory]
    ) -> int:
        """Of a prompt's block ``hashes``, how many the worker holds (leading ones): from
        its KV events when it sends them, else this coordinator's guess in ``guesses``."""
        view = self._known.get(worker_id) or guesses.get(worker_id)
        return 0 if view is None else view.overlap_blocks(hashes)

    def _guess_held(self, decode: WorkerRecord, hashes: Sequence[BlockHash]) -> None:
        """Guess that ``decode`` holds ``hashes`` now (nothing to guess for a worker that
        sends its KV events)."""
        if decode.worker_id not in self._known:
            self._decode_memory(decode).remember(hashes)

    def _memory(self, worker_id: str) -> PrefixMemory:
        memory = self._prefix.get(worker_id)
        if memory is None:
            memory = self._prefix[worker_id] = PrefixMemory(self.config.prefix_memory_blocks)
        return memory

    def _decode_memory(self, worker: WorkerRecord) -> PrefixMemory:
        """What ``worker`` likely holds: at most as many blocks as its pool has."""
        memory = self._decode_prefix.get(worker.worker_id)
        if memory is None:
            capacity = min(self.config.prefix_memory_blocks, max(worker.num_blocks, 1))
            memory = self._decode_prefix[worker.worker_id] = PrefixMemory(capacity)
        return memory
