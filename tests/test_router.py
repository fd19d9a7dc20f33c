"""Worker registry and routing on plain objects (torch-free)."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest

from splitserve.common.adapter_id import AdapterId
from splitserve.common.blocks import prompt_block_hashes
from splitserve.common.kv_push_cost import MIN_PUSHES, KvPushCost, KvPushCosts
from splitserve.common.load import EngineLoad
from splitserve.common.membership import Role
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.step_cost import MIN_STEPS, StepCost
from splitserve.coordinator import router as router_module
from splitserve.coordinator.placement import PlacementMode, PrefillView, Reason, Slo
from splitserve.coordinator.registry import WorkerRecord, WorkerRegistry
from splitserve.coordinator.router import DecodeProgress, Route, Router, RoutingConfig
from tests.request_records import record

LEARNED_COST = StepCost(
    decode_base_s=0.012,
    per_decode_seq_s=0.001,
    prefill_base_s=0.01,
    per_prefill_token_s=0.002,
    decode_steps=MIN_STEPS,
    prefill_steps=MIN_STEPS,
)
"""A step-time model learned on both sides (adaptive placement's tests)."""


def _worker(
    worker_id: str,
    role: Role,
    free_blocks: int = 100,
    running_tokens: int = 0,
    pending_prefill: int = 0,
    compat_hash: str = "h",
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,
        address=f"{worker_id}:1",
        compat_hash=compat_hash,
        block_size=16,
        dtype="bfloat16",
        num_blocks=100,
        max_model_len=4096,
        load=EngineLoad(
            num_total_blocks=100,
            num_used_blocks=100 - free_blocks,
            num_running_tokens=running_tokens,
            num_pending_prefill_tokens=pending_prefill,
        ),
    )


def _router(*workers: WorkerRecord, local_max: int = 0) -> Router:
    registry = WorkerRegistry(expiry_s=1.0)
    for worker in workers:
        registry.register(worker)
    return Router(registry, RoutingConfig(local_prefill_max_tokens=local_max))


def test_decode_goes_to_the_worker_with_room_and_a_light_batch() -> None:
    router = _router(
        _worker("busy", Role.DECODE, free_blocks=90, running_tokens=3000),
        _worker("idle", Role.DECODE, free_blocks=80),
    )
    assert router.pick_decode(100).worker_id == "idle"
    assert router.pick_decode(100, exclude=["idle"]).worker_id == "busy"
    assert router.pick_decode(10_000) is None  # longer than any worker's context


def test_dispatched_requests_count_until_the_next_heartbeat() -> None:
    a, b = _worker("a", Role.DECODE), _worker("b", Role.DECODE)
    router = _router(a, b)
    first = router.pick_decode(320)
    with router.decoding(first, DecodeProgress(max_tokens=96, tpot_s=0.05)):
        assert router.pick_decode(320) is not first


def test_each_decoding_request_leaves_with_its_own_progress() -> None:
    """Two requests with equal figures are two entries; the one that ends takes its own
    out, and the other's progress (updated after) stays what placement reads."""
    decode = _worker("d", Role.DECODE)
    router = _router(decode)
    first, second = (DecodeProgress(max_tokens=96, tpot_s=0.05) for _ in range(2))
    with router.decoding(decode, first):
        with router.decoding(decode, second):
            assert len(router._pending["d"].decoding) == 2
        first.num_tokens = 3
        assert list(router._pending["d"].decoding) == [first]
        assert next(iter(router._pending["d"].decoding)) is first
    assert not router._pending["d"].decoding


def test_prefill_prefers_cached_prefixes_and_matching_layouts() -> None:
    decode = _worker("d", Role.DECODE)
    warm = _worker("warm", Role.PREFILL, pending_prefill=200)
    cold = _worker("cold", Role.PREFILL, pending_prefill=100)
    other = _worker("other", Role.PREFILL, compat_hash="different")
    router = _router(decode, warm, cold, other)
    prompt = list(range(1000))
    router._memory("warm").remember(prompt_block_hashes(prompt, 16))
    route = router.route(record(prompt, 16))
    assert route is not None and route.decode is decode
    assert route.prefill is warm  # 200 pending - 992 cached beats 100 pending
    assert router.route(record(list(range(5000, 5100)), 16)).prefill is cold


def test_short_prompts_and_missing_prefill_workers_stay_local() -> None:
    router = _router(_worker("d", Role.DECODE), _worker("p", Role.PREFILL), local_max=64)
    assert router.route(record(list(range(64)), 8)).prefill is None
    assert router.route(record(list(range(1000, 1065)), 8)).prefill is not None
    # the decode worker holds the 64 tokens routed to it above: it would compute 1 of these 65
    assert router.route(record(list(range(65)), 8)).prefill is None
    assert _router(_worker("d", Role.DECODE)).route(record(list(range(500)), 8)).prefill is None


def test_registry_expires_silent_workers_and_marks_failures() -> None:
    registry = WorkerRegistry(expiry_s=1.0)
    registry.register(_worker("w", Role.DECODE))
    registry.mark_failed("w")
    assert registry.workers(Role.DECODE) == []
    assert registry.heartbeat("w", EngineLoad(num_total_blocks=100))
    assert [w.worker_id for w in registry.workers(Role.DECODE)] == ["w"]
    assert registry.expire(now=time.monotonic() + 5) and registry.get("w") is None
    assert not registry.heartbeat("w", EngineLoad())  # unknown: it must register again


def test_a_route_without_prefill_remembers_no_prefix_for_a_prefill_worker() -> None:
    router = _router(_worker("d", Role.DECODE), _worker("p", Role.PREFILL))
    prompt = list(range(512))
    route = router.route(record(prompt, 16), with_prefill=False)
    assert route is not None and route.prefill is None
    assert router._memory("p").overlap_blocks(prompt_block_hashes(prompt, 16)) == 0
    assert router.route(record(prompt, 16)).prefill is not None
    assert router._memory("p").overlap_blocks(prompt_block_hashes(prompt, 16)) == 32
    router.forget("p")  # it left the registry
    assert router._memory("p").overlap_blocks(prompt_block_hashes(prompt, 16)) == 0


def test_adaptive_routing_sees_the_workers_learned_step_costs_and_their_queues() -> None:
    """The router hands placement each worker's reported step-time model and queued tokens
    (the more of its report and this coordinator's own unanswered prompts): a long prefill
    queue sends the prompt to a lightly loaded decode worker, a short one to the prefill
    worker."""
    cost = LEARNED_COST
    decode = _worker("d", Role.DECODE)
    prefill = _worker("p", Role.PREFILL, pending_prefill=300)
    for worker in (decode, prefill):
        worker.load = dataclasses.replace(worker.load, step_cost=cost)
    registry = WorkerRegistry(expiry_s=1.0)
    for worker in (decode, prefill):
        registry.register(worker)
    router = Router(registry, RoutingConfig(mode=PlacementMode.ADAPTIVE))
    prompt = list(range(320))
    routed = router.route

    def route_unseen(*args: object, **kwargs: object) -> Route | None:
        """The prompt as one the decode worker has not seen (the router's record of what it
        holds forgotten): the placements compare computing all of it there or remotely."""
        router._decode_prefix.clear()
        return routed(*args, **kwargs)  # type: ignore[arg-type]

    router.route = route_unseen  # type: ignore[method-assign]
    route = router.route(record(prompt, 96))
    assert route is not None and route.prefill is prefill
    assert route.placement is not None and route.placement.reason is Reason.REMOTE_WITHIN_SLO
    # the worker's 300 may be this coordinator's own 300, sent and not yet answered: counted
    # once (1.25 s predicted, within 0.8 of the target), not twice (1.85 s, at risk)
    with router.prefilling(prefill, 300):
        route = router.route(record(prompt, 96))
    assert route is not None and route.prefill is prefill
    assert route.placement is not None and route.placement.reason is Reason.REMOTE_WITHIN_SLO
    with router.prefilling(prefill, 1000):  # sent, not yet in its report: 1000 tokens
        route = router.route(record(prompt, 96))
    assert route is not None and route.prefill is None
    assert route.placement is not None and route.placement.reason is Reason.LOCAL_FASTER
    # a prompt placed on the decode worker counts there until its first token: with 1500
    # tokens of its own queued (3.75 s), local is no faster than remote (3.2 s: 2.65 s, then
    # one 256-token chunk of the decode worker's before the first token)
    decode.load = dataclasses.replace(decode.load, prefill_chunk_tokens=256)
    with router.prefilling(prefill, 1000), router.prefilling(decode, 1500):
        route = router.route(record(prompt, 96))
    assert route is not None and route.placement is not None
    assert route.placement.reason is Reason.REMOTE_FASTER
    tight = Slo(ttft_s=2.0, tpot_s=0.013)  # no room in the decode batch's TPOT
    with router.prefilling(prefill, 1000):
        route = router.route(record(prompt, 96, slo=tight))
    assert route is not None and route.prefill is prefill
    assert route.placement is not None and route.placement.reason is Reason.TPOT_GUARD
    assert route.slo == tight  # the attempt guards the request's own target while it decodes
    # a request this coordinator streams from the decode worker, 0.5 s from its first token
    # of 96 (the 0.05 s target leaves 4.75 s for 95 gaps): 4.25 s for its 90 remaining
    # tokens. Its steps (~1.2 s) and this prompt (0.65 s) fit; 2.8 s later (1.45 s left) they
    # no longer do, though its steps alone still would.
    progress = DecodeProgress(max_tokens=96, tpot_s=0.05)
    assert progress.running(time.monotonic()) is None  # before its first token: TTFT's matter
    progress.first_token_at, progress.num_tokens = time.monotonic() - 0.5, 6
    running = progress.running(progress.first_token_at + 0.5)
    assert running is not None and running.remaining_tokens == 90
    assert running.spare_s == pytest.approx(4.25)
    with router.prefilling(prefill, 1000), router.decoding(decode, progress):
        route = router.route(record(prompt, 96))
        assert route is not None and route.placement is not None
        assert route.placement.reason is Reason.LOCAL_FASTER
        progress.first_token_at -= 2.8
        route = router.route(record(prompt, 96))
    assert route is not None and route.prefill is prefill
    assert route.placement is not None and route.placement.reason is Reason.RUNNING_TPOT_GUARD


def test_a_dual_role_worker_never_pushes_to_itself_and_is_seen_with_its_decode_batch() -> None:
    """Two dual-role workers, each a prefill and a decode member at one address: a request
    decoding on one is offered only the other's prefill role (its own is local prefill), and
    that candidate comes with the decode batch it runs."""
    members = []
    for name, free, running in (("a", 90, 1600), ("b", 40, 800)):
        for role in (Role.PREFILL, Role.DECODE):
            worker = _worker(f"{name}-{role.value}", role, free_blocks=free)
            worker.address = f"{name}:1"
            worker.load = dataclasses.replace(
                worker.load, num_running_requests=4, num_running_tokens=running
            )
            members.append(worker)
    router = Router(_registry(*members), RoutingConfig(mode=PlacementMode.REMOTE))
    for _ in range(3):
        route = router.route(record(list(range(320)), 96))
        assert route is not None and route.decode.worker_id == "a-decode"
        assert route.prefill is not None and route.prefill.worker_id == "b-prefill"
    decode = router.registry.get("a-decode")
    assert decode is not None
    (candidate,) = router._prefill_candidates(decode, 320)
    assert candidate.worker_id == "b-prefill"
    (view,) = _views_of(router, decode, candidate)
    assert (view.batch_requests, view.batch_tokens) == (4, 800) and view.decodes


def _registry(*workers: WorkerRecord) -> WorkerRegistry:
    registry = WorkerRegistry(expiry_s=1.0)
    for worker in workers:
        registry.register(worker)
    return registry


def _views_of(router: Router, decode: WorkerRecord, candidate: WorkerRecord) -> list[PrefillView]:
    """The views ``place`` receives (captured by wrapping it for one call)."""
    seen: list[PrefillView] = []
    original = router_module.place

    def capture(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.extend(args[3])
        return original(*args, **kwargs)

    router_module.place = capture
    try:
        router.place_prompt(decode, [candidate], [], record(range(320), 96))
    finally:
        router_module.place = original
    return seen


def _costed(worker: WorkerRecord, per_prefill_token_s: float | None) -> WorkerRecord:
    """``worker`` with a learned prefill model (``per_prefill_token_s``; None: never
    prefilled, so no model)."""
    if per_prefill_token_s is None:
        return worker
    cost = StepCost(per_prefill_token_s=per_prefill_token_s, prefill_steps=MIN_STEPS)
    return dataclasses.replace(worker, load=dataclasses.replace(worker.load, step_cost=cost))


def test_prompt_rates_count_the_workers_placement_may_compute_prompts_on() -> None:
    prefill = _costed(_worker("p", Role.PREFILL), 0.001)  # 1000 tokens/s
    decode = _worker("d", Role.DECODE)  # never prefilled: borrows the prefill worker's rate
    registry = _registry(prefill, decode)

    def rates(mode: PlacementMode, local_max: int = 0) -> list[float]:
        config = RoutingConfig(mode=mode, local_prefill_max_tokens=local_max)
        return [round(r) for r in Router(registry, config).prompt_rates(2048)]

    assert rates(PlacementMode.REMOTE) == [1000]
    assert rates(PlacementMode.RULE) == [1000]  # every prompt goes remote
    assert rates(PlacementMode.RULE, local_max=64) == [1000, 1000]
    assert rates(PlacementMode.ADAPTIVE) == [1000, 1000]
    assert rates(PlacementMode.LOCAL) == [1000, 1000]
    # a decode worker that learned its own rate counts at it
    learned = _registry(prefill, _costed(decode, 0.002))
    assert [round(r) for r in Router(learned, RoutingConfig(mode=PlacementMode.ADAPTIVE))
            .prompt_rates(2048)] == [1000, 500]  # fmt: skip
    # no prefill worker: the decode workers' own rates, none borrowed
    alone = Router(_registry(_costed(decode, 0.002), _worker("e", Role.DECODE)), RoutingConfig())
    assert [round(r) for r in alone.prompt_rates(2048)] == [500]
    # a dual-role worker (both members at one address) counts once
    dual_decode = dataclasses.replace(decode, address=prefill.address)
    dual = Router(_registry(prefill, dual_decode), RoutingConfig(mode=PlacementMode.ADAPTIVE))
    assert [round(r) for r in dual.prompt_rates(2048)] == [1000]


def test_a_conversations_next_turn_goes_back_to_the_decode_worker_holding_it() -> None:
    """Turn 2 (turn 1, its reply, a new message) returns to the decode worker that decoded
    turn 1 while the load allows, and adaptive placement computes only its new part there
    (``Reason.LOCAL_CACHED``): fewer tokens than the prefill worker, which never saw the
    reply, would compute; far busier, the worker loses it."""
    cost = LEARNED_COST
    a, b = _worker("a", Role.DECODE), _worker("b", Role.DECODE)
    prefill = _worker("p", Role.PREFILL)
    for worker in (a, b, prefill):
        worker.load = dataclasses.replace(worker.load, step_cost=cost)
    router = Router(_registry(a, b, prefill), RoutingConfig(mode=PlacementMode.ADAPTIVE))
    turn1 = list(range(200))
    first = router.route(record(turn1, 40))
    assert first is not None and first.prefill is prefill  # nothing cached anywhere yet
    holder, other = (a, b) if first.decode is a else (b, a)
    reply = list(range(1000, 1040))
    router.finished(holder, turn1 + reply)
    turn2 = turn1 + reply + list(range(2000, 2030))
    holder.load = dataclasses.replace(holder.load, num_used_blocks=30)  # 30 fewer free blocks
    route = router.route(record(turn2, 40))
    assert route is not None and route.decode is holder
    assert route.placement is not None and route.placement.reason is Reason.LOCAL_CACHED
    # 239 of 270 tokens are cached there (14 whole blocks: 224), so only 46 are computed
    assert route.placement.predicted_ttft_s is not None
    assert route.placement.predicted_ttft_s < cost.prefill_s(100)
    # the holder's batch reads 4,000 tokens a step (250 blocks): its 14 cached blocks do not
    # make up for that, and the other worker computes nothing of it locally
    holder.load = dataclasses.replace(holder.load, num_running_tokens=4000)
    route = router.route(record(turn2, 40))
    assert route is not None and route.decode is other
    assert route.placement is not None and route.placement.reason is not Reason.LOCAL_CACHED
    router.forget(holder.worker_id)
    assert router.decode_cached_blocks(holder, prompt_block_hashes(turn2, 16)) == 0


def test_a_sessions_requests_go_to_its_home_worker_on_every_coordinator() -> None:
    """Rendezvous hashing: two coordinators that registered the workers in other orders agree
    on each session's home, whatever the load (the least loaded worker would take every
    request without sessions); the sessions spread over the workers; a worker that leaves
    (or is excluded, a resume) moves only its own sessions, each to the same next home."""
    workers = [
        _worker("d0", Role.DECODE, free_blocks=95),
        _worker("d1", Role.DECODE, free_blocks=60, running_tokens=800),
        _worker("d2", Role.DECODE, free_blocks=70, running_tokens=400),
    ]
    first, second = _router(*workers), _router(*reversed(workers))
    assert first.pick_decode(64).worker_id == "d0"  # without a session: the least loaded
    sessions = [f"conversation-{i}" for i in range(60)]
    homes = {s: first.pick_decode(64, session_id=s).worker_id for s in sessions}
    assert homes == {s: second.pick_decode(64, session_id=s).worker_id for s in sessions}
    assert set(homes.values()) == {"d0", "d1", "d2"}  # spread, not all on the idlest
    for session, home in homes.items():
        moved = first.pick_decode(64, exclude=["d1"], session_id=session).worker_id
        assert moved == (home if home != "d1" else moved) and moved != "d1"
        assert moved == second.pick_decode(64, exclude=["d1"], session_id=session).worker_id


def test_a_saturated_home_gives_its_sessions_request_to_the_least_loaded() -> None:
    """Load overrides the session: a home with requests waiting, or without free blocks for
    the request, is passed over for the worker plain scoring picks."""
    idle = _worker("idle", Role.DECODE, free_blocks=95)
    sessions = [f"s{i}" for i in range(40)]
    home_id = "home"
    on_home = [
        s
        for s in sessions
        if _router(idle, _worker(home_id, Role.DECODE)).pick_decode(64, session_id=s).worker_id
        == home_id
    ]
    assert on_home  # some sessions live on "home" while it has room
    waiting = _worker(home_id, Role.DECODE)
    waiting = dataclasses.replace(
        waiting, load=dataclasses.replace(waiting.load, num_waiting_requests=2)
    )
    full = _worker(home_id, Role.DECODE, free_blocks=3)  # 64 + 64 tokens need 8 blocks
    for saturated in (waiting, full):
        router = _router(idle, saturated)
        assert {router.pick_decode(128, session_id=s).worker_id for s in on_home} == {"idle"}


def test_a_prefill_worker_that_pulls_is_credited_with_the_decode_workers_prefix() -> None:
    """The reverse transfer: a prefill worker that pulls a decode worker's cached KV computes
    only what neither holds, so placement counts the decode worker's prefix for it when that
    is at least its minimum longer than its own; one that does not pull gets its own only."""
    decode = _worker("d", Role.DECODE)
    pulls = dataclasses.replace(_worker("pulls", Role.PREFILL), pulls_cached_kv_min_blocks=2)
    computes = _worker("computes", Role.PREFILL)
    router = _router(decode, pulls, computes)
    history = list(range(400))  # a conversation the decode worker decoded: 25 blocks
    router._decode_memory(decode).remember(prompt_block_hashes(history, 16))
    router._memory("pulls").remember(prompt_block_hashes(history[:320], 16))  # 20 blocks
    seen: list[PrefillView] = []
    original = router_module.place

    def capture(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.extend(args[3])
        return original(*args, **kwargs)

    prompt = [*history, *range(5000, 5050)]
    hashes = prompt_block_hashes(prompt, 16)
    router_module.place = capture
    try:
        router.place_prompt(decode, [pulls, computes], hashes, record(prompt, 96))
        # with only one block more on the decode side, pulling is not worth it
        router._memory("pulls").remember(prompt_block_hashes(history[:384], 16))
        router.place_prompt(decode, [pulls], hashes, record(prompt, 96))
    finally:
        router_module.place = original
    assert [(view.worker_id, view.cached_tokens, view.pulled_tokens) for view in seen] == [
        ("pulls", 400, 80),
        ("computes", 0, 0),
        ("pulls", 384, 0),
    ]


def test_placement_sees_the_push_figure_a_prefill_worker_reported_for_the_decode_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill worker's load carries its learned push figures per decode worker address
    (``common/kv_push_cost.py``): placement gets the link's to this request's decode worker,
    the figure over all its pushes for a decode worker it never pushed to."""
    links = KvPushCosts(
        KvPushCost(0.0, 1e-5, MIN_PUSHES),
        (("d:1", KvPushCost(0.02, 1e-3, MIN_PUSHES)), ("e:1", KvPushCost(0.0, 0.0, MIN_PUSHES))),
    )
    prefill = _worker("p", Role.PREFILL)
    prefill = dataclasses.replace(prefill, load=dataclasses.replace(prefill.load, kv_push=links))
    decodes = [_worker(name, Role.DECODE) for name in ("d", "e", "f")]
    router = _router(*decodes, prefill)
    seen: list[PrefillView] = []
    original = router_module.place

    def capture(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.extend(args[3])
        return original(*args, **kwargs)

    monkeypatch.setattr(router_module, "place", capture)
    prompt = list(range(320))
    for decode in decodes:
        router.place_prompt(decode, [prefill], prompt_block_hashes(prompt, 16), record(prompt, 96))
    assert [view.push_cost for view in seen] == [
        links.peers[0][1],
        links.peers[1][1],
        links.overall,
    ]


class _CountedProgress(DecodeProgress):
    """A decoding request that counts how often placement reads it."""

    reads = 0

    def running(self, now: float):  # noqa: ANN201
        _CountedProgress.reads += 1
        return super().running(now)


def test_a_request_placed_remotely_reads_no_running_request() -> None:
    """Routing costs O(1) per request this coordinator streams from the decode worker: the
    running-request guard's view is built only when placement consults it (a prompt that may
    be computed there), and the unanswered prompt tokens are kept per address, not summed
    over every worker's pending work per candidate."""
    decode, prefill = _worker("d", Role.DECODE), _worker("p", Role.PREFILL)
    for worker in (decode, prefill):
        worker.load = dataclasses.replace(worker.load, step_cost=LEARNED_COST)
    router = Router(_registry(decode, prefill), RoutingConfig(mode=PlacementMode.ADAPTIVE))
    progresses = []
    for _ in range(1000):
        progress = _CountedProgress(max_tokens=96, tpot_s=0.05)
        progress.first_token_at, progress.num_tokens = time.monotonic(), 1
        progresses.append(progress)
    _CountedProgress.reads = 0
    with contextlib.ExitStack() as stack:
        for progress in progresses:
            stack.enter_context(router.decoding(decode, progress))
        route = router.route(record(list(range(320)), 96))
        assert route is not None and route.prefill is prefill
        assert route.placement is not None and route.placement.reason is Reason.REMOTE_WITHIN_SLO
        assert _CountedProgress.reads == 0
        # the prefill worker far behind: local placement is weighed, the guard reads each
        with router.prefilling(prefill, 5000):
            assert router._queued_prefill_tokens(prefill) == 5000
            route = router.route(record(list(range(320)), 96))
        assert route is not None and route.placement is not None
        assert route.placement.reason is Reason.LOCAL_FASTER
        assert _CountedProgress.reads == len(progresses)
    assert router._queued_prefill_tokens(prefill) == 0
    assert not router._prefill_sent  # every block's tokens left with it


def test_a_request_of_a_lora_adapter_goes_only_to_workers_serving_it() -> None:
    """Its decode worker serves the adapter; its prefill worker serves it with the same files
    (digest), since the prompt's KV it pushes is decoded there."""
    adapter, other_files = AdapterId("a", "d1"), AdapterId("a", "d2")

    def serving(worker: WorkerRecord, *adapters: AdapterId) -> WorkerRecord:
        return dataclasses.replace(worker, adapters=frozenset(adapters))

    router = _router(
        _worker("plain", Role.DECODE, free_blocks=100),
        serving(_worker("lora", Role.DECODE, free_blocks=10), adapter),
        _worker("p-plain", Role.PREFILL),
        serving(_worker("p-other", Role.PREFILL), other_files),
        serving(_worker("p-lora", Role.PREFILL, pending_prefill=5000), adapter),
    )
    asked = record(range(200), params=SamplingParams(adapter="a"))
    route = router.route(asked)
    assert route is not None and route.decode.worker_id == "lora"
    assert route.prefill is None or route.prefill.worker_id == "p-lora"
    candidates = router._prefill_candidates(route.decode, 200, adapter)
    assert [w.worker_id for w in candidates] == ["p-lora"]
    assert router.pick_decode(100).worker_id == "plain"  # the base model: the roomier one
    assert router.pick_decode(100, adapter=AdapterId("b", "0" * 32)) is None  # nobody serves it
    assert router.route(record(range(200), params=SamplingParams(adapter="b"))) is None
