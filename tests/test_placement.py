"""Placement decisions (``coordinator/placement.py``) on plain figures, torch-free: the fixed
modes and the rule, and adaptive placement choosing local prefill only when the prefill side
puts the TTFT target at risk, local is faster and the decode batch keeps its TPOT target."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.kv_push_cost import MIN_PUSHES, KvPushCost
from splitserve.common.step_cost import MIN_STEPS, StepCost
from splitserve.coordinator.placement import (
    NO_TARGETS,
    DecodeView,
    LatencyTargets,
    PlacementConfig,
    PlacementMode,
    PrefillView,
    Reason,
    RunningRequest,
    Slo,
    place,
)

SLO = Slo(ttft_s=2.0, tpot_s=0.05)
RULE = PlacementConfig(local_prefill_max_tokens=0)
ONE_CORE = StepCost(
    decode_base_s=0.012,
    per_decode_seq_s=0.001,
    per_context_token_s=1e-6,
    prefill_base_s=0.01,
    per_prefill_token_s=0.002,  # 500 prompt tokens/s
    decode_steps=MIN_STEPS,
    prefill_steps=MIN_STEPS,
)
UNKNOWN = StepCost()


def _decode(
    running: int = 0, queued: int = 0, cost: StepCost = ONE_CORE, share: float = 0.0
) -> DecodeView:
    return DecodeView(
        cost,
        running_requests=running,
        running_tokens=400 * running,
        queued_tokens=queued,
        prefill_share=share,
        chunk_tokens=512,
    )


def _prefill(name: str, queued: int = 0, cached: int = 0, cost: StepCost = ONE_CORE) -> PrefillView:
    return PrefillView(name, cost, queued_tokens=queued, cached_tokens=cached)


def _place(
    decode: DecodeView,
    prefills: list[PrefillView],
    mode: PlacementMode = PlacementMode.ADAPTIVE,
    prompt: int = 320,
    max_tokens: int = 96,
    rule: PlacementConfig = RULE,
):  # noqa: ANN202
    return place(prompt, max_tokens, decode, prefills, SLO, mode, rule)


def test_without_a_prefill_worker_the_prompt_is_local_in_every_mode() -> None:
    for mode in PlacementMode:
        placement = _place(_decode(), [], mode)
        assert (placement.where, placement.reason) == ("local", Reason.NO_PREFILL_WORKER)


def test_forced_modes_and_the_rule() -> None:
    prefills = [_prefill("busy", queued=1000), _prefill("idle", queued=10)]
    assert _place(_decode(), prefills, PlacementMode.LOCAL).prefill_worker_id is None
    remote = _place(_decode(), prefills, PlacementMode.REMOTE)
    assert (remote.prefill_worker_id, remote.reason) == ("idle", Reason.FORCED)
    rule = _place(_decode(), prefills, PlacementMode.RULE)
    assert (rule.prefill_worker_id, rule.reason) == ("idle", Reason.RULE)
    # cached tokens count: the busy worker holds 1000 of a 1300-token prompt
    prefills = [_prefill("busy", queued=1000, cached=1000), _prefill("idle", queued=500)]
    assert _place(_decode(), prefills, PlacementMode.RULE, prompt=1300).prefill_worker_id == "busy"


def test_a_short_prompt_stays_local_in_rule_and_adaptive_modes() -> None:
    rule = PlacementConfig(local_prefill_max_tokens=64)
    for mode in (PlacementMode.RULE, PlacementMode.ADAPTIVE):
        placement = _place(_decode(), [_prefill("p")], mode, prompt=60, rule=rule)
        assert (placement.where, placement.reason) == ("local", Reason.SHORT_PROMPT)
    # 300 tokens, 256 of them cached on the prefill worker: cheapest there, not local
    cached = [_prefill("p", cached=256)]
    assert _place(_decode(), cached, PlacementMode.RULE, prompt=300, rule=rule).where == "remote"


def test_adaptive_falls_back_to_the_rule_until_the_models_are_known() -> None:
    prefills = [_prefill("a", queued=100, cost=UNKNOWN), _prefill("b", queued=50, cost=UNKNOWN)]
    placement = _place(_decode(), prefills)
    assert (placement.prefill_worker_id, placement.reason) == ("b", Reason.NO_MODEL)
    placement = _place(_decode(cost=UNKNOWN), [_prefill("a", queued=5000)])
    assert (placement.prefill_worker_id, placement.reason) == ("a", Reason.NO_MODEL)


def test_a_decode_worker_that_never_prefilled_borrows_a_prefill_workers_speed() -> None:
    decode_only = StepCost(**{**ONE_CORE.__dict__, "prefill_base_s": 0.0, "prefill_steps": 0})
    decode_only = StepCost(**{**decode_only.__dict__, "per_prefill_token_s": 0.0})
    assert not decode_only.knows_prefill
    placement = _place(_decode(running=2, cost=decode_only), [_prefill("p", queued=1000)])
    # as with its own model (ONE_CORE): local, predicted from the prefill worker's speed
    assert (placement.where, placement.reason) == ("local", Reason.LOCAL_FASTER)
    assert placement.predicted_ttft_s == pytest.approx(
        _place(_decode(running=2), [_prefill("p", queued=1000)]).predicted_ttft_s
    )


def test_adaptive_stays_remote_while_remote_meets_the_ttft_target() -> None:
    # an idle decode worker would be as fast, but remote costs its batch nothing
    placement = _place(_decode(), [_prefill("p", queued=200)])
    assert (placement.prefill_worker_id, placement.reason) == ("p", Reason.REMOTE_WITHIN_SLO)
    assert placement.predicted_ttft_s == pytest.approx(0.01 + 0.002 * 520 + 0.013 + 0.00032)


def test_adaptive_goes_local_when_the_prefill_queue_puts_ttft_at_risk() -> None:
    # 1000 queued tokens: remote ~2.3 s > 0.8 * 2 s; a light decode batch has room
    placement = _place(_decode(running=2), [_prefill("p", queued=1000)])
    assert (placement.where, placement.reason) == ("local", Reason.LOCAL_FASTER)
    assert placement.predicted_ttft_s is not None and placement.predicted_ttft_s < 1.0
    assert placement.predicted_local_tpot_s is not None
    assert placement.predicted_local_tpot_s <= SLO.tpot_s


def test_adaptive_keeps_a_full_decode_batch_within_its_tpot_target() -> None:
    # the same queue, but 30 running requests: their steps are ~0.05 s before any prefill
    placement = _place(_decode(running=30), [_prefill("p", queued=1000)])
    assert (placement.where, placement.reason) == ("remote", Reason.TPOT_GUARD)
    assert placement.predicted_local_tpot_s is not None
    assert placement.predicted_local_tpot_s > SLO.tpot_s


def test_the_tpot_guard_counts_the_share_of_time_prompts_already_take() -> None:
    """Local prompts stretch every step of a running request's life: a decode worker that
    already spends half its time on prompts doubles its batch's mean inter-token time, so the
    prompt that a fresh worker would take (predicted ~30 ms) goes remote there (~54 ms)."""
    fresh = _place(_decode(running=8), [_prefill("p", queued=1000)])
    assert (fresh.where, fresh.reason) == ("local", Reason.LOCAL_FASTER)
    busy = _place(_decode(running=8, share=0.5), [_prefill("p", queued=1000)])
    assert (busy.where, busy.reason) == ("remote", Reason.TPOT_GUARD)
    assert fresh.predicted_local_tpot_s is not None and busy.predicted_local_tpot_s is not None
    step_s = ONE_CORE.decode_step_s(9, 400 * 8 + 320)
    prompt_s = ONE_CORE.prefill_s(320) / 96
    assert fresh.predicted_local_tpot_s == pytest.approx(step_s + prompt_s)
    assert busy.predicted_local_tpot_s == pytest.approx(step_s / 0.5 + prompt_s)
    # a share of 1 (a worker doing nothing else) is capped: still a finite prediction
    capped = _place(_decode(running=8, share=1.0), [_prefill("p", queued=1000)])
    assert capped.predicted_local_tpot_s == pytest.approx(step_s / 0.1 + prompt_s)


def test_a_remote_first_token_waits_for_the_decode_workers_prompt_chunk_in_progress() -> None:
    idle = _place(_decode(), [_prefill("p")]).predicted_ttft_s
    assert idle is not None
    # 300 prompt tokens of its own queued: the step in progress computes them (chunk 512)
    busy = _place(_decode(queued=300), [_prefill("p")]).predicted_ttft_s
    assert busy == pytest.approx(idle + ONE_CORE.prefill_s(300))
    # 5000 queued: only one chunk of them (512) runs before the first token's step
    long_queue = _place(_decode(queued=5000), [_prefill("p")]).predicted_ttft_s
    assert long_queue == pytest.approx(idle + ONE_CORE.prefill_s(512))


def test_adaptive_stays_remote_when_local_would_be_no_faster() -> None:
    placement = _place(_decode(queued=2000), [_prefill("p", queued=1000)])
    assert (placement.where, placement.reason) == ("remote", Reason.REMOTE_FASTER)


def test_adaptive_picks_the_prefill_worker_predicted_fastest_not_the_shortest_queue() -> None:
    slow = StepCost(**{**ONE_CORE.__dict__, "per_prefill_token_s": 0.008})
    prefills = [_prefill("slow-short-queue", queued=100, cost=slow), _prefill("fast", queued=400)]
    placement = _place(_decode(), prefills)
    assert placement.prefill_worker_id == "fast"
    assert _place(_decode(), prefills, PlacementMode.RULE).prefill_worker_id == "slow-short-queue"


def _dual(name: str, batch: int, queued: int = 0) -> PrefillView:
    """A dual-role candidate: a prefill role whose engine decodes ``batch`` requests too."""
    return PrefillView(
        name, ONE_CORE, queued, cached_tokens=0, batch_requests=batch, batch_tokens=400 * batch
    )


def test_a_dual_role_candidate_counts_its_decode_batch_in_ttft_and_tpot() -> None:
    """Its prompt rides its own decode batch's steps (one per chunk) and stalls that batch:
    a candidate whose batch would leave the TPOT target is passed over while another one keeps
    it, even when faster; with no candidate within TPOT the fastest is still used."""
    idle = _dual("idle", batch=0)
    busy = _dual("busy", batch=20)
    plain = _prefill("plain")
    base = _place(_decode(running=8), [plain]).predicted_ttft_s
    assert base is not None
    assert _place(_decode(running=8), [idle]).predicted_ttft_s == pytest.approx(base)
    with_batch = _place(_decode(running=8), [_dual("small", batch=2)]).predicted_ttft_s
    assert with_batch is not None and with_batch > base  # one of its batch steps per chunk

    # 320 tokens = 0.65 s of prefill over 16 output tokens: +41 ms on a 20-request batch
    # (decode step 32 ms): past 50 ms. The idle one keeps it, though it has a queue.
    slow_idle = _dual("slow-idle", batch=0, queued=200)
    placement = _place(_decode(running=8), [busy, slow_idle], max_tokens=16)
    assert placement.prefill_worker_id == "slow-idle"
    placement = _place(_decode(running=8), [busy], max_tokens=16)
    assert placement.prefill_worker_id == "busy"  # no candidate within TPOT: the fastest


def test_a_requests_own_targets_replace_ttft_and_only_tighten_tpot() -> None:
    default = Slo(ttft_s=2.0, tpot_s=0.05)
    assert NO_TARGETS.slo(default) == default
    assert LatencyTargets(ttft_ms=500).slo(default) == Slo(ttft_s=0.5, tpot_s=0.05)
    assert LatencyTargets(ttft_ms=30_000).slo(default).ttft_s == 30.0
    # a looser TPOT target would let local prompts stall the batch it joins: not taken
    assert LatencyTargets(tpot_ms=1000).slo(default).tpot_s == 0.05
    assert LatencyTargets(tpot_ms=20).slo(default).tpot_s == pytest.approx(0.02)
    # a relaxed TTFT target keeps a queued prompt remote where the default would take it local
    queued = [_prefill("p", queued=1000)]
    assert _place(_decode(running=2), queued).where == "local"
    relaxed = LatencyTargets(ttft_ms=10_000).slo(SLO)
    placement = place(320, 96, _decode(running=2), queued, relaxed, PlacementMode.ADAPTIVE, RULE)
    assert (placement.where, placement.reason) == ("remote", Reason.REMOTE_WITHIN_SLO)


@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan"), float("inf")])
def test_a_target_that_is_not_a_positive_number_is_refused(bad: float) -> None:
    for name in ("ttft_ms", "tpot_ms"):
        with pytest.raises(InvalidRequestError) as error:
            LatencyTargets(**{name: bad})
        assert error.value.param == f"latency_targets.{name}"


def test_with_no_ttft_margin_adaptive_takes_the_faster_side_within_tpot() -> None:
    """``ttft_at_risk=0``: a prompt goes local whenever that is predicted faster and keeps
    the batch's TPOT, not only once remote TTFT is at risk."""
    queued = [_prefill("p", queued=200)]  # remote ~1.06 s: well within 0.8 of 2 s
    assert _place(_decode(running=2), queued).reason is Reason.REMOTE_WITHIN_SLO
    eager = PlacementConfig(ttft_at_risk=0.0)
    placement = _place(_decode(running=2), queued, rule=eager)
    assert (placement.where, placement.reason) == ("local", Reason.LOCAL_FASTER)
    # nothing queued anywhere: local is no faster, and a full batch is still guarded
    assert _place(_decode(), [_prefill("p")], rule=eager).reason is Reason.REMOTE_FASTER
    assert _place(_decode(running=30), queued, rule=eager).reason is Reason.TPOT_GUARD


