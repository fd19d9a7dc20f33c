"""Token-budget scheduler on plain objects: admission, chunking, preemption, stopping, leaks."""

from __future__ import annotations

import pytest

from splitserve.common.errors import ContextLengthExceededError, InvalidRequestError
from splitserve.common.request_update import FinishReason
from splitserve.engine.request import RequestStatus
from tests.factories import EOS, make_request, make_scheduler, run_step


def drain(scheduler, token_id: int = 100, max_steps: int = 1000) -> dict:
    """Run until idle; returns the finish reason of every request."""
    finished = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return finished
        _, updates = run_step(scheduler, token_id)
        finished.update({u.request_id: u.finish_reason for u in updates if u.finish_reason})
    raise AssertionError("scheduler did not drain")


def test_prefill_then_decode_within_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", prompt_len=10, max_tokens=3))
    scheduler.add_request(make_request("b", prompt_len=6, max_tokens=3))
    output, updates = run_step(scheduler)
    assert [(c.request_id, c.num_tokens, c.samples) for c in output.chunks] == [
        ("a", 10, True),
        ("b", 6, True),
    ]
    assert [u.new_token_ids for u in updates] == [(100,), (100,)]
    output, _ = run_step(scheduler)
    assert [(c.num_tokens, c.start_position) for c in output.chunks] == [(1, 10), (1, 6)]
    assert drain(scheduler) == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_long_prompt_is_chunked_and_samples_only_at_the_end() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", prompt_len=20, max_tokens=2))
    sizes = []
    for _ in range(3):
        output, updates = run_step(scheduler)
        [chunk] = output.chunks
        sizes.append((chunk.start_position, chunk.num_tokens, chunk.samples, len(updates)))
    assert sizes == [(0, 8, False, 0), (8, 8, False, 0), (16, 4, True, 1)]
    drain(scheduler)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_decodes_are_scheduled_before_new_prefills_share_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", prompt_len=4, max_tokens=5))
    run_step(scheduler)
    scheduler.add_request(make_request("b", prompt_len=30, max_tokens=1))
    output, _ = run_step(scheduler)
    assert [(c.request_id, c.num_tokens) for c in output.chunks] == [("a", 1), ("b", 9)]


def test_preempts_newest_running_request_and_recomputes_it() -> None:
    # 6 blocks of 4 tokens: two requests of 8-token prompts growing to 16 tokens cannot coexist.
    scheduler = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    scheduler.add_request(make_request("old", prompt_len=8, max_tokens=8))
    scheduler.add_request(make_request("new", prompt_len=8, max_tokens=8, first_token=50))
    preempted_seen = False
    for _ in range(40):
        if not scheduler.has_unfinished:
            break
        run_step(scheduler)
        new = scheduler.requests.get("new")
        if new is not None and new.status is RequestStatus.PREEMPTED:
            preempted_seen = True
            assert new.num_computed_tokens == 0
            old = scheduler.requests.get("old")  # None once it finished
            assert old is None or old.status is RequestStatus.RUNNING
    assert preempted_seen
    assert not scheduler.has_unfinished
    assert scheduler.stats.num_preemptions >= 1
    assert scheduler.kv_cache.num_free_blocks == 6


def test_recompute_after_preemption_feeds_prompt_and_output() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    scheduler.add_request(make_request("old", prompt_len=8, max_tokens=8))
    scheduler.add_request(make_request("new", prompt_len=8, max_tokens=8, first_token=50))
    for _ in range(40):
        output, _ = run_step(scheduler)
        resumed = [c for c in output.chunks if c.request_id == "new" and c.start_position == 0]
        request = scheduler.requests.get("new")
        if resumed and request is not None and request.num_preemptions:
            chunk = resumed[0]
            assert list(chunk.token_ids) == request.all_token_ids[: chunk.num_tokens]
            assert chunk.num_tokens > 8  # prompt plus the tokens generated before preemption
            return
    raise AssertionError("the preempted request was never recomputed")


