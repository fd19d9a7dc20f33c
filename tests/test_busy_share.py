"""``common/busy_share.py``: the time-decayed share of wall time spent on observed work."""

from __future__ import annotations

import math

import pytest

from splitserve.common.busy_share import MAX_SHARE, DecayingShare


def test_steady_work_converges_to_its_fraction_of_wall_time() -> None:
    share = DecayingShare(started_at=0.0, time_constant_s=10.0)
    # 30 ms of prompt work at the end of every 100 ms step, for a minute
    for step in range(1, 601):
        share.observe(step / 10, 0.03)
    assert share.share(60.0) == pytest.approx(0.3, rel=0.03)


def test_idle_time_decays_the_share_towards_zero() -> None:
    share = DecayingShare(started_at=0.0, time_constant_s=10.0)
    for second in range(1, 31):
        share.observe(float(second), 0.5)
    busy = share.share(30.0)
    assert share.share(40.0) == pytest.approx(busy * math.exp(-1.0), rel=0.1)
    assert share.share(130.0) < 0.001


def test_a_young_worker_counts_only_the_time_it_has_lived() -> None:
    share = DecayingShare(started_at=100.0, time_constant_s=10.0)
    share.observe(101.0, 0.5)  # half of its first second
    assert share.share(101.0) == pytest.approx(0.5, rel=0.06)
    assert share.share(100.0) == pytest.approx(0.5, rel=0.06)  # clock read before: held


def test_the_share_is_capped_and_bad_input_is_refused() -> None:
    share = DecayingShare(started_at=0.0)
    share.observe(1.0, 5.0)  # more work than wall time (a clock glitch): capped
    assert share.share(1.0) == MAX_SHARE
    share.observe(2.0, -1.0)  # negative seconds count as none
    assert share.share(2.0) <= MAX_SHARE
    with pytest.raises(ValueError):
        DecayingShare(started_at=0.0, time_constant_s=0.0)
