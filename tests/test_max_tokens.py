"""A request's ``max_tokens`` is settled by one rule (``coordinator/max_tokens.py``), from what
the wire says the caller asked (``convert.asked_sampling_from_proto``): the caller's within the
operator's cap, else the operator's default within the room the decode workers have, never
past the context window. Torch-free, no processes."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.common.errors import ContextLengthExceededError, InvalidRequestError
from splitserve.coordinator.max_tokens import (
    NO_ROOM_MAX_TOKENS,
    OutputLimits,
    fewest_max_tokens,
    settle_max_tokens,
)
from splitserve.proto import convert
from splitserve.proto.splitserve.v1 import common_pb2

LIMITS = OutputLimits(
    default_max_tokens=1024, max_tokens_cap=0, max_model_len=4096, fill_limit=4096
)


def _limits(**changes: int) -> OutputLimits:
    return dataclasses.replace(LIMITS, **changes)


def test_an_asked_max_tokens_is_the_requests() -> None:
    assert settle_max_tokens(48, 0, 100, LIMITS) == 48
    assert fewest_max_tokens(48) == 48


def test_an_asked_max_tokens_over_the_cap_is_refused_naming_the_field() -> None:
    assert settle_max_tokens(64, 0, 100, _limits(max_tokens_cap=64)) == 64
    with pytest.raises(InvalidRequestError, match="at most 64") as caught:
        settle_max_tokens(65, 0, 100, _limits(max_tokens_cap=64))
    assert caught.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("num_prompt_tokens", "param"), [(4000, "max_tokens"), (4096, "prompt"), (5000, "prompt")]
)
def test_prompt_and_max_tokens_past_the_context_are_refused(
    num_prompt_tokens: int, param: str
) -> None:
    with pytest.raises(ContextLengthExceededError) as caught:
        settle_max_tokens(97, 0, num_prompt_tokens, LIMITS)
    assert caught.value.param == param


def test_without_max_tokens_the_default_within_the_room_the_workers_have() -> None:
    assert fewest_max_tokens(None) == 1
    assert settle_max_tokens(None, 0, 100, LIMITS) == 1024
    assert settle_max_tokens(None, 0, 3500, LIMITS) == 596  # the room left
    assert settle_max_tokens(None, 0, 100, _limits(fill_limit=1000)) == 900  # KV-bound workers
    assert settle_max_tokens(None, 0, 100, _limits(default_max_tokens=0)) == 3996
    assert settle_max_tokens(None, 0, 100, _limits(max_tokens_cap=256)) == 256


def test_without_max_tokens_min_tokens_raises_the_default_not_the_room() -> None:
    assert settle_max_tokens(None, 2000, 100, LIMITS) == 2000
    assert settle_max_tokens(None, 2000, 3500, LIMITS) == 596  # then min_tokens is refused


def test_without_room_the_context_check_decides() -> None:
    limits = _limits(fill_limit=1000)
    assert settle_max_tokens(None, 0, 1000, limits) == NO_ROOM_MAX_TOKENS
    assert settle_max_tokens(None, 40, 1000, limits) == 40
    with pytest.raises(ContextLengthExceededError):
        settle_max_tokens(None, 0, 4090, limits)


def test_the_wire_says_whether_max_tokens_was_asked_and_params_come_once_settled() -> None:
    unset = convert.asked_sampling_from_proto(common_pb2.SamplingParams(min_tokens=20))
    assert (unset.max_tokens, unset.min_tokens) == (None, 20)  # no provisional value
    params = unset.params_with(settle_max_tokens(unset.max_tokens, unset.min_tokens, 10, LIMITS))
    assert (params.max_tokens, params.min_tokens) == (1024, 20)
    asked = convert.asked_sampling_from_proto(
        common_pb2.SamplingParams(max_tokens=8, temperature=0.1)
    )
    assert asked.max_tokens == 8
    assert asked.params_with(8).temperature == 0.1  # float32 on the wire, rounded back
    with pytest.raises(InvalidRequestError) as caught:
        unset.params_with(10)  # below the request's min_tokens
    assert caught.value.param == "min_tokens"


def test_bad_sampling_values_are_refused_before_max_tokens_is_settled() -> None:
    """``AskedSampling.check`` validates what the caller sent before the coordinator asks the
    cluster anything, so a bad value is a 400 even while no decode worker is registered."""
    bad = convert.asked_sampling_from_proto(common_pb2.SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidRequestError) as caught:
        bad.check()
    assert caught.value.param == "temperature"
    unset = convert.asked_sampling_from_proto(common_pb2.SamplingParams(min_tokens=20))
    unset.check()  # no max_tokens asked: the min_tokens alone is valid
    below = convert.asked_sampling_from_proto(
        common_pb2.SamplingParams(max_tokens=5, min_tokens=20)
    )
    below.check()  # the context and the cap decide first; settling then refuses min_tokens