def test_prefix_cache_hit_skips_cached_blocks() -> None:
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", prompt_len=13, max_tokens=1))
    drain(scheduler)
    scheduler.add_request(make_request("b", prompt_len=13, max_tokens=1))
    output, _ = run_step(scheduler)
    [chunk] = output.chunks
    assert chunk.start_position == 12 and chunk.num_tokens == 1
    assert scheduler.stats.prefix_hit_tokens == 12
    drain(scheduler)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_stop_conditions() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", max_tokens=10))
    scheduler.add_request(make_request("ignore", max_tokens=3, ignore_eos=True))
    scheduler.add_request(make_request("stop_id", max_tokens=10, stop_token_ids=(EOS,)))
    scheduler.add_request(make_request("min", max_tokens=10, min_tokens=2))
    finished = {}
    for _ in range(5):
        _, updates = run_step(scheduler, token_id=EOS)
        finished.update(
            {
                u.request_id: (u.finish_reason, u.num_output_tokens)
                for u in updates
                if u.finish_reason
            }
        )
    assert finished == {
        "eos": (FinishReason.STOP, 1),
        "ignore": (FinishReason.LENGTH, 3),
        "stop_id": (FinishReason.STOP, 1),
        "min": (FinishReason.STOP, 2),
    }


def test_max_model_len_ends_generation() -> None:
    scheduler = make_scheduler(max_model_len=12)
    scheduler.add_request(make_request("a", prompt_len=10, max_tokens=100))
    assert drain(scheduler) == {"a": FinishReason.LENGTH}


def test_abort_frees_blocks_everywhere() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("running", max_tokens=50))
    run_step(scheduler)
    scheduler.add_request(make_request("waiting", max_tokens=50))
    assert scheduler.abort_request("running").status is RequestStatus.FINISHED_ABORTED
    assert scheduler.abort_request("waiting") is not None
    assert scheduler.abort_request("unknown") is None
    assert not scheduler.has_unfinished
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert scheduler.schedule().finished_request_ids == {"running", "waiting"}


def test_rejects_requests_that_can_never_run() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError):
        scheduler.add_request(make_request("empty", prompt_len=0))
    with pytest.raises(ContextLengthExceededError):
        scheduler.add_request(make_request("long", prompt_len=64))
    with pytest.raises(ContextLengthExceededError):  # needs more KV than the worker has
        scheduler.add_request(make_request("big", prompt_len=10, max_tokens=20))
    scheduler.add_request(make_request("ok", prompt_len=4, max_tokens=4))
    with pytest.raises(InvalidRequestError):
        scheduler.add_request(make_request("ok"))


def test_max_num_seqs_limits_running_batch() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, max_tokens=2))
    output, _ = run_step(scheduler)
    assert [c.request_id for c in output.chunks] == ["a", "b"]
    assert drain(scheduler) == {name: FinishReason.LENGTH for name in "abc"}


