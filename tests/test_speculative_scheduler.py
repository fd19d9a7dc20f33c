"""Speculative decoding in the scheduler (torch-free): which requests get drafts, how many, and
how the verdicts are kept (``engine/scheduler.py``, module docstring)."""

from __future__ import annotations

from splitserve.common.request_update import FinishReason
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.step_cost import StepCost
from splitserve.engine.config import SpeculativeConfig
from splitserve.engine.request import Request
from tests.factories import EOS, make_scheduler

PROMPT = [5, 6, 7, 8, 9, 5, 6]
"""Its suffix (5, 6) opened it, followed by 7, 8, 9."""


def _request(request_id: str = "a", prompt=PROMPT, **params) -> Request:
    sampling = SamplingParams(**{"max_tokens": 16, "temperature": 0.0, **params})
    return Request(request_id, list(prompt), sampling, frozenset({EOS}))


def _prefilled(*requests: Request, **speculative):
    """A scheduler (3 drafts, n-grams 2..4 unless given) that has run the requests' prompts
    and sampled 7 for each: (5, 6, 7) then points at 8, 9, 5."""
    scheduler = make_scheduler(
        speculative=SpeculativeConfig(**{"num_tokens": 3, "ngram_min": 2, **speculative})
    )
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update(output, {chunk.request_id: 7 for chunk in output.chunks})
    return scheduler


def test_drafts_are_verified_and_kept_up_to_the_first_miss() -> None:
    scheduler = _prefilled(_request())
    output = scheduler.schedule()
    [chunk] = output.chunks
    assert chunk.draft_token_ids == (8, 9, 5)
    assert chunk.token_ids == (7, 8, 9, 5) and chunk.start_position == 7
    assert chunk.is_decode and chunk.samples
    # The model chose 8 after 7 and 9 after 8 (kept), 4 after 9 (the draft said 5).
    [update] = scheduler.update(output, {}, {"a": (8, 9, 4, 1)})
    assert update.new_token_ids == (8, 9, 4)
    request = scheduler.requests["a"]
    assert request.output_token_ids == [7, 8, 9, 4]
    assert request.num_computed_tokens == 10  # 7, 8 and 9 computed; 4 is next
    stats = scheduler.stats
    assert (stats.num_draft_tokens, stats.num_accepted_draft_tokens) == (3, 2)
    assert stats.num_generation_tokens == 1 + 3


def test_every_draft_kept_adds_the_token_after_the_last() -> None:
    scheduler = _prefilled(_request())
    output = scheduler.schedule()
    [update] = scheduler.update(output, {}, {"a": (8, 9, 5, 6)})
    assert update.new_token_ids == (8, 9, 5, 6)
    assert scheduler.requests["a"].num_computed_tokens == 11


def test_a_stop_token_among_the_kept_tokens_ends_the_request_there() -> None:
    scheduler = _prefilled(_request())
    output = scheduler.schedule()
    [update] = scheduler.update(output, {}, {"a": (8, EOS, 5, 6)})
    assert update.new_token_ids == (8, EOS)
    assert update.finish_reason is FinishReason.STOP
    assert "a" not in scheduler.requests
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_drafts_never_pass_max_tokens() -> None:
    scheduler = _prefilled(_request(max_tokens=3))  # one token out, two to go
    output = scheduler.schedule()
    [chunk] = output.chunks
    assert chunk.draft_token_ids == (8,)  # the draft and the token after it: max_tokens
    [update] = scheduler.update(output, {}, {"a": (8, 9)})
    assert update.new_token_ids == (8, 9)
    assert update.finish_reason is FinishReason.LENGTH


def test_only_requests_without_logprobs_or_stop_strings_speculate() -> None:
    requests = [
        _request("sampled", temperature=0.7),
        _request("logprobs", logprobs=2),
        _request("stop string", stop=("x",)),
        _request("greedy"),
        _request("penalty", repetition_penalty=1.2),
        _request("min tokens", min_tokens=4),
    ]
    scheduler = _prefilled(*requests, max_step_rows=64)
    drafts = {chunk.request_id: chunk.draft_token_ids for chunk in scheduler.schedule().chunks}
    speculating = {"sampled", "greedy", "penalty", "min tokens"}
    assert drafts == {
        r.request_id: (8, 9, 5) if r.request_id in speculating else () for r in requests
    }


def test_a_step_holds_at_most_max_step_rows_decode_rows() -> None:
    scheduler = _prefilled(_request("a"), _request("b"), max_step_rows=4)
    chunks = scheduler.schedule().chunks
    assert [chunk.draft_token_ids for chunk in chunks] == [(8, 9), ()]  # 2 decodes + 2 drafts


def test_off_by_default_and_without_a_match() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(_request())
    output = scheduler.schedule()
    scheduler.update(output, {"a": 7})
    assert scheduler.schedule().chunks[0].draft_token_ids == ()
    unique = _prefilled(_request(prompt=[1, 2, 3, 4]))
    assert unique.schedule().chunks[0].draft_token_ids == ()


def test_a_request_whose_drafts_all_missed_sits_out_the_next_step() -> None:
    scheduler = _prefilled(_request(), ngram_min=1)
    output = scheduler.schedule()
    assert output.chunks[0].draft_token_ids == (8, 9, 5)
    [update] = scheduler.update(output, {}, {"a": (5, 2, 3, 4)})  # the first draft missed
    assert update.new_token_ids == (5,)
    output = scheduler.schedule()
    assert output.chunks[0].draft_token_ids == ()  # backing off, though (5,) stood before 6
    scheduler.update(output, {"a": 6})
    # 5, 6, 7, 8, 9, 5, 6, 7, 5, 6: the suffix (5, 6) last stood before 7, 5, 6
    assert scheduler.schedule().chunks[0].draft_token_ids == (7, 5, 6)


def test_drafts_are_cut_where_their_chance_no_longer_pays_for_their_row() -> None:
    """A known step-time model: 10 ms a decode step plus 2 ms a row, so for one decoding
    request a draft must be kept with a chance of at least 2 / 12; a new request's chance is
    0.5 at the first draft, 0.25 at the second, 0.125 at the third (cut)."""
    scheduler = _prefilled(_request())
    scheduler.step_cost = StepCost(decode_base_s=0.010, per_decode_seq_s=0.002, decode_steps=100)
    assert scheduler.schedule().chunks[0].draft_token_ids == (8, 9)
    unknown = _prefilled(_request())
    unknown.step_cost = StepCost(decode_base_s=0.010, per_decode_seq_s=0.002, decode_steps=1)
    assert unknown.schedule().chunks[0].draft_token_ids == (8, 9, 5)  # not known yet: all
