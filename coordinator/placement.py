"""Where a request's prompt is computed (torch-free): on a prefill worker, which pushes its KV
to the decode worker ("remote"), or on the decode worker itself, chunked into its decode batch
("local"). Decided per request from live figures and each worker's learned step-time model
(``common/step_cost.py``), against the request's latency targets (``Slo``).

``place`` predicts, from plain figures (``DecodeView``, ``PrefillView``):

- remote TTFT on prefill worker p: ``p.cost.prefill_s(p.queued_tokens + uncached)`` (its
  queue first, then this prompt, less what p likely has cached) plus the KV push's exposed
  part, ``p.push_cost.exposed_s(pushed)`` (the transfer that outlasts the compute, for the
  prompt's tokens after the decode worker's cached ones, as p learned it on its link to this
  decode worker; 0 until learned) plus one decode step of the decode worker (the handoff and
  the first token's trip), plus, while the decode worker computes prompts of its own, one of
  its prompt chunks (the first token waits for the step in progress);
- local TTFT: ``d.cost.prefill_s(d.queued_tokens + prompt)`` plus one decode step of its batch
  per ``d.chunk_tokens`` of prompt (the batch's steps carry the chunks);
- the TPOT that local prefill gives the decode batch, in steady state: its decode step with
  this request added, stretched by the share of the decode worker's time that prompts already
  take (``d.prefill_share``: a running request lives through every prompt computed there
  during its life, so its mean inter-token time is ``step / (1 - share)``), plus the time of
  its queued prompts and this one spread over ``max_tokens`` tokens (about the output this
  request shares it with);
- each request already decoding there (``DecodeView.running``, past its first token): the
  time its remaining steps take (``remaining_tokens`` batch steps) plus the prompt time it
  sits through (the queued local prompts and this one, as far as its remaining steps carry
  chunks of them), against the time it has left within its TPOT target (``spare_s``). That
  steady mean hides the requests a burst of local prompts lands on near their end: a short
  request whose last steps carry three prompts' chunks misses its target though the
  batch's mean is met.

A dual-role candidate (a worker that decodes too, ``PrefillView.decodes``) computes the prompt
in chunks inside its own decode batch: its remote TTFT adds one of its batch steps per chunk,
and adaptive placement counts the TPOT it gives that batch as it does for local (its own
prompt share included); a candidate
that would push its batch past the TPOT target is not used while another one is within it.
(The router never offers a request's own decode worker as a candidate: that is local.)

A decode worker that holds the prompt's start in its prefix cache (``DecodeView.
cached_tokens``: a conversation's earlier turns, decoded there) computes only the rest
locally: local predictions count that rest, and adaptive placement keeps the prompt there
(``Reason.LOCAL_CACHED``) when that is fewer tokens than any prefill worker would compute
from its own cache (one that pulls the decode worker's cached KV computes as few, but the
KV travels both ways; its pull counts in its remote TTFT only),
the TTFT target holds with the at-risk margin, the batch's TPOT stays within
``PlacementConfig.cached_tpot_share`` of its target and no running request is pushed past
its own (the guards below), before it looks at remote at all: the prefill worker's time and
the transfer are saved, not just the TTFT. The TPOT margin matters under load: chunks that
keep the batch's mean just within the target still spread some requests' inter-token times
past it (aiperf's multi-turn load at 3 req/s, ``bench/bench_multiturn.py``, without it).

``PlacementMode.ADAPTIVE``: remote on the candidate with the lowest predicted TTFT while
that meets ``ttft_at_risk`` (default ``AT_RISK``) of the TTFT target (a prompt computed
elsewhere costs the decode batch nothing, so local has nothing to win then); otherwise local
when it is predicted faster, keeps the decode batch within the TPOT target and pushes no
running request that is predicted within its own target past it (a request already predicted
past it is lost either way, and does not hold back a prompt that can still meet its
targets); otherwise that best remote. The target counts from the request's arrival: the
time it already waited (``waited_s``: in admission's queue, say) is added to the remote
prediction before the at-risk test, so a request held back at admission is not sent to a
queue it has no time for.

A decode worker that never prefilled has no prefill model of its own: it is assumed as fast
as the prefill worker that has seen the most prompts (same model and layout), until its own
local prefills teach it. Until the models adaptive needs are known (``StepCost.knows_*``:
the decode worker's decode part, some candidate's prefill part), and in ``RULE`` mode (the
default until a benchmark shows adaptive wins), the rule decides (``PlacementConfig``): prompts
of at most ``local_prefill_max_tokens`` stay local, the rest go to the prefill worker with
the fewest queued tokens after what it likely has cached. (The rule used to keep a prompt
local when its part uncached *on the prefill worker* was short: a prompt seen before then
ran in full on a decode worker that may never have seen it.) ``REMOTE`` and ``LOCAL`` force
one side where possible (the benchmark's baselines).

Every ``Placement`` carries its reason and predictions, for metrics and the log.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from splitserve.common.errors import InvalidRequestError
from splitserve.common.kv_push_cost import NO_PUSH_COST, KvPushCost
from splitserve.common.load import DEFAULT_PREFILL_CHUNK_TOKENS
from splitserve.common.step_cost import StepCost

AT_RISK = 0.8
"""By default a remote TTFT predicted above this fraction of the target is at risk
(predictions err)."""
MAX_PREFILL_SHARE = 0.9
"""Placement counts a worker's prompt share as at most this (a batch stretched tenfold is
past any target already); a share that is not a finite number counts as this too."""


class PlacementMode(enum.StrEnum):
    RULE = "rule"
    ADAPTIVE = "adaptive"
    REMOTE = "remote"
    LOCAL = "local"


class Reason(enum.StrEnum):
    """Why a placement was chosen (a metric label: keep the set small)."""

    NO_PREFILL_WORKER = "no_prefill_worker"
    """No compatible prefill worker: local."""
    FORCED = "forced"
    """``PlacementMode.REMOTE`` / ``LOCAL``."""
    SHORT_PROMPT = "short_prompt"
    """Rule: the prompt is at most ``local_prefill_max_tokens`` long."""
    RULE = "rule"
    """``PlacementMode.RULE``: the prefill worker with the fewest queued tokens."""
    NO_MODEL = "no_model"
    """Rule: a step-time model it needs is not known yet."""
    REMOTE_WITHIN_SLO = "remote_within_slo"
    """Adaptive: the best remote TTFT is not at risk."""
    LOCAL_FASTER = "local_faster"
    """Adaptive: remote is at risk; local is faster and keeps the batch within TPOT."""
    REMOTE_FASTER = "remote_faster"
    """Adaptive: remote is at risk, but local would be no faster."""
    TPOT_GUARD = "tpot_guard"
    """Adaptive: remote is at risk and local faster, but local would push the decode
    batch past its TPOT target."""
    RUNNING_TPOT_GUARD = "running_tpot_guard"
    """Adaptive: remote is at risk and local faster, but local would push a request
    decoding there, predicted within its TPOT target, past it."""
    LOCAL_CACHED = "local_cached"
    """Adaptive: the decode worker holds the prompt's start (a conversation's earlier turns),
    so it computes fewer tokens than any prefill worker would, within the TTFT and TPOT
    targets; nothing travels."""


@dataclass(frozen=True)
class Slo:
    """A request's latency targets, seconds."""

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class LatencyTargets:
    """The targets a request asks for, milliseconds; None: the coordinator's. Raises
    ``InvalidRequestError`` for a target that is not a positive finite number."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InvalidRequestError(
                    f"{name} must be a positive number of milliseconds, not {value}",
                    f"latency_targets.{name}",
                )

    def slo(self, default: Slo) -> Slo:
        """The ``Slo`` placement uses for this request: its TTFT target where it gave one;
        its TPOT target only where tighter than ``default``'s, because placement guards the
        TPOT of the whole decode batch it joins, whose other requests keep the default."""
        ttft_s = default.ttft_s if self.ttft_ms is None else self.ttft_ms / 1000
        tpot_s = (
            default.tpot_s if self.tpot_ms is None else min(default.tpot_s, self.tpot_ms / 1000)
        )
        return Slo(ttft_s=ttft_s, tpot_s=tpot_s)


NO_TARGETS = LatencyTargets()
"""A request that asks for no targets of its own."""


@dataclass(frozen=True)
class RunningRequest:
    """A request decoding on a worker, past its first token, as its TPOT target sees it."""

    remaining_tokens: int
    """Tokens it may still generate (at most: it may stop early)."""
    spare_s: float
    """Time it may still take to its last token and keep its mean inter-token time within
    its target: target x (its tokens - 1) less the time since its first token."""


@dataclass(frozen=True)
class DecodeView:
    """The decode worker the request will run on, as placement sees it."""

    cost: StepCost
    running_requests: int
    running_tokens: int
    """The KV its running batch attends over per step."""
    queued_tokens: int
    """Prompt tokens it still has to compute (its own local prefills)."""
    prefill_share: float = 0.0
    """The fraction of its recent wall time its steps spent on prompt tokens (< 1)."""
    chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    """Prompt tokens it computes per step at most (its ``--max-num-batched-tokens``)."""
    running: Iterable[RunningRequest] = ()
    """Requests decoding there past their first token that the placing coordinator
    streams (another coordinator's are in ``running_requests`` only). Read only where the
    running-request guard is consulted (a prompt that may be computed there), and then
    iterated afresh each time: the router passes a view that builds them on iteration, so
    a request placed remotely at once costs nothing per running request."""
    cached_tokens: int = 0
    """Of this prompt, the tokens it likely holds in its prefix cache (a conversation's
    earlier turns decoded there): computed there, only the rest is."""


@dataclass(frozen=True)
class PrefillView:
    """One compatible prefill worker."""

    worker_id: str
    cost: StepCost
    queued_tokens: int
    """Prompt tokens queued there: the more of what the worker reported and what this
    coordinator sent there unanswered."""
    cached_tokens: int
    """Of this prompt, the tokens it likely need not compute: its cached ones, or where it
    pulls them, the decode worker's (``pulled_tokens`` of them)."""
    pulled_tokens: int = 0
    """Of ``cached_tokens``, those it would pull from the decode worker's cache (the reverse
    transfer) rather than hold itself."""
    batch_requests: int = 0
    """A dual-role worker's own decode batch (requests decoding there), which a prompt
    computed there shares its steps with; 0 for a prefill-only worker."""
    batch_tokens: int = 0
    """The KV that batch attends over per step."""
    chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    """Prompt tokens it computes per step at most."""
    prefill_share: float = 0.0
    """The fraction of its recent wall time spent on prompt tokens (counts for its batch)."""
    push_cost: KvPushCost = NO_PUSH_COST
    """What pushing the prompt's KV to the decode worker adds to its TTFT beyond the compute,
    as this worker learned it from its pushes (``common/kv_push_cost.py``; its link to that
    decode worker, else its pushes to any); not known: 0 (the push assumed hidden)."""

    @property
    def decodes(self) -> bool:
        return self.batch_requests > 0


@dataclass(frozen=True)
class PlacementConfig:
    local_prefill_max_tokens: int = 0
    """Rule and adaptive: a prompt of at most this many tokens stays on the decode worker."""
    ttft_at_risk: float = AT_RISK
    """Adaptive: a remote TTFT predicted above this fraction of the target is at risk (0: the
    prompt goes to whichever side is predicted faster whenever local keeps the TPOT target)."""
    cached_tpot_share: float = AT_RISK
    """Adaptive: a prompt whose start the decode worker holds is computed there
    (``Reason.LOCAL_CACHED``) only while the batch's predicted TPOT stays within this
    fraction of the target: the saving is optional, and the batch's headroom is what its
    requests' inter-token times have to absorb the chunks' spread."""


@dataclass(frozen=True)
class Placement:
    """Where the prompt runs, and why."""

    prefill_worker_id: str | None
    """None: local (the decode worker computes it)."""
    reason: Reason
    predicted_ttft_s: float | None = None
    """Of the chosen side; None when the rule decided."""
    predicted_local_tpot_s: float | None = None
    """The decode batch's TPOT had it prefilled locally (adaptive only)."""

    @property
    def where(self) -> str:
        return "local" if self.prefill_worker_id is None else "remote"


def steady_tpot_s(step_s: float, prefill_share: float) -> float:
    """The mean inter-token time of a batch whose decode steps take ``step_s`` on a worker
    that spends ``prefill_share`` of its time on prompts (capped at ``MAX_PREFILL_SHARE``)."""
    if not math.isfinite(prefill_share):  # a worker's report: never trusted to lower the guard
        prefill_share = MAX_PREFILL_SHARE
    share = min(max(prefill_share, 0.0), MAX_PREFILL_SHARE)
    return step_s / (1.0 - share)


def delays_a_running_request_past_target(
    decode: DecodeView, cost: StepCost, num_prompt_tokens: int, batch_step_s: float
) -> bool:
    """Whether computing ``num_prompt_tokens`` more on ``decode`` (after its queued prompt
    tokens, in chunks its decode steps carry) pushes one of its running requests past its
    TPOT target that, by the same prediction, meets it without them. A request with ``n``
    steps left sits through at most ``n`` chunks of the prompts computed there; each of its
    steps takes ``batch_step_s``."""
    chunk = max(decode.chunk_tokens, 1)
    for request in decode.running:
        carried = request.remaining_tokens * chunk  # prompt tokens its remaining steps carry
        decoding_s = request.remaining_tokens * batch_step_s
        before_s = decoding_s + cost.prefill_s(min(decode.queued_tokens, carried))
        after_s = decoding_s + cost.prefill_s(
            min(decode.queued_tokens + num_prompt_tokens, carried)
        )
        if before_s <= request.spare_s < after_s:
            return True
    return False


def _with_prefill_model(decode_cost: StepCost, known: Sequence[PrefillView]) -> StepCost:
    """The decode worker's step-time model; one that never prefilled is assumed to compute
    prompts at the speed of the prefill worker with the most prefill steps learned."""
    if decode_cost.knows_prefill:
        return decode_cost
    lender = max(known, key=lambda p: p.cost.prefill_steps).cost
    return dataclasses.replace(
        decode_cost,
        prefill_base_s=lender.prefill_base_s,
        per_prefill_token_s=lender.per_prefill_token_s,
    )


def _remote_ttfts(
    known: Sequence[PrefillView],
    num_prompt_tokens: int,
    pushed_tokens: int,
    max_tokens: int,
    first_step_s: float,
    slo: Slo,
) -> dict[str, float]:
    """The predicted TTFT on each prefill worker whose model is ``known``: its queue and this
    prompt's uncached tokens, the exposed part of pushing ``pushed_tokens`` tokens' KV (its
    ``push_cost``; 0 where not learned), then the decode worker's ``first_step_s``; a worker
    that decodes too adds its own decode steps, and is left out when its batch would then
    miss the TPOT target, unless every one would."""
    remote_ttft, remote_tpot = {}, {}
    for p in known:
        uncached = p.queued_tokens + num_prompt_tokens - p.cached_tokens
        prefill_s = p.cost.prefill_s(uncached)
        push_s = p.push_cost.exposed_s(pushed_tokens)
        remote_ttft[p.worker_id] = prefill_s + push_s + first_step_s
        if p.decodes:  # its chunks ride its own decode batch's steps
            hosted_step_s = p.cost.decode_step_s(p.batch_requests, p.batch_tokens)
            hosted_chunks = math.ceil(uncached / max(p.chunk_tokens, 1))
            remote_ttft[p.worker_id] += hosted_chunks * hosted_step_s
            remote_tpot[p.worker_id] = steady_tpot_s(hosted_step_s, p.prefill_share) + (
                prefill_s / max(max_tokens, 1)
            )
    within_tpot = [w for w in remote_ttft if remote_tpot.get(w, 0.0) <= slo.tpot_s]
    if within_tpot and len(within_tpot) < len(remote_ttft):
        remote_ttft = {w: remote_ttft[w] for w in within_tpot}
    return remote_ttft


def _local_prediction(
    decode: DecodeView,
    decode_cost: StepCost,
    uncached: int,
    max_tokens: int,
    batch_step_s: float,
) -> tuple[float, float]:
    """(TTFT, TPOT) predicted for the prompt computed on the decode worker: its queue and
    the ``uncached`` tokens in chunks riding its decode steps; its batch's steady TPOT plus
    the prompt's time spread over the request's output."""
    local_tokens = decode.queued_tokens + uncached
    local_prefill_s = decode_cost.prefill_s(local_tokens)
    steps = math.ceil(local_tokens / max(decode.chunk_tokens, 1))
    local_ttft = local_prefill_s + steps * batch_step_s
    local_tpot = steady_tpot_s(batch_step_s, decode.prefill_share) + (
        local_prefill_s / max(max_tokens, 1)
    )
    return local_ttft, local_tpot


def _by_rule(
    num_prompt_tokens: int,
    decode: DecodeView,
    prefills: Sequence[PrefillView],
    mode: PlacementMode,
    config: PlacementConfig,
) -> Placement | None:
    """The placement that needs no prediction (no prefill worker, a forced mode, a short
    prompt, the rule, a step-time model not learned yet); None: adaptive decides."""
    if not prefills:
        return Placement(None, Reason.NO_PREFILL_WORKER)
    by_queue = min(prefills, key=lambda p: p.queued_tokens + num_prompt_tokens - p.cached_tokens)
    if mode is PlacementMode.LOCAL:
        return Placement(None, Reason.FORCED)
    if mode is PlacementMode.REMOTE:
        return Placement(by_queue.worker_id, Reason.FORCED)
    if num_prompt_tokens - decode.cached_tokens <= config.local_prefill_max_tokens:
        # what the decode worker would compute (a prompt a prefill worker has cached is
        # cheapest there, but one the decode worker holds most of is cheaper still)
        return Placement(None, Reason.SHORT_PROMPT)
    if mode is PlacementMode.RULE:
        return Placement(by_queue.worker_id, Reason.RULE)
    if not any(p.cost.knows_prefill for p in prefills) or not decode.cost.knows_decode:
        return Placement(by_queue.worker_id, Reason.NO_MODEL)
    return None


def place(
    num_prompt_tokens: int,
    max_tokens: int,
    decode: DecodeView,
    prefills: Sequence[PrefillView],
    slo: Slo,
    mode: PlacementMode,
    config: PlacementConfig,
    waited_s: float = 0.0,
) -> Placement:
    """See the module docstring. ``prefills``: compatible candidates (may be empty);
    ``waited_s``: seconds since the request arrived. Predictions in the result count from
    now (the attempt's start)."""
    ruled = _by_rule(num_prompt_tokens, decode, prefills, mode, config)
    if ruled is not None:
        return ruled
    known = [p for p in prefills if p.cost.knows_prefill]
    decode_cost = _with_prefill_model(decode.cost, known)
    batch_step_s = decode_cost.decode_step_s(
        decode.running_requests + 1, decode.running_tokens + num_prompt_tokens
    )
    # a remote prompt's first token waits for the decode worker's step in progress
    chunk = max(decode.chunk_tokens, 1)
    first_step_s = batch_step_s + decode_cost.prefill_s(min(decode.queued_tokens, chunk))
    local_uncached = num_prompt_tokens - decode.cached_tokens  # also what a push carries
    remote_ttft = _remote_ttfts(
        known, num_prompt_tokens, local_uncached, max_tokens, first_step_s, slo
    )
    best_remote = min(remote_ttft, key=remote_ttft.__getitem__)
    local_ttft, local_tpot = _local_prediction(
        decode, decode_cost, local_uncached, max_tokens, batch_step_s
    )
    remote = Placement(best_remote, Reason.REMOTE_WITHIN_SLO, remote_ttft[best_remote], local_tpot)
    # what a prefill worker would compute from its own cache: pulling costs a transfer both
    # ways, which computing locally saves
    fewest_remote = min(num_prompt_tokens - p.cached_tokens + p.pulled_tokens for p in known)
    if (
        0 < local_uncached < fewest_remote
        and waited_s + local_ttft <= config.ttft_at_risk * slo.ttft_s
        and local_tpot <= config.cached_tpot_share * slo.tpot_s
        and not delays_a_running_request_past_target(
            decode, decode_cost, local_uncached, batch_step_s
        )
    ):
        return Placement(None, Reason.LOCAL_CACHED, local_ttft, local_tpot)
    if waited_s + remote_ttft[best_remote] <= config.ttft_at_risk * slo.ttft_s:
        return remote
    if local_ttft >= remote_ttft[best_remote]:
        return dataclasses.replace(remote, reason=Reason.REMOTE_FASTER)
    if local_tpot > slo.tpot_s:
        return dataclasses.replace(remote, reason=Reason.TPOT_GUARD)
    if delays_a_running_request_past_target(decode, decode_cost, local_uncached, batch_step_s):
        return dataclasses.replace(remote, reason=Reason.RUNNING_TPOT_GUARD)
    return Placement(None, Reason.LOCAL_FASTER, local_ttft, local_tpot)