def test_remote_prefill_reservation_lifecycle() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    table = scheduler.reserve_for_remote_prefill(make_request("remote", prompt_len=10))
    assert len(table) == 3 and scheduler.kv_cache.num_free_blocks == 5
    assert not scheduler.has_unfinished  # nothing to schedule until the KV lands
    assert scheduler.schedule().chunks == ()
    update = scheduler.complete_remote_prefill("remote", 100)
    assert update.new_token_ids == (100,) and update.finish_reason is None
    output, _ = run_step(scheduler)
    [chunk] = output.chunks
    assert (chunk.start_position, chunk.num_tokens) == (10, 1)  # decodes, no recompute
    drain(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 8


def test_remote_prefill_abort_eos_and_capacity() -> None:
    from splitserve.common.errors import CapacityError

    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.reserve_for_remote_prefill(make_request("aborted", prompt_len=8))
    with pytest.raises(CapacityError):  # 2 blocks free, 3 needed: nothing is held
        scheduler.reserve_for_remote_prefill(make_request("full", prompt_len=12, max_tokens=1))
    assert scheduler.kv_cache.num_free_blocks == 2
    assert scheduler.abort_request("aborted") is not None
    assert scheduler.kv_cache.num_free_blocks == 4
    scheduler.reserve_for_remote_prefill(make_request("eos", prompt_len=8))
    update = scheduler.complete_remote_prefill("eos", EOS)
    assert update.finish_reason is FinishReason.STOP
    assert scheduler.kv_cache.num_free_blocks == 4
    with pytest.raises(InvalidRequestError):
        scheduler.complete_remote_prefill("eos", 5)


def _adapters_in(output) -> set[str]:  # noqa: ANN001
    return {c.adapter for c in output.chunks if c.adapter}


def test_max_loras_bounds_the_adapters_of_the_running_requests() -> None:
    """vLLM's ``--max-loras``: with 2, requests of a third adapter wait (keeping their
    place) while the base model's and the running adapters' requests go ahead; they start
    once every request of one running adapter has ended. Nothing is lost or leaked."""
    scheduler = make_scheduler(max_loras=2, max_num_batched_tokens=256)
    plan = [("a1", "A", 6), ("b1", "B", 2), ("c1", "C", 2), ("base", "", 2), ("a2", "A", 2)]
    for index, (name, digest, tokens) in enumerate(plan):
        scheduler.add_request(
            make_request(
                name, max_tokens=tokens, first_token=10 + 20 * index, adapter_digest=digest
            )
        )
    output, _ = run_step(scheduler)
    assert [c.request_id for c in output.chunks] == ["a1", "b1", "base", "a2"]
    assert [r.request_id for r in scheduler.waiting] == ["c1"]
    seen: list[set[str]] = []
    started_c = None
    for step in range(1, 20):
        if not scheduler.has_unfinished:
            break
        output, _ = run_step(scheduler)
        seen.append(_adapters_in(output))
        if started_c is None and "C" in _adapters_in(output):
            started_c = step
    assert all(len(adapters) <= 2 for adapters in seen)
    assert started_c is not None and started_c >= 2  # after b1 ended (2 tokens)
    assert not scheduler.has_unfinished
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_max_loras_parks_a_remote_prefill_with_its_kv_until_its_adapter_fits() -> None:
    """On a decode worker a request's KV arrives from a prefill worker: one of an adapter
    with no room waits parked, its blocks held, and joins with its next token (no
    recompute) once the running requests leave room; an abort frees a parked one."""
    scheduler = make_scheduler(max_loras=1, num_blocks=32, block_size=4)
    scheduler.add_request(make_request("a", prompt_len=8, max_tokens=3, adapter_digest="A"))
    run_step(scheduler)
    for name, digest in (("b", "B"), ("gone", "B"), ("base", "")):
        request = make_request(name, max_tokens=3, first_token=50, adapter_digest=digest)
        scheduler.reserve_for_remote_prefill(request)
        update = scheduler.complete_remote_prefill(name, 100)
        assert update.new_token_ids == (100,) and update.finish_reason is None
    assert [r.request_id for r in scheduler.parked] == ["b", "gone", "base"]
    assert scheduler.requests["b"].status is RequestStatus.WAITING_FOR_ADAPTER
    assert scheduler.abort_request("gone") is not None
    output, _ = run_step(scheduler)  # the base model's request joins; b waits for a's end
    assert [c.request_id for c in output.chunks] == ["a", "base"]
    assert [r.request_id for r in scheduler.parked] == ["b"]
    output, _ = run_step(scheduler)  # a ends with this step (3 tokens)
    assert "b" not in {c.request_id for c in output.chunks}
    output, _ = run_step(scheduler)
    [chunk] = [c for c in output.chunks if c.request_id == "b"]
    assert (chunk.start_position, chunk.num_tokens) == (8, 1)  # its next token, KV kept
    assert drain(scheduler) == {"b": FinishReason.LENGTH}  # base ended meanwhile
    assert scheduler.kv_cache.num_free_blocks == 32
