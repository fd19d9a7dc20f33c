"""Admission by KV (``coordinator/admission.py``) on plain objects: what fits starts at once,
the rest waits in arrival order or is refused at once with the predicted wait as its retry
hint; the queue is bounded by requests and by prompt tokens; a wait that outlasts its limit or
whose caller leaves ends it without losing anyone's place."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from splitserve.common.errors import OverloadedError
from splitserve.common.step_cost import StepCost
from splitserve.coordinator.admission import (
    REFUSES_ALL_S,
    RETRY_HINT_MAX_AGE_S,
    AdmissionConfig,
    KvAdmission,
    KvDemand,
    WorkerCapacity,
)
from splitserve.coordinator.capacity import decode_batch_within
from tests.request_records import admit

T = TypeVar("T")
BLOCK = 16


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def demand(prompt: int, max_tokens: int) -> KvDemand:
    return KvDemand.of(prompt, max_tokens, BLOCK)


def admission(
    capacity: int = 1000, clock: Clock | None = None, **config: Any
) -> tuple[KvAdmission, list[int]]:
    """An admission over a capacity the test may change (``cap[0] = ...``)."""
    cap = [capacity]
    # no first-token time unless a test sets one: admitted requests end by their tokens left
    settings = AdmissionConfig(**{"prior_tpot_s": 0.05, "prior_ttft_s": 0.0, **config})
    return KvAdmission(settings, lambda: cap[0], clock or Clock()), cap


def run(scenario: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, timeout=10))


async def started(coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    task = asyncio.create_task(coroutine)
    await asyncio.sleep(0)  # it reaches its wait
    return task


async def ended(*tasks: asyncio.Task[None]) -> bool:
    """Whether the tasks end within a second (a grant takes a few loop turns to arrive)."""
    _, pending = await asyncio.wait(tasks, timeout=1.0)
    return not pending


def test_demand_is_prompt_plus_max_tokens_in_whole_blocks() -> None:
    assert demand(10, 6).num_tokens == 16
    assert demand(10, 7).num_tokens == 32
    assert demand(512, 16) == KvDemand(num_tokens=528, num_prompt_tokens=512, max_tokens=16)


def test_what_fits_is_admitted_at_once_and_release_is_idempotent() -> None:
    gate, _ = admission(capacity=64)

    async def scenario() -> None:
        await admit(gate, "a", demand(20, 12))  # 32
        await admit(gate, "b", demand(20, 12))  # 64: full
        assert gate.snapshot().admitted_tokens == 64
        gate.release("a")
        gate.release("a")
        gate.release("never-admitted")
        assert gate.snapshot().admitted_tokens == 32

    run(scenario())


def test_waiters_are_admitted_in_arrival_order_as_kv_comes_back() -> None:
    gate, _ = admission(capacity=64)

    async def scenario() -> None:
        await admit(gate, "running", demand(40, 8))  # 48 of 64
        big = await started(admit(gate, "big", demand(40, 8)))  # 48: waits
        small = await started(admit(gate, "small", demand(8, 8)))  # 16 would fit: no overtaking
        assert not big.done() and not small.done()
        assert gate.snapshot().num_queued == 2
        gate.release("running")  # 48 + 16 = 64: both fit, granted in the same instant
        assert gate.snapshot().admitted_tokens == 64 and gate.snapshot().num_queued == 0
        assert await ended(big, small)

    run(scenario())


def test_the_predicted_wait_walks_admitted_requests_by_their_end() -> None:
    clock = Clock()
    gate, _ = admission(capacity=96, clock=clock)

    async def scenario() -> None:
        await admit(gate, "short", demand(16, 16))  # 32 tokens, ends in 16 x 0.05 = 0.8 s
        await admit(gate, "long", demand(16, 48))  # 64 tokens, ends in 48 x 0.05 = 2.4 s
        assert gate.predicted_wait_s(demand(16, 16)) == pytest.approx(0.8)  # 32 frees: enough
        assert gate.predicted_wait_s(demand(48, 16)) == pytest.approx(2.4)  # needs both gone
        gate.progress("long", 40)  # 8 left: now it ends first, in 0.4 s, and frees enough
        # the admitted requests' ends are read again at most every RETRY_HINT_MAX_AGE_S
        assert gate.predicted_wait_s(demand(48, 16)) == pytest.approx(2.4)
        clock.now += RETRY_HINT_MAX_AGE_S + 0.01
        assert gate.predicted_wait_s(demand(48, 16)) == pytest.approx(0.4)

    run(scenario())


def test_a_request_predicted_to_wait_too_long_is_refused_at_once_with_that_hint() -> None:
    gate, _ = admission(capacity=64, max_queue_wait_s=1.0)

    async def scenario() -> None:
        await admit(gate, "running", demand(16, 48))  # 64, ends in 2.4 s
        with pytest.raises(OverloadedError) as refused:
            await admit(gate, "late", demand(8, 8))
        assert refused.value.retry_after_s == pytest.approx(2.4)
        assert gate.snapshot().num_queued == 0 and gate.refusals["predicted_wait"] == 1

    run(scenario())


def test_a_request_that_bounds_its_own_wait_is_refused_by_that_bound() -> None:
    """``max_queue_wait_ms`` (a request's own bound): refused at once when its predicted wait
    is longer, and refused once it waited that long (no backstop factor: the caller said it
    will not wait longer); a request without one keeps the coordinator's bound."""
    gate, _ = admission(capacity=64, max_queue_wait_s=30.0, prior_tpot_s=0.001)

    async def scenario() -> None:
        await admit(gate, "running", demand(16, 48))  # 64 of 64; predicted to end in 0.05 s
        with pytest.raises(OverloadedError, match="beyond the 0.01 s it may wait"):
            await admit(gate, "hurried", demand(8, 8), max_queue_wait_s=0.01)
        assert gate.refusals["predicted_wait"] == 1
        bounded = await started(admit(gate, "bounded", demand(8, 8), max_queue_wait_s=0.2))
        patient = await started(admit(gate, "patient", demand(8, 8)))
        with pytest.raises(OverloadedError, match="waited 0.2 s"):
            await bounded  # "running" never ends: 0.2 s, not 4 x 0.2
        assert gate.refusals["waited_out"] == 1 and not patient.done()
        gate.release("running")
        await patient  # the coordinator's 30 s bound: still waiting, now admitted

    run(scenario())


def test_the_queue_is_bounded_by_requests_and_by_prompt_tokens() -> None:
    gate, _ = admission(capacity=64, max_queued_requests=2, max_queued_prompt_tokens=100)

    async def scenario() -> None:
        await admit(gate, "running", demand(16, 16))  # 32
        await admit(gate, "running-2", demand(16, 16))  # 64: full, ends in 0.8 s
        first = await started(admit(gate, "w1", demand(60, 4)))
        with pytest.raises(OverloadedError, match="prompt tokens") as by_tokens:
            await admit(gate, "too-many-tokens", demand(50, 4))  # 60 + 50 > 100
        assert by_tokens.value.refuses_all_s == 0  # a smaller prompt would still fit
        second = await started(admit(gate, "w2", demand(30, 2)))
        with pytest.raises(OverloadedError, match="already wait") as refused:
            await admit(gate, "too-many", demand(1, 1))
        assert refused.value.retry_after_s > 0  # computed: the queue ahead must run first
        assert refused.value.refuses_all_s == REFUSES_ALL_S  # full by count: any arrival
        assert gate.refusals["queue_full"] == 2
        gate.release("running")
        gate.release("running-2")
        assert await ended(first)
        gate.release("w1")
        assert await ended(second)

    run(scenario())


def test_a_full_queue_refuses_with_the_wait_behind_it_computed_at_most_that_long_ago() -> None:
    clock = Clock()
    gate, _ = admission(capacity=64, clock=clock, max_queued_requests=1)

    async def scenario() -> None:
        await admit(gate, "running", demand(16, 48))  # 64: full, ends in 2.4 s
        waiter = await started(admit(gate, "waiter", demand(16, 16)))
        hints = []
        for name in ("crowd-1", "crowd-2"):
            with pytest.raises(OverloadedError, match="already wait") as refused:
                await admit(gate, name, demand(16, 16))
            hints.append(refused.value.retry_after_s)
        assert hints[0] == pytest.approx(gate.predicted_wait_s(demand(16, 16)))
        assert hints[1] == hints[0]  # reused within RETRY_HINT_MAX_AGE_S
        gate.progress("running", 40)  # 8 tokens left: the queue moves sooner
        clock.now += RETRY_HINT_MAX_AGE_S * 2
        with pytest.raises(OverloadedError) as refused:
            await admit(gate, "crowd-3", demand(16, 16))
        assert refused.value.retry_after_s < hints[0]  # computed again
        gate.release("running")
        assert await ended(waiter)

    run(scenario())


def test_the_running_sums_follow_every_way_in_and_out() -> None:
    """The backlog's prompt count and the average context that bounds the decode batch are
    kept as running sums; after grants, first tokens and releases in any order they equal
    what the admitted requests add up to (read through the batch bound's context)."""
    contexts: list[int] = []

    def capacity(context_tokens: int) -> WorkerCapacity:
        contexts.append(context_tokens)
        return WorkerCapacity(max_decoding=100)

    gate = KvAdmission(AdmissionConfig(), lambda: 10_000, Clock(), worker_capacity=capacity)

    async def scenario() -> None:
        asked = {"a": demand(100, 20), "b": demand(300, 60), "c": demand(40, 8)}
        for name, need in asked.items():
            await admit(gate, name, need)
        gate.progress("b", 1)
        gate.release("a")
        gate.progress("c", 1)
        gate.release("c")
        gate.progress("c", 1)  # after its release: ignored
        await admit(gate, "d", demand(20, 4))
        assert gate._admitted.backlog_prompts == 1  # d (b has its first token)
        contexts.clear()
        assert gate._max_decoding(demand(0, 0)) == 100
        # b (300 + 30) and d (20 + 2) admitted, plus the asked (0): their mean
        assert contexts == [round((330 + 22 + 0) / 3)]

    run(scenario())


def test_a_wait_that_outlasts_its_limit_is_refused_and_the_next_moves_up() -> None:
    gate, _ = admission(capacity=64, max_queue_wait_s=0.3, prior_tpot_s=0.001)

    async def scenario() -> None:
        await admit(gate, "stuck", demand(16, 48))  # predicted to end in 0.05 s; it does not
        waiting = await started(admit(gate, "w", demand(16, 16)))
        with pytest.raises(OverloadedError, match="waited"):
            await waiting
        assert gate.snapshot().num_queued == 0 and gate.refusals["waited_out"] == 1
        gate.release("stuck")
        await admit(gate, "next", demand(16, 16))  # nothing left behind in the queue

    run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_the_one_behind_it_moves_up() -> None:
    gate, _ = admission(capacity=64)

    async def scenario() -> None:
        await admit(gate, "running", demand(16, 16))  # 32 of 64
        head = await started(admit(gate, "head", demand(40, 8)))  # 48: waits
        behind = await started(admit(gate, "behind", demand(8, 8)))  # 16: waits behind it
        head.cancel()
        assert await ended(head, behind)  # it fits once it is the oldest
        assert head.cancelled() and not behind.cancelled()
        assert gate.snapshot().admitted_tokens == 48

    run(scenario())


def test_kv_share_a_joining_worker_and_a_request_larger_than_the_share() -> None:
    gate, cap = admission(capacity=128, kv_share=0.5)  # admits against 64

    async def scenario() -> None:
        assert gate.snapshot().capacity_tokens == 64
        await admit(gate, "alone", demand(100, 20))  # 128 > 64: may run alone
        waiting = await started(admit(gate, "w", demand(16, 16)))
        assert not waiting.done()
        cap[0] = 512  # a decode worker joined: 256 admitted against
        await admit(gate, "new", demand(16, 16))  # the waiter is served first, then this one
        assert await ended(waiting)
        assert gate.snapshot().admitted_tokens == 128 + 32 + 32

    run(scenario())


def test_measured_time_per_token_replaces_the_prior() -> None:
    clock = Clock()
    gate, _ = admission(capacity=1000, clock=clock, prior_tpot_s=0.05)

    async def scenario() -> None:
        await admit(gate, "r", demand(16, 100))
        gate.progress("r", 1)  # the first token: its wait was TTFT, not counted
        assert gate.snapshot().tpot_s == pytest.approx(0.05)
        for _ in range(200):
            clock.now += 0.02
            gate.progress("r", 1)
        assert gate.snapshot().tpot_s == pytest.approx(0.02, rel=0.01)

    run(scenario())


def test_the_predicted_wait_plays_the_queue_forward() -> None:
    clock = Clock()
    gate, _ = admission(capacity=64, clock=clock, prior_ttft_s=1.0)

    async def scenario() -> None:
        await admit(gate, "running", demand(48, 16))  # 64 tokens; no first token yet
        assert gate.predicted_wait_s(demand(48, 16)) == pytest.approx(1.0 + 0.8)
        clock.now += 1.0  # its first token comes as predicted: 15 left, it ends in 0.75 s
        gate.progress("running", 1)
        first = await started(admit(gate, "first", demand(48, 16)))  # 0.75 -> 2.55
        assert gate.predicted_wait_s(demand(48, 16)) == pytest.approx(0.75 + 1.0 + 0.8)
        second = await started(admit(gate, "second", demand(48, 16)))  # 2.55 -> 4.35
        assert gate.predicted_wait_s(demand(48, 16)) == pytest.approx(0.75 + 2 * 1.8)
        gate.release("running")
        gate.release("first")
        assert await ended(first, second)

    run(scenario())


def test_the_first_token_time_is_measured_from_admission() -> None:
    clock = Clock()
    gate, _ = admission(capacity=1000, clock=clock, prior_ttft_s=1.0)

    async def scenario() -> None:
        for i in range(100):
            await admit(gate, f"r{i}", demand(16, 4))
            clock.now += 0.3
            gate.progress(f"r{i}", 1)
            gate.release(f"r{i}")
        assert gate.snapshot().ttft_s == pytest.approx(0.3, rel=0.01)

    run(scenario())


def test_the_prefill_backlog_is_bounded_and_drains_on_first_tokens() -> None:
    capacity = WorkerCapacity(prefill_tokens_per_s=1000.0)
    gate = KvAdmission(
        AdmissionConfig(prefill_backlog_s=0.2, prior_tpot_s=0.05, prior_ttft_s=0.5),
        lambda: 10_000,
        Clock(),
        worker_capacity=lambda context_tokens: capacity,
    )  # 0.2 s of 1000 tokens/s: 200 prompt tokens may be admitted and not yet computed

    async def scenario() -> None:
        await admit(gate, "a", demand(120, 8))
        await admit(gate, "b", demand(80, 8))  # 200: the backlog is full, the KV is not
        waiting = await started(admit(gate, "c", demand(50, 8)))
        assert gate.snapshot().prefill_backlog_tokens == 200 and not waiting.done()
        # the backlog drains at 1000 tokens/s: 50 more fit once 50 are done, at 0.05 s
        assert gate.predicted_wait_s(demand(50, 8)) == pytest.approx(0.1)  # behind "c"
        gate.progress("a", 1)  # a's first token: its 120 prompt tokens are computed
        assert await ended(waiting)
        assert gate.snapshot().prefill_backlog_tokens == 130
        gate.release("b")  # ended before its first token: its prompt leaves the backlog
        assert gate.snapshot().prefill_backlog_tokens == 50

    run(scenario())


def test_the_prefill_backlog_always_holds_one_prompt_per_worker_that_computes_prompts() -> None:
    """Two workers may compute prompts (a prefill worker, and a decode worker placement may
    use): 0.5 s of their 2000 tokens/s is 1000 tokens, less than one 1,400-token prompt, yet
    each of them gets one; the third waits for a first token."""
    capacity = WorkerCapacity(prefill_tokens_per_s=2000.0, prompt_workers=2)
    gate = KvAdmission(
        AdmissionConfig(prefill_backlog_s=0.5, prior_tpot_s=0.05, prior_ttft_s=0.5),
        lambda: 100_000,
        Clock(),
        worker_capacity=lambda context_tokens: capacity,
    )

    async def scenario() -> None:
        await admit(gate, "a", demand(1400, 100))
        await admit(gate, "b", demand(1400, 100))
        waiting = await started(admit(gate, "c", demand(1400, 100)))
        assert gate.snapshot().prefill_backlog_tokens == 2800 and not waiting.done()
        gate.progress("a", 1)  # a's prompt is done: one worker is free
        assert await ended(waiting)
        late = await started(admit(gate, "d", demand(1400, 100)))
        assert not late.done()
        gate.release("b")  # ended before its first token: its worker is free too
        assert await ended(late)
        assert gate.snapshot().prefill_backlog_tokens == 2800  # c and d

    run(scenario())


def test_the_decode_batch_the_tpot_target_allows_bounds_admission() -> None:
    seen_contexts: list[int] = []

    def capacity(context_tokens: int) -> WorkerCapacity:
        seen_contexts.append(context_tokens)
        return WorkerCapacity(max_decoding=2)

    gate = KvAdmission(
        AdmissionConfig(prior_tpot_s=0.05, prior_ttft_s=0.5),
        lambda: 10_000,
        Clock(),
        worker_capacity=capacity,
    )

    async def scenario() -> None:
        await admit(gate, "a", demand(16, 16))  # ends in 0.8 s
        await admit(gate, "b", demand(16, 40))  # ends in 2.0 s
        waiting = await started(admit(gate, "c", demand(16, 16)))  # KV has room; the batch not
        assert not waiting.done()
        assert 28 in seen_contexts  # prompt + half the output, averaged over a, b and c
        # the second slot frees when b ends: its first-token time (0.5 s), then 40 tokens
        assert gate.predicted_wait_s(demand(16, 16)) == pytest.approx(0.5 + 2.0)
        gate.release("a")
        assert await ended(waiting)

    run(scenario())


def test_predictions_use_the_measured_backlog_drain_rate() -> None:
    clock = Clock()
    capacity = WorkerCapacity(prefill_tokens_per_s=10_000.0)  # the compute rate: optimistic
    gate = KvAdmission(
        AdmissionConfig(prefill_backlog_s=0.01, prior_tpot_s=0.05, prior_ttft_s=0.5),
        lambda: 100_000,
        clock,
        worker_capacity=lambda context_tokens: capacity,
    )  # the backlog holds 100 prompt tokens

    async def scenario() -> None:
        # two 50-token prompts fill the backlog; one is done every 0.05 s and the next takes
        # its place: the loaded backlog drains 1000 tokens/s
        await admit(gate, "r0", demand(50, 4))
        await admit(gate, "r1", demand(50, 4))
        for i in range(2, 22):
            clock.now += 0.05
            gate.progress(f"r{i - 2}", 1)
            await admit(gate, f"r{i}", demand(50, 4))
        assert gate.snapshot().prefill_drain_tokens_per_s == pytest.approx(1000.0)
        # 50 more tokens wait for 50 to drain: 0.05 s at the measured rate, not 0.005 s
        assert gate.predicted_wait_s(demand(50, 4)) == pytest.approx(0.05, rel=0.05)

    run(scenario())


def test_the_decode_batch_within_a_step_target() -> None:
    cost = StepCost(
        decode_base_s=0.010, per_decode_seq_s=0.001, per_context_token_s=1e-6, decode_steps=8
    )
    # 10 ms + n x (1 ms + 1000 tokens x 1 us) <= 40 ms: n <= 15
    assert decode_batch_within(cost, 1000, 0.040) == 15
    assert decode_batch_within(cost, 1000, 0.005) == 1  # never below one
    assert decode_batch_within(StepCost(), 1000, 0.040) is None  # not learned yet


def test_the_coordinator_flags_and_their_env_twins_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve.coordinator.main import build_parser

    defaults = build_parser().parse_args([])
    assert not defaults.admit_within_tpot and defaults.max_queue_wait == 30.0
    monkeypatch.setenv("SPLITSERVE_ADMIT_WITHIN_TPOT", "1")
    monkeypatch.setenv("SPLITSERVE_PREFILL_BACKLOG", "0.25")
    flags = build_parser().parse_args(["--kv-share", "0.5", "--default-max-tokens", "64"])
    assert flags.admit_within_tpot and flags.prefill_backlog == 0.25
    assert (flags.kv_share, flags.default_max_tokens) == (0.5, 64)


def test_waits_longer_than_predicted_scale_later_predictions() -> None:
    clock = Clock()
    gate, _ = admission(capacity=64, clock=clock, prior_tpot_s=0.05)

    async def scenario() -> None:
        await admit(gate, "running", demand(16, 48))  # 64 of 64, ends in 2.4 s
        waiting = await started(admit(gate, "w", demand(16, 48)))
        assert gate.predicted_wait_s(demand(16, 48), (0, -1.0, -1)) == pytest.approx(2.4)
        clock.now += 7.2  # it took three times as long as predicted
        gate.release("running")
        assert await ended(waiting)
        # one measurement moves the scale a tenth of the way: 1 + 0.1 x (3 - 1) = 1.2
        assert gate.predicted_wait_s(demand(16, 48)) == pytest.approx(1.2 * 2.4)

    run(scenario())


def test_a_waiter_past_its_ttft_deadline_lets_one_that_can_still_meet_its_own_go_first() -> None:
    """Past the knee, arrival order makes every request miss once the queue holds a TTFT
    target's worth of work; a waiter that will miss anyway yields to one that need not."""
    clock = Clock()
    gate, _ = admission(capacity=64, clock=clock)

    async def scenario() -> None:
        await admit(gate, "running", demand(40, 8))  # 48 of 64
        old = await started(admit(gate, "old", demand(40, 8), ttft_deadline=clock.now + 1.0))
        clock.now += 2.0  # "old" is past its deadline now
        new = await started(admit(gate, "new", demand(40, 8), ttft_deadline=clock.now + 2.0))
        assert gate.snapshot().num_queued == 2
        gate.release("running")  # room for one of them: the one that can still be on time
        assert await ended(new) and not old.done()
        assert gate.late_waiters == 1 and gate.snapshot().num_queued == 1
        # a newcomer is predicted behind the on-time waiters only, the late one behind it
        assert gate.predicted_wait_s(demand(8, 8), (0, 1e9, 10**9)) < gate.predicted_wait_s(
            demand(8, 8)
        )
        gate.release("new")  # nobody on time waits: the late one is admitted
        assert await ended(old)
        assert gate.snapshot().num_queued == 0

    run(scenario())


def test_with_late_waiters_not_yielding_arrival_order_holds() -> None:
    clock = Clock()
    gate, _ = admission(capacity=64, clock=clock, late_waiters_yield=False)

    async def scenario() -> None:
        await admit(gate, "running", demand(40, 8))
        old = await started(admit(gate, "old", demand(40, 8), ttft_deadline=clock.now + 1.0))
        clock.now += 2.0
        new = await started(admit(gate, "new", demand(40, 8), ttft_deadline=clock.now + 2.0))
        gate.release("running")
        assert await ended(old) and not new.done()
        assert gate.late_waiters == 0
        new.cancel()

    run(scenario())


def test_a_waiter_is_late_once_its_prompt_could_not_be_computed_by_its_deadline() -> None:
    """Late means it cannot make it any more: admitted now, its prompt computed at once at the
    cluster's prefill rate (1,000 tokens/s here) would still end past its deadline. A
    1,000-token prompt due in 0.3 s is late already; a 40-token one due as soon is not."""
    clock = Clock()
    capacity = WorkerCapacity(prefill_tokens_per_s=1000.0)
    gate = KvAdmission(
        AdmissionConfig(prior_tpot_s=0.05, prior_ttft_s=0.0),
        lambda: 2000,
        clock,
        worker_capacity=lambda context_tokens: capacity,
    )

    async def scenario() -> None:
        await admit(gate, "running", demand(1000, 8))  # 1008 of 2000
        long = await started(admit(gate, "long", demand(1000, 8), ttft_deadline=clock.now + 0.3))
        short = await started(admit(gate, "short", demand(40, 8), ttft_deadline=clock.now + 0.3))
        assert gate.snapshot().num_queued == 2
        gate.release("running")  # the short one, still on time, first; then the backlog is full
        assert await ended(short) and not long.done() and gate.late_waiters == 1
        long.cancel()  # a late waiter cancelled leaves its queue
        await asyncio.wait([long])
        assert gate.snapshot().num_queued == 0

    run(scenario())


def test_a_crowd_queueing_one_by_one_is_predicted_as_the_whole_queue_played_again() -> None:
    """Arrivals joining the tail reuse the queue played forward (``_tail_play``); each one's
    prediction equals playing every waiter ahead of it afresh, also after the queue changed
    elsewhere (a waiter left) and with mixed demands."""
    gate, _ = admission(capacity=256, max_queued_requests=64)

    async def scenario() -> None:
        await admit(gate, "running", demand(120, 100))
        waiters = []
        for index in range(12):
            newcomer = demand(16 + 8 * (index % 3), 40 + 16 * (index % 4))
            tail_order = (0, 1e9, 10**9)
            assert gate.predicted_wait_s(newcomer, tail_order) == gate.predicted_wait_s(newcomer)
            waiters.append(await started(admit(gate, f"w{index}", newcomer)))
            if index == 6:  # one leaves from the middle: the played queue is made again
                waiters.pop(3).cancel()
                await asyncio.sleep(0)
        final = demand(64, 64)
        assert gate.predicted_wait_s(final, (0, 1e9, 10**9)) == gate.predicted_wait_s(final)
        assert gate.predicted_wait_s(final) > 0
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    run(scenario())