def test_the_time_a_request_already_waited_counts_against_its_ttft_target() -> None:
    """The target counts from arrival: remote ~1.06 s is within 0.8 of 2 s for a fresh
    request, not for one held 0.7 s in admission's queue (1.76 s > 1.6 s): that one goes to
    the faster side, local, while the batch keeps its TPOT target."""
    queued = [_prefill("p", queued=200)]
    fresh = place(320, 96, _decode(running=2), queued, SLO, PlacementMode.ADAPTIVE, RULE)
    assert fresh.reason is Reason.REMOTE_WITHIN_SLO
    assert fresh.predicted_ttft_s is not None and fresh.predicted_ttft_s < 0.8 * SLO.ttft_s
    waited = place(320, 96, _decode(running=2), queued, SLO, PlacementMode.ADAPTIVE, RULE, 0.7)
    assert (waited.where, waited.reason) == ("local", Reason.LOCAL_FASTER)
    # predictions still count from now, and a wait changes nothing where local is no faster
    # or would break the batch's TPOT target
    assert waited.predicted_ttft_s is not None and waited.predicted_ttft_s < 1.0
    idle = place(320, 96, _decode(), [_prefill("p")], SLO, PlacementMode.ADAPTIVE, RULE, 1.9)
    assert idle.reason is Reason.REMOTE_FASTER
    full = place(320, 96, _decode(running=30), queued, SLO, PlacementMode.ADAPTIVE, RULE, 0.7)
    assert full.reason is Reason.TPOT_GUARD


