"""Prompt-lookup drafts (``engine/ngram_proposer.py``)."""

from __future__ import annotations

import pytest

from splitserve.engine.ngram_proposer import DECAY, MAX_SKIP, PRIOR, Drafter, NgramIndex


def _index(tokens: list[int], min_n: int = 2, max_n: int = 4) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index


def test_proposes_what_followed_the_suffix_before() -> None:
    # suffix (7, 8) occurred at 1..2, followed by 9, 10, 11
    assert _index([6, 7, 8, 9, 10, 11, 5, 7, 8]).propose(3) == [9, 10, 11]
    assert _index([6, 7, 8, 9, 10, 11, 5, 7, 8]).propose(2) == [9, 10]


def test_the_longest_suffix_wins_then_the_latest_occurrence() -> None:
    # (3, 4) was followed by 1 (early) and by 2 (later); (5, 3, 4) only by 9
    tokens = [5, 3, 4, 9, 0, 3, 4, 1, 0, 3, 4, 2, 0, 5, 3, 4]
    assert _index(tokens).propose(1) == [9]
    assert _index(tokens[:-3] + [8, 3, 4]).propose(1) == [2]  # no 3-gram match: latest 2-gram


def test_nothing_without_an_earlier_occurrence_or_room() -> None:
    assert _index([1, 2, 3, 4]).propose(4) == []
    assert _index([1, 2, 1, 2]).propose(0) == []
    assert _index([1]).propose(2) == []
    assert _index([], 1, 1).propose(2) == []
    # a match at the very end proposes only what is known after it
    assert _index([1, 2, 1, 2]).propose(5) == [1, 2]


def test_extending_in_pieces_equals_extending_at_once() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 1, 4]
    growing = NgramIndex(1, 3)
    for cut in range(1, len(tokens) + 1):
        growing.extend(tokens[cut - 1 : cut])  # one token at a time, as decoding appends
        assert growing.propose(4) == _index(tokens[:cut], 1, 3).propose(4)
    assert growing.tokens == tokens
    assert growing.propose(4) == [1, 5, 9, 2]  # (3, 1, 4) opened the sequence


def test_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramIndex(0, 2)


def test_a_drafter_backs_off_after_rejections_and_resumes_after_a_kept_draft() -> None:
    tokens = [6, 7, 8, 9, 10, 11, 5, 7, 8]
    drafter = Drafter(2, 4)
    assert drafter.propose(tokens, 2) == [9, 10]
    drafter.record(proposed=2, kept=0)  # sits out 1 step
    assert drafter.propose(tokens, 2) == []
    assert drafter.propose(tokens, 2) == [9, 10]
    drafter.record(proposed=2, kept=0)  # a second miss in a row: 2 steps
    assert [drafter.propose(tokens, 2) for _ in range(3)] == [[], [], [9, 10]]
    drafter.record(proposed=2, kept=1)
    assert drafter.propose(tokens, 2) == [9, 10]
    for _ in range(10):
        drafter.record(proposed=2, kept=0)
    skipped = 0
    while not drafter.propose(tokens, 2):
        skipped += 1
    assert skipped == MAX_SKIP


def test_a_drafter_indexes_tokens_appended_since_it_last_proposed() -> None:
    drafter = Drafter(2, 2)
    assert drafter.propose([1, 2, 3], 2) == []
    assert drafter.propose([1, 2, 3, 4, 1, 2], 2) == [3, 4]
    assert drafter.index.tokens == [1, 2, 3, 4, 1, 2]


def test_a_drafter_cuts_drafts_whose_chance_falls_below_the_bar() -> None:
    drafter = Drafter(2, 2)
    assert drafter.continuation == PRIOR[0] / PRIOR[1] == 0.5
    drafts = [1, 2, 3, 4]
    assert drafter.worth_proposing(drafts, 0.0) == drafts
    assert drafter.worth_proposing(drafts, 0.2) == [1, 2]  # 0.5, 0.25 (0.125 < 0.2)
    drafter.record(proposed=4, kept=4)  # all kept: 4 reached, 4 kept
    kept, reached = DECAY * PRIOR[0] + 4, DECAY * PRIOR[1] + 4
    assert drafter.continuation == kept / reached
    drafter.record(proposed=4, kept=1)  # the second was reached and missed
    kept, reached = DECAY * kept + 1, DECAY * reached + 2
    assert drafter.continuation == kept / reached
    assert drafter.worth_proposing(drafts, 0.5) == [1, 2]  # 0.75, 0.56, then 0.42
