"""``StepOutput.followed_by``: two consecutive outputs of one request as one."""

from __future__ import annotations

import pytest

from splitserve.common.logprobs import TokenLogprob
from splitserve.common.request_update import FinishReason, RequestUpdate, StepOutput


def _output(tokens, count, finish=None, request_id="r") -> StepOutput:
    update = RequestUpdate(request_id, tokens, finish, 5, 2, count, 7 if finish else None)
    logprobs = tuple(TokenLogprob(token, -0.5, 1, ()) for token in tokens)
    return StepOutput(update, logprobs)


def test_tokens_and_logprobs_in_order_with_the_later_counts_and_finish() -> None:
    merged = _output((1,), 1).followed_by(_output((2, 3), 3, FinishReason.STOP))
    assert merged.update.new_token_ids == (1, 2, 3)
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3]
    assert merged.update.num_output_tokens == 3
    assert merged.update.finish_reason is FinishReason.STOP
    assert merged.update.stop_token_id == 7


def test_nothing_follows_a_finished_output_or_another_requests() -> None:
    with pytest.raises(ValueError, match="finished"):
        _output((1,), 1, FinishReason.LENGTH).followed_by(_output((2,), 2))
    with pytest.raises(ValueError, match="two requests"):
        _output((1,), 1).followed_by(_output((2,), 2, request_id="other"))