def test_a_local_prompt_never_pushes_a_running_request_past_its_own_target() -> None:
    """The batch's steady TPOT (~45 ms) allows the 320-token prompt locally (0.65 s of
    compute); a request running there with 10 tokens left (~0.25 s of steps) and 0.5 s left
    within its target would sit through all of it and miss its target: the prompt goes
    remote. With 1 s left it goes local; a request already predicted past its target (0.2 s
    left) is lost either way and holds nothing back."""
    queued = [_prefill("p", queued=1000)]

    def with_running(*running: RunningRequest, chunk: int = 512) -> DecodeView:
        return dataclasses.replace(_decode(running=8), running=running, chunk_tokens=chunk)

    assert _place(with_running(), queued).reason is Reason.LOCAL_FASTER
    tight = _place(with_running(RunningRequest(10, 1.0), RunningRequest(10, 0.5)), queued)
    assert (tight.where, tight.reason) == ("remote", Reason.RUNNING_TPOT_GUARD)
    assert tight.predicted_local_tpot_s is not None
    assert tight.predicted_local_tpot_s < SLO.tpot_s  # the steady guard alone would allow it
    roomy = _place(with_running(RunningRequest(10, 1.0)), queued)
    assert (roomy.where, roomy.reason) == ("local", Reason.LOCAL_FASTER)
    lost = _place(with_running(RunningRequest(10, 0.2)), queued)
    assert lost.reason is Reason.LOCAL_FASTER
    # a request sits through only the chunks its remaining steps carry: 2 steps of 64-token
    # chunks are 128 prompt tokens (~0.3 s with its steps), within 0.4 s; the whole prompt
    # (~0.7 s) would not be
    short = _place(with_running(RunningRequest(2, 0.4), chunk=64), queued)
    assert short.reason is Reason.LOCAL_FASTER
    assert _place(with_running(RunningRequest(6, 0.4), chunk=64), queued).reason is (
        Reason.RUNNING_TPOT_GUARD
    )


