"""``launch/scale_policy.py``: the autoscaler's moves for one role, from the coordinators'
figure (the HPA's behaviour as deploy/base/autoscaling.yaml sets it)."""

from __future__ import annotations

import pytest

from splitserve.launch.scale_policy import ScalePolicy, ScalerSettings

SETTINGS = ScalerSettings(
    check_interval_s=1.0, stabilization_s=10.0, scale_down_period_s=3.0, scale_up_pods=2
)


def test_a_higher_figure_adds_its_ceiling_at_once_within_the_most() -> None:
    policy = ScalePolicy(SETTINGS, most=8)
    assert policy.move(0.0, need=2.2, active=1) == 2  # ceil(2.2) = 3 workers wanted
    assert policy.move(1.0, need=30.0, active=4) == 4  # capped at most = 8
    assert policy.move(2.0, need=3.0, active=3) == 0


def test_one_check_adds_at_most_scale_up_pods_or_doubles() -> None:
    policy = ScalePolicy(SETTINGS, most=100)
    assert policy.move(0.0, need=50.0, active=1) == 2  # scale_up_pods = 2
    assert policy.move(1.0, need=50.0, active=6) == 6  # doubling: 6 more


def test_a_dip_shorter_than_the_window_drains_nothing() -> None:
    policy = ScalePolicy(SETTINGS, most=8)
    policy.move(0.0, need=4.0, active=4)
    moves = [policy.move(t, need=1.0, active=4) for t in (1.0, 5.0, 9.0, 10.0)]
    assert moves == [0, 0, 0, 0]  # 4 was wanted within the last 10 s each time
    assert policy.move(10.5, need=1.0, active=4) == -1  # the 4 left the window


def test_drains_one_worker_per_period() -> None:
    policy = ScalePolicy(SETTINGS, most=8)
    times = (0.0, 0.5, 1.0, 2.0, 2.9, 3.0, 3.5, 5.9, 6.0)
    downs = [(t, policy.move(t, need=1.0, active=4)) for t in times]
    assert [t for t, move in downs if move] == [0.0, 3.0, 6.0]
    assert {move for _, move in downs} == {0, -1}


def test_the_survivors_load_holds_off_a_scale_down() -> None:
    """From N to N - 1 only once N - 1 carry the figure: 3 workers at a need of 2.01 stay."""
    policy = ScalePolicy(SETTINGS, most=8)
    assert [policy.move(float(t), need=2.01, active=3) for t in range(20)] == [0] * 20
    assert policy.move(20.0, need=2.0, active=3) == 0  # 2.01 still in the window
    assert policy.move(31.0, need=2.0, active=3) == -1


def test_never_below_the_least() -> None:
    policy = ScalePolicy(SETTINGS, most=4, least=1)
    assert [policy.move(float(t), need=0.0, active=1) for t in range(30)] == [0] * 30
    assert policy.wanted(0.0) == 1 and policy.wanted(9.5) == 4


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        ScalePolicy(SETTINGS, most=0, least=1)
    with pytest.raises(ValueError):
        ScalerSettings(check_interval_s=0)
    with pytest.raises(ValueError):
        ScalerSettings(scale_up_pods=0)