def test_the_running_guard_counts_the_prompts_already_queued_there() -> None:
    """300 prompt tokens already queued locally come first: a request that meets its target
    after sitting through them (0.9 s left, ~0.86 s predicted) but not after this prompt too
    holds the prompt back; with nothing queued the same request leaves room for it."""
    queued = [_prefill("p", queued=2000)]
    running = (RunningRequest(10, 0.9),)
    empty = dataclasses.replace(_decode(running=8), running=running)
    assert _place(empty, queued).reason is Reason.LOCAL_FASTER
    behind = dataclasses.replace(_decode(running=8, queued=300), running=running)
    assert _place(behind, queued).reason is Reason.RUNNING_TPOT_GUARD


def test_a_cached_prompt_stays_local_only_while_the_batch_keeps_tpot_headroom() -> None:
    """The decode worker holds 300 of the prompt's 320 tokens: it computes the other 20 in its
    batch (``LOCAL_CACHED``) while the batch's predicted TPOT stays within
    ``cached_tpot_share`` of the target; past that share, though within the target, the
    prompt goes to the prefill worker."""

    def cached(running: int) -> DecodeView:
        return dataclasses.replace(_decode(running=running), cached_tokens=300)

    light = _place(cached(8), [_prefill("p")])
    assert (light.where, light.reason) == ("local", Reason.LOCAL_CACHED)
    heavy = _place(cached(20), [_prefill("p")])
    assert heavy.predicted_local_tpot_s is not None
    assert PlacementConfig().cached_tpot_share * SLO.tpot_s < heavy.predicted_local_tpot_s
    assert heavy.predicted_local_tpot_s <= SLO.tpot_s
    assert (heavy.where, heavy.reason) == ("remote", Reason.REMOTE_WITHIN_SLO)
    lenient = PlacementConfig(local_prefill_max_tokens=0, cached_tpot_share=1.0)
    assert _place(cached(20), [_prefill("p")], rule=lenient).reason is Reason.LOCAL_CACHED
    # a prefill worker that pulls the decode worker's cached KV would compute as few tokens
    # (the router credits it with them); the tie stays local, where nothing travels
    pulling = dataclasses.replace(_prefill("p"), cached_tokens=300, pulled_tokens=300)
    assert _place(cached(8), [pulling]).reason is Reason.LOCAL_CACHED
    assert _place(cached(20), [pulling]).where == "remote"


NARROW_LINK = KvPushCost(base_s=0.02, per_token_s=0.001, pushes=MIN_PUSHES)
"""A prefill worker's learned push over a narrow link: 20 ms + 1 ms a token beyond the
compute (``common/kv_push_cost.py``)."""


def test_the_learned_push_makes_remote_miss_the_ttft_target_so_the_prompt_stays_local() -> None:
    """600 tokens: computed remotely in ~1.2 s, within 0.8 x 2 s, so remote; over a link that
    exposes 0.62 s of their push, ~1.85 s: at risk, and local (~1.24 s) is faster and keeps
    the batch's TPOT. A figure fitted on too few pushes counts as 0 (today's prediction)."""
    decode = _decode(running=2)
    wide = _place(decode, [_prefill("p")], prompt=600)
    assert (wide.where, wide.reason) == ("remote", Reason.REMOTE_WITHIN_SLO)
    narrow = dataclasses.replace(_prefill("p"), push_cost=NARROW_LINK)
    placement = _place(decode, [narrow], prompt=600)
    assert (placement.where, placement.reason) == ("local", Reason.LOCAL_FASTER)
    assert placement.predicted_ttft_s is not None and wide.predicted_ttft_s is not None
    local_s, remote_s = placement.predicted_ttft_s, wide.predicted_ttft_s
    assert local_s < remote_s + NARROW_LINK.exposed_s(600)
    assert remote_s <= 0.8 * SLO.ttft_s < remote_s + NARROW_LINK.exposed_s(600)
    unlearned = dataclasses.replace(narrow, push_cost=dataclasses.replace(NARROW_LINK, pushes=1))
    assert _place(decode, [unlearned], prompt=600) == wide


def test_the_push_term_counts_only_the_tokens_that_travel() -> None:
    """Remote TTFT adds the link's exposed transfer for the prompt's tokens after the decode
    worker's cached prefix (those never travel), and the faster link wins."""
    narrow = dataclasses.replace(_prefill("narrow"), push_cost=NARROW_LINK)
    wide = _place(_decode(), [_prefill("p")]).predicted_ttft_s
    assert wide is not None
    remote = _place(_decode(), [narrow]).predicted_ttft_s
    assert remote == pytest.approx(wide + NARROW_LINK.exposed_s(320))
    cached = dataclasses.replace(_decode(), cached_tokens=256)
    rule = PlacementConfig(local_prefill_max_tokens=0, cached_tpot_share=0.0)  # not kept local
    adaptive = place(320, 96, cached, [narrow], SLO, PlacementMode.ADAPTIVE, rule)
    plain = place(320, 96, cached, [_prefill("p")], SLO, PlacementMode.ADAPTIVE, rule)
    assert adaptive.predicted_ttft_s is not None and plain.predicted_ttft_s is not None
    assert adaptive.predicted_ttft_s == pytest.approx(
        plain.predicted_ttft_s + NARROW_LINK.exposed_s(320 - 256)
    )
    both = _place(_decode(), [narrow, _prefill("queued", queued=100)])
    assert both.prefill_worker_id == "queued"  # 0.2 s of queue beats 0.34 s of exposed push
